"""fixres_dist: DDP training and FixRes finetuning of image classifiers on clusters.

``TrainerConfig`` holds a run's options; ``Trainer(config)()`` runs one rank's part of the job.
"""
from .config import TrainerConfig
from .errors import FixresError
from .trainer import Trainer

__all__ = ["Trainer", "TrainerConfig", "FixresError"]
