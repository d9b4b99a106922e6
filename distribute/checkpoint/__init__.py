"""Checkpoints: `Checkpoint`, `CheckpointManager`, `RNGState` (see NOTE [checkpoint format])."""

from distribute.checkpoint._checkpoint import Checkpoint
from distribute.checkpoint._format import CheckpointError
from distribute.checkpoint._manager import CheckpointManager
from distribute.checkpoint._objects import RNGState

__all__ = ["Checkpoint", "CheckpointError", "CheckpointManager", "RNGState"]
