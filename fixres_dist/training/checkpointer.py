"""Writing the job's checkpoints and continuing from one, with every rank taking part.

A checkpoint (:mod:`fixres_dist.training.checkpoint`: the file format) holds the unwrapped model,
the optimizer step's state (:class:`~fixres_dist.training.step.TrainStep`), the position
(:class:`~fixres_dist.training.state.TrainState`), the history (:class:`~fixres_dist.reporting.run_log.RunLog`)
and, per rank, its RNG states, BatchNorm buffers and host; resuming it is bit-identical on the same world
size, and on another one keeps the global batch or re-derives the learning rate
(:mod:`~fixres_dist.training.world_change`) and averages the buffers. With ``--best-metric`` each
checkpoint holds the :class:`~fixres_dist.training.best_checkpoint.BestCheckpoint`'s state, and the best
epoch's checkpoint is kept as ``best.pth``.
"""
from __future__ import annotations

import math
import socket

import torch

from fixres_dist import finite
from fixres_dist.config import TrainerConfig
from fixres_dist.distributed import checkpoint_shards, collectives, pipeline, sharding
from fixres_dist.errors import FixresError, plural
from fixres_dist.reporting.run_log import RunLog
from fixres_dist.training import checkpoint, world_change
from fixres_dist.training.best_checkpoint import BestCheckpoint
from fixres_dist.training.faults import FaultInjector
from fixres_dist.training.network import Network
from fixres_dist.training.state import TrainState
from fixres_dist.training.step import TrainStep


