"""Replica device names: torch's and tf.distribute's spellings, checked at construction.

Accepted for one device: a `torch.device`, torch's strings (``"cpu"``, ``"cuda:1"``,
``"meta"``), and TensorFlow's (``"/gpu:0"``, ``"GPU:0"``, ``"/device:CPU:0"``,
``"/job:localhost/replica:0/task:0/device:GPU:0"``); GPU means CUDA. Logical CPU
devices (``"cpu:0"``, ``"cpu:1"``) are distinct replicas whose tensors all live on
the one CPU. A CUDA device that this machine does not have is refused, naming
the devices it has.

Example:
    >>> from distribute.strategies._devices import parse_device
    >>> parse_device("/job:localhost/replica:0/task:0/device:CPU:1")
    ('cpu:1', device(type='cpu'))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distribute.errors import InvalidArgumentError

__all__ = [
    "available_devices",
    "default_devices",
    "device_list",
    "local_gpu",
    "parse_device",
    "replica_devices",
]


def available_devices() -> list[str]:
    """The devices a replica can use here: the CPU and every visible CUDA GPU."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu", *(f"cuda:{i}" for i in range(count))]


def _torch_spelling(name: str) -> str:
    """``"/job:w/replica:0/task:0/device:GPU:1"`` -> ``"cuda:1"``; torch names unchanged."""
    spelled = name.strip()
    if "device:" in spelled:
        spelled = spelled.rsplit("device:", 1)[1]
    spelled = spelled.lstrip("/")
    kind, sep, index = spelled.partition(":")
    kind = kind.lower()
    if kind == "gpu":
        kind = "cuda"
    return f"{kind}{sep}{index}"


def parse_device(device: str | torch.device) -> tuple[str, torch.device]:
    """Returns (display name, tensor device) for a replica device.

    Raises:
        InvalidArgumentError: the name is not a device, or a CUDA device this
            machine does not have.
    """
    name = str(device) if isinstance(device, torch.device) else _torch_spelling(device)
    try:
        parsed = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError(
            f"{device!r} is not a device name ({e}); use e.g. 'cpu', 'cpu:1' (a logical CPU "
            f"replica), 'cuda:0' or TensorFlow's '/gpu:0'; devices here: {available_devices()}"
        ) from None
    if parsed.type == "cpu":
        return name, torch.device("cpu")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = parsed.index if parsed.index is not None else 0
        if not 0 <= index < count:
            raise InvalidArgumentError(
                f"device {device!r} ({name}) does not exist on this machine, which has "
                f"{available_devices()}; pick one of those (logical CPU replicas: "
                "['cpu:0', 'cpu:1', ...])"
            )
    return name, parsed


def device_list(devices: str | torch.device | Sequence[str | torch.device]) -> list[str]:
    """A strategy's device argument as a list of torch names: one device alone is one
    replica (``"cpu:0"`` is not four devices), TF's spellings become torch's.

    Raises:
        InvalidArgumentError: see `parse_device`.
    """
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    return [parse_device(d)[0] for d in devices]


def local_gpu(
    local_rank: int,
    local_world_size: int,
    device_count: int,
    visible_devices: str | None,
    assigned: Sequence[int] = (),
) -> int:
    """The index of the GPU a worker process binds to: its own, never a neighbour's.

    ``assigned`` (a SLURM task's GPU ids) wins when they exist here. Otherwise local
    rank ``k`` of ``local_world_size`` takes GPU ``k``, which needs at least as many
    visible GPUs as processes on the host. A launcher that gives each process its
    own single GPU (``CUDA_VISIBLE_DEVICES=<one id>`` per process) leaves each one
    GPU 0.

    Raises:
        InvalidArgumentError: more processes on the host than visible GPUs, so two
            would share one (NCCL fails with "Duplicate GPU detected").

    Example:
        >>> from distribute.strategies._devices import local_gpu
        >>> local_gpu(3, 8, 8, None)
        3
        >>> local_gpu(3, 8, 1, "5")   # the launcher gave this process GPU 5 alone
        0
    """
    usable = [i for i in assigned if 0 <= i < device_count]
    if usable:
        return usable[0]
    if local_world_size <= device_count and 0 <= local_rank < device_count:
        return local_rank
    own_gpu = visible_devices is not None and len(visible_devices.split(",")) == 1
    if device_count == 1 and own_gpu:
        return 0
    raise InvalidArgumentError(
        f"{local_world_size} worker processes run on this host (local rank {local_rank}) but "
        f"only {device_count} GPU(s) are visible (CUDA_VISIBLE_DEVICES={visible_devices!r}), "
        "so processes would share a GPU; start one process per GPU (torchrun "
        f"--nproc_per_node={device_count}), give each process its own CUDA_VISIBLE_DEVICES, "
        "or pass devices=['cpu'] to train on the CPU"
    )


def default_devices() -> list[str]:
    """Every visible CUDA GPU, else one CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def replica_devices(devices: Sequence[str | torch.device]) -> tuple[torch.device, ...]:
    """The local replicas' devices, checked: at least one, all distinct.

    Raises:
        InvalidArgumentError: no device, or one named twice.
    """
    if not devices:
        raise InvalidArgumentError("a strategy needs at least one device, got none")
    parsed = [parse_device(d) for d in devices]
    names = [n for n, _ in parsed]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(
            f"devices must be distinct, got {names}; name logical CPU replicas "
            '"cpu:0", "cpu:1", ...'
        )
    return tuple(d for _, d in parsed)
