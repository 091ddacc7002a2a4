"""Experiment trackers: MLflow and Weights & Biases as sinks of the run's record, on rank 0 (``--tracker``).

Beside TensorBoard (:mod:`fixres_dist.reporting.tensorboard_events`), and fed the same way: every event
rank 0 records (``metrics.jsonl``'s) and the per-step training curves go to each tracker asked for, as
the same tags (``train/loss``, ``eval/top1/<K>px``, ``train/loss_step``, ...: see
:func:`~fixres_dist.reporting.tensorboard_events.event_scalars`) with the same numbers. Both packages
are an optional extra (``pip install -e '.[trackers]'``); a run asking for one that is not installed is
refused before it starts (:func:`check_available`, in the preflight).

**Step: images trained on since the job started**, TensorBoard's x axis (an epoch's values at its end,
``epoch x images per epoch``; a per-step value at the images trained on before that step), so that a
run resumed on another world size continues the same axis and runs of other batch sizes line up.

**What each tracker gets.** The configuration as parameters (``config.json``'s fields, one level,
a value that is no string as its JSON; MLflow's are cut to its longest parameter value,
``mlflow.utils.validation.MAX_PARAM_VAL_LENGTH`` characters), every scalar of the run's events and the
per-step curves, and, from the launcher after a successful run (:func:`log_final_artifacts`), the
resolution sweep plot (``resolution_sweep.png``) and the exported model folder (``<job folder>/export/``)
when they exist.

* MLflow (:class:`MlflowRun`): tracking URI ``--mlflow-tracking-uri``, by default a SQLite store in the
  job folder, ``sqlite:///<job folder>/mlflow.db``, artifacts in ``<job folder>/mlartifacts/``
  (MLflow 3's file store is refused by MLflow unless ``MLFLOW_ALLOW_FILE_STORE=true``); experiment
  ``--mlflow-experiment`` (default ``fixres_dist``), run name the job id. Written through
  :class:`mlflow.MlflowClient`, the values of an epoch batched into one ``log_batch`` at each checkpoint.
* W&B (:class:`WandbRun`): project ``--wandb-project`` (default ``fixres_dist``), ``--wandb-mode``
  ``offline`` (the default: no network; ``wandb sync <dir>/wandb/offline-run-*`` uploads later) or
  ``online``, files under ``--wandb-dir`` (default the job folder). ``wandb.log(..., step=images)``.

**Resuming.** The tracker's run id is saved in every checkpoint (``trackers``, beside ``tensorboard_at``),
so the rerun of a stopped job, and a SLURM requeue, continue the same tracker run (MLflow: the run
reopened by its id; W&B: ``wandb.init(id=..., resume="allow")``); a checkpoint of another job folder
(``--resume`` of another job) starts a new one. Steps stay continuous and none is logged twice: a
tracker run keeps, per tag, the first value sent at a step, and a resumed run sends a tag's value only
at steps after the last one the tracker holds. MLflow, which would keep both values at a step, is asked
where each tag stops when the run is reopened; so what an interrupted run logged after its last
checkpoint stays (on the same world size it equals what the resumed run computes again, the resume
being bit-identical) and the resumed run's values take over after it. W&B offline cannot be asked: each
attempt writes its own ``offline-run-*`` folder with the same id, the resumed one from the checkpoint
on, and W&B, whose steps only increase, drops on sync the values below the step the run reached. A
tracker started on a resumed run (``--tracker`` given only from some rerun on) gets the history of the
checkpoint first, so its per-epoch curves have no gap.

**Failures.** A tracker that cannot start or write (a bad URI, an unreachable server, a wandb failure)
is one ``FixresWarning`` line in the log, and that tracker stops; the run goes on (``metrics.jsonl``
has every figure). An HTTP MLflow server is tried ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` (2 unless set)
times, ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (10 s unless set) each.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable

from fixres_dist.config import TRACKERS
from fixres_dist.errors import FixresError, first_line, say

INSTALL = "pip install -e '.[trackers]'"
DEFAULT_EXPERIMENT = DEFAULT_PROJECT = "fixres_dist"
MLFLOW_DB, MLFLOW_ARTIFACTS = "mlflow.db", "mlartifacts"
EXPORT_FOLDER = "export"  # <job folder>/export/: the exported model (fixres_dist.deploy), logged at the end
CHECKPOINT_FILE = "checkpoint.pth"  # where the run ids are saved (fixres_dist.training.checkpoint's file)
# What each tracker imports; a SQLite store needs SQLAlchemy and Alembic besides mlflow-skinny.
PACKAGES = {"mlflow": ("mlflow",), "wandb": ("wandb",)}
SQLITE_PACKAGES = ("sqlalchemy", "alembic")
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
BATCH = 1000  # MLflow's most metrics in one log_batch
PARAM_BATCH = 100  # ... and parameters


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-removed installation
        return False


def mlflow_uri(config) -> str:
    """The MLflow tracking URI of a run: ``--mlflow-tracking-uri``, else ``sqlite:///<job folder>/mlflow.db``
    (an absolute path)."""
    return config.mlflow_tracking_uri or f"sqlite:///{(Path(config.job_folder) / MLFLOW_DB).absolute()}"


def check_available(config) -> None:
    """Raise :class:`FixresError` (one line naming the fix) if a tracker of ``config.trackers`` lacks its
    package (a SQLite MLflow store: also SQLAlchemy and Alembic). Cheap, imports nothing: the preflight's."""
    for name in config.trackers:
        needed = PACKAGES[name] + (SQLITE_PACKAGES if name == "mlflow" and mlflow_uri(config).startswith("sqlite:")
                                   else ())
        missing = [module for module in needed if not _installed(module)]
        if missing:
            raise FixresError(f"--tracker {name} needs the {', '.join(missing)} package"
                              f"{'s' if len(missing) > 1 else ''}, not installed: {INSTALL}")