class Checkpointer:
    """The checkpoints of ``network``'s job (``images_per_epoch``: training images per epoch, for the
    schedule's progress and the TensorBoard position; ``data``: the data's identity, recorded).
    ``last_step``: the global step of the last checkpoint written or resumed (None: none yet);
    ``unsaved``: trained since it; ``best``: the best checkpoint and early stopping (``--best-metric``),
    whose state every checkpoint holds."""

    def __init__(self, config: TrainerConfig, run_log: RunLog, faults: FaultInjector, network: Network,
                 images_per_epoch: int, control_group=None, data: dict | None = None):
        self.config, self.run_log, self.faults, self.control_group = config, run_log, faults, control_group
        self.data = data  # the data's identity, recorded in every checkpoint (checkpoint.check_same_data)
        self.network, self.images_per_epoch = network, images_per_epoch
        self.step: TrainStep | None = None
        self.last_step: int | None = None
        self.unsaved = False
        self.loss: dict | None = None  # where the run before stopped when it lost ranks (world_change.note_loss)
        self.best = BestCheckpoint(config, run_log)

    def train_with(self, step: TrainStep) -> None:
        """Training starts: checkpoints hold ``step``'s optimizer, schedule, scaler and EMA too."""
        self.step = step

    def save(self, state: TrainState) -> None:
        """All ranks: gather per-rank RNG and BatchNorm buffers; rank 0 writes; all learn the outcome.
        Raises :class:`~fixres_dist.errors.FixresError` on every rank when the write failed (the
        previous checkpoint is kept), :class:`~fixres_dist.finite.NonFiniteLoss` if the
        epoch's sums are not finite."""
        cfg, network, step, images_per_epoch = self.config, self.network, self.step, self.images_per_epoch
        mine = {"rng": checkpoint.rng_state(), "buffers": checkpoint.buffers_of(network.model),
                "host": socket.gethostname(),
                **({"ema_buffers": checkpoint.buffers_of(step.ema.module)} if step.ema is not None else {})}
        ranks = collectives.gather_object(mine, self.control_group)
        partial = state.meter is not None and state.images_in_epoch
        sums = state.meter.totals() if partial else torch.zeros(3, dtype=torch.float64, device=network.device)
        epoch_sums = collectives.all_reduce_sum(sums).tolist()  # all ranks: a collective
        if not all(map(math.isfinite, epoch_sums)):  # a last guard: the callers agreed on this step first
            raise self.diverged(state, state.global_step)
        error, weights, shards, digests = None, None, None, None
        full = network.strategy.full_state(network.model, step.optimizer)  # all ranks: a split model's, whole
        if network.strategy.writes_shards:  # every rank writes its shards first (a collective)
            try:
                shards, digests = checkpoint_shards.write(
                    cfg.job_folder, state.global_step, network.model, step.optimizer,
                    step.ema.module if step.ema is not None else None, cfg.global_rank)
            except finite.NonFiniteWeights as exc:  # the update after a finite loss diverged, on some rank
                error, weights = str(exc), exc.detail
            except FixresError as exc:
                error = str(exc)
        if cfg.global_rank == 0 and error is None:
            tensors = {"model": None, "optimizer": None} if shards else full or {"model": network.model.state_dict(),
                                                                                   **step.tensors()}
            contents = checkpoint.Contents(
                **tensors, **step.state_dict(state.epoch + state.images_in_epoch / images_per_epoch), shards=shards,
                shard_digests=digests,
                input_size=state.input_size, epoch_sums=epoch_sums, epoch=state.epoch,
                images_in_epoch=state.images_in_epoch, global_step=state.global_step, ranks=ranks,
                epoch_seconds=state.meter.seconds() if partial else 0.0, config=cfg.to_dict(),
                metrics=self.run_log.history, lineage=network.lineage_at(state.input_size).record(),
                classes=network.classes, data=self.data, layout=network.layout.to_dict(), best=self.best.state_dict(),
                tensorboard_at=self.run_log.checkpointed(state.images_seen(images_per_epoch)),
                trackers=self.run_log.tracker_runs() or None)
            try:
                checkpoint.save_checkpoint(cfg.job_folder, contents.as_dict(), state.global_step, cfg.keep_checkpoints,
                                           self.faults.checkpoint_write, protect=cfg.resume, best_step=self.best.step)
            except finite.NonFiniteWeights as exc:  # the update after a finite loss diverged
                error, weights = str(exc), exc.detail
            except FixresError as exc:
                error = str(exc)
        error, weights = collectives.broadcast_object((error, weights))
        if weights:
            raise self.diverged(state, state.global_step, weights)
        if error:
            raise FixresError(error if cfg.global_rank == 0 else f"rank 0 could not write the checkpoint: {error}")
        self.unsaved, self.last_step = False, state.global_step

    def _world_changed(self, contents, state: TrainState, train_images: int) -> None:
        """The line about resuming on another world size or split: a ``world_change`` event and its line
        when the data-parallel ranks changed (:mod:`~fixres_dist.training.world_change`; a warning when
        the global batch did), a note when only the split did (tensor or pipeline parallelism)."""
        cfg, now, was = self.config, self.network.layout, world_change.SavedRun.of(contents).layout
        split, data_parallel = now.split_words(), was.data_parallel_size
        if data_parallel == now.data_parallel_size:
            self.run_log.log(f"resuming a {len(contents.ranks)}-rank checkpoint{was.split_words()} on "
                             f"{plural(cfg.num_tasks, 'rank')}{split}: the same {data_parallel} data-parallel "
                             f"rank(s), batches and learning rate; RNG streams restart; {now.compare(was)}")
            return
        hosts = collectives.gather_object(socket.gethostname(), self.control_group)  # all ranks: a collective
        if cfg.global_rank == 0:
            fields = self.run_log.record("world_change", **world_change.event(
                cfg, contents, hosts, self.images_per_epoch, self.loss, self.step.base_lr))
            kept = fields["global_batch"] == fields["global_batch_before"]
            (self.run_log.log if kept else self.run_log.warn)(world_change.describe(
                fields, train_images, split, pipeline.has_batchnorm(self.network.model)))

    def restore(self, resume, state: TrainState, train_images: int) -> None:
        """Continue from ``resume`` (:class:`~fixres_dist.training.inputs.Resume`): parameters, the
        optimizer step's state, RNG and BatchNorm buffers (``state`` already holds the position)."""
        cfg, contents, network, step = self.config, resume.contents, self.network, self.step
        self.last_step = state.global_step
        self.loss = world_change.read_loss(cfg) if cfg.global_rank == 0 else None  # ranks lost before this run
        # the same ranks in the same roles: each continues its own RNG and BatchNorm
        same_world = network.layout.same_roles(world_change.SavedRun.of(contents).layout)
        rank = cfg.global_rank if same_world else None
        if same_world:
            checkpoint.set_rng_state(contents.ranks[cfg.global_rank]["rng"])
        buffers = checkpoint.rank_buffers(contents.ranks, rank)
        if contents.shards:
            checkpoint_shards.load_into(resume.path.parent / contents.shards, network.model, step.optimizer,
                                        step.ema.module if step.ema is not None else None)
            sharding.load_buffers(network.model, buffers)
        else:
            network.strategy.load_state_dict(network.model, {**contents.model, **buffers})
            step.load_tensors(contents)
        step.load(contents, checkpoint.rank_buffers(contents.ranks, rank, "ema_buffers") if step.ema else None)
        self.best.load_state_dict(contents.best)
        if cfg.global_rank == 0:  # mends best.pth if a kill came between writing its checkpoint and linking it
            checkpoint.keep_best(cfg.job_folder, self.best.step)
        ended = self.best.stopped_at is not None and state.epoch >= self.best.stopped_at  # early stopping's end
        if not same_world and state.epoch < cfg.epochs and not ended:
            self._world_changed(contents, state, train_images)
        if state.epoch >= cfg.epochs or ended:
            epochs = f"{cfg.epochs} epoch{'s' * (cfg.epochs != 1)}"
            done = f"stopped early after epoch {state.epoch}" if ended else f"completed its {epochs}"
            self.run_log.log(f"{resume.path}: this job already {done}; nothing to do (use another --job-id for a new "
                             "run)")
        else:
            self.run_log.log(f"resumed from {resume.path}: epoch {state.epoch + 1}, image {state.images_in_epoch} of "
                             f"the epoch, step {state.global_step}")

    def diverged(self, state: TrainState, step: int, weights: str | None = None) -> finite.NonFiniteLoss:
        """Every rank, at a non-finite loss of optimizer step ``step`` (or, with ``weights`` saying which
        tensors, non-finite weights after it): records it; returns the error to raise (nothing more is
        written)."""
        cfg = self.config
        self.run_log.record("diverged", epoch=state.epoch + 1, step=step,
                            reason="non-finite weights" if weights else "non-finite loss")
        kept = (f"the last good checkpoint (step {self.last_step}) is kept in {cfg.job_folder}"
                if self.last_step is not None else "no checkpoint was written")
        what = (f"non-finite weights after epoch {state.epoch + 1}, step {step} ({weights})" if weights else
                f"non-finite loss (NaN or infinity) at epoch {state.epoch + 1}, step {step}")
        return finite.NonFiniteLoss(f"{what}: training stopped on all ranks; {kept}; lower --learning-rate "
                                    "(or raise --warmup-epochs) and use a new --job-id")

