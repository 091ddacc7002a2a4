"""Pipeline parallelism's strategy (``--pipeline-stages N``): rank 0's weights everywhere, the unsplit
optimizer's numbering kept, the model cut into stages (:class:`~fixres_dist.distributed.pipeline.Pipeline`)
that run their own micro-batches; checkpoints gathered whole (:mod:`fixres_dist.distributed.pipeline_state`).

With ``--model-ema`` the EMA's copy (made whole before the cut, :class:`~fixres_dist.models.ema.ModelEMA`) is
cut at the same pieces into a second pipeline that only evaluates: each rank keeps the average of its own
stages' parameters and buffers, updated from them after each step, evaluated through that pipeline's schedules,
gathered whole into the checkpoint's ``model_ema`` as the model's weights are.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fixres_dist.config import TrainerConfig
from fixres_dist.distributed import pipeline, pipeline_state, sharding
from fixres_dist.distributed.layout import Layout
from fixres_dist.distributed.strategy import Strategy


class PipelineSplit(Strategy):
    """``config``'s stages (``layout.pipeline`` of them) on ``device``. ``parameter_groups(model)``: the
    optimizer's parameter groups of the whole model (dicts with ``"params"``), whose numbering the
    checkpoints keep; ``log``: rank 0's log."""

    lays_out_before_evaluating = True
    schedules = True

    def __init__(self, config: TrainerConfig, layout: Layout, device: torch.device,
                 parameter_groups: Callable[[nn.Module], list[dict]], log: Callable[[str], None]):
        self.config, self.layout, self.device, self.log = config, layout, device, log
        self.parameter_groups = parameter_groups
        self.pipeline: pipeline.Pipeline | None = None  # this rank's stages and their schedules (wrap makes it)
        self.averaged: pipeline.Pipeline | None = None  # the same stages of the EMA's average (--model-ema)
        self.whole_groups: list[list[str]] | None = None  # the unsplit model's optimizer numbering
        self._mesh = None

    @property
    def data_group(self):
        """A stage's data-parallel ranks (the mesh made at the first call: a collective)."""
        return self._stage_mesh().get_group("data")

    def _stage_mesh(self):
        if self._mesh is None:
            self._mesh = pipeline.pipeline_mesh(self.device, self.config.num_tasks, self.layout.pipeline)
        return self._mesh

    def wrap(self, model: nn.Module, average: nn.Module | None,
             size: int) -> tuple[nn.Module, nn.Module, nn.Module | None]:
        cfg = self.config
        sharding.start_from_rank0(model)
        names = {param: name for name, param in model.named_parameters()}
        self.whole_groups = [[names[p] for p in group["params"]] for group in self.parameter_groups(model)]
        self.pipeline = self._cut(model, size, list(cfg.pipeline_split) if cfg.pipeline_split else None)
        module = self.pipeline.module
        self.log(f"--pipeline-stages {self.layout.pipeline}: {self.pipeline.describe()}; "
                 f"{sum(p.numel() for p in module.parameters()):,} parameters on this rank"
                 + ("; the EMA's average of them alike" if average is not None else ""))
        if average is not None:  # rank 0's too, cut at the model's pieces: its stage's parameters in the same order
            sharding.start_from_rank0(average)
            self.averaged = self._cut(average, size, self.pipeline.starts)
            average = self.averaged.module
        return module, module, average

    def _cut(self, model: nn.Module, size: int, starts: list[int] | None) -> pipeline.Pipeline:
        """This rank's stages of ``model`` (the first piece of each: ``starts``, or balanced at ``size`` pixels)."""
        cfg = self.config
        return pipeline.Pipeline(
            model, self._stage_mesh(), size=size, schedule=cfg.pipeline_schedule,
            microbatches=cfg.pipeline_microbatches, virtual=pipeline.virtual_stages(cfg.pipeline_schedule),
            starts=starts, architecture=cfg.architecture, summed=True, label_smoothing=cfg.label_smoothing,
            buffer_sync=False)

    def schedule(self, images: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor | None:
        return self.pipeline.train_step(images, targets, scale)

    def clip_grad_norm(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return self.pipeline.clip_grad_norm(max_norm)

    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
        return pipeline_state.gather_whole(self.pipeline, optimizer, self.whole_groups,
                                           self.averaged.module if self.averaged is not None else None)

    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        own = model.state_dict()
        sharding.load_state_dict(model, {key: value for key, value in state.items() if key in own})

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(pipeline_state.own_optimizer_state(model, optimizer, state, self.whole_groups))

    def evaluated(self, module: nn.Module, size: int, classes: int,
                  at_size: Callable[[nn.Module, int], nn.Module]) -> nn.Module:
        """The model's pipeline, or the EMA's where ``module`` is the average :meth:`wrap` returned."""
        averaged = self.averaged is not None and module is self.averaged.module
        return (self.averaged if averaged else self.pipeline).evaluator(classes)
