#!/usr/bin/env bash
# On a machine with one CUDA GPU: the CUDA tests, then the precision and speed checks, in one go
# (under 8 minutes on a recent GPU). Prints a table last. Set-up as usual: `make setup` first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
nvidia-smi -L || true
timeout 180 "$PY" -m pytest -q -m cuda tests/gpu
timeout 300 "$PY" benchmarks/gpu_check.py "$@"
