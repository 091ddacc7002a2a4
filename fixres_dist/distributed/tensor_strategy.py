"""Tensor parallelism's strategy (``--tensor-parallel N``): rank 0's weights everywhere, each ViT block
split over its tensor group (:mod:`fixres_dist.distributed.tensor_parallel`), the gradients averaged over
the data-parallel groups after the backward, clipped as a whole and gathered whole for checkpoints.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from fixres_dist.config import TrainerConfig
from fixres_dist.distributed import sharding, tensor_parallel
from fixres_dist.distributed.layout import Layout
from fixres_dist.distributed.strategy import Strategy


class TensorSplit(Strategy):
    """``config``'s tensor groups (of ``layout.tensor`` ranks) on ``device``; ``log``: rank 0's log."""

    lays_out_before_evaluating = True

    def __init__(self, config: TrainerConfig, layout: Layout, device: torch.device, log: Callable[[str], None]):
        self.config, self.layout, self.device, self.log = config, layout, device, log
        self.model: nn.Module | None = None
        self.mesh = None  # the data x tensor mesh (wrap makes it: a collective)

    def wrap(self, model: nn.Module, average: nn.Module | None,
             size: int) -> tuple[nn.Module, nn.Module, nn.Module | None]:
        cfg, tensor = self.config, self.layout.tensor
        self.mesh = tensor_parallel.tensor_mesh(self.device, cfg.num_tasks, tensor)
        sharding.start_from_rank0(model)
        mlps, attentions = tensor_parallel.parallelize(model, self.mesh["tensor"], cfg.architecture)
        self.model = model
        self.log(f"--tensor-parallel {tensor}: {mlps} MLPs"
                 + (f" and {attentions} attentions (by heads)" if attentions else " (attention whole)")
                 + f" split over tensor groups of {tensor} ranks, {cfg.data_parallel_size} data-parallel "
                 f"group(s); {tensor_parallel.local_parameters(model):,} of "
                 f"{sum(p.numel() for p in model.parameters()):,} parameters on this rank")
        return model, model, average

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the gradients are reduced once, after the step's last backward

    def reduce_gradients(self) -> None:
        tensor_parallel.average_gradients(self.model, self.mesh)

    def clip_grad_norm(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return tensor_parallel.clip_grad_norm(self.model, max_norm)

    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
        return sharding.full_state_dicts(model, optimizer)
