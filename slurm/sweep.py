"""FixRes-finetune one checkpoint at several test resolutions as one SLURM job array; print the table.

    python slurm/sweep.py --resolutions 160,224,288 --gpus-per-node 8 --partition gpu --timeout-min 60 \
        -- --weight-path runs/1234/checkpoint.pth --data-path /datasets/imagenet --shared-folder-path runs

Each array task is a ``main_finetune.py`` run at ``--input-size r`` (1 epoch unless ``--epochs`` is
given); the table shows each resolution's top-1 before and after finetuning.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing

from fixres_dist.cluster.cli import sweep_main

if __name__ == "__main__":
    sys.exit(sweep_main())
