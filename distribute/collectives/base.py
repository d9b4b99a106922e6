"""The cross-process collectives a multi-worker strategy plugs in (`CrossWorker`).

`ProcessGroupCollectives` (process_group.py) implements it over a torch.distributed
process group; the layers above (buffers, gradients, input, checkpoints, training)
depend on this protocol only, and reach a strategy's through
`StrategyExtended.cross_worker` (docs/architecture.md, "The engine's seams").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from distribute._enums import ReduceOp

__all__ = ["CrossWorker", "gather_bytes"]

_T = TypeVar("_T")


class CrossWorker(Protocol):
    """The cross-process collectives a multi-worker strategy plugs in.

    Every call is a collective: every worker makes the same calls in the same order,
    and ``name`` says in errors which call a missing or mismatched worker did not
    make.
    """

    @property
    def rank(self) -> int:
        """This worker's index among the workers (0 is the chief)."""
        ...

    @property
    def world_size(self) -> int:
        """How many workers take part."""
        ...

    def barrier(self, name: str) -> None:
        """Returns when every worker has called it (a missing worker is named)."""
        ...

    def run_watched(self, name: str, call: Callable[[], _T]) -> _T:
        """Runs ``call``, whose own collectives span the workers (DCP's save and
        load), so that a worker dying inside it is named within seconds."""
        ...

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp,
        *,
        name: str,
        bytes_per_pack: int = 0,
        check: bool = True,
        in_place: bool = False,
    ) -> list[torch.Tensor]: ...

    def all_gather(self, tensor: torch.Tensor, axis: int, *, name: str) -> torch.Tensor: ...

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0, *, name: str) -> None: ...

    def all_reduce_int(self, value: int, name: str) -> int: ...

    def check_same(self, signature: Any, *, name: str) -> None: ...

    def all_reduce_async(
        self, tensors: Sequence[torch.Tensor], op: ReduceOp, *, name: str
    ) -> Any: ...


def gather_bytes(cross: CrossWorker, data: bytes) -> list[bytes]:
    """Every worker's ``data``, in worker order (two all-gathers: sizes, then bytes).

    Example::

        structures = gather_bytes(collectives, pickle.dumps(my_batch_structure))
    """
    sizes = cross.all_gather(torch.tensor([len(data)]), 0, name="input sizes").tolist()
    mine = torch.tensor(list(data), dtype=torch.uint8)
    flat = bytes(cross.all_gather(mine, 0, name="input structure").tolist())
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(sizes))]
