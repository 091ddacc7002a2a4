"""The one choice of a run's strategy (:class:`~fixres_dist.distributed.strategy.Strategy`) from its
parallel layout: one process, DDP, FSDP2 (full or hybrid), tensor parallelism or pipeline stages.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fixres_dist.config import TrainerConfig
from fixres_dist.distributed.ddp_strategy import Replicated
from fixres_dist.distributed.fsdp_strategy import FullySharded
from fixres_dist.distributed.layout import Layout
from fixres_dist.distributed.pipeline_strategy import PipelineSplit
from fixres_dist.distributed.strategy import SingleProcess, Strategy
from fixres_dist.distributed.tensor_fsdp_strategy import ShardedTensorSplit
from fixres_dist.distributed.tensor_strategy import TensorSplit

KINDS = (SingleProcess, Replicated, FullySharded, TensorSplit, ShardedTensorSplit, PipelineSplit)  # all there are


def strategy_for(layout: Layout, config: TrainerConfig, device: torch.device, *, amp: torch.dtype | None,
                 parameter_groups: Callable[[nn.Module], list[dict]], log: Callable[[str], None],
                 warn: Callable[[str], None]) -> Strategy:
    """The strategy of ``config``'s run laid out as ``layout`` on ``device``: one process, tensor
    parallelism (2-D when ``--sharding full/hybrid`` makes shard groups of 2 ranks or more), pipeline
    stages, ``--sharding full/hybrid`` or DDP. ``amp``: the ``--amp`` dtype or None (FSDP2's mixed
    precision); ``parameter_groups(model)``: the optimizer's groups of the whole model (a pipeline's
    checkpoints keep their numbering); ``log``/``warn``: rank 0's log. Makes no collective."""
    if config.num_tasks == 1:
        return SingleProcess(f"--sharding {config.sharding} on 1 rank: nothing to shard; the model trains whole"
                             if config.sharding != "ddp" else "", log)
    if layout.tensor_enabled and layout.shard_enabled:
        return ShardedTensorSplit(config, layout, device, amp, log, warn)
    if layout.tensor_enabled:
        return TensorSplit(config, layout, device, log)
    if layout.pipeline_enabled:
        return PipelineSplit(config, layout, device, parameter_groups, log)
    if config.sharding != "ddp":
        return FullySharded(config, device, amp, log, warn)
    return Replicated(device, broadcast_buffers=config.dist_bn == "broadcast")
