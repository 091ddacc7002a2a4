#!/usr/bin/env bash
# The main job on the embedded Fashion-MNIST subset with 2 local ranks:
# train from scratch at a low resolution, then FixRes-finetune at a higher test resolution, with a
# resolution sweep before and after finetuning (resolution_sweep.png/.md in the finetune's job folder).
# Extra arguments go to both scripts (e.g. --shared-folder-path /tmp/runs).
set -euo pipefail
cd "$(dirname "$0")/.."
STAMP=$(date +%Y%m%d-%H%M%S)
SHARED=${SHARED:-runs}
.venv/bin/python main_scratch.py --num-tasks 2 --input-size 32 --shared-folder-path "$SHARED" \
    --job-id "demo-scratch-$STAMP" "$@"
.venv/bin/python main_finetune.py --num-tasks 2 --input-size 48 --shared-folder-path "$SHARED" \
    --job-id "demo-finetune-$STAMP" --weight-path "$SHARED/demo-scratch-$STAMP/checkpoint.pth" \
    --test-sizes 24,32,40,48,56,64 "$@"
