"""Where listeners bind: the cluster spec's address, unless it is a loopback alias."""

from __future__ import annotations

import socket
import sys
from typing import Any

import pytest

from distribute.collectives import _rendezvous
from distribute.collectives._rendezvous import loopback_alias
from distribute.ps._transport import interface_of


def _resolving_to(monkeypatch: pytest.MonkeyPatch, name: str, address: str) -> None:
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == name:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_addresses_and_localhost_are_not_loopback_aliases(host: str) -> None:
    assert not loopback_alias(host)


def test_a_machine_name_resolving_to_loopback_is_an_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian's /etc/hosts maps the hostname to 127.0.1.1."""
    _resolving_to(monkeypatch, "trainer-7", "127.0.1.1")
    assert loopback_alias("trainer-7")


def test_the_store_of_a_loopback_alias_listens_on_every_interface(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _resolving_to(monkeypatch, "trainer-7", "127.0.1.1")
    assert _rendezvous._listen("trainer-7", 0) is None  # torch's store binds every interface


def test_the_store_listens_on_the_given_address_only() -> None:
    fd = _rendezvous._listen("127.0.0.1", 0)
    assert fd is not None
    with socket.socket(fileno=fd) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux interface names")
def test_tensorpipe_listens_on_the_interface_of_the_address() -> None:
    assert interface_of("127.0.0.1") == "lo"


def test_a_launcher_gives_each_task_the_interface_of_its_address() -> None:
    """`LocalCluster` puts it in the tasks' environment (NOTE [rpc's listening
    interface]); the library writes no variable into its own process."""
    from distribute.ps._transport import listening_environment

    assert listening_environment("127.0.0.1") == {"TP_SOCKET_IFNAME": "lo"}
    assert listening_environment("192.0.2.254") == {}  # TEST-NET: no interface has it


def test_a_task_whose_hostname_resolves_elsewhere_is_told_which_interface_to_set(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from distribute.ps import _transport

    monkeypatch.delenv("TP_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(_transport, "_hostname_address", lambda: "192.0.2.254")
    with caplog.at_level(logging.WARNING, logger=_transport.__name__):
        _transport._check_listening_interface("127.0.0.1")
    assert "set TP_SOCKET_IFNAME=lo" in caplog.text
    caplog.clear()
    monkeypatch.setenv("TP_SOCKET_IFNAME", "lo")  # the user chose: nothing to say
    with caplog.at_level(logging.WARNING, logger=_transport.__name__):
        _transport._check_listening_interface("127.0.0.1")
    assert caplog.text == ""
