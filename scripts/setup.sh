#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and installs phalanx into it.
# torch is chosen before phalanx so that pip never resolves an unpinned torch: on a machine
# without an NVIDIA driver that would pull a multi-GB CUDA build for nothing.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: NVIDIA GPU found, installing a CUDA build of torch"
        "$PY" -m pip install --quiet "torch>=2.6"
    else
        echo "setup: no NVIDIA GPU found, installing the CPU build torch==2.13.0"
        "$PY" -m pip install --quiet "torch==2.13.0"
    fi
fi

"$PY" -m pip install --quiet -e ".[dev]"
touch "$VENV/.installed"
echo "setup: ready ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
