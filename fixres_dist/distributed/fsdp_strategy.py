"""FSDP2's strategy (``--sharding full/hybrid``): the model and the EMA's copy sharded per block over the
job's mesh (:func:`fixres_dist.distributed.sharding.shard`), gradients reduce-scattered in the backward,
checkpoints written as each rank's shards, every evaluation on the shards. No rank but 0 ever holds the
whole model: they build it on the meta device and receive their shards of rank 0's tensors one tensor at
a time (:attr:`builds_from_rank0`; with ``--cpu-offload`` every rank builds it whole first).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from fixres_dist.config import TrainerConfig
from fixres_dist.distributed import layout, sharding
from fixres_dist.distributed.strategy import Strategy


class FullySharded(Strategy):
    """``config``'s sharding on ``device``; ``amp``: the ``--amp`` dtype (gathered parameters in it,
    gradients reduced in float32) or None; ``log``/``warn``: rank 0's log."""

    writes_shards = True
    lays_out_before_evaluating = True

    def __init__(self, config: TrainerConfig, device: torch.device, amp: torch.dtype | None,
                 log: Callable[[str], None], warn: Callable[[str], None]):
        self.config, self.device, self.amp, self.log, self.warn = config, device, amp, log, warn
        self.builds_from_rank0 = config is not None and not config.cpu_offload  # offloaded: whole on every rank first
        self.model: nn.Module | None = None
        self.shard_group: int | None = None  # the mesh's shard axis, as the ranks met (wrap)

    @classmethod
    def of(cls, model: nn.Module) -> "FullySharded":
        """The strategy of ``model``, sharded already (by :func:`~fixres_dist.distributed.sharding.shard`),
        for a step run outside a Trainer (the memory estimate, benchmarks)."""
        strategy = cls(None, None, None, print, print)  # nothing to wrap, nothing to log
        strategy.model = model
        return strategy

    def wrap(self, model: nn.Module, average: nn.Module | None,
             size: int) -> tuple[nn.Module, nn.Module, nn.Module | None]:
        cfg = self.config
        mesh = sharding.device_mesh(cfg, self.device)
        blocks = sharding.shard([model] + ([average] if average is not None else []), mesh, cfg, self.amp)
        self.model, self.shard_group = model, mesh.size(-1)
        shape = " x ".join(f"{size} {'replicate' if name == 'data' else name}"  # the replicas: mesh axis data
                           for size, name in zip(mesh.shape, mesh.mesh_dim_names))
        per_rank = sum(p.to_local().numel() for p in model.parameters())
        self.log(f"--sharding {cfg.sharding}: {blocks or 'no'} blocks and the root sharded over a mesh of {shape} "
                 f"ranks; {per_rank:,} of {sum(p.numel() for p in model.parameters()):,} parameters on this rank"
                 + ("" if cfg.reshard_after_forward else ", kept gathered from forward to backward")
                 + (", offloaded to the CPU" if cfg.cpu_offload else ""))
        if not blocks:
            self.warn(f"--sharding {cfg.sharding}: no known blocks in {cfg.architecture}; the whole model is one "
                      "unit, gathered at once on every rank (no memory saved while it runs)")
        return model, model, average

    def laid_out(self, planned: layout.Layout) -> layout.Layout:
        return planned if self.shard_group is None else layout.of(self.config, self.shard_group)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return sharding.gradient_sync_off(self.model)
