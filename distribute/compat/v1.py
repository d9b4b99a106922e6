"""`ds.compat.v1`: the TF1-style strategies.

Example::

    strategy = ds.compat.v1.ParameterServerStrategy()   # every worker runs the program
"""

from __future__ import annotations

from distribute.strategies.parameter_server_v1 import (
    ParameterServerStrategyV1 as ParameterServerStrategy,
)

__all__ = ["ParameterServerStrategy"]
