"""Where a network's weights come from: the resolution they were trained from scratch at, and the
resolution of their FixRes finetune, carried from checkpoint to checkpoint.

FixRes' apparent-object-size estimate (section 3.1, :func:`fixres_dist.fixres.finetuning.apparent_size_test_resolution`)
is a function of the resolution the network was trained at with RandomResizedCrop: its
*from-scratch* training resolution. A finetune checkpoint's own configuration names the finetune's
resolution (``input_size``) and the weights it started from (``weight_path``); the scratch
resolution is one file further back. So every checkpoint records its :class:`Lineage` under
``"lineage"``, and the chain is answerable without the earlier files:

* scratch training: trained at ``--input-size``, not finetuned;
* finetune: trained at ``--train-size`` if given, else at what the weight file's lineage says;
  finetuned at the finetune's resolution;
* evaluation (``--eval-only``): the weight file's lineage; ``--train-size`` overrides its train size.

Checkpoints written before the record existed: a scratch checkpoint's configuration says its
``input_size``; a finetune's says its ``train_size`` if one was given, else the lineage of its own
``weight_path`` file is read if that file is still there (at most :data:`MAX_DEPTH` files back).
Weight files from elsewhere (torchvision, timm) record nothing. What cannot be answered is
reported as unknown, never guessed.
"""
from __future__ import annotations

from pathlib import Path

import attrs

from fixres_dist.errors import FixresError
from fixres_dist.models import weights

RECORD_KEY = "lineage"  # the checkpoint entry
MAX_DEPTH = 4  # weight files followed back through configurations, for checkpoints without a record


def _size(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@attrs.frozen
class Lineage:
    """``train_size``: pixels the weights were trained from scratch at (None: unknown);
    ``finetuned_at``: pixels of their FixRes finetune (None: not finetuned, or not known to be)."""

    train_size: int | None = None
    finetuned_at: int | None = None

    def record(self) -> dict:
        """The checkpoint entry (plain data)."""
        return {"train_size": self.train_size, "finetuned_at": self.finetuned_at}

    @classmethod
    def from_record(cls, record: dict) -> "Lineage":
        return cls(_size(record.get("train_size")), _size(record.get("finetuned_at")))

    def describe(self) -> str:
        """``"trained from scratch at 32 px, FixRes-finetuned at 48 px"``, or what is unknown."""
        trained = f"trained from scratch at {self.train_size} px" if self.train_size else \
            "train resolution unknown (the weights record none; --train-size gives it)"
        return trained + (f", FixRes-finetuned at {self.finetuned_at} px" if self.finetuned_at else "")


def of_weights(found: weights.WeightFile | None, depth: int = MAX_DEPTH) -> Lineage:
    """The lineage of the weights in ``found`` (:func:`fixres_dist.models.weights.read_weight_file`'s
    result; None: no weight file), from its record or, for older checkpoints, its configuration."""
    if found is None:
        return Lineage()
    if found.lineage is not None:
        return Lineage.from_record(found.lineage)
    config = found.config
    if config is None:  # not a fixres_dist checkpoint
        return Lineage()
    size = _size(config.get("input_size"))
    if config.get("mode") != "finetune":
        return Lineage(size)
    train = _size(config.get("train_size"))
    source = config.get("weight_path")
    if train is None and depth > 0 and isinstance(source, str) and Path(source).is_file():
        try:
            train = of_weights(weights.read_weight_file(source, config.get("weight_key")), depth - 1).train_size
        except FixresError:  # replaced or damaged since: the train size stays unknown
            train = None
    return Lineage(train, size)


def trained(config, loaded: Lineage, input_size: int) -> Lineage:
    """The lineage of the network a run of ``config`` reports on and checkpoints: the weights it
    evaluates (``--eval-only``: ``loaded``, :func:`for_run`'s), those it trains from scratch at
    ``input_size`` pixels, or those it finetunes at ``input_size`` from ``loaded``."""
    if config.eval_only:
        return loaded
    if config.mode == "scratch":
        return Lineage(input_size)
    return Lineage(loaded.train_size, input_size)


def for_run(config, found: weights.WeightFile | None) -> Lineage:
    """What a run of ``config`` (a TrainerConfig) reports about its network: scratch training, the
    weights it trains (``--input-size``); otherwise the lineage of the weights it loads (``found``),
    ``--train-size`` winning over their record."""
    if config.mode == "scratch" and not config.eval_only:
        return Lineage(_size(config.input_size))
    source = of_weights(found)
    return attrs.evolve(source, train_size=config.train_size or source.train_size)
