"""Strategy implementations, one per module."""

from distribute.strategies import default as _default  # noqa: F401  # registers the default strategy
