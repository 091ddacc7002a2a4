"""Submit main_scratch.py or main_finetune.py to SLURM through submitit (see docs/cluster.md).

    python slurm/submit.py finetune --nodes 2 --gpus-per-node 8 --partition gpu --timeout-min 240 \
        -- --shared-folder-path /checkpoint/$USER/fixres --data-path /datasets/imagenet --weight-path CKPT

Everything after ``--`` is passed to the main script's parser; SLURM sets the ranks and the job id.
Prints the job id and where the logs are; ``--wait`` also reports each rank's result.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing

from fixres_dist.cluster.cli import submit_main

if __name__ == "__main__":
    sys.exit(submit_main())