def parameters(config: dict, limit: int | None = None) -> dict[str, str]:
    """``config`` (:meth:`~fixres_dist.config.TrainerConfig.to_dict`) as tracker parameters: one level
    (a nested mapping's keys joined with ``.``), each value a string (JSON for what is no string: lists,
    numbers, ``null``), cut to ``limit`` characters if given."""
    flat = {}

    def add(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{prefix}.{key}" if prefix else str(key), inner)
            return
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        flat[prefix] = text[:limit] if limit is not None else text
    add("", config)
    return flat


def _quiet_loggers() -> None:
    """MLflow's and Alembic's INFO lines (creating the SQLite store's tables) stay out of the rank's log."""
    for name in ("mlflow", "alembic"):
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.WARNING:
            logger.setLevel(logging.WARNING)


class TrackerRun:
    """One tracker's run: values sent once per tag and step (see the module's "Resuming").

    ``after``: per tag, the last step the tracker holds (a value at it or before is not sent again);
    ``holds_history``: the run holds the resumed checkpoint's history already (its run id was saved
    after the history was sent), so a replay skips it. Subclasses open the run in ``__init__`` (raising
    whatever the package raises) and write in :meth:`_send`, :meth:`flush`, :meth:`finish`."""

    name = ""

    def __init__(self):
        self.after: dict[str, int] = {}
        self.run_id = ""
        self.holds_history = False

    def log(self, step: int, scalars: list[tuple[str, float]]) -> None:
        fresh = [(tag, value) for tag, value in scalars if step > self.after.get(tag, -1)]
        for tag, _ in fresh:
            self.after[tag] = step
        if fresh:
            self._send(step, fresh)

    def _send(self, step: int, scalars: list[tuple[str, float]]) -> None:
        """Send ``scalars`` (tag, value) at ``step`` (images trained on) to the tracker: each tracker's own."""
        raise NotImplementedError(f"{type(self).__name__} sends its own scalars")

    def flush(self) -> None:
        """Write what is queued."""

    def finish(self, status: str) -> None:
        """End this process's part of the run (``status``: ``FINISHED``, ``FAILED`` or ``KILLED``)."""


class MlflowRun(TrackerRun):
    """An MLflow run through :class:`mlflow.MlflowClient`: created in the experiment, or reopened by
    ``run_id`` (its parameters kept: MLflow refuses a changed value; only new ones are added)."""

    name = "MLflow"

    def __init__(self, config, run_id: str | None = None):
        super().__init__()
        from mlflow import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        _quiet_loggers()
        uri = mlflow_uri(config)
        if uri.startswith(("http:", "https:")):
            for name, value in HTTP_DEFAULTS.items():
                os.environ.setdefault(name, value)
        self.uri, self.client, self.queue = uri, MlflowClient(uri), []
        params = parameters(config.to_dict(), MAX_PARAM_VAL_LENGTH)
        if run_id:
            run = self.client.get_run(run_id)
            self.client.update_run(run_id, status="RUNNING")
            self.after = {key: max(m.step for m in self.client.get_metric_history(run_id, key))
                          for key in run.data.metrics}
            params = {k: v for k, v in params.items() if k not in run.data.params}
        else:
            experiment = config.mlflow_experiment or DEFAULT_EXPERIMENT
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(
                experiment, artifact_location=_artifact_location(uri))
            run = self.client.create_run(experiment_id, run_name=config.job_id, tags={
                "fixres_dist.job_id": config.job_id, "fixres_dist.job_folder": str(Path(config.job_folder).absolute()),
                "fixres_dist.run": config.run_name})
            run_id = run.info.run_id
        self.run_id = run_id
        _owner_only_store(uri)
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), PARAM_BATCH):
            self.client.log_batch(run_id, params=items[start:start + PARAM_BATCH])

    def _send(self, step: int, scalars: list[tuple[str, float]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)  # MLflow's timestamps: milliseconds
        self.queue += [Metric(tag, value, now, step) for tag, value in scalars]
        if len(self.queue) >= BATCH:
            self.flush()

    def flush(self) -> None:
        queue, self.queue = self.queue, []
        for start in range(0, len(queue), BATCH):
            self.client.log_batch(self.run_id, metrics=queue[start:start + BATCH])

    def finish(self, status: str) -> None:
        self.flush()
        self.client.set_terminated(self.run_id, status)

    def log_artifacts(self, files: list[tuple[Path, str | None]]) -> None:
        """Each ``(file or folder, folder in the run's artifacts or None)``."""
        for path, where in files:
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), where)
            else:
                self.client.log_artifact(self.run_id, str(path), where)


