"""How a parallel kind trains a model, behind one small interface: :class:`Strategy`, and
:class:`SingleProcess`, the strategy of a model trained whole in one process.

A strategy does every act that depends on how the ranks hold the model: it wraps the model (and the
EMA's copy, alike) for training (:meth:`Strategy.wrap`), accumulates micro-batches without reducing them
(:meth:`Strategy.no_sync`), reduces and clips the gradients, moves the full state dicts in and out,
gives the module evaluation runs, and names the ranks a BatchNorm averages its statistics over
(:attr:`Strategy.data_group`). A pipeline runs its own micro-batches: :attr:`Strategy.schedules` and
:meth:`Strategy.schedule`. One is chosen per run from the layout
(:func:`fixres_dist.distributed.strategies.strategy_for`); the others are
:class:`~fixres_dist.distributed.ddp_strategy.Replicated` (DDP),
:class:`~fixres_dist.distributed.fsdp_strategy.FullySharded` (FSDP2 full or hybrid),
:class:`~fixres_dist.distributed.tensor_strategy.TensorSplit` and
:class:`~fixres_dist.distributed.pipeline_strategy.PipelineSplit`.
"""
from __future__ import annotations

import abc
import contextlib
from typing import Callable

import torch
from torch import nn

from fixres_dist.distributed import sharding

# The interface, by name: what every strategy answers (tests/distributed/test_strategies.py checks it).
INTERFACE = ("wrap", "no_sync", "reduce_gradients", "clip_grad_norm", "full_state", "load_state_dict",
             "load_optimizer_state_dict", "evaluated", "data_group", "schedules", "schedule",
             "writes_shards", "lays_out_before_evaluating", "time_gradient_reduction", "laid_out",
             "builds_from_rank0")


class Strategy(abc.ABC):
    """One parallel kind's acts on a model. Its defaults are those of a model whose gradients need no
    reduction after the backward: torch's ``clip_grad_norm_``, full state dicts loaded as they are
    (:func:`~fixres_dist.distributed.sharding.load_state_dict`), evaluation on the module itself."""

    writes_shards = False  # its checkpoints are each rank's shards (torch.distributed.checkpoint)
    lays_out_before_evaluating = False  # wrapped before the first evaluation: evaluations run on its parts
    schedules = False  # runs its own micro-batches (:meth:`schedule`) instead of the step's accumulation
    # Every rank but 0 builds the model on the meta device (no memory) and :meth:`wrap` fills its part from
    # rank 0's tensors, one at a time (:func:`~fixres_dist.distributed.sharding.load_from_rank0`).
    builds_from_rank0 = False

    @abc.abstractmethod
    def wrap(self, model: nn.Module, average: nn.Module | None,
             size: int) -> tuple[nn.Module, nn.Module, nn.Module | None]:
        """Prepare ``model`` (and ``average``, the EMA's copy made before, alike) to train at ``size``
        pixels; returns ``(model, the module training calls, average)``: the model and the average may be
        replaced (a pipeline rank keeps its stages of each). Call once, on every rank (a collective for all
        but one process)."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """A context in which a backward accumulates gradients without reducing them (all micro-batches
        but a step's last)."""
        return contextlib.nullcontext()

    def reduce_gradients(self) -> None:
        """Reduce the gradients after a step's last backward, where the wrapper did not."""

    def clip_grad_norm(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Scale the gradients of ``parameters`` so that the L2 norm of all of them together (the whole
        model's) is at most ``max_norm``; returns that norm before clipping (a 0-dim float tensor)."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
        """All ranks (a collective where the state is split): ``{"model", "optimizer"}`` (and ``"model_ema"``,
        the EMA's weights, where :meth:`wrap` split them too) gathered whole as a one-file checkpoint holds
        them, or None where rank 0 holds them whole already or the checkpoint is written as shards."""
        return None

    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a full state_dict (every rank holds it) into ``model`` or the EMA's average (as :meth:`wrap`
        returned them); a split one keeps its part."""
        sharding.load_state_dict(model, state)

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load an unsplit optimizer's ``state`` (numbered over the whole model) into ``optimizer`` (over
        ``model``). Raises :class:`~fixres_dist.errors.FixresError` when the parameter counts differ."""
        sharding.load_optimizer_state_dict(model, optimizer, state)

    def evaluated(self, module: nn.Module, size: int, classes: int,
                  at_size: Callable[[nn.Module, int], nn.Module]) -> nn.Module:
        """What evaluation runs at ``size`` pixels: ``at_size(module, size)`` (``module``, the model or its
        EMA, at that resolution), or a module that gives (B, ``classes``) logits another way."""
        return at_size(module, size)

    @property
    def data_group(self):
        """The process group of the ranks that hold the same layers and see different images (where a
        BatchNorm averages its statistics); None: all ranks."""
        return None

    def schedule(self, images: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor | None:
        """With :attr:`schedules`: forward and backward of float (B, 3, H, W) ``images`` and their targets,
        each image's summed loss times ``scale``; returns the summed loss (None on ranks that hold none)."""
        raise NotImplementedError(f"{type(self).__name__} runs the step's micro-batches")

    def time_gradient_reduction(self, model: nn.Module, bucket_ready: Callable[[], None]) -> bool:
        """Call ``bucket_ready()`` as the gradients whose reduction runs last are accumulated, if this
        strategy can tell (step times); returns whether it could."""
        return False

    def laid_out(self, planned):
        """The :class:`~fixres_dist.distributed.layout.Layout` as :meth:`wrap` built it (checkpoints record
        it): ``planned``, unless the ranks' meeting decided a size (a hybrid shard group: a node's ranks)."""
        return planned


class SingleProcess(Strategy):
    """One process (world size 1): the model trains whole, nothing to reduce. ``note``: a line for
    ``log`` when it wraps (a layout asked for that one process cannot apply), or empty."""

    def __init__(self, note: str = "", log: Callable[[str], None] = print):
        self.note, self.log = note, log

    def wrap(self, model: nn.Module, average: nn.Module | None,
             size: int) -> tuple[nn.Module, nn.Module, nn.Module | None]:
        if self.note:
            self.log(self.note)
        return model, model, average


SINGLE = SingleProcess()  # the step's default: a model in one process
