"""The errors a coordinator raises, and a worker's error rebuilt on the chief.

# NOTE [errors from workers]
A closure (or a ``dataset_fn``) that raises on a worker is the user's error, not
a lost worker: the worker returns it as a `ClosureFailure` (ps/_runtime.py), a
plain record that any pickle reads, holding the exception pickled by cloudpickle.
A class the worker got by value (defined in the chief's ``__main__``) travels back
by value too, and cloudpickle maps it to the chief's own class, so ``except
MyError`` works on the chief. Where the chief cannot rebuild the exception (its
class cannot be imported here, its ``__init__`` does not take its ``args``, an
attribute cannot be pickled), it raises a `RemoteError` instead, deriving from the
nearest builtin of the original's classes, naming its type, its message and the
worker. Either way the exception carries a note (PEP 678, shown under its
traceback) naming the worker and holding the worker's traceback.

A worker is lost only when its connection closed or it does not answer a ping
within the strategy's timeout; the coordinator logs which worker and why.

Example::

    class ShardMissing(Exception): ...

    def dataset_fn(context):
        raise ShardMissing(f"no shard {context.input_pipeline_id}")

    try:
        coordinator.create_per_worker_dataset(dataset_fn)
    except ShardMissing as e:       # the chief's own class
        print(e.__notes__[0])       # "raised on worker_0; its traceback there: ..."
"""

from __future__ import annotations

import builtins
from typing import Any

import cloudpickle

from distribute.errors import DistributeError
from distribute.ps._runtime import ClosureFailure

__all__ = [
    "ClosureCancelledError",
    "RemoteError",
    "WorkerLostError",
    "note_worker",
    "rebuilt",
]


class ClosureCancelledError(DistributeError, RuntimeError):
    """A closure was cancelled because an earlier one failed (or the cluster shut
    down before it ran); its `RemoteValue` raises this.

    Example::

        first = coordinator.schedule(fails)         # raises ValueError on a worker
        queued = coordinator.schedule(step)
        try:
            coordinator.join()                      # the ValueError
        except ValueError:
            pass
        queued.fetch()                              # ClosureCancelledError
    """


class WorkerLostError(DistributeError, ConnectionError):
    """Every worker died and none came back within the strategy's timeout: nothing is
    left to run closures.

    Example::

        try:
            coordinator.join()
        except ds.coordinator.WorkerLostError:
            ...   # restart worker tasks (they rejoin), or the cluster from a checkpoint
    """


class RemoteError(DistributeError):
    """An exception raised on a worker that the chief cannot rebuild (NOTE [errors
    from workers]); an instance also derives from the nearest builtin exception of
    the original's classes, so ``except ValueError`` still catches a ValueError
    subclass's.

    Attributes:
        type_name: the original exception's class, ``module.QualName``.
        remote_message: the original's message.
        task: the worker that raised it.
        remote_traceback: its traceback on the worker.

    Example::

        try:
            coordinator.join()
        except ds.coordinator.RemoteError as e:
            print(e.type_name, e.task)   # "shards.BadShard worker_1"
            print(e.remote_traceback)
    """

    type_name: str
    remote_message: str
    task: str
    remote_traceback: str

    def __reduce__(self) -> Any:
        return (_remote_error, (self._fields(),))

    def _fields(self) -> dict[str, Any]:
        return {
            "bases": [c.__name__ for c in type(self).__mro__ if c.__module__ == "builtins"],
            "message": str(self),
            "type_name": self.type_name,
            "remote_message": self.remote_message,
            "task": self.task,
            "remote_traceback": self.remote_traceback,
        }


#: `RemoteError` classes by the builtin they also derive from.
_REMOTE_ERRORS: dict[type[BaseException], type[RemoteError]] = {Exception: RemoteError}


def _remote_error_class(base: type[BaseException]) -> type[RemoteError]:
    cls = _REMOTE_ERRORS.get(base)
    if cls is None:
        cls = type(f"Remote{base.__name__}", (RemoteError, base), {"__module__": __name__})
        _REMOTE_ERRORS[base] = cls
    return cls


def _remote_error(fields: dict[str, Any]) -> RemoteError:
    """A `RemoteError` from its fields (how one unpickles), deriving from the first
    of ``fields["bases"]`` (builtin names) that can be mixed in."""
    error: RemoteError | None = None
    for name in fields["bases"]:
        base = getattr(builtins, name, None)
        if not (isinstance(base, type) and issubclass(base, Exception)):
            continue
        try:
            error = _remote_error_class(base)(fields["message"])
            break
        except TypeError:  # a builtin that cannot be mixed in, or takes other arguments
            continue
    if error is None:  # a BaseException only (KeyboardInterrupt): Exception's
        error = RemoteError(fields["message"])
    error.type_name = fields["type_name"]
    error.remote_message = fields["remote_message"]
    error.task = fields["task"]
    error.remote_traceback = fields["remote_traceback"]
    return error


def rebuilt(failure: ClosureFailure) -> BaseException:
    """The exception `failure` carries, on the chief: the original where it can be
    rebuilt, else a `RemoteError` naming it; noted with its worker and traceback."""
    why = failure.unsent
    error: BaseException | None = None
    if failure.blob is not None:
        try:
            loaded = cloudpickle.loads(failure.blob)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
        else:
            if isinstance(loaded, BaseException):
                error = loaded
            else:
                why = f"it unpickled as a {type(loaded).__name__}"
    if error is None:
        error = _remote_error(
            {
                "bases": failure.builtins,
                "message": (
                    f"{failure.type_name} raised on {failure.task}: {failure.message} (the "
                    f"chief cannot rebuild {failure.type_name}: {why}; define the class in "
                    "a module the chief imports, or make it picklable: its __init__ taking "
                    "its message)"
                ),
                "type_name": failure.type_name,
                "remote_message": failure.message,
                "task": failure.task,
                "remote_traceback": failure.text,
            }
        )
    note_worker(error, failure.task, failure.text)
    return error


def note_worker(error: BaseException, task: str, text: str) -> None:
    """Adds a note (PEP 678) to `error`: raised on `task`, with its traceback there."""
    note = f"raised on {task}; its traceback there:\n{text.rstrip()}"
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(note)
    else:  # Python 3.10: the attribute alone (tracebacks do not show it)
        error.__notes__ = [*getattr(error, "__notes__", ()), note]  # type: ignore[attr-defined]  # PEP 678 before 3.11
