"""The optimizer step and what it owns: optimizer, learning-rate schedule, fp16 loss scaler,
MixUp/CutMix, the weights' EMA, the watch for a non-finite loss and the step's times
(:mod:`fixres_dist.reporting.step_times`).

:class:`TrainStep` is what :func:`fixres_dist.training.engine.train_one_epoch` calls per global batch;
the loop itself and its arithmetic are :mod:`fixres_dist.training.engine`'s, the rates
:mod:`fixres_dist.training.optim`'s (linear scaling rule: Goyal et al. 2017, section 2.1).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from fixres_dist import finite
from fixres_dist.config import TrainerConfig
from fixres_dist.errors import plural
from fixres_dist.models.ema import ModelEMA
from fixres_dist.reporting.step_times import StepTimes
from fixres_dist.training import engine, mixing, optim
from fixres_dist.training.engine import AMP_DTYPES
from fixres_dist.training.network import Network


def base_learning_rate(config: TrainerConfig) -> float:
    """``--learning-rate`` (per 256 images) scaled to the global batch by the linear scaling rule (the
    data-parallel ranks' batches: a tensor group's ranks see the same images; a global batch kept from
    another world size: :attr:`~fixres_dist.config.TrainerConfig.images_per_step`)."""
    return optim.scaled_learning_rate(config.learning_rate, config.images_per_step, 1)


class TrainStep:
    """One optimizer step on this rank's share of a global batch, for ``network`` (prepared for
    training). ``watch``: where each step's loss is checked for NaN or infinity (the stop
    controller's, :class:`~fixres_dist.training.stopping.StopController`). ``steps_per_epoch``:
    optimizer steps in an epoch; ``train_images``: images in the training set; ``log``/``warn``:
    rank 0's log, which gets the optimizer's line and warnings about a schedule or EMA that cannot
    run their course in this run.

    Build it after :meth:`Network.wrap <fixres_dist.training.network.Network.wrap>` (sharding replaces
    the parameters the optimizer holds); ``ema``: the weights' average (``network.average``), made
    before the wrap, or None.

    ``global_step`` is the caller's (:class:`~fixres_dist.training.state.TrainState`): the step about to
    run is ``global_step + 1``, which seeds its MixUp/CutMix draw.
    """

    def __init__(self, config: TrainerConfig, network: Network, ema: ModelEMA | None, num_classes: int,
                 watch: finite.LossWatch, steps_per_epoch: int, train_images: int, log: Callable[[str], None],
                 warn: Callable[[str], None]):
        self.config, self.network = config, network
        self.base_lr = base_learning_rate(config)
        self.amp = AMP_DTYPES[config.amp]
        self.optimizer = optim.build_optimizer(config.opt, optim.parameter_groups(
            network.model, config.weight_decay, config.norm_weight_decay), self.base_lr, config.momentum)
        log(self._describe(steps_per_epoch, train_images))
        self._check_schedule(warn)
        self.scaler = torch.amp.GradScaler("cuda", enabled=config.amp == "fp16")
        self.mixing = mixing.BatchMixing(config.mixup_alpha, config.cutmix_alpha, num_classes, config.seed)
        self.ema = ema
        self.watch = watch  # the first step whose loss was not finite, on this rank
        self.times = StepTimes(network.device, config.global_rank, config.step_times)  # where its time goes
        if config.step_times:
            network.strategy.time_gradient_reduction(network.model, self.times.bucket_ready)
        self.settings = engine.StepSettings(  # the constants of every step
            network.device, world=config.data_parallel_size, amp=self.amp, channels_last=config.channels_last,
            normalization=network.preprocessing.normalization, label_smoothing=config.label_smoothing,
            accumulation=config.accumulation, clip_grad_norm=config.clip_grad_norm)
        self.progress = 0.0  # epochs of training done when the current step started (the LR schedule's)
        if self.ema is not None:
            self._check_ema_horizon(steps_per_epoch, warn)

    def _describe(self, steps_per_epoch: int, train_images: int) -> str:
        """The log line: optimizer, learning rate and how the linear scaling rule made it, steps per epoch."""
        cfg = self.config
        accumulated = f" x {cfg.accumulation} accumulated" if cfg.accumulation > 1 else ""
        batch = (f"{cfg.global_batch} (global batch kept: {plural(cfg.data_parallel_size, 'rank')}{accumulated})"
                 if cfg.global_batch else f"{cfg.batch} x {cfg.data_parallel_size}{accumulated}")
        return (f"{cfg.opt} lr {self.base_lr:g} = {cfg.learning_rate:g} x {batch} / "
                f"{optim.REFERENCE_BATCH} (linear scaling rule), {steps_per_epoch} steps per epoch"
                + (f", repeated augmentation x{cfg.ra_reps} (an epoch: about {-(-train_images // cfg.ra_reps):,} "
                   f"images, {cfg.ra_reps} copies each)" if cfg.ra_reps > 1 else "")
                + (" (more copies than ranks: some copies of an image share a rank)"
                   if cfg.ra_reps > cfg.data_parallel_size else ""))

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, global_batch: int | None,
                 global_step: int) -> torch.Tensor:
        """Step ``global_step + 1`` on uint8 (B, 3, H, W) ``images`` and int64 (B,) ``labels``
        (:func:`fixres_dist.training.engine.train_step`); returns this rank's summed loss (a 0-dim tensor)."""
        cfg = self.config
        mix = None
        if self.mixing.enabled:
            data_rank = self.network.layout.data_rank(cfg.global_rank)
            def mix(batch, targets, micro_batch):  # drawn from (seed, step, virtual rank): the same after a resume,
                virtual = data_rank + micro_batch * cfg.data_parallel_size  # on any world size
                return self.mixing(batch, targets, (global_step + 1, virtual, 0))
        loss = engine.train_step(self.network, self.optimizer, self.scaler, images, labels, self.settings,
                                 global_batch=global_batch, strategy=self.network.strategy, mix=mix, times=self.times)
        self.watch.observe(global_step + 1, loss)
        return loss

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def set_progress(self, progress: float) -> None:
        """The learning rate at ``progress`` epochs of training (warmup, then ``--lr-scheduler``)."""
        cfg = self.config
        self.progress = progress
        lr = self.base_lr * optim.lr_factor(progress, cfg.epochs, cfg.warmup_epochs, cfg.lr_scheduler,
                                            cfg.lr_step_size, cfg.lr_gamma)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def after_step(self, global_step: int) -> None:
        """After optimizer step ``global_step``: the EMA's update (:class:`~fixres_dist.models.ema.ModelEMA`)."""
        if self.ema is not None:
            self.ema.after_step(self.network.model, global_step, warming_up=self.progress < self.config.warmup_epochs)

    def tensors(self) -> dict:
        """Its large checkpoint entries, of an unsharded model (a sharded one's are written as shards:
        :mod:`fixres_dist.distributed.checkpoint_shards`): the optimizer's state and the EMA's weights."""
        return {"optimizer": self.optimizer.state_dict(),
                **({"model_ema": self.ema.state_dict()} if self.ema is not None else {})}

    def state_dict(self, progress: float) -> dict:
        """Its other checkpoint entries (:class:`~fixres_dist.training.checkpoint.Contents`) at ``progress``
        epochs: the schedule, the fp16 scaler, the EMA's update count."""
        return {"schedule": {"base_lr": self.base_lr, "progress": progress},
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                **({"model_ema_state": self.ema.extra_state()} if self.ema is not None else {})}

    def load_tensors(self, contents) -> None:
        """The optimizer's state and the EMA's weights of a one-file checkpoint's
        :class:`~fixres_dist.training.checkpoint.Contents`, into a sharded, split or whole model's (the
        strategy's: a pipeline rank keeps its stages' part of each)."""
        strategy = self.network.strategy
        strategy.load_optimizer_state_dict(self.network.model, self.optimizer, contents.optimizer)
        if self.ema is not None:
            strategy.load_state_dict(self.ema.module, contents.model_ema)

    def load(self, contents, ema_buffers: dict | None) -> None:
        """Continue the scaler and the EMA's update count and BatchNorm ``ema_buffers`` of a checkpoint's
        :class:`~fixres_dist.training.checkpoint.Contents` (after :meth:`load_tensors` or the shards)."""
        if self.scaler.is_enabled() and contents.scaler:
            self.scaler.load_state_dict(contents.scaler)
        if self.ema is not None:
            self.ema.load_state(contents.model_ema_state, ema_buffers)

    def _check_schedule(self, warn: Callable[[str], None]) -> None:
        """Warn when the learning-rate schedule cannot run its course in this run (a recipe's or the
        default warmup kept on a much shorter run): the rate would only rise, or never step down."""
        cfg = self.config
        after = cfg.epochs - cfg.warmup_epochs
        if cfg.warmup_epochs and after <= 0:
            warn(f"--warmup-epochs {cfg.warmup_epochs:g} covers the whole run ({plural(cfg.epochs, 'epoch')}): the "
                 "learning rate only rises and never decays; lower --warmup-epochs")
        elif cfg.lr_scheduler == "step" and cfg.lr_step_size >= after:
            warn(f"--lr-step-size {cfg.lr_step_size} is not less than the {after:g} epochs after the warmup: "
                 "the step schedule never decays in this run; lower --lr-step-size")

    def _check_ema_horizon(self, steps_per_epoch: int, warn: Callable[[str], None]) -> None:
        """Warn when the run gives the EMA too few updates after the warmup to move from where it started
        (a recipe's decay kept on a much shorter run): it would report the starting weights."""
        cfg = self.config
        steps = steps_per_epoch * cfg.epochs
        updates = max(0, steps - math.ceil(cfg.warmup_epochs * steps_per_epoch)) // cfg.model_ema_steps
        kept = cfg.model_ema_decay ** updates
        if kept > 0.1:
            warn(f"--model-ema gets {plural(updates, 'update')} after the warmup in this run (one every "
                 f"{cfg.model_ema_steps} of {steps} steps): with decay {cfg.model_ema_decay:g} the average keeps "
                 f"{100 * kept:.0f} % of the weights it started from; lower --model-ema-steps or --model-ema-decay")
