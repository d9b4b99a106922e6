"""`ds.compat`: tf.distribute's compatibility names (`ds.compat.v1`)."""

from __future__ import annotations

from distribute.compat import v1

__all__ = ["v1"]
