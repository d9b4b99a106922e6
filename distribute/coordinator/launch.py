"""One command for a local parameter-server cluster: ps and worker tasks as local
processes, and the chief's script with its ``TF_CONFIG``.

    python -m distribute.coordinator.launch --workers 2 --ps 1 -- \\
        examples/train_digits.py --strategy parameter_server

Exits with the chief's exit code (1 if a task did not exit cleanly).
"""

from __future__ import annotations

import sys

from distribute.coordinator.local import main

if __name__ == "__main__":
    sys.exit(main())
