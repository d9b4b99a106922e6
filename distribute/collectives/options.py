"""Options of the cross-replica collectives (`ds.experimental.CommunicationOptions`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from distribute.errors import InvalidArgumentError

__all__ = ["CommunicationImplementation", "CommunicationOptions"]


class CommunicationImplementation(enum.Enum):
    """Which cross-process collective implementation to use.

    AUTO: nccl when every replica is a CUDA device, else gloo. RING: gloo. NCCL: nccl.

    Example:
        >>> import distribute as ds
        >>> ring = ds.experimental.CommunicationImplementation.RING
        >>> ds.experimental.CommunicationOptions(implementation=ring).implementation.value
        'RING'
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


@dataclass(frozen=True)
class CommunicationOptions:
    """Options for cross-replica collectives.

    Args:
        bytes_per_pack: gradients are all-reduced in packs of about this many bytes;
            0 means one pack (for the overlapped multi-worker path: DDP's 25 MiB).
        timeout_seconds: how long a collective waits for its peers before raising;
            None means the library default (300 s).
        implementation: `CommunicationImplementation`.

    Example:
        >>> import distribute as ds
        >>> ds.experimental.CommunicationOptions(bytes_per_pack=1 << 20).bytes_per_pack
        1048576
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        if self.bytes_per_pack < 0:
            raise InvalidArgumentError(
                f"bytes_per_pack must be >= 0 (0: one pack), got {self.bytes_per_pack}"
            )
        if self.timeout_seconds is not None and self.timeout_seconds <= 0:
            raise InvalidArgumentError(
                f"timeout_seconds must be positive or None, got {self.timeout_seconds}"
            )
        object.__setattr__(self, "implementation", CommunicationImplementation(self.implementation))
