"""Lose a node, keep training: a job continued on another number of ranks keeps its recipe.

A run that resumes a checkpoint written by another number of data-parallel ranks (a node lost and the
job restarted on the survivors by torchrun's elastic agent or by SLURM, a node back, or a rerun by
hand) continues the same epoch of the same sample stream (:mod:`fixres_dist.data.samplers`: no image
repeated or skipped). What it keeps, ``--world-change``:

* ``keep-global-batch`` (the default): the images per optimizer step of the run that wrote the
  checkpoint, and so the learning rate, its schedule and the steps per epoch. Each rank takes a share
  of the global batch (shares differ by one image at most) in as many accumulated micro-batches as keep
  each at ``--batch`` images or fewer (:attr:`~fixres_dist.config.TrainerConfig.accumulation`): 2 ranks
  after 4 accumulate 2, and each micro-batch holds the images one of the 4 ranks held (the sampler's
  virtual ranks), so that the steps are the uninterrupted run's up to float rounding. What differs:
  BatchNorm's running statistics, updated once per micro-batch in turn rather than per rank and
  averaged; on a world whose size divides no multiple of the old one, the BatchNorm batches too.
  Pipeline stages do not accumulate: there the rank's batch is kept instead (a warning says so), as it
  is when the global batch would leave a rank fewer than 2 images.
* ``keep-rank-batch``: each rank's ``--batch``; the global batch follows the ranks and the learning
  rate is re-derived by the linear scaling rule (Goyal et al., arXiv 1706.02677, section 2.1).

``--min-world-size N``: a run on fewer than N ranks stops at once, before training, with exit status
3 (the last checkpoint kept), as a preempted one does; torchrun's elastic agent and SLURM's requeue
then try again, up to their own bounds (``--max-restarts``, ``--max-requeues``).

Each change is one log line and one ``world_change`` event in ``metrics.jsonl``: ranks and hosts
before and after, the epoch, image and step it continues from, the global batch and micro-batches,
and, when ranks were lost, the images trained since the last checkpoint that are trained again and
the seconds from the loss to this restart. The surviving ranks of a lost peer write what they had
reached (:func:`note_loss`, ``lost.json`` in the job folder); the next run reads it and removes it.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Callable

import attrs

from fixres_dist import io
from fixres_dist.config import TrainerConfig, steps_of
from fixres_dist.distributed import layout
from fixres_dist.distributed.layout import Layout
from fixres_dist.distributed.preemption import Preempted
from fixres_dist.distributed.rendezvous import STORE_HOST, LostPeers
from fixres_dist.errors import FixresError, plural

LOSS_FILE = "lost.json"  # in the job folder: where the survivors of a lost peer stopped (note_loss)


@attrs.frozen
class SavedRun:
    """The batches of the run that wrote a checkpoint: its data-parallel ranks, global batch (images per
    optimizer step), micro-batches per rank, the ranks whose last-batch rule its global batch keeps, and
    its parallel layout."""

    data_parallel_size: int
    images_per_step: int
    accumulation: int
    global_batch_ranks: int
    layout: Layout

    @classmethod
    def of(cls, contents) -> "SavedRun":
        """From a checkpoint's :class:`~fixres_dist.training.checkpoint.Contents` (its ``config`` and ``ranks``;
        a field absent there: its default), as :func:`fixres_dist.config.steps_of` computes a run's steps."""
        saved = contents.config
        was = Layout.saved(contents.layout, saved, len(contents.ranks))
        data_parallel = was.data_parallel_size
        images, accumulation = steps_of(saved["batch"], data_parallel, saved.get("grad_accum_steps", 1),
                                        saved.get("global_batch"))
        return cls(data_parallel, images, accumulation, saved.get("global_batch_ranks") or data_parallel, was)


def check_minimum(config: TrainerConfig, contents) -> None:
    """Raises :class:`~fixres_dist.distributed.preemption.Preempted` (exit status 3) when a run continuing
    ``contents`` has fewer ranks than ``--min-world-size``, :class:`FixresError` when a fresh job (``contents``
    None) has; nothing otherwise."""
    if config.min_world_size and config.num_tasks < config.min_world_size:
        below = f"{plural(config.num_tasks, 'rank')}, fewer than --min-world-size {config.min_world_size}"
        if contents is None:
            raise FixresError(f"this job has {below}")
        raise Preempted(f"only {below}: stopped before training; the checkpoint of step {contents.global_step} "
                        "is kept, and the job continues from it on enough ranks")


