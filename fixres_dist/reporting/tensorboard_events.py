"""TensorBoard event files of a run, written by rank 0 into ``<job folder>/tensorboard/``.

View them with ``tensorboard --logdir <job folder>/tensorboard`` (several jobs side by side:
``--logdir <shared folder>``). Written through :class:`torch.utils.tensorboard.SummaryWriter`; the
``tensorboard`` package is an optional extra (``pip install -e '.[tensorboard]'``).

**x axis: images trained on since the job started**, not optimizer steps: ``epoch x images per
epoch + images into the epoch``. A run resumed on another world size (another global batch, so
other step counts) continues the same axis, and runs of different batch sizes line up.

* a per-step value (:meth:`TensorBoardLog.step_scalars`: ``train/loss_step``, ``train/lr_step``) is
  placed at the images the weights had been trained on *before* that step, i.e. where the loss was
  measured; the first step of the job is at 0;
* an epoch's ``train`` event (``train/loss``, ``train/lr``, ``train/img_per_s``) and the evaluations
  after it are placed at the end of the epoch, ``epoch x images_per_epoch`` (their ``epoch`` field
  counts the epochs trained, so an evaluation before any training is at 0);
* evaluations: ``<group>/top1/<resolution>px``, ``<group>/top5/<resolution>px`` and
  ``<group>/loss/<resolution>px``, top-1/top-5 in percent, loss the mean cross-entropy (nats), where
  ``<group>`` is ``eval`` for the epoch evaluations and ``eval_<label>`` for labelled ones (the
  resolution sweeps ``eval_before``, ``eval_after``, ``eval_trained``, ``eval_sweep``, and
  ``eval_train_resolution``); an ``ema_eval`` event (the EMA weights) uses ``eval_ema`` and
  ``eval_ema_<label>``.

**Resuming.** A resumed run opens its log with ``resume_at``, the images-trained count of its
checkpoint. The writer's first record is then a ``SessionLog START`` at that step (SummaryWriter's
``purge_step``): TensorBoard's Python loader (``EventAccumulator``, ``--load_fast=false``) drops
every value at a step >= ``resume_at`` read from earlier files, i.e. whatever the interrupted run
wrote after its checkpoint. The Rust loader (``--load_fast=true``, TensorBoard's default where
its ``tensorboard-data-server`` is installed) ignores that record but drops, per tag, every value
at a step >= s when a value at step s arrives (its reservoirs' preemption); the resumed run rewrites
every tag at the same steps, so each stale value disappears when the resumed run reaches it.
Events of the checkpoint's history at a step >= ``resume_at`` (an epoch's train event and
evaluations recorded just before a checkpoint at its end) were purged with the rest and are not
recorded again by the resumed run: :meth:`TensorBoardLog.replay` writes them back. A run that had
no event log for a while (``--tensorboard`` given only from some rerun on, or a log stopped by a
full disk) starts its log where the events stop instead, the checkpoint's ``tensorboard_at``
(images trained on at the last checkpoint written while the log worked; 0 if it never did), and
replays the history from there: the per-epoch curves have no gap (the per-step ones cannot be
recovered for the time without a log). Both loaders
read a run's event files in name order, and a file's name starts with its creation time in whole
seconds: the log waits, at most 2 s, until its file sorts after every file already there.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Callable

from fixres_dist.errors import FixresError, first_line

FOLDER = "tensorboard"
INSTALL = "pip install -e '.[tensorboard]'"
EVAL_GROUPS = {"eval": "eval", "ema_eval": "eval_ema"}
EVENT_FILE = re.compile(r"events\.out\.tfevents\.(\d{10})\.")
MAX_WAIT = 2.0  # seconds: the most the log waits for its file name to sort after the existing ones


def check_available() -> None:
    """Raise :class:`FixresError` (one line naming the fix) if the ``tensorboard`` package cannot be
    found. Cheap and torch-free: for a command line's checks before anything starts."""
    try:
        found = importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):  # a broken or half-removed installation
        found = False
    if not found:
        raise FixresError(f"TensorBoard logging needs the tensorboard package, which is not installed: {INSTALL}")


