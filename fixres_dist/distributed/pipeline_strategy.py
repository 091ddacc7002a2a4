"""Pipeline parallelism's strategy (``--pipeline-stages N``): rank 0's weights everywhere, the unsplit
optimizer's numbering kept, the model cut into stages (:class:`~fixres_dist.distributed.pipeline.Pipeline`)
that run their own micro-batches; checkpoints gathered whole (:mod:`fixres_dist.distributed.pipeline_state`).
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

    def wrap(self, model: nn.Module, average: nn.Module | None, size: int) -> tuple[nn.Module, nn.Module]:
        cfg = self.config
        sharding.start_from_rank0(model)
        names = {param: name for name, param in model.named_parameters()}
        self.whole_groups = [[names[p] for p in group["params"]] for group in self.parameter_groups(model)]
        self.pipeline = pipeline.Pipeline(
            model, self._stage_mesh(), size=size, schedule=cfg.pipeline_schedule,
            microbatches=cfg.pipeline_microbatches, virtual=pipeline.virtual_stages(cfg.pipeline_schedule),
            starts=list(cfg.pipeline_split) if cfg.pipeline_split else None,
            architecture=cfg.architecture, summed=True, label_smoothing=cfg.label_smoothing, buffer_sync=False)
        module = self.pipeline.module
        self.log(f"--pipeline-stages {self.layout.pipeline}: {self.pipeline.describe()}; "
                 f"{sum(p.numel() for p in module.parameters()):,} parameters on this rank")
        return module, module

    def schedule(self, images: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor | None:
        return self.pipeline.train_step(images, targets, scale)

    def clip_grad_norm(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return self.pipeline.clip_grad_norm(max_norm)

    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
        return pipeline_state.gather_whole(self.pipeline, optimizer, self.whole_groups)

    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        own = model.state_dict()
        sharding.load_state_dict(model, {key: value for key, value in state.items() if key in own})

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(pipeline_state.own_optimizer_state(model, optimizer, state, self.whole_groups))

    def evaluated(self, module: nn.Module, size: int, classes: int,
                  at_size: Callable[[nn.Module, int], nn.Module]) -> nn.Module:
        return self.pipeline.evaluator(classes)
