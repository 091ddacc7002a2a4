#!/usr/bin/env bash
# The main job, FixRes' cheap recipe on real images with 2 local ranks (measured times: README.md):
# 1. train resnet20 from scratch at a low resolution, 24 px, on the embedded fashion_mnist_canvas
#    (real Fashion-MNIST garments at random scales and positions on a 48 px canvas);
# 2. FixRes-finetune its classifier and last BatchNorm at the higher test resolution, 32 px, with the
#    test preprocessing, sweeping 24-40 px before and after (resolution_sweep.png/.md in its job folder);
# 3. control: the same finetune at the train resolution, so the gain is not just extra training;
# 4. print the table (scripts/demo_report.py) and the wall time.
# Extra arguments go to every run, after the demo's own, so they win. Job folders go to
# --shared-folder-path if given, else to $SHARED (default runs/). A quick check of the whole path, 1 epoch each:
#   e.g. bash scripts/demo.sh --shared-folder-path /tmp/runs --epochs 1
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
STAMP=$(date +%Y%m%d-%H%M%S)
SHARED=${SHARED:-runs}
PYTHON=${PYTHON:-.venv/bin/python}
ARGS=("$@")
for i in "${!ARGS[@]}"; do  # the last --shared-folder-path wins, as it does for the scripts' parser
    case "${ARGS[$i]}" in
        --job-id|--job-id=*) echo "demo.sh: --job-id cannot go to all three runs (each needs its own job);" \
                                  "the demo names them demo-{scratch,fixres,control}-<time>" >&2; exit 2 ;;
        --shared-folder-path) [ $((i + 1)) -lt ${#ARGS[@]} ] && SHARED=${ARGS[$((i + 1))]} ;;
        --shared-folder-path=*) SHARED=${ARGS[$i]#--shared-folder-path=} ;;
    esac
done
RUN=(--num-tasks 2 --architecture resnet20 --data-path fixres_dist/embedded_data/fashion_mnist_canvas
     --shared-folder-path "$SHARED")
WEIGHTS="$SHARED/demo-scratch-$STAMP/checkpoint.pth"
"$PYTHON" main_scratch.py "${RUN[@]}" --input-size 24 --epochs 6 --job-id "demo-scratch-$STAMP" "$@"
"$PYTHON" main_finetune.py "${RUN[@]}" --weight-path "$WEIGHTS" --input-size 32 --test-sizes 24,28,32,36,40 \
    --epochs 1 --job-id "demo-fixres-$STAMP" "$@"
"$PYTHON" main_finetune.py "${RUN[@]}" --weight-path "$WEIGHTS" --input-size 24 --epochs 1 \
    --job-id "demo-control-$STAMP" "$@"
"$PYTHON" scripts/demo_report.py "$SHARED/demo-fixres-$STAMP" "$SHARED/demo-control-$STAMP" --seconds $((SECONDS - START))
