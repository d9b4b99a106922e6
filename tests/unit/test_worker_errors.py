"""A worker's error as the chief raises it (NOTE [errors from workers]), in one
process: what `ps._runtime.failure` records on the worker and `coordinator._failures
.rebuilt` makes of it. The same over real processes (a class of the chief's
``__main__``): tests/distributed/test_parameter_server_fit.py.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
from typing import Any

import cloudpickle
import pytest

import distribute as ds
from distribute.coordinator._failures import rebuilt
from distribute.ps._runtime import ClosureFailure, failure


def _raised_on_worker(error: BaseException, task: str = "worker_1") -> ClosureFailure:
    """`error` raised and caught on `task`, as the worker sends it back (through
    plain pickle, as rpc does)."""
    try:
        raise error
    except BaseException as e:
        sent = failure(task, e)
    received: ClosureFailure = pickle.loads(pickle.dumps(sent))
    return received


def _dynamic_class(name: str, base: type[Exception] = Exception) -> type[Exception]:
    """A class cloudpickle pickles by value (as one of the chief's ``__main__``)."""
    return type(name, (base,), {"__module__": "__main__"})


def test_a_builtin_error_keeps_its_type_and_message_and_notes_the_worker_and_traceback() -> None:
    error = rebuilt(_raised_on_worker(KeyError("shard 3")))
    assert type(error) is KeyError and error.args == ("shard 3",)
    (note,) = error.__notes__
    assert note.startswith("raised on worker_1; its traceback there:\nTraceback")
    assert "_raised_on_worker" in note and "KeyError: 'shard 3'" in note


def test_a_class_sent_by_value_is_rebuilt_as_that_same_class() -> None:
    cls = _dynamic_class("ShardMissing")
    cloudpickle.dumps(cls)  # the chief sent it to the worker with a closure
    error = rebuilt(_raised_on_worker(cls("no shard 1")))
    assert type(error) is cls and str(error) == "no shard 1"
    assert error.__notes__[0].startswith("raised on worker_1;")


def test_an_error_whose_init_does_not_take_its_message_is_a_remote_error_of_its_builtin() -> None:
    class TwoPart(LookupError):
        def __init__(self, code: int, detail: str) -> None:
            super().__init__(f"code {code}: {detail}")

    error = rebuilt(_raised_on_worker(TwoPart(7, "bad row"), task="worker_0"))
    assert isinstance(error, ds.coordinator.RemoteError)
    assert isinstance(error, ds.errors.DistributeError) and isinstance(error, LookupError)
    assert error.task == "worker_0"
    assert error.type_name.endswith("TwoPart")
    assert error.remote_message == "code 7: bad row"
    assert "in _raised_on_worker" in error.remote_traceback
    assert "TwoPart raised on worker_0: code 7: bad row" in str(error)
    assert "__init__" in str(error)  # how to make it rebuildable


def test_an_error_with_an_attribute_that_cannot_be_pickled_is_a_remote_error() -> None:
    error = ValueError("holds a lock")
    error.lock = threading.Lock()  # type: ignore[attr-defined]  # what a user might attach
    sent = _raised_on_worker(error)
    assert sent.blob is None and "lock" in sent.unsent
    remote = rebuilt(sent)
    assert isinstance(remote, ds.coordinator.RemoteError) and isinstance(remote, ValueError)
    assert remote.remote_message == "holds a lock"
    assert "cannot rebuild builtins.ValueError" in str(remote)


def test_an_exception_subclass_of_exception_only_is_a_plain_remote_error() -> None:
    cls = _dynamic_class("Odd")
    sent = _raised_on_worker(cls("odd"))
    broken = dataclasses.replace(sent, blob=b"not a pickle")
    error = rebuilt(broken)
    assert type(error) is ds.coordinator.RemoteError
    assert error.remote_message == "odd"


def test_a_remote_error_pickles_and_unpickles_with_its_fields() -> None:
    class TwoPart(ValueError):
        def __init__(self, code: int, detail: str) -> None:
            super().__init__(f"{code} {detail}")

    error = rebuilt(_raised_on_worker(TwoPart(1, "x")))
    again: Any = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    fields = ("type_name", "remote_message", "task", "remote_traceback")
    assert [getattr(again, f) for f in fields] == [getattr(error, f) for f in fields]
    assert str(again) == str(error)


@pytest.mark.parametrize(
    ("base", "nearest"), [(UnicodeDecodeError, ValueError), (OSError, OSError)]
)
def test_builtins_with_other_constructors_still_give_a_remote_error_of_the_nearest_that_fits(
    base: type[Exception], nearest: type[Exception]
) -> None:
    class Unrebuildable(base):  # type: ignore[misc, valid-type]  # a parametrized base
        def __init__(self) -> None:
            super().__init__(
                *(("utf-8", b"\xff", 0, 1, "bad") if base is UnicodeDecodeError else ("io",))
            )

        def __reduce__(self) -> Any:
            return (_fail_to_rebuild, ())

    error = rebuilt(_raised_on_worker(Unrebuildable()))
    assert isinstance(error, ds.coordinator.RemoteError) and isinstance(error, nearest)
    assert "cannot be rebuilt" in str(error)


def _fail_to_rebuild() -> None:
    raise TypeError("cannot be rebuilt")
