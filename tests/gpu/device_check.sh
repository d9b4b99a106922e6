#!/usr/bin/env bash
# The GPU check of issue #26, from the repository root (tests/gpu/README.md, "The GPU check"):
#   tests/gpu/device_check.sh              on a machine with a GPU: report and log in $OUT
#   tests/gpu/device_check.sh --dry-run    the same run on the CPU (CI runs it)
# Everything is in tests/gpu/device_check.py (--help lists the options); PYTHON picks the
# interpreter (default python3, the one that holds torch).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python3}" tests/gpu/device_check.py "$@"