def _artifact_location(uri: str) -> str | None:
    """Where a new experiment's artifacts go: ``mlartifacts/`` beside a SQLite store's file; MLflow's
    own choice for other stores (a file store's folder, a server's)."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri[len("sqlite:///"):]).parent / MLFLOW_ARTIFACTS).absolute().as_uri()


def _owner_only_store(uri: str) -> None:
    """A SQLite store's file readable by its owner only, as every file of a job folder."""
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if path.is_file() and path.stat().st_uid == os.getuid():
            path.chmod(0o600)


class WandbRun(TrackerRun):
    """A W&B run (``wandb.init``), new or resumed by ``run_id`` (``resume="allow"``). Its service process
    (``wandb-core``) runs in a session of its own, so a stop signal to the job's process group (Ctrl-C)
    does not reach it, and it ignores SIGUSR2 (the default preemption signal) sent to every process; a
    SIGTERM or SIGINT sent to it ends it, and W&B then stops with one warning."""

    name = "W&B"

    def __init__(self, config, run_id: str | None = None):
        super().__init__()
        import wandb

        folder = Path(config.wandb_dir or config.job_folder)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.run = wandb.init(
            project=config.wandb_project or DEFAULT_PROJECT, dir=str(folder), mode=config.wandb_mode,
            id=run_id or None, resume="allow" if run_id else None, name=config.job_id, reinit="create_new",
            config=parameters(config.to_dict()), allow_val_change=True,
            settings=wandb.Settings(silent=True, console="off"))
        self.run_id, self.holds_history = self.run.id, bool(run_id)  # offline, W&B cannot say where it stops

    def _send(self, step: int, scalars: list[tuple[str, float]]) -> None:
        self.run.log(dict(scalars), step=step)

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)

    def log_artifacts(self, files: list[tuple[Path, str | None]]) -> None:
        import wandb

        for path, where in files:
            if path.is_dir():
                artifact = wandb.Artifact(f"{self.run.name or self.run.id}-{where}".replace("/", "-"), type="model")
                artifact.add_dir(str(path))
                self.run.log_artifact(artifact)
            else:
                self.run.log({path.stem: wandb.Image(str(path))})


OPENERS = {"mlflow": MlflowRun, "wandb": WandbRun}
assert tuple(OPENERS) == TRACKERS


