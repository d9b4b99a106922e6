"""Runs this process as the ps or worker task that ``TF_CONFIG`` names.

    TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 0}}' \\
        python -m distribute.coordinator.serve

Exits 0 when the chief shuts the cluster down.
"""

from __future__ import annotations

from distribute.cluster_resolver.tfconfig import TFConfigClusterResolver
from distribute.strategies.parameter_server import Server

if __name__ == "__main__":
    Server(TFConfigClusterResolver()).join()
