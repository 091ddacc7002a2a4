"""DDP's strategy: every data-parallel rank holds a full replica, gradients all-reduced in the backward
by ``DistributedDataParallel`` (its ``no_sync`` for all micro-batches but the last).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fixres_dist.distributed.collectives import BUFFER_SYNC
from fixres_dist.distributed.strategy import Strategy

LAST_GRADIENTS = 4  # parameters whose gradients, the last of a backward, mark DDP's last bucket (step times)


class Replicated(Strategy):
    """DDP over all ranks on ``device``; ``broadcast_buffers``: rank 0's BatchNorm buffers at every forward
    (``--dist-bn broadcast``)."""

    def __init__(self, device: torch.device, broadcast_buffers: bool):
        self.device, self.broadcast_buffers = device, broadcast_buffers
        self.wrapped: DistributedDataParallel | None = None

    def wrap(self, model: nn.Module, average: nn.Module | None,
             size: int) -> tuple[nn.Module, nn.Module, nn.Module | None]:
        self.wrapped = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda"
                                               else None, **{BUFFER_SYNC: self.broadcast_buffers})
        return model, self.wrapped, average

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.wrapped.no_sync()

    def time_gradient_reduction(self, model: nn.Module, bucket_ready: Callable[[], None]) -> bool:
        """Call ``bucket_ready()`` as the gradients of the model's first :data:`LAST_GRADIENTS` trainable
        parameters (in module order) are accumulated: the last gradients of a backward, whose bucket DDP
        hands to its all-reduce last. Post-accumulate-grad hooks, run by autograd where the backward
        runs; DDP keeps its own C++ all-reduce. (A Python communication hook would run its
        ``Future.then`` callback in gloo's threads, each making and deleting a Python thread state, and
        a loader worker forked meanwhile can deadlock in CPython 3.11's after-fork.)"""
        for parameter in [p for p in model.parameters() if p.requires_grad][:LAST_GRADIENTS]:
            parameter.register_post_accumulate_grad_hook(lambda _: bucket_ready())
        return True
