"""The Keras-style high-level loop: `Model`, `callbacks`, `metrics`, `losses`, `optimizers`."""

from distribute.training import callbacks, losses, metrics, optimizers
from distribute.training.model import Model

__all__ = ["Model", "callbacks", "losses", "metrics", "optimizers"]
