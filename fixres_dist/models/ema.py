"""Exponential moving average (EMA) of a model's weights: ``--model-ema``.

The average is ``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn(decay)`` and
``use_buffers=True`` (the parameters and the BatchNorm running statistics are averaged), as
torchvision's references do (``references/classification/utils.py``, ``ExponentialMovingAverage``).
It is updated every ``every`` optimizer steps: ``ema = decay x ema + (1 - decay) x weights``;
``decay`` is per update (timm's and DeiT's meaning; torchvision rescales its ``--model-ema-decay``
by the global batch, the update interval and the epochs, see :mod:`fixres_dist.training.recipes`). During
the learning-rate warmup the average restarts at every update (it copies the weights), as in
torchvision's references, so that it does not carry the random initialisation.

The parameters of the average are the same on every rank (the weights are); its BatchNorm
statistics are not (each rank's follow its own images) until :meth:`ModelEMA.average_statistics`
averages them over the ranks, as the Trainer does for the model at each epoch's end
(``--dist-bn reduce``), so that the average evaluated on every rank is one network.

The copy is a deep copy of the model, but for the process group of a synchronised BatchNorm (a pipeline
stage's data-parallel ranks, :func:`fixres_dist.models.batchnorm.synchronise`), which cannot be copied: the
copy names the same group. A strategy may replace the copy when it wraps the model
(:meth:`fixres_dist.distributed.strategy.Strategy.wrap`): a pipeline rank keeps its stages of it
(:mod:`fixres_dist.distributed.pipeline_strategy`), cut as the model's, so that their parameters and buffers
come in the same order, and the update runs on them alone.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from fixres_dist.distributed import collectives, sharding


def _each_kind(average):
    """``average`` (a ``multi_avg_fn``) applied to sharded parameters (DTensors) and plain tensors
    (buffers; parameters unsharded) apart: one foreach kernel cannot take both."""
    def each_kind(averaged: list, current: list, updates) -> None:
        for sharded in (True, False):
            pairs = [(a, c) for a, c in zip(averaged, current) if isinstance(a, DTensor) == sharded]
            if pairs:
                average([a for a, _ in pairs], [c for _, c in pairs], updates)
    return each_kind


GROUP_ATTRIBUTES = ("group", "process_group")  # a synchronised BatchNorm's process group (ours, torch's)


def _process_groups(model: nn.Module) -> dict[tuple[str, str], dist.ProcessGroup]:
    """``(module name, attribute) -> process group`` of ``model``'s synchronised BatchNorms that name one."""
    return {(name, attribute): getattr(module, attribute) for name, module in model.named_modules()
            for attribute in GROUP_ATTRIBUTES if isinstance(getattr(module, attribute, None), dist.ProcessGroup)}


def _set_groups(model: nn.Module, groups: dict[tuple[str, str], dist.ProcessGroup | None]) -> None:
    for (name, attribute), group in groups.items():
        setattr(model.get_submodule(name), attribute, group)


class ModelEMA:
    """The EMA of ``model`` (the unwrapped module: not its DDP wrapper), on ``model``'s device. Make it
    before sharding ``model`` (a sharded module cannot be copied), then shard :attr:`module` alike.

    ``decay`` in [0, 1): the average's weight at each update; ``every``: optimizer steps between
    updates (>= 1). ``module`` is the averaged network (an ``nn.Module`` taking the model's inputs).
    """

    def __init__(self, model: nn.Module, decay: float, every: int):
        if not 0 <= decay < 1 or every < 1:
            raise ValueError(f"EMA decay must be in [0, 1) and every >= 1, got {decay}, {every}")
        groups = _process_groups(model)  # set apart while the model is copied: a process group cannot be copied
        _set_groups(model, dict.fromkeys(groups))
        try:
            self.averaged = AveragedModel(model, multi_avg_fn=_each_kind(get_ema_multi_avg_fn(decay)), use_buffers=True)
        finally:
            _set_groups(model, groups)
        _set_groups(self.averaged.module, groups)
        self.averaged.requires_grad_(False)
        self.decay, self.every = decay, every

    @property
    def module(self) -> nn.Module:
        return self.averaged.module

    @module.setter
    def module(self, module: nn.Module) -> None:
        """The copy as the strategy wrapped it (a pipeline rank's stages of it): the same parameters and
        buffers, in the order of the wrapped model's, that :meth:`after_step` is given."""
        self.averaged.module = module

    @property
    def updates(self) -> int:
        """Updates since the average last restarted (0: it holds no average yet)."""
        return int(self.averaged.n_averaged)

    def after_step(self, model: nn.Module, global_step: int, warming_up: bool) -> None:
        """Update from ``model`` after optimizer step ``global_step`` (1-based) when it is due; during the
        warmup (``warming_up``) the average restarts, i.e. copies the weights."""
        if global_step % self.every:
            return
        if warming_up:
            self.averaged.n_averaged.zero_()
        self.averaged.update_parameters(model)

    def average_statistics(self, model: nn.Module, group=None) -> None:
        """Average the EMA's BatchNorm running statistics over the ranks of ``group`` (a collective; None:
        all ranks; a pipeline's: a stage's data-parallel ranks), for the normalisation layers that train in
        ``model`` (the others never change: they stay as they are)."""
        for averaged, trained in zip(self.module.modules(), model.modules()):
            averaged.training = trained.training
        collectives.average_batchnorm_statistics(self.module, group)

    def state_dict(self) -> dict:
        """The averaged network's state_dict (the model's keys), as rank 0 saves it under ``model_ema``."""
        return self.module.state_dict()

    def extra_state(self) -> dict:
        """What the checkpoint keeps besides the weights: the number of updates since the last restart."""
        return {"updates": self.updates}

    def load(self, weights: dict, extra: dict, buffers: dict | None = None) -> None:
        """Restore from a checkpoint: ``weights`` (:meth:`state_dict`), ``extra`` (:meth:`extra_state`)
        and, if given, this rank's BatchNorm ``buffers`` (:func:`fixres_dist.training.checkpoint.rank_buffers`)
        over the statistics in ``weights``."""
        self.load_weights(weights)
        self.load_state(extra, buffers)

    def load_weights(self, weights: dict) -> None:
        """The averaged weights of a one-file checkpoint (full tensors), into a sharded or plain average."""
        sharding.load_state_dict(self.module, weights)

    def load_state(self, extra: dict, buffers: dict | None = None) -> None:
        """The update count (:meth:`extra_state`) and this rank's BatchNorm ``buffers``, after the weights."""
        sharding.load_buffers(self.module, buffers or {})
        self.averaged.n_averaged.fill_(int(extra["updates"]))
