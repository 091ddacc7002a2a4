"""The run's record: its history of events, and where rank 0 shows and writes them.

Every rank keeps the history (a list of :meth:`~fixres_dist.reporting.metrics.MetricsLog.event`
dicts; it goes into the checkpoint); rank 0 alone prints log lines (above the progress bar),
appends ``metrics.jsonl`` and, with ``--tensorboard``, writes TensorBoard event files
(:mod:`fixres_dist.reporting.tensorboard_events`) whose x axis is images trained on; with ``--tracker``,
it feeds the same figures to MLflow and W&B (:mod:`fixres_dist.reporting.trackers`).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from fixres_dist.config import CONFIG_FILE, TrainerConfig
from fixres_dist.distributed import layout
from fixres_dist.errors import FixresWarning, say
from fixres_dist.io import write_private
from fixres_dist.reporting.metrics import METRICS_FILE, MetricsLog
from fixres_dist.reporting.step_times import findings as step_times_findings
from fixres_dist.reporting.step_times import line as step_times_line

POINTS_PER_EPOCH = 50  # about this many points of the per-step training curves an epoch


class RunLog:
    """Log lines, events and curves of one rank's run (see the module docstring).

    ``log``: where rank 0's lines go (default the console, above the progress bar).
    ``history``: every event so far, this run's and those of the checkpoint it resumed.
    """

    def __init__(self, config: TrainerConfig, log: Callable[[str], None] | None = None):
        self.config, self.rank0 = config, config.global_rank == 0
        self._print = log or tqdm.write
        self.history: list[dict] = []
        self.metrics = MetricsLog(config.job_folder / METRICS_FILE, self.rank0)
        self.board = None  # rank 0's TensorBoardLog with --tensorboard
        self.board_every = 1  # optimizer steps between two per-step points of the training curves
        self.board_until = 0  # images trained on up to which the event files hold the curves
        self.trackers = None  # rank 0's Trackers with --tracker (trackers.py), from start()
        self.runs: dict = {}  # the tracker run ids every checkpoint saves (those resumed, while a tracker is off)
        self.profiler = None  # this rank's StepProfiler with --profile (profiling.py), from start()

    def log(self, message: str) -> None:
        if self.rank0:
            self._print(message)

    def warn(self, message: str) -> None:
        """Rank 0: a :class:`~fixres_dist.errors.FixresWarning` and a ``warning:`` line in the log
        (``Trainer(config)()`` shows only the line)."""
        if self.rank0:
            warnings.warn(message, FixresWarning, stacklevel=3)
            self.log(f"warning: {message}")

    def record(self, event: str, **fields) -> dict:
        """Add an event to the history (with its time, which a resumed run's rewrite keeps), to
        ``metrics.jsonl`` and to the curves; returns it."""
        entry = MetricsLog.event(event, **fields)
        self.history.append(entry)
        self.metrics.write(entry)
        if self.board is not None:
            self.board.event(entry)
        if self.trackers is not None:
            self.trackers.event(entry)
        return entry

    def epoch_trained(self, epoch: int, result, lr: float, step_times: list[dict | None] | None = None) -> None:
        """Epoch ``epoch`` (0-based) trained: its ``train`` event and log line, from its
        :class:`~fixres_dist.training.engine.EpochResult` and the learning rate at its end; then, from
        every rank's step times (:meth:`StepTimes.gather <fixres_dist.reporting.step_times.StepTimes.gather>`),
        a ``step_times`` event and the warnings of :func:`~fixres_dist.reporting.step_times.findings`."""
        cfg = self.config
        self.record("train", epoch=epoch + 1, loss=result.loss, lr=lr, img_per_s=result.img_per_s, images=result.images,
                    **({"skipped_images": result.skipped} if result.skipped else {}),
                    **({"left_out_images": result.left_out} if result.left_out else {}))
        self.log(f"epoch {epoch + 1}/{cfg.epochs}: train loss {result.loss:.4f}, lr {lr:.4g}, "
                 f"{result.img_per_s:,.0f} img/s"
                 + (f", {result.skipped} unreadable images skipped" if result.skipped else "")
                 + (f", its last {result.left_out} images left out: fewer than 2 per rank after resuming on "
                    f"{cfg.data_parallel_size} {'data-parallel ' if layout.of(cfg).tensor_enabled else ''}ranks"
                    if result.left_out else ""))
        if step_times and any(step_times):
            lines = step_times_findings(step_times, epoch + 1, cfg.workers)
            self.record("step_times", epoch=epoch + 1, findings=lines,
                        ranks=[{k: v for k, v in r.items() if k != "busy_ms"} for r in step_times if r is not None])
            self.log(step_times_line([r for r in step_times if r is not None]))
            for line in lines:
                self.warn(line)

    def events(self, event: str, **fields) -> list[dict]:
        """The events of kind ``event`` whose ``fields`` have these values, oldest first."""
        return [e for e in self.history if e["event"] == event and all(e.get(k) == v for k, v in fields.items())]

    def epoch_evaluated(self, epoch: int, event: str = "eval") -> bool:
        """Whether epoch ``epoch``'s evaluation (``eval``, or ``ema_eval`` of the EMA) is recorded (not a
        sweep's: those carry a label)."""
        return any("label" not in e for e in self.events(event, epoch=epoch))

    def start(self, config, history: list[dict], board_at: int, resume_at: int, images_per_epoch: int,
              runs: dict | None = None) -> None:
        """The run's ``config`` (:class:`~fixres_dist.config.TrainerConfig`, once a world change is known:
        :mod:`~fixres_dist.training.world_change`). Rank 0 writes ``config.json`` and the history of
        the checkpoint resumed (dropping events it does not know of) to ``metrics.jsonl``; with
        ``--tensorboard`` it opens the event files;
        with ``--profile`` every rank starts its profiler (:mod:`fixres_dist.reporting.profiling`); with
        ``--tracker`` it opens the trackers (continuing ``runs``, the run ids the checkpoint saved:
        :func:`resumed_runs`) and sends them the history they lack.

        ``board_at``: images trained on up to which the job's event files hold the curves
        (:func:`resumed_board_at`). ``resume_at``:
        images trained on at the checkpoint. The event files are opened where the checkpoint resumed
        from, or where they stop if that is earlier (the log was off or had failed); what an
        interrupted run wrote after that point is hidden and the events the checkpoint knows are
        rewritten from it (no duplicate points on a curve, no gap in the per-epoch ones).
        """
        self.config, self.history = config, list(history)
        if self.config.profile:
            from fixres_dist.reporting.profiling import FOLDER, StepProfiler
            self.profiler = StepProfiler(self.config.job_folder / FOLDER, self.config.global_rank, self.config.profile,
                                         self.config.profile_after, self.config.device, self.log,
                                         lambda line: say(f"fixres_dist: rank {config.global_rank}: warning: {line}"))
        if not self.rank0:
            return
        write_private(self.config.job_folder / CONFIG_FILE, self.config.to_json() + "\n")
        self.metrics.rewrite(self.history)
        self.board_until, self.runs = board_at, dict(runs or {})
        cfg = self.config
        self.board_every = max(1, -(-images_per_epoch // cfg.images_per_step) // POINTS_PER_EPOCH)
        if cfg.trackers:
            self._open_trackers(images_per_epoch)
        if not self.config.tensorboard:
            return  # the checkpoints carry on where the event files stop
        from fixres_dist.reporting.tensorboard_events import TensorBoardLog  # its writer is imported only when asked

        since = min(resume_at, self.board_until)
        self.board = TensorBoardLog(self.config.job_folder, images_per_epoch, resume_at=since,
                                    on_failure=self._board_failed)
        self.log(f"TensorBoard: event files in {self.board.folder} (x axis: images trained on; "
                 f"tensorboard --logdir {self.board.folder})"
                 + (f"; the curves from image {since:,} on rewritten from the checkpoint's history" if since < resume_at
                    else ""))
        self.board.replay(self.history, since=since)
        self.board_until = since

    def _open_trackers(self, images_per_epoch: int) -> None:
        """Rank 0: the experiment trackers, each that opened told the history it lacks."""
        from fixres_dist.reporting.trackers import Trackers  # imports no tracker package until opened

        self.trackers = Trackers(self.config, images_per_epoch, self.runs, self.warn)
        self.runs = self.trackers.runs
        if not self.trackers.open:  # each warned of why; the run ids resumed are kept for the checkpoints
            self.trackers = None
            return
        self.log(f"experiment trackers: {self.trackers.describe()}")
        self.trackers.replay(self.history)

    def _board_failed(self, message: str) -> None:
        """The TensorBoard log stopped (a write failed): say so once; training goes on."""
        self.board = None
        self.warn(f"{message}; training goes on (metrics.jsonl has every figure)")

    def step_scalars(self, global_step: int, images_seen: int, loss, images: int, lr: float) -> None:
        """The per-step training curves (every :attr:`board_every` optimizer steps): rank 0's mean loss
        (``loss``: the 0-dim tensor of its summed loss over its ``images``; read only when drawn, a
        device sync on CUDA) and the learning rate at ``images_seen`` images trained on."""
        if (self.board is not None or self.trackers is not None) and global_step % self.board_every == 0:
            value = loss.item() / images
            for sink in (self.board, self.trackers):
                if sink is not None:
                    sink.step_scalars(images_seen, value, lr)
        if self.profiler is not None:
            self.profiler.after_step()

    def figure(self, tag: str, figure, images_seen: int) -> None:
        if self.board is not None:
            self.board.figure(tag, figure, images_seen)

    def checkpointed(self, images_seen: int) -> int:
        """A checkpoint is written at ``images_seen``: returns where the event files hold the curves up
        to (the checkpoint's ``tensorboard_at``)."""
        if self.board is not None:
            self.board_until = images_seen
        return self.board_until

    def tracker_runs(self) -> dict:
        """A checkpoint is written: the trackers' queued values are sent; returns the run ids it saves
        (the checkpoint's ``trackers``)."""
        if self.trackers is not None:
            self.runs = self.trackers.checkpointed()
        return dict(self.runs)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.trackers is not None:
            from fixres_dist.reporting.trackers import status_now

            self.trackers.close(status_now())  # FINISHED, or KILLED / FAILED while an exception is handled
            self.trackers = None
        if self.profiler is not None:
            self.profiler.close()


def resumed_board_at(resume, job_folder: Path, resume_at: int) -> int:
    """Where the event files of ``job_folder`` hold the curves up to (images trained on), by the
    checkpoint resumed (``resume``: a :class:`~fixres_dist.training.inputs.Resume`, or None): its own
    record, or for a checkpoint written before it recorded one, all of them (``resume_at``) if that
    run wrote curves. No checkpoint, or one of another job's folder, says nothing of these files (0)."""
    if not _own(resume, job_folder):
        return 0
    if resume.contents.tensorboard_at is not None:
        return resume.contents.tensorboard_at
    return resume_at if resume.contents.config.get("tensorboard") else 0


def resumed_runs(resume, config) -> dict:
    """The experiment trackers' run ids a run continues (:mod:`fixres_dist.reporting.trackers`): those of
    the checkpoint resumed (``resume``: a :class:`~fixres_dist.training.inputs.Resume`, or None) if it is
    the job folder's own; a checkpoint of another job (``--resume`` to start a new job) starts new runs."""
    if not _own(resume, config.job_folder):
        return {}
    return dict(resume.contents.trackers or {})


def _own(resume, job_folder: Path) -> bool:
    """Whether ``resume`` is a checkpoint of ``job_folder`` (not one a new job starts from)."""
    return resume is not None and Path(resume.path).resolve().parent == Path(job_folder).resolve()
