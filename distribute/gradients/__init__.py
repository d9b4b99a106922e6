"""What happens to gradients when `optimizer.step()` runs: the gradient layer.

Unmodified `torch.optim` optimizers train distributed variables: global step hooks
(`_hooks.py`) refuse steps that would give wrong numbers (NOTE [refused steps])
and hand the rest to the running strategy's `StepHandler` (`base.py`). The
synchronous strategies share one handler (`synchronous.py`), which sums the
gradients with one of two `GradientSum` implementations: the in-process sum at
the step (`_local_sum.py`) or the bucket reducer that overlaps the cross-worker
all-reduce with backward (`_bucket_reducer.py`). A new strategy provides its own
handler; nothing here needs editing for it. `GradScaler` (`scaler.py`) is
`torch.amp.GradScaler` for replicas: it unscales the summed gradients.
"""

from __future__ import annotations

from distribute.gradients.base import GradientSum, StepHandler
from distribute.gradients.scaler import GradScaler

__all__ = ["GradScaler", "GradientSum", "StepHandler"]