class Trackers:
    """Rank 0's trackers of a run (``config.trackers``), fed like :class:`TensorBoardLog
    <fixres_dist.reporting.tensorboard_events.TensorBoardLog>`.

    ``runs``: the tracker run ids the checkpoint resumed saved (``{"mlflow": id, "wandb": id}``, None:
    none); ``images_per_epoch``: the x axis unit; ``warn(message)``: a tracker that failed (once per
    tracker, which then stops). Every tracker that fails to open is warned of here; those that open are in
    :attr:`open`.
    """

    def __init__(self, config, images_per_epoch: int, runs: dict | None, warn: Callable[[str], None]):
        from fixres_dist.reporting.tensorboard_events import event_scalars

        self._scalars, self.images_per_epoch, self.warn = event_scalars, images_per_epoch, warn
        self.runs = dict(runs or {})  # kept for the checkpoint also while a tracker is off
        self.open: dict[str, TrackerRun] = {}
        for name in config.trackers:
            try:
                run = OPENERS[name](config, self.runs.get(name))
            except Exception as exc:  # any failure of a tracker's package: the run goes on without it
                self.warn(_failed(name, "could not start", exc))
                continue
            self.open[name], self.runs[name] = run, run.run_id

    def describe(self) -> str:
        """The log's line on the trackers that opened."""
        return "; ".join(f"{run.name} run {run.run_id}" + (f" ({run.uri})" if isinstance(run, MlflowRun) else
                                                          f" ({run.run.settings.mode})")
                         for run in self.open.values()) + " (step: images trained on)"

    def _each(self, act: Callable[[TrackerRun], None], history: bool = False) -> None:
        """``act`` on each open tracker (``history``: those that lack the resumed history); one that fails
        stops, with its warning."""
        for name, run in list(self.open.items()):
            if history and run.holds_history:
                continue
            try:
                act(run)
            except Exception as exc:  # any failure of the package: the tracker stops, never the run
                del self.open[name]
                self.warn(_failed(name, "stopped", exc))

    def event(self, entry: dict, history: bool = False) -> None:
        """One metrics event's scalars (:func:`~fixres_dist.reporting.tensorboard_events.event_scalars`);
        ``history``: an event of the resumed checkpoint's history (:meth:`replay`)."""
        found = self._scalars(entry, self.images_per_epoch)
        if found and found[1]:
            self._each(lambda run: run.log(*found), history)

    def replay(self, history: list[dict]) -> None:
        """The checkpoint's history, oldest first, to each tracker that may lack it: what it does not hold yet
        (its ``after``) is sent."""
        for entry in history:
            self.event(entry, history=True)

    def step_scalars(self, images_seen: int, loss: float, lr: float) -> None:
        """One optimizer step's loss and learning rate, at ``images_seen`` images trained on before it."""
        self._each(lambda run: run.log(images_seen, [("train/loss_step", loss), ("train/lr_step", lr)]))

    def checkpointed(self) -> dict:
        """A checkpoint is written: queued values are sent; returns the run ids it saves."""
        self._each(lambda run: run.flush())
        return dict(self.runs)

    def close(self, status: str) -> None:
        self._each(lambda run: run.finish(status))
        self.open = {}


def _failed(name: str, what: str, exc: BaseException) -> str:
    tracker = {"mlflow": "MLflow", "wandb": "W&B"}[name]
    return (f"{tracker} tracking {what} ({type(exc).__name__}: {first_line(exc)}); training goes on without it "
            "(metrics.jsonl has every figure)")


def status_now() -> str:
    """The status a run ends with, judged from the exception being handled (if any): ``FINISHED``,
    ``KILLED`` (a stop signal, Ctrl-C) or ``FAILED``."""
    from fixres_dist.distributed.preemption import Preempted

    exc = sys.exc_info()[1]
    if exc is None:
        return "FINISHED"
    return "KILLED" if isinstance(exc, (Preempted, KeyboardInterrupt)) else "FAILED"


def saved_runs(job_folder: Path) -> dict:
    """The tracker run ids in ``job_folder``'s checkpoint (``{}``: none, or no checkpoint)."""
    path = Path(job_folder) / CHECKPOINT_FILE
    if not path.is_file():
        return {}
    from fixres_dist.io import safe_load

    return dict(safe_load(path, "checkpoint").get("trackers") or {})


def log_final_artifacts(config, job_folder: str | Path) -> None:
    """After a successful run, on the launcher of rank 0: reopen each tracker run saved in the job's
    checkpoint and log the resolution sweep plot (``resolution_sweep.png``) and the exported model
    folder (``export/``) where they exist. Nothing without ``--tracker``, on other ranks, or without a
    saved run. A failure is one ``fixres_dist: warning:`` line on stderr; nothing is raised."""
    if not config.trackers or config.global_rank != 0:
        return
    from fixres_dist.reporting.reports import PLOT_FILE

    job_folder = Path(job_folder)
    files = [(path, where) for path, where in ((job_folder / PLOT_FILE, None), (job_folder / EXPORT_FOLDER,
                                                                                 EXPORT_FOLDER)) if path.exists()]
    try:
        runs = saved_runs(job_folder) if files else {}
    except FixresError as exc:
        say(f"fixres_dist: warning: tracker artifacts not logged: {exc}")
        return
    for name in config.trackers:
        if name not in runs:
            continue
        try:
            run = OPENERS[name](config, runs[name])
            run.log_artifacts(files)
            run.finish("FINISHED")
        except Exception as exc:  # any failure of the package: a tracker never fails a finished job
            say(f"fixres_dist: warning: {_failed(name, 'could not log the artifacts', exc)}")
