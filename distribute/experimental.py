"""`ds.experimental`: communication options, value contexts, variable partitioners,
`FullyShardedStrategy`, and model parallelism (`DeviceMesh`, `LayoutMap`, `TensorLayout`,
`ModelParallelStrategy`).

A facade: each name is defined in the layer it belongs to (collectives, data,
partitioners) and re-exported here, as tf.distribute's ``experimental`` namespace.
"""

from __future__ import annotations

from distribute import partitioners
from distribute.collectives.options import CommunicationImplementation, CommunicationOptions
from distribute.data.options import ValueContext
from distribute.strategies._layout import DeviceMesh, LayoutMap, TensorLayout
from distribute.strategies.fully_sharded import FullyShardedStrategy
from distribute.strategies.model_parallel import ModelParallelStrategy

__all__ = [
    "CommunicationImplementation",
    "CommunicationOptions",
    "DeviceMesh",
    "FullyShardedStrategy",
    "LayoutMap",
    "ModelParallelStrategy",
    "TensorLayout",
    "ValueContext",
    "partitioners",
]
