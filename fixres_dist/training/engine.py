"""The training and evaluation loops, as functions of explicit arguments (no Trainer state).

* :func:`train_step`: one optimizer step on this rank's share of a global batch (accumulated
  micro-batches, MixUp/CutMix, gradient clipping as asked), the run's constants in one
  :class:`StepSettings`, the layout's acts its :class:`~fixres_dist.distributed.strategy.Strategy`'s;
* :func:`train_one_epoch`: the steps of one epoch (or of its rest, after a mid-epoch resume),
  with the caller's hooks for the learning rate and for what happens after each step;
* :func:`evaluate`: exact top-1/top-5 over every validation image once, whatever the world size;

Evaluation counts every validation image exactly once: each rank runs the *unwrapped* model on its
share (an :class:`~fixres_dist.data.samplers.ExactBatchSampler` without shuffling; no padding
duplicates), then per-rank sums (top-1 hits, top-5 hits, summed loss, image count) are
all-reduced in float64. Top-1/top-5 are percentages of the images counted.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from fixres_dist.data.pipeline import IMAGENET_NORMALIZATION, to_device
from fixres_dist.distributed import collectives, sharding
from fixres_dist.distributed.strategy import SINGLE, Strategy
from fixres_dist.fixres.finetuning import eval_mode

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}


def autocast(device: torch.device, amp: torch.dtype | None):
    """Mixed precision for ``amp`` (``torch.bfloat16``/``torch.float16``) on ``device``; a no-op for None."""
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=amp)


def micro_batches(images: int, accumulation: int) -> int:
    """How many micro-batches a share of ``images`` images is cut into for ``accumulation``
    accumulated micro-batches per optimizer step: ``accumulation``, fewer for a small last share so
    that every micro-batch keeps at least 2 images (BatchNorm cannot train on one), at least 1.
    :func:`train_step` passes the smallest rank's share, so that every rank takes as many forward
    passes (synchronised BatchNorm meets the other ranks in each)."""
    return max(1, min(accumulation, images // 2))


@attrs.frozen
class StepSettings:
    """A run's constants of every training step, made once: ``device``; ``world``: data-parallel ranks;
    ``amp``: the autocast dtype (``torch.bfloat16``/``torch.float16``) or None; ``channels_last``;
    ``normalization``: the (mean, std) the images are normalised with; ``label_smoothing``;
    ``accumulation``: micro-batches per step (:func:`micro_batches`); ``clip_grad_norm``: the largest L2
    norm of the whole gradient, or None (no clipping)."""

    device: torch.device
    world: int = 1
    amp: torch.dtype | None = None
    channels_last: bool = False
    normalization: tuple = IMAGENET_NORMALIZATION
    label_smoothing: float = 0.0
    accumulation: int = 1
    clip_grad_norm: float | None = None


def train_step(forward: Callable, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               images: torch.Tensor, labels: torch.Tensor, settings: StepSettings, *,
               global_batch: int | None = None, strategy: Strategy = SINGLE,
               mix: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
               times=None) -> torch.Tensor:
    """One optimizer step on this rank's uint8 (B, 3, H, W) share of a global batch.

    The loss is the mean over the *global* batch (``global_batch`` images on all ``settings.world``
    data-parallel ranks; default B x world): this rank's summed cross-entropy x world / global batch,
    which the gradients' averaging over the ranks turns into exactly the gradient of one process on the
    whole batch, even when the last batch is split unevenly. ``forward`` is the (wrapped, maybe compiled)
    model; ``strategy``: how the ranks hold it (:class:`~fixres_dist.distributed.strategy.Strategy`).

    The share is cut into ``settings.accumulation`` micro-batches (:func:`micro_batches`), each forward
    and backward in turn, gradients summed; all but the last under the strategy's ``no_sync()``, so that
    gradients are reduced once per step. The step's gradient is the same as one pass over the whole share
    (up to float rounding and BatchNorm, whose statistics are per micro-batch). A strategy that
    :attr:`~fixres_dist.distributed.strategy.Strategy.schedules` its own micro-batches (a pipeline's)
    runs the share instead, mixed once (micro-batch 0). Then the strategy's ``reduce_gradients()`` and,
    with ``settings.clip_grad_norm``, its ``clip_grad_norm`` (fp16 unscaled first).
    ``mix(images, labels, micro-batch index)``: MixUp/CutMix (:mod:`fixres_dist.training.mixing`) on the
    normalised float images; returns them and float (b, classes) soft targets. ``times``: the step's
    :class:`~fixres_dist.reporting.step_times.StepTimes`, marked after the backward and the optimizer.
    Returns the detached *summed* loss of this rank's images (against the mixed targets if mixing; 0 on a
    pipeline rank that holds no last stage).
    """
    device = settings.device
    images = to_device(images, device, settings.channels_last, settings.normalization)
    labels = labels.to(device, non_blocking=True)
    global_batch = global_batch or labels.numel() * settings.world
    scale = settings.world / global_batch
    optimizer.zero_grad(set_to_none=True)
    if strategy.schedules:
        total = _scheduled(strategy, images, labels, scale, settings, mix)
    else:
        total = _accumulated(forward, scaler, images, labels, scale, settings, global_batch, strategy, mix)
    strategy.reduce_gradients()
    if times is not None:
        times.mark("backward")
    if settings.clip_grad_norm is not None:
        scaler.unscale_(optimizer)
        strategy.clip_grad_norm([p for group in optimizer.param_groups for p in group["params"]],
                                settings.clip_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    if times is not None:
        times.mark("optimizer")
    return total


def _accumulated(forward, scaler, images, labels, scale, settings, global_batch, strategy, mix) -> torch.Tensor:
    """:func:`train_step`'s micro-batches: forwards and backwards, the gradients summed; the summed loss."""
    # The same count on every rank (shares differ by one image at most), unless unreadable images
    # skipped left this share too small for it.
    count = micro_batches(global_batch // settings.world, settings.accumulation)
    if labels.numel() < 2 * count:
        count = micro_batches(labels.numel(), settings.accumulation)
    total = None
    for index, (part, part_labels) in enumerate(zip(images.tensor_split(count), labels.tensor_split(count))):
        targets = part_labels
        if mix is not None:
            part, targets = mix(part, part_labels, index)
        with contextlib.nullcontext() if index == count - 1 else strategy.no_sync():
            with autocast(settings.device, settings.amp):
                logits = forward(part)
            loss_sum = F.cross_entropy(logits.float(), targets, reduction="sum",
                                       label_smoothing=settings.label_smoothing)
            scaler.scale(loss_sum * scale).backward()  # fp16: scaled against underflow; otherwise as is
        total = loss_sum.detach() if total is None else total + loss_sum.detach()
    return total


def _scheduled(strategy: Strategy, images, labels, scale, settings, mix) -> torch.Tensor:
    """:func:`train_step`'s share run by the strategy's own schedule (a pipeline's micro-batches): each
    image's cross-entropy summed, times ``scale``; the summed loss (0 where no last stage is held)."""
    targets = labels
    if mix is not None:
        images, targets = mix(images, labels, 0)
    with autocast(settings.device, settings.amp):
        loss = strategy.schedule(images, targets, scale)
    return loss if loss is not None else torch.zeros((), device=settings.device)


class EpochMeter:
    """This rank's summed loss, images and unreadable images of the epoch so far, and its duration.

    The loss sum stays on the device (no host sync per step); the counts are host integers.
    ``start`` holds the totals before a mid-epoch stop (the rank whose sums count carries them across a
    resume) and ``seconds_before`` the epoch's training time (seconds) before it (every rank: the speed is
    the images over all ranks over the epoch's time, whichever rank reports it). ``counted``: whether its
    totals count in the job's (False: a rank that saw the same images as another of its tensor group; its
    totals are 0).
    """

    def __init__(self, device: torch.device, start=(0.0, 0.0, 0.0), seconds_before: float = 0.0,
                 counted: bool = True):
        self.device, self.counted = device, counted
        self.started, self.seconds_before = time.perf_counter(), seconds_before
        self.sums = torch.zeros(3, dtype=torch.float64, device=device) + \
            torch.tensor(start, dtype=torch.float64, device=device)
        self.counts = [0, 0]  # images, unreadable images

    def add(self, loss_sum: torch.Tensor, images: int, skipped: int) -> None:
        self.sums[0] += loss_sum.double()
        self.counts[0] += images
        self.counts[1] += skipped

    def seconds(self) -> float:
        """Seconds of training in this epoch, including those before a resume."""
        return self.seconds_before + time.perf_counter() - self.started

    def totals(self) -> torch.Tensor:
        """(summed loss, images, unreadable images), float64 on the device."""
        counts = torch.tensor(self.counts, dtype=torch.float64, device=self.device)
        totals = self.sums + torch.cat([torch.zeros(1, dtype=torch.float64, device=self.device), counts])
        return totals if self.counted else torch.zeros_like(totals)


@attrs.frozen
class EpochResult:
    """An epoch over all ranks: mean loss (nats), images trained on, unreadable images skipped, speed
    (images/s over the whole epoch, also across a resume), and images left out after a resume on more
    ranks (:mod:`fixres_dist.data.samplers`)."""

    loss: float
    images: int
    skipped: int
    img_per_s: float
    left_out: int = 0


def train_one_epoch(step: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], loader,
                    meter: EpochMeter, *, epoch: int, start_image: int,
                    set_progress: Callable[[float], None], after_step: Callable[[int], None],
                    progress_bar=None, times=None) -> EpochResult:
    """Train over ``loader`` (an ExactBatchSampler loader) from image ``start_image`` of ``epoch``.

    Before each step ``set_progress(epochs done, as a float)`` (the LR schedule); ``step(images,
    labels, global batch)`` returns the summed loss; then ``after_step(images done in the epoch)``
    (periodic checkpoints, stop agreement). ``progress_bar``: a :class:`fixres_dist.reporting.progress.Bar`
    over the epoch's images (all ranks), given each step's summed loss unread. ``times``: the
    :class:`~fixres_dist.reporting.step_times.StepTimes` to mark as each batch arrives and each
    step's work ends. Returns the epoch's totals over all ranks.
    """
    sampler = loader.batch_sampler
    sampler.set_epoch(epoch, skip=start_image)
    global_batches = sampler.global_batch_sizes()
    dataset_size = sampler.dataset_size
    done, left_out = start_image, sampler.left_out
    mark = times.mark if times is not None else lambda point: None
    if times is not None:
        times.start_epoch()
    for index, (images, labels, skipped) in enumerate(loader):
        mark("batch")
        set_progress(epoch + done / dataset_size)
        loss = step(images, labels, global_batches[index])
        meter.add(loss, labels.numel(), skipped)
        now = sampler.images_done(index + 1)
        if progress_bar is not None:  # the loss stays on the device until the bar redraws
            progress_bar.advance(now - done, loss, labels.numel())
        done = now
        after_step(done)
        mark("done")
    seconds = meter.seconds()
    loss_sum, images, skipped = collectives.all_reduce_sum(meter.totals()).tolist()
    return EpochResult(loss_sum / max(images, 1), int(images), int(skipped), images / max(seconds, 1e-9), left_out)


