"""FSDP2 x tensor parallelism (``--tensor-parallel N --sharding full/hybrid``), 2-D as torchtitan
composes them: on the job's one mesh, each ViT block's MLP split over its ``tensor`` group
(:func:`fixres_dist.distributed.tensor_parallel.parallelize`; the attention kept whole: FSDP2 would
gather the heads' strided split of ``qkv`` permuted), then every block and the root sharded over the
``shard`` axis (hybrid: ``data`` x ``shard``) of the same mesh (:func:`fixres_dist.distributed.sharding.shard`).

FSDP2 reduces the gradients over the data-parallel ranks (a tensor group's ranks see the same images);
the norm that clipping bounds is summed over every mesh a gradient lives on
(:func:`~fixres_dist.distributed.tensor_parallel.clip_grad_norm`). Checkpoints are each rank's shards,
as FSDP2's, and read back under any strategy.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fixres_dist.config import TrainerConfig
from fixres_dist.distributed import sharding, tensor_parallel
from fixres_dist.distributed.fsdp_strategy import FullySharded
from fixres_dist.distributed.layout import Layout


class ShardedTensorSplit(FullySharded):
    """``config``'s tensor groups (``layout.tensor`` ranks) and sharding on ``device``; ``amp``: the ``--amp``
    dtype or None; ``log``/``warn``: rank 0's log."""

    def __init__(self, config: TrainerConfig, layout: Layout, device: torch.device, amp: torch.dtype | None,
                 log: Callable[[str], None], warn: Callable[[str], None]):
        super().__init__(config, device, amp, log, warn)
        self.layout = layout

    def wrap(self, model: nn.Module, average: nn.Module | None,
             size: int) -> tuple[nn.Module, nn.Module, nn.Module | None]:
        cfg, tensor = self.config, self.layout.tensor
        mesh = sharding.job_mesh(cfg, self.device)
        modules = [model] + ([average] if average is not None else [])
        states = sharding.rank0_states(modules)  # rank 0's full tensors, before the split
        model.to("meta")  # on every rank alike: the split then sends nothing; the shards get rank 0's values
        mlps, _ = tensor_parallel.parallelize(model, mesh["tensor"], cfg.architecture, heads=False)
        blocks = sharding.shard(modules, mesh[sharding.shard_axes(cfg)], cfg, self.amp, states)
        self.model = model
        self.log(f"--tensor-parallel {tensor} x --sharding {cfg.sharding}: {mlps} MLPs split over tensor groups of "
                 f"{tensor} ranks (attention whole), then {blocks} blocks and the root sharded over "
                 f"{self.layout.describe()}; {tensor_parallel.local_parameters(model):,} of "
                 f"{sum(p.numel() for p in model.parameters()):,} parameters on this rank")
        return model, model, average

    def clip_grad_norm(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return tensor_parallel.clip_grad_norm(self.model, max_norm)
