"""Collectives: in-process CrossDeviceOps, cross-process process groups, packing."""

from distribute.collectives.process_group import AllReduceHandle, ProcessGroupCollectives

__all__ = ["AllReduceHandle", "ProcessGroupCollectives"]