def continued(config: TrainerConfig, contents, warn: Callable[[str], None]) -> TrainerConfig:
    """``config`` for a run that continues ``contents`` (a checkpoint's
    :class:`~fixres_dist.training.checkpoint.Contents`, or None): with ``keep-global-batch``, the global
    batch the checkpoint's run trained with (``global_batch`` set where this world's ``--batch`` x ranks x
    ``--grad-accum-steps`` differs from it); ``warn`` is told when the global batch cannot be kept.
    Raises as :func:`check_minimum` does."""
    check_minimum(config, contents)
    if contents is None or config.eval_only:
        return config
    saved = SavedRun.of(contents)
    wanted = saved.images_per_step
    plain = attrs.evolve(config, global_batch=None, global_batch_ranks=None)
    if config.world_change == "keep-rank-batch" or wanted == plain.images_per_step:
        return plain
    staged = layout.of(config).pipeline_enabled
    if staged or wanted < 2 * config.data_parallel_size:
        why = ("pipeline stages do not accumulate micro-batches" if staged else
               f"it would leave some of the {config.data_parallel_size} data-parallel ranks fewer than 2 images")
        warn(f"the global batch of {wanted} images is not kept ({why}): each rank keeps --batch {config.batch} "
             "(--world-change keep-rank-batch)")
        return plain
    return attrs.evolve(config, global_batch=wanted, global_batch_ranks=saved.global_batch_ranks)


def note_loss(config: TrainerConfig, epoch: int, images_in_epoch: int, global_step: int, lost: str,
              only_the_store: bool = False) -> None:
    """A surviving rank of a lost peer: where training had reached (``epoch`` 0-based, images into it,
    optimizer steps done) and what was lost, for the run that continues (:func:`read_loss`). Best effort:
    every survivor writes, atomically; a failure to write loses only the figure. ``only_the_store``: all
    this rank saw is rank 0's store going silent (:attr:`LostPeers.only_the_store`); it does not replace
    another survivor's record of the same failure (the same step and world, within ``--dist-timeout``),
    which names the ranks whose heartbeats stopped: rank 0 may only have been stopped after that loss."""
    now = time.time()
    record = {"time": now, "epoch": epoch, "images_in_epoch": images_in_epoch, "step": global_step,
              "ranks": config.num_tasks, "lost": lost, "host": socket.gethostname()}
    earlier = _valid(config.job_folder / LOSS_FILE)
    if earlier is not None and earlier["step"] > global_step:  # a run that failed before it resumed: keep the loss
        return
    if only_the_store and earlier is not None and STORE_HOST not in earlier["lost"] and \
            (earlier["step"], earlier.get("ranks")) == (global_step, config.num_tasks) and \
            now - earlier["time"] <= config.dist_timeout:
        return
    try:
        io.write_private(config.job_folder / LOSS_FILE, json.dumps(record))
    except OSError:
        pass