def check_folder(job_folder: Path) -> None:
    """Raise :class:`FixresError` (one line) if ``job_folder/tensorboard`` exists but cannot take event
    files: a file, a dangling link, or a folder this user cannot write. For the checks before anything
    starts (an absent folder is made by the run)."""
    folder = Path(job_folder) / FOLDER
    if folder.is_symlink() and not folder.exists():
        raise FixresError(f"cannot write TensorBoard events in {folder}: it is a link to {os.readlink(folder)}, "
                          "which does not exist")
    if folder.exists() and not folder.is_dir():
        raise FixresError(f"cannot write TensorBoard events in {folder}: it is a file, not a folder")
    if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
        raise FixresError(f"cannot write TensorBoard events in {folder}: the folder is not writable")


def _quiet_writer_thread_errors() -> None:
    """SummaryWriter's background thread re-raises a failed write (a full disk) after storing it for the
    next call, where :class:`TensorBoardLog` handles it; keep threading's default hook from printing
    that thread's traceback too. Other threads' exceptions are shown as before."""
    shown = threading.excepthook
    if getattr(shown, "fixres_tensorboard", False):
        return

    def hook(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            return
        shown(args)

    hook.fixres_tensorboard = True
    threading.excepthook = hook


def event_scalars(event: dict, images_per_epoch: int) -> tuple[int, list[tuple[str, float]]] | None:
    """``(step, [(tag, value), ...])`` of one metrics event (``metrics.jsonl``), the step in images
    trained on; None for an event without scalars (``sweep``, ``input_size``, ...) or without its
    ``epoch``. A value that is missing or null (a non-finite number in ``metrics.jsonl``) is left out."""
    kind, epoch = event.get("event"), event.get("epoch")
    if epoch is None or kind not in ("train", "step_times", *EVAL_GROUPS):
        return None
    if kind == "step_times":  # per rank: milliseconds per step of each phase, peak memory
        scalars = [(f"step_time_ms/{phase}/rank{r['rank']}", float(ms)) for r in event.get("ranks", [])
                   for phase, ms in r["ms_per_step"].items() if ms is not None]
        scalars += [(f"peak_memory_gib/rank{r['rank']}", float(r["peak_memory_gib"])) for r in event.get("ranks", [])]
        return int(epoch) * images_per_epoch, scalars
    if kind == "train":
        fields = [("train/loss", "loss"), ("train/lr", "lr"), ("train/img_per_s", "img_per_s")]
    else:
        label = event.get("label")
        group = EVAL_GROUPS[kind] + (f"_{label.replace('-', '_')}" if label else "")
        fields = [(f"{group}/{name}/{event['resolution']}px", name) for name in ("top1", "top5", "loss")]
    scalars = [(tag, float(event[key])) for tag, key in fields if event.get(key) is not None]
    return int(epoch) * images_per_epoch, scalars


class TensorBoardLog:
    """TensorBoard event files in ``folder/tensorboard`` (create it on rank 0 only).

    ``images_per_epoch``: the training images of one epoch (the x axis unit, see the module's
    docstring). ``resume_at``: images trained on at the checkpoint this run starts from (0 for a
    fresh start, which also hides what an earlier attempt that never checkpointed wrote).
    ``flush_secs``: the longest time (seconds) a value waits in memory before it is written.
    Every method is cheap: values are queued and written by SummaryWriter's background thread.
    Raises :class:`FixresError` if the tensorboard package is missing or the folder cannot be
    written. A write that fails later (a full disk, a folder removed) stops the log, not the run:
    ``on_failure(message)`` is called once with a one-line reason, and every later call does
    nothing (:attr:`failed` holds the reason). Usable as a context manager (closes, and so
    flushes, on exit).
    """

    def __init__(self, folder: Path, images_per_epoch: int, resume_at: int = 0, flush_secs: float = 30.0,
                 on_failure: Callable[[str], None] | None = None):
        if images_per_epoch < 1 or resume_at < 0:
            raise ValueError(f"images_per_epoch must be positive and resume_at non-negative, "
                             f"not {images_per_epoch} and {resume_at}")
        check_available()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise FixresError(f"TensorBoard logging cannot import tensorboard ({first_line(exc)}): "
                              f"{INSTALL}") from None
        self.folder, self.images_per_epoch = Path(folder) / FOLDER, images_per_epoch
        self.on_failure, self.failed = on_failure, None
        _quiet_writer_thread_errors()
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            _wait_to_sort_last(self.folder)
            self.writer = SummaryWriter(str(self.folder), purge_step=resume_at, flush_secs=flush_secs)
            self._owner_only()  # the writer's file is created with the umask's mode
        except OSError as exc:
            raise FixresError(f"cannot write TensorBoard events in {self.folder}: {exc.strerror or exc}") from None

    def _write(self, write: Callable[[], None]) -> None:
        """Run ``write`` (a call on the writer) unless the log has failed; a failure stops the log."""
        if self.failed is not None:
            return
        try:
            write()
        except OSError as exc:
            self.failed = f"TensorBoard events stopped ({exc.strerror or exc}) in {self.folder}"
            try:
                self.writer.close()
            except OSError:
                pass
            if self.on_failure is not None:
                self.on_failure(self.failed)

    def step_scalars(self, images_seen: int, loss: float, lr: float) -> None:
        """One optimizer step's loss (mean cross-entropy of its global batch) and learning rate;
        ``images_seen``: images the job had trained on before this step."""
        def write():
            self.writer.add_scalar("train/loss_step", loss, images_seen)
            self.writer.add_scalar("train/lr_step", lr, images_seen)
        self._write(write)

    def event(self, event: dict, walltime: float | None = None) -> None:
        """Write the scalars of one metrics event (:func:`event_scalars`); others are ignored.
        ``walltime``: seconds since the epoch to file them at (default: now)."""
        found = event_scalars(event, self.images_per_epoch)
        if found:
            step, scalars = found
            def write():
                for tag, value in scalars:
                    self.writer.add_scalar(tag, value, step, walltime=walltime)
            self._write(write)

    def replay(self, history: list[dict], since: int) -> int:
        """After a resume from a checkpoint at ``since`` images: write again the events of the
        checkpoint's ``history`` whose step is >= ``since`` (the purge hid them), at their recorded
        times. Returns how many events had scalars to write."""
        replayed = 0
        for entry in history:
            found = event_scalars(entry, self.images_per_epoch)
            if found and found[0] >= since and found[1]:
                self.event(entry, walltime=entry.get("time"))
                replayed += 1
        return replayed

    def figure(self, tag: str, fig, images_seen: int) -> None:
        """A matplotlib Figure (the resolution sweep plot, :func:`fixres_dist.reporting.reports.plot`) as an
        image at ``images_seen``; the figure stays open for its owner."""
        self._write(lambda: self.writer.add_figure(tag, fig, images_seen, close=False))

    def flush(self) -> None:
        """Write everything queued so far to disk."""
        self._write(self.writer.flush)

    def close(self) -> None:
        """Flush and close the event file; later calls do nothing."""
        self._write(self.writer.close)
        if self.failed is None:
            try:
                self._owner_only()
            except OSError:  # the folder went away meanwhile: nothing left to protect
                pass

    def _owner_only(self) -> None:
        """Event files readable by their owner only (0600), as every file of a job folder."""
        for path in self.folder.iterdir():
            if path.is_file() and not path.is_symlink():
                path.chmod(0o600)

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _wait_to_sort_last(folder: Path) -> None:
    """Wait (at most :data:`MAX_WAIT` seconds) until the current whole second is later than the
    creation second in every event file name in ``folder``, so that a new file sorts after them."""
    newest = max((int(m.group(1)) for p in folder.iterdir() if (m := EVENT_FILE.match(p.name))), default=None)
    if newest is None:
        return
    deadline = time.time() + MAX_WAIT
    while math.floor(time.time()) <= newest and time.time() < deadline:
        time.sleep(min(0.05, max(0.0, newest + 1 - time.time())) or 0.01)
