#!/usr/bin/env bash
# Create .venv (if missing) and install fixres_dist with its test extra. Idempotent.
# torch/torchvision are pinned to the releases this project is tested with.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
if ! .venv/bin/python -c "import torch, torchvision, fixres_dist" 2>/dev/null \
   || ! .venv/bin/python -c "import pytest, submitit, attrs, tqdm, matplotlib" 2>/dev/null; then
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q torch==2.14.1 torchvision==0.29.1
    .venv/bin/pip install -q -e ".[test]"
fi
echo "setup: $(.venv/bin/python -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)')"