def _valid(path) -> dict | None:
    """The record at ``path`` if it is one :func:`note_loss` could have written (else None: a loss record
    only adds figures to a line, it never stops a run)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    counts = ("epoch", "images_in_epoch", "step")
    if not isinstance(record, dict) or not all(type(record.get(k)) is int and record[k] >= 0 for k in counts):
        return None
    if not isinstance(record.get("time"), (int, float)) or not 0 < record["time"] <= time.time() + 1:
        return None
    return {**record, "lost": str(record.get("lost", "?"))[:500]}


def read_loss(config: TrainerConfig) -> dict | None:
    """What :func:`note_loss` wrote, once (rank 0 removes the file, even one it cannot use), or None."""
    path = config.job_folder / LOSS_FILE
    record = _valid(path)
    if config.global_rank == 0:
        try:
            os.unlink(path)
        except OSError:
            pass
    return record


def event(config: TrainerConfig, contents, hosts_after: list[str], images_per_epoch: int,
          loss: dict | None, lr: float) -> dict:
    """The fields of the ``world_change`` event of a run on ``config`` continuing ``contents`` on hosts
    ``hosts_after`` (one name per rank); ``loss``: :func:`read_loss`'s record, when ranks were lost; ``lr``:
    this run's peak learning rate (linear scaling rule). ``seconds_since_loss``: since the survivors saw it."""
    saved = SavedRun.of(contents)
    at = contents.epoch * images_per_epoch + contents.images_in_epoch
    fields = {"ranks_before": len(contents.ranks), "ranks_after": config.num_tasks,
              "hosts_before": sorted({r.get("host", "?") for r in contents.ranks}),
              "hosts_after": sorted(set(hosts_after)), "epoch": contents.epoch + 1,
              "images_in_epoch": contents.images_in_epoch, "step": contents.global_step,
              "global_batch_before": saved.images_per_step, "global_batch": config.images_per_step,
              "accumulation": config.accumulation, "kept": config.world_change,
              "micro_batches_before": saved.data_parallel_size * saved.accumulation,
              "micro_batches": config.data_parallel_size * config.accumulation,
              "base_lr_before": (contents.schedule or {}).get("base_lr"), "base_lr": lr,
              "layout_before": saved.layout.describe(), "layout": layout.of(config).describe(),
              "images_lost": None, "seconds_since_loss": None}
    reached = loss["epoch"] * images_per_epoch + loss["images_in_epoch"] if loss is not None else -1
    if loss is not None and loss["step"] >= contents.global_step and at <= reached <= at + 1000 * images_per_epoch:
        fields.update(images_lost=reached - at, seconds_since_loss=round(time.time() - loss["time"], 1),
                      lost=loss["lost"])
    return fields


def describe(fields: dict, train_images: int, split: str, batchnorm: bool) -> str:
    """The log line of a ``world_change`` event's ``fields`` (``split``: how the ranks split the model now;
    ``batchnorm``: whether the model has BatchNorm layers, whose batches and statistics may change)."""
    before, after = fields["hosts_before"], fields["hosts_after"]
    where = (f"{plural(fields['ranks_before'], 'rank')} on {', '.join(before)} -> "
             f"{plural(fields['ranks_after'], 'rank')}{split} on {', '.join(after)}")
    at = (f"epoch {fields['epoch']} continues at image {fields['images_in_epoch']} of {train_images} of the same "
          f"permutation (no image repeated), step {fields['step']}")
    if fields["global_batch"] == fields["global_batch_before"]:
        micro = f", {fields['accumulation']} accumulated micro-batches per rank" if fields["accumulation"] > 1 else ""
        batch = f"global batch of {fields['global_batch']} kept{micro}: learning rate and schedule unchanged"
    else:
        steps = [-(-train_images // fields[k]) for k in ("global_batch_before", "global_batch")]
        old = f"{fields['base_lr_before']:g} -> " if fields["base_lr_before"] is not None else ""
        batch = (f"global batch {fields['global_batch_before']} -> {fields['global_batch']}: peak lr {old}"
                 f"{fields['base_lr']:g} by the linear scaling rule, {steps[0]} -> {steps[1]} steps per epoch")
    norms = ""
    if batchnorm:
        same = fields["global_batch"] == fields["global_batch_before"] and \
            fields["micro_batches"] == fields["micro_batches_before"]
        norms = ("; BatchNorm statistics averaged" if same else
                 f"; BatchNorm batches change ({fields['micro_batches_before']} -> {fields['micro_batches']} per step, "
                 "over all ranks): its statistics, and so the results, drift from an uninterrupted run's")
    lost = ""
    if fields["images_lost"] is not None:
        lost = (f"; {fields['images_lost']:,} images trained since the last checkpoint are trained again, "
                f"{fields['seconds_since_loss']:.1f} s after the survivors saw the loss")
    layouts = f"; layout {fields['layout_before']} -> {fields['layout']}" if "layout" in fields else ""
    return f"world change: {where}: {at}; {batch}{norms}; RNG streams restart{lost}{layouts}"


def after_failure(config: TrainerConfig, state, failure: Exception) -> None:
    """A rank's run failed with ``failure``: when peers were lost
    (:class:`~fixres_dist.distributed.rendezvous.LostPeers`), :func:`note_loss` where its ``state``
    (:class:`~fixres_dist.training.state.TrainState`) had reached."""
    if isinstance(failure, LostPeers):
        note_loss(config, state.epoch, state.images_in_epoch, state.global_step, str(failure), failure.only_the_store)
