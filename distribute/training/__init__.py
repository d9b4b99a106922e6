"""The Keras-style high-level loop: `Model`, `callbacks`, `metrics`, `losses`."""

from distribute.training import callbacks, losses, metrics
from distribute.training.model import Model

__all__ = ["Model", "callbacks", "losses", "metrics"]
