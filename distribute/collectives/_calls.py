"""One collective call's parts: its signature (a hash and a description for the
mismatch message), its flat buffer, the handle of an all-reduce in flight, and whether
a failure was the transport's (`ProcessGroupCollectives` in process_group.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from distribute.collectives.packing import slot_views

__all__ = [
    "AllReduceHandle",
    "describe",
    "dtype_name",
    "flatten",
    "is_transport_error",
    "items",
    "signature_hash",
]


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's transport failing (a peer's connection closed,
    gloo's or nccl's own timeout), as raised by torch's collectives: not a user error.

    Example::

        >>> from distribute.collectives._calls import is_transport_error
        >>> is_transport_error(RuntimeError("[../third_party/gloo/gloo/transport/tcp/"
        ...                                 "pair.cc:553] Connection closed by peer"))
        True
    """
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and "/gloo/" in str(exc)


def signature_hash(signature: Any) -> int:
    digest = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def items(tensors: Sequence[torch.Tensor]) -> list[str]:
    return [f"{dtype_name(t.dtype)}{list(t.shape)}" for t in tensors]


def describe(tensors: Sequence[torch.Tensor]) -> str:
    parts = items(tensors)
    return parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"


def flatten(tensors: Sequence[torch.Tensor], copy: bool) -> torch.Tensor:
    parts = [t.detach().reshape(-1) for t in tensors]
    if len(parts) > 1:
        return torch.cat(parts)
    return parts[0].clone() if copy else parts[0]


class AllReduceHandle:
    """An all-reduce in flight; `wait()` returns the reduced tensors."""

    def __init__(
        self,
        wait: Callable[[], None] | None,
        flat: torch.Tensor,
        templates: list[torch.Tensor],
        finish: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self._wait = wait  # waits for the work under the owner's deadline; None: done
        self._flat = flat
        self._templates = templates
        self._finish = finish  # the owner's reduction's last step (MEAN's division)

    def wait(self) -> list[torch.Tensor]:
        """Blocks until the all-reduce is done.

        Raises:
            CollectiveTimeoutError: a peer never arrived (it is named).
        """
        if self._wait is not None:
            self._wait()
        device = self._templates[0].device
        flat = self._finish(self._flat).to(device)
        return slot_views(flat, self._templates)
