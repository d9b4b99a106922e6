"""The one interface parameter-server tasks talk through, and its rpc implementation.

Everything the parameter-server code sends between tasks goes through `Transport`:
start it, call a module-level function on a named task (a future), stop it. The
implementation here is `torch.distributed.rpc` over TensorPipe, which upstream has
put in maintenance mode; another transport (gRPC, a socket protocol) replaces it by
implementing these three methods.

The rpc agent joins through the store of this library's rendezvous (`rendezvous()`:
bounded, comparing every task's cluster spec, naming a duplicated task), so a task
of another job that reaches the same port is refused before any rpc is set up.

Example::

    transport = RpcTransport.start("worker_0", rank=1, world_size=4, store=store,
                                   timeout_seconds=60)
    future = transport.call("ps_0", some_module.some_function, (x,))
    value = future.wait()
    transport.shutdown()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch.futures import Future

__all__ = ["RpcTransport", "Transport"]


class Transport(Protocol):
    """What the parameter-server tasks need from a transport."""

    @property
    def name(self) -> str: ...

    def call(
        self, task: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float
    ) -> Future[Any]:
        """Runs ``fn(*args)`` on `task`; the future fails when the task dies or the
        call takes longer than `timeout` seconds."""
        ...

    def shutdown(self) -> None:
        """Stops this task's endpoint without waiting for the others."""
        ...


class RpcTransport:
    """`Transport` over `torch.distributed.rpc` (TensorPipe), one per process."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._stopped = False

    @classmethod
    def start(
        cls, name: str, *, rank: int, world_size: int, store: Any, timeout_seconds: float
    ) -> RpcTransport:
        """Joins the rpc group of `world_size` tasks through `store` (every task calls
        this; it returns when all have)."""
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc

        options = rpc.TensorPipeRpcBackendOptions(
            rpc_timeout=timeout_seconds, init_method="tcp://unused"
        )
        # What init_rpc does after its own rendezvous; the store is ours (module doc).
        dist_autograd._init(rank)  # type: ignore[attr-defined]  # private, as init_rpc calls it
        backend = rpc.BackendType.TENSORPIPE  # type: ignore[attr-defined]  # an enum made at runtime
        rpc._init_rpc_backend(backend, store, name, rank, world_size, options)  # type: ignore[no-untyped-call]  # untyped in torch
        return cls(name)

    @property
    def name(self) -> str:
        return self._name

    def call(
        self, task: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float
    ) -> Future[Any]:
        import torch.distributed.rpc as rpc

        future: Future[Any] = rpc.rpc_async(task, fn, args=args, timeout=timeout)
        return future

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        import torch.distributed.rpc as rpc

        rpc.shutdown(graceful=False)
