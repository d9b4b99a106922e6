"""`ds.experimental`: communication options, value contexts and variable partitioners.

A facade: each name is defined in the layer it belongs to (collectives, data,
partitioners) and re-exported here, as tf.distribute's ``experimental`` namespace.
"""

from __future__ import annotations

from distribute import partitioners
from distribute.collectives.options import CommunicationImplementation, CommunicationOptions
from distribute.data.options import ValueContext

__all__ = ["CommunicationImplementation", "CommunicationOptions", "ValueContext", "partitioners"]
