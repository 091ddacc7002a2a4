"""``python -m fixres_dist.cluster {main_scratch.py,main_finetune.py} [options]``: one task of a
plain sbatch job (``slurm/job.sbatch``), under the same protocol as a submitit job (see .task)."""
import sys

from fixres_dist.cluster.task import main

sys.exit(main())
