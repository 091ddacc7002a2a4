"""fixres_dist: DDP training and FixRes finetuning of image classifiers on clusters.

``TrainerConfig`` holds a run's options; ``Trainer(config)()`` runs one rank's part of the job and
returns a ``RunResult``. ``Preempted`` (exit status ``PREEMPTED_EXIT_STATUS``) follows a
preemption checkpoint; ``FixresError`` is every user-facing error (one line); ``FixresWarning`` a warning about a run
that goes on.

The names are imported on first use (PEP 562), so that ``import fixres_dist.startup`` does not
import torch: the scripts guard their start-up against stop signals before torch loads.
"""
import importlib

_EXPORTS = {"Trainer": "training.trainer", "RunResult": "training.trainer", "TrainerConfig": "config",
            "FixresError": "errors", "FixresWarning": "errors", "Preempted": "distributed.preemption",
            "PREEMPTED_EXIT_STATUS": "distributed.preemption"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