@attrs.frozen
class EvalResult:
    """Top-1 and top-5 in percent, mean cross-entropy loss (nats), number of distinct images."""

    top1: float
    top5: float
    loss: float
    images: int


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, amp: torch.dtype | None = None,
             channels_last: bool = False, normalization=IMAGENET_NORMALIZATION,
             after_batch: Callable[[], None] | None = None, progress_bar=None, forwards: int = 0,
             size: int = 0, counted: bool = True) -> EvalResult:
    """Evaluate ``model`` (unwrapped, put in eval mode) on this rank's share and reduce over ranks.

    ``amp``: autocast dtype (``torch.bfloat16``/``torch.float16``) or None; the sums are float64.
    ``after_batch()`` runs after each batch that every rank has (a collective is allowed there: the
    stop agreement, which may raise to abandon the evaluation). ``progress_bar``: a
    :class:`fixres_dist.reporting.progress.Bar` over the validation images of all ranks.
    ``forwards``: a sharded model's forwards per rank
    (:func:`~fixres_dist.distributed.sharding.forwards_to_match`), made up with blank ``size``-pixel
    images where this rank has fewer batches. ``counted``: False on a rank whose images another rank of
    its tensor group counts (:meth:`~fixres_dist.distributed.layout.Layout.counts_metrics`).
    """
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # top1 hits, top5 hits, loss sum, count
    sampler = loader.batch_sampler if after_batch is not None or progress_bar is not None else None
    common = sampler.common_batches if after_batch is not None else 0
    done = ran = 0
    with eval_mode(model):
        for index, (images, labels, _skipped) in enumerate(loader):
            images = to_device(images, device, channels_last, normalization)
            labels = labels.to(device, non_blocking=True)
            with autocast(device, amp):
                logits = model(images).float()
            k = min(5, logits.shape[1])
            hits = logits.topk(k, dim=1).indices.eq(labels[:, None])
            sums += torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum(),
                                 F.cross_entropy(logits, labels, reduction="sum"),
                                 torch.tensor(labels.numel(), device=device)]).double()
            if progress_bar is not None:
                now = sampler.images_done(index + 1)
                progress_bar.advance(now - done)
                done = now
            if index < common:
                after_batch()
            ran = index + 1
        sharding.blank_forwards(model, forwards - ran, size, device, channels_last)
    top1, top5, loss, count = collectives.all_reduce_sum(sums if counted else torch.zeros_like(sums)).tolist()
    count = max(count, 1)
    return EvalResult(100 * top1 / count, 100 * top5 / count, loss / count, int(count))
