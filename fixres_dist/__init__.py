"""fixres_dist: DDP training and FixRes finetuning of image classifiers on clusters.

``TrainerConfig`` holds a run's options; ``Trainer(config)()`` runs one rank's part of the job and
returns a ``RunResult``. ``Preempted`` (exit status ``PREEMPTED_EXIT_STATUS``) follows a
preemption checkpoint; ``FixresError`` is every user-facing error (one line).
"""
from .config import TrainerConfig
from .errors import FixresError
from .preemption import PREEMPTED_EXIT_STATUS, Preempted
from .trainer import RunResult, Trainer

__all__ = ["Trainer", "TrainerConfig", "RunResult", "FixresError", "Preempted", "PREEMPTED_EXIT_STATUS"]
