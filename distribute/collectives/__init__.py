"""Collectives: in-process CrossDeviceOps, cross-process process groups, packing."""
