"""SLURM through submitit: check a request against the cluster, submit the Trainer, requeue, sweep.

Three parts, used by ``slurm/submit.py`` and ``slurm/sweep.py``:

* :class:`SlurmTrainer`, the picklable callable that submitit runs once per task. It takes the
  task's place from ``submitit.JobEnvironment`` (global/local rank, number of tasks, job id), keys
  the file rendezvous on the job id *and* ``SLURM_RESTART_COUNT`` (a requeued job never meets a
  rendezvous file of its earlier run) and runs :class:`fixres_dist.Trainer`, which resumes from the
  job folder's checkpoint. Its :meth:`SlurmTrainer.checkpoint` is submitit's requeue protocol.
* :func:`check_request`, which compares what a job asks for with ``sinfo`` and the shared folder,
  so that an impossible job is refused in seconds instead of pending forever.
* :func:`submit`, :func:`report` and :func:`submit_sweep` / :func:`gather_sweep` for the scripts.

The requeue path, on SLURM's warning signal (``--signal USR2@delay``, or
``scancel --signal=USR2 JOBID``): every rank finishes its optimizer step, the ranks write one
checkpoint together (the Trainer), then the Trainer calls the handler that was installed before
it, which is this module's bridge to submitit's handler: rank 0 asks :meth:`SlurmTrainer.checkpoint`
for the resubmission, runs ``scontrol requeue`` and exits; the other ranks wait to be stopped by the
requeue (exiting first could make ``srun --kill-on-bad-exit`` end the job before rank 0 requeues it).
SLURM starts the job again with the same id and ``SLURM_RESTART_COUNT`` + 1; the Trainer resumes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

from .cli import build_parser, config_fields
from .config import TrainerConfig
from .errors import FixresError

RANK_FLAGS = ("num_tasks", "global_rank", "local_rank", "job_id", "dist_url")
UNUSABLE_NODE_STATES = ("down", "drain", "fail", "inval", "maint", "future")
LOCAL_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs")
TIME_LIMIT_CHECK_S = 30   # slurmctld checks time limits (and sends the warning signal) every 30 s
MIN_RUN_BEFORE_WARNING_S = 30
SQUEUE_POLL_S = 0.25
FOLLOWER_WAIT_S = 120    # how long a rank other than 0 waits for rank 0's requeue to stop it
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- inside the job
def _restart_count(environ=None) -> int:
    value = (os.environ if environ is None else environ).get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def task_config(template: TrainerConfig, job_id: str, global_rank: int, local_rank: int, num_tasks: int,
                restart: int) -> TrainerConfig:
    """``template`` placed at one task of a SLURM job (raises FixresError if the sizes disagree).

    The rendezvous is ``file://<shared>/<job id>/rendezvous-<restart>.json``: keyed on the
    restart count, so the ranks of a requeued job never read the file of an earlier run.
    """
    if num_tasks != template.num_tasks:
        raise FixresError(f"SLURM started {num_tasks} tasks but the job was submitted for "
                          f"{template.num_tasks}; resubmit with slurm/submit.py")
    job_folder = Path(template.shared_folder_path) / job_id
    url = "file://" + str((job_folder / f"rendezvous-{restart}.json").absolute())
    return attrs.evolve(template, num_tasks=num_tasks, global_rank=global_rank, local_rank=local_rank,
                        job_id=job_id, dist_url=url if num_tasks > 1 else "env://")


class _SubmititBridge:
    """What runs after the Trainer has written its checkpoint for a stop signal (see module doc).

    Installed as the Python handler of SIGTERM and of the preemption signal *before* the Trainer
    starts, so that the Trainer finds it as "the previous handler" and calls it at a safe point. It
    also works alone (a Trainer that does not handle signals): then it runs as the OS handler.
    """

    def __init__(self, rank: int, preempt_signum: int):
        self.rank = rank
        self.preempt_signum = preempt_signum
        self.submitit_preempt = signal.getsignal(preempt_signum)
        self.submitit_term = signal.getsignal(signal.SIGTERM)

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self.on_term)
        signal.signal(self.preempt_signum, self.on_preempt)

    def uninstall(self) -> None:
        """Give the signals back to submitit (a SIGTERM during shutdown is then only logged)."""
        signal.signal(signal.SIGTERM, self.submitit_term)
        signal.signal(self.preempt_signum, self.submitit_preempt)

    def on_preempt(self, signum, frame) -> None:
        if callable(self.submitit_preempt):
            # rank 0: checkpoint() -> resubmission pickled, scontrol requeue, sys.exit; others return.
            self.submitit_preempt(signum, frame)
        if self.rank == 0:
            raise SystemExit(3)  # no submitit handler (not under submitit): stopped, checkpoint written
        print(f"fixres_dist: rank {self.rank}: checkpoint written; waiting for rank 0 to requeue the job",
              file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the requeue stops this task with SIGTERM
        deadline = time.monotonic() + FOLLOWER_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.5)
        raise SystemExit(3)

    def on_term(self, signum, frame) -> None:
        if callable(self.submitit_term):
            self.submitit_term(signum, frame)  # submitit logs "bypassing SIGTERM"
        print(f"fixres_dist: rank {self.rank}: stopped by SIGTERM", file=sys.stderr, flush=True)
        raise SystemExit(3)


class SlurmTrainer:
    """The callable submitted to SLURM: one task's rank from ``JobEnvironment``, then the Trainer.

    ``config`` is the job's template (``num_tasks`` = all tasks; ranks, job id and rendezvous are
    filled in per task). Calling returns the Trainer's result plus ``job_id``, ``restart`` (the
    ``SLURM_RESTART_COUNT``), ``host`` and ``seconds``. :meth:`checkpoint` is submitit's requeue
    protocol: it returns a resubmission of a fresh SlurmTrainer, which resumes from the job folder.
    """

    def __init__(self, config: TrainerConfig):
        self.config = config

    def __call__(self) -> dict:
        import submitit  # imported here: the module is also used where submitit is not needed

        from .trainer import Trainer

        started = time.time()
        env = submitit.JobEnvironment()
        restart = _restart_count()
        config = task_config(self.config, env.job_id, env.global_rank, env.local_rank, env.num_tasks, restart)
        preempt = getattr(config, "preempt_signal", "SIG" + submitit.JobEnvironment.USR_SIG)
        bridge = _SubmititBridge(config.global_rank, signal.Signals[preempt])
        bridge.install()
        try:
            result = Trainer(config)()
        except FixresError as exc:
            print(f"fixres_dist: rank {config.global_rank}: {exc}", file=sys.stderr, flush=True)
            raise
        except Exception as exc:
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(f"fixres_dist: rank {config.global_rank}: {type(exc).__name__}: {cause}", file=sys.stderr, flush=True)
            raise
        finally:
            bridge.uninstall()
        return {**result, "job_id": env.job_id, "restart": restart, "host": socket.gethostname(),
                "seconds": time.time() - started}

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(type(self)(self.config))

    def __repr__(self) -> str:
        return f"SlurmTrainer({self.config.mode}, {self.config.num_tasks} task(s))"


# --------------------------------------------------------------------------- the cluster
@attrs.frozen
class Node:
    name: str
    cpus: int
    memory_mb: int
    gpus: int
    state: str

    @property
    def usable(self) -> bool:
        return not self.state.lower().startswith(UNUSABLE_NODE_STATES)


@attrs.frozen
class Partition:
    name: str
    default: bool
    up: bool
    max_time_min: float | None   # None: no limit
    nodes: tuple[Node, ...]


def _run(cmd: list[str], timeout: float = 15) -> str:
    if shutil.which(cmd[0]) is None:
        raise FixresError(f"no SLURM here: {cmd[0]} is not on PATH (run on a login node, or start the local "
                          "test cluster with slurm/start-local-slurm.sh)")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise FixresError(f"{' '.join(cmd)} did not answer within {timeout:g} s (is slurmctld up?)") from None
    if out.returncode != 0:
        first = (out.stderr.strip() or out.stdout.strip() or f"exit status {out.returncode}").splitlines()[0]
        raise FixresError(f"{cmd[0]} failed: {first}")
    return out.stdout


def parse_time_limit(text: str) -> float | None:
    """SLURM time (``infinite``, ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``) in minutes."""
    text = text.strip()
    if text.lower() in ("infinite", "unlimited", "n/a", ""):
        return None
    days = 0
    if "-" in text:
        day_text, text = text.split("-", 1)
        days = int(day_text)
        parts = [int(p) for p in text.split(":")] + [0, 0]
        hours, minutes, seconds = parts[:3]
    else:
        parts = [int(p) for p in text.split(":")]
        if len(parts) == 1:
            hours, minutes, seconds = 0, parts[0], 0
        elif len(parts) == 2:
            hours, minutes, seconds = 0, parts[0], parts[1]
        else:
            hours, minutes, seconds = parts[-3:]
    return days * 1440 + hours * 60 + minutes + seconds / 60


def parse_gpus(gres: str) -> int:
    """Number of GPUs in a ``sinfo %G`` value such as ``gpu:8``, ``gpu:a100:4(S:0-1),gpu:v100:2``."""
    total = 0
    for item in gres.split(","):
        fields = item.split("(")[0].split(":")
        if fields[0] == "gpu" and len(fields) >= 2 and fields[-1].isdigit():
            total += int(fields[-1])
    return total


def read_partitions() -> dict[str, Partition]:
    """Every partition with its nodes, from one ``sinfo -N`` call (raises FixresError)."""
    out = _run(["sinfo", "-h", "-N", "-o", "%P|%a|%l|%N|%c|%m|%G|%T"])
    rows: dict[str, dict] = {}
    for line in out.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 8:
            continue
        name, avail, limit, node, cpus, mem, gres, state = fields
        default = name.endswith("*")
        name = name.rstrip("*")
        row = rows.setdefault(name, {"default": default, "up": avail == "up",
                                     "max_time_min": parse_time_limit(limit), "nodes": []})
        row["nodes"].append(Node(node, int(cpus.rstrip("+") or 0), int(mem.rstrip("+") or 0),
                                 parse_gpus(gres), state))
    return {name: Partition(name, r["default"], r["up"], r["max_time_min"], tuple(r["nodes"]))
            for name, r in rows.items()}


@attrs.frozen
class SlurmRequest:
    """What a job asks SLURM for (one task per GPU; ``gpus_per_node=0``: CPU tasks)."""

    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int | None = None
    cpus_per_task: int | None = None
    mem_gb: float | None = None
    partition: str | None = None
    timeout_min: int = 60
    signal_delay_s: int = 120
    job_name: str | None = None
    max_requeues: int = 3
    array_parallelism: int = 32

    @property
    def tasks(self) -> int:
        return self.tasks_per_node or self.gpus_per_node or 1


def _fs_type(path: Path) -> str:
    best, kind = "", ""
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) >= 3 and str(path).startswith(fields[1]) and len(fields[1]) > len(best):
                    best, kind = fields[1], fields[2]
    except OSError:
        pass
    return kind


def check_shared_folder(path: Path, nodes: int) -> None:
    """The shared folder exists and this user can create files in it; warn if nodes cannot share it."""
    if not path.is_dir():
        raise FixresError(f"shared folder {path} does not exist (create it on a file system that every "
                          "node mounts, e.g. mkdir -p it, and pass it as --shared-folder-path)")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".fixres-write-test-"):
            pass
    except OSError as exc:
        raise FixresError(f"shared folder {path} is not writable: {exc.strerror or exc}") from None
    kind = _fs_type(path.resolve())
    if nodes > 1 and kind in LOCAL_FILESYSTEMS:
        print(f"fixres_dist: warning: shared folder {path} is on {kind}, which other nodes cannot see; "
              "ranks on other nodes will not find the rendezvous or the checkpoints", file=sys.stderr)


def check_request(request: SlurmRequest, partitions: dict[str, Partition]) -> SlurmRequest:
    """Refuse a job that can never run here; returns the request with partition and CPUs filled in.

    Raises :class:`FixresError` with one line for: an unknown or down partition; more nodes, tasks,
    CPUs, GPUs or memory than any usable node of the partition has; a time limit above the
    partition's; ``timeout_min`` too short for ``signal_delay_s``; one task per GPU violated.
    """
    r = request
    for name in ("nodes", "timeout_min", "max_requeues", "array_parallelism"):
        if getattr(r, name) < (0 if name == "max_requeues" else 1):
            raise FixresError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(r, name)}")
    if r.gpus_per_node < 0 or r.signal_delay_s < 0:
        raise FixresError("--gpus-per-node and --signal-delay-s must be >= 0")
    if r.gpus_per_node and r.tasks_per_node not in (None, r.gpus_per_node):
        raise FixresError(f"one task per GPU: --tasks-per-node {r.tasks_per_node} differs from "
                          f"--gpus-per-node {r.gpus_per_node} (drop --tasks-per-node)")
    if r.tasks < 1 or (r.cpus_per_task is not None and r.cpus_per_task < 1):
        raise FixresError("--tasks-per-node and --cpus-per-task must be >= 1")
    if r.mem_gb is not None and r.mem_gb <= 0:
        raise FixresError(f"--mem-gb must be > 0, got {r.mem_gb}")
    needed = r.signal_delay_s + TIME_LIMIT_CHECK_S + MIN_RUN_BEFORE_WARNING_S
    if r.timeout_min * 60 < needed:
        raise FixresError(f"--timeout-min {r.timeout_min} is too short for --signal-delay-s {r.signal_delay_s}: "
                          f"SLURM may send the warning signal {r.signal_delay_s + TIME_LIMIT_CHECK_S} s before "
                          f"the limit; use --timeout-min >= {math.ceil(needed / 60)} or a smaller --signal-delay-s")
    if not partitions:
        raise FixresError("sinfo lists no partitions: the cluster has no nodes configured")
    if r.partition is None:
        defaults = [p.name for p in partitions.values() if p.default]
        if not defaults:
            raise FixresError(f"the cluster has no default partition; give --partition (one of {', '.join(partitions)})")
        r = attrs.evolve(r, partition=defaults[0])
    if r.partition not in partitions:
        raise FixresError(f"partition {r.partition!r} does not exist (partitions: {', '.join(partitions)})")
    part = partitions[r.partition]
    if not part.up:
        raise FixresError(f"partition {part.name!r} is not up (sinfo shows it inactive or down)")
    if part.max_time_min is not None and r.timeout_min > part.max_time_min:
        raise FixresError(f"--timeout-min {r.timeout_min} exceeds the time limit of partition {part.name!r} "
                          f"({part.max_time_min:g} minutes)")

    def fits(node: Node, cpus_per_task: int) -> bool:
        return (node.cpus >= r.tasks * cpus_per_task and node.gpus >= r.gpus_per_node
                and (r.mem_gb is None or node.memory_mb >= r.mem_gb * 1024))

    cpus_per_task = r.cpus_per_task or max(1, min(n.cpus for n in part.nodes) // r.tasks)
    fitting = [n for n in part.nodes if fits(n, cpus_per_task)]
    if len(fitting) < r.nodes:
        biggest = max(part.nodes, key=lambda n: (n.gpus, n.cpus, n.memory_mb))
        want = (f"{r.nodes} node(s) with {r.tasks} task(s) x {cpus_per_task} CPU(s)"
                + (f", {r.gpus_per_node} GPU(s)" if r.gpus_per_node else "")
                + (f", {r.mem_gb:g} GB" if r.mem_gb else ""))
        raise FixresError(f"partition {part.name!r} cannot run {want}: {len(fitting)} of its "
                          f"{len(part.nodes)} node(s) are big enough (largest: {biggest.cpus} CPUs, "
                          f"{biggest.gpus} GPUs, {biggest.memory_mb / 1024:.1f} GB)")
    usable = [n for n in fitting if n.usable]
    if len(usable) < r.nodes:
        states = ", ".join(f"{n.name} {n.state}" for n in fitting)
        raise FixresError(f"partition {part.name!r}: only {len(usable)} of the {len(fitting)} node(s) that fit "
                          f"are usable ({states}); the job would pend until an admin brings them back")
    return attrs.evolve(r, cpus_per_task=cpus_per_task)


# --------------------------------------------------------------------------- submitting
def template_config(mode: str, main_argv: list[str], request: SlurmRequest,
                    overrides: dict | None = None) -> TrainerConfig:
    """The job's TrainerConfig from ``main_*.py`` flags (ranks left to the tasks); checks inputs."""
    from .launch import preflight

    args = build_parser(mode).parse_args(main_argv)
    given = [f"--{name.replace('_', '-')}" for name in RANK_FLAGS if getattr(args, name) is not None]
    if given:
        raise FixresError(f"{', '.join(given)}: SLURM sets the ranks, the job id and the rendezvous; drop these flags")
    fields = config_fields(args, mode)
    if request.gpus_per_node == 0 and args.device == "cuda":
        raise FixresError("--device cuda needs --gpus-per-node > 0")
    fields["device"] = args.device or ("cuda" if request.gpus_per_node else "cpu")
    fields["dist_backend"] = args.dist_backend or ("nccl" if fields["device"] == "cuda" else "gloo")
    fields.update(overrides or {})
    if "preempt_signal" in attrs.fields_dict(TrainerConfig):
        import submitit

        usr = "SIG" + submitit.JobEnvironment.USR_SIG  # what SLURM sends (#SBATCH --signal), SUBMITIT_PREEMPT_SIGNAL
        if fields.get("preempt_signal", usr) != usr:
            raise FixresError(f"--preempt-signal {fields['preempt_signal']}: submitit's jobs get {usr} "
                              "(set SUBMITIT_PREEMPT_SIGNAL to change it); drop the flag")
        fields["preempt_signal"] = usr
    for name in ("data_path", "weight_path", "shared_folder_path", "resume"):
        if fields.get(name):
            fields[name] = str(Path(fields[name]).expanduser().absolute())
    fields.setdefault("shared_folder_path", str(Path("runs").absolute()))
    config = TrainerConfig(num_tasks=request.nodes * request.tasks, global_rank=0, local_rank=0,
                           job_id="submit", dist_url="env://", **fields)
    preflight(config)
    return config


def make_executor(request: SlurmRequest, shared: Path, mode: str):
    """A submitit AutoExecutor for ``request``; logs go to ``<shared>/<job id>/logs``."""
    import submitit

    executor = submitit.AutoExecutor(folder=shared / "%j" / "logs", cluster="slurm",
                                     slurm_max_num_timeout=request.max_requeues)
    params = dict(nodes=request.nodes, tasks_per_node=request.tasks, cpus_per_task=request.cpus_per_task,
                  timeout_min=request.timeout_min, slurm_partition=request.partition,
                  slurm_signal_delay_s=request.signal_delay_s, name=request.job_name or f"fixres-{mode}",
                  slurm_array_parallelism=request.array_parallelism,
                  # one failing task ends the job at once instead of its peers waiting for it
                  slurm_srun_args=["--kill-on-bad-exit=1"],
                  slurm_additional_parameters={"requeue": True},
                  # the job imports this package from where the submitter found it (a checkout works)
                  slurm_setup=[f"export PYTHONPATH={PACKAGE_ROOT}${{PYTHONPATH:+:$PYTHONPATH}}"])
    if request.gpus_per_node:
        params["gpus_per_node"] = request.gpus_per_node
    if request.mem_gb is not None:
        params["mem_gb"] = request.mem_gb
    executor.update_parameters(**params)
    return executor


def job_folder(config: TrainerConfig, job_id: str) -> Path:
    return Path(config.shared_folder_path) / job_id


def log_files(config: TrainerConfig, job_id: str, rank: int | str = "<rank>") -> tuple[Path, Path]:
    logs = job_folder(config, job_id) / "logs"
    return logs / f"{job_id}_{rank}_log.out", logs / f"{job_id}_{rank}_log.err"


def submit(mode: str, request: SlurmRequest, main_argv: list[str]):
    """Check everything, submit one job; returns ``(job, config, request)`` (request completed)."""
    request = check_request(request, read_partitions())
    config = template_config(mode, main_argv, request)
    check_shared_folder(Path(config.shared_folder_path), request.nodes)
    executor = make_executor(request, Path(config.shared_folder_path), mode)
    job = executor.submit(SlurmTrainer(config))
    return job, config, request


# --------------------------------------------------------------------------- waiting
def squeue_states(job_id: str) -> dict[str, str]:
    """``{job id: state}`` of a job (or the tasks of an array) while SLURM lists it; {} afterwards."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%i|%T"], capture_output=True,
                             text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return {"?": "UNKNOWN"}
    if out.returncode != 0:
        # "Invalid job id specified": the job has left slurmctld's memory; anything else: ask again
        return {} if "invalid job id" in out.stderr.lower() else {"?": "UNKNOWN"}
    states = {}
    for line in out.stdout.splitlines():
        if "|" in line:
            jid, state = line.strip().split("|", 1)
            states[jid] = state
    return states


def watch(job_id: str, on_change=None, started: float | None = None, timeout: float | None = None) -> dict:
    """Poll squeue until the job has left the queue; returns ``{"running_after": s, "events": [...]}``.

    ``events`` are ``(seconds since started, job id, state)`` for every state change, so a requeue
    shows as RUNNING -> PENDING -> RUNNING. ``on_change`` is called with each event.
    """
    started = time.time() if started is None else started
    last: dict[str, str] = {}
    events = []
    while True:
        states = squeue_states(job_id)
        for jid, state in states.items():
            if last.get(jid) != state:
                event = (time.time() - started, jid, state)
                events.append(event)
                if on_change:
                    on_change(event)
        if not states:
            break
        last = states
        if timeout is not None and time.time() - started > timeout:
            break
        time.sleep(SQUEUE_POLL_S)
    running = [t for t, _, s in events if s == "RUNNING"]
    return {"running_after": running[0] if running else None, "events": events}


def _cause(exc: Exception) -> tuple[bool, str]:
    """``(raised in the task?, one line)`` from submitit's FailedJobError / UncompletedJobError."""
    text = str(exc)
    parts = text.split("----------------------")
    if len(parts) >= 3:  # FailedJobError: the task's traceback sits between two rulers
        lines = [ln.strip() for ln in parts[1].splitlines() if ln.strip()]
        return True, lines[-1] if lines else type(exc).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return False, lines[0] if lines else type(exc).__name__


def task_outcomes(job) -> list[tuple[int, object, str | None]]:
    """``(rank, result or None, error line or None)`` for every task of a finished submitit job.

    Failed tasks come first, the one that failed earliest (by its error pickle's time) at the front:
    a rank that raised before the ranks that only lost it, before the ranks that were killed.
    """
    outcomes, order = [], []
    for rank in range(job.num_tasks):
        task = job.task(rank)
        try:
            outcomes.append((rank, task.result(), None))
            order.append((2, 0.0, rank))
        except Exception as exc:  # submitit's FailedJobError / UncompletedJobError: report, don't crash
            raised, cause = _cause(exc)
            try:
                when = task.paths.result_pickle.stat().st_mtime
            except OSError:
                when = float("inf")
            outcomes.append((rank, None, cause))
            order.append((0 if raised else 1, when, rank))
    return [outcomes[rank] for _, _, rank in sorted(order)]


def first_failure(outcomes) -> tuple[int, str] | None:
    """The failed task that :func:`task_outcomes` put first, as ``(rank, error line)``."""
    failed = [(rank, error) for rank, _, error in outcomes if error is not None]
    return failed[0] if failed else None


def final_state(job_id: str, timeout: float = 10) -> str:
    """The job's state in ``sacct`` once it is terminal (sacct lags the queue by about a second)."""
    deadline = time.time() + timeout
    state = "UNKNOWN"
    while time.time() < deadline:
        try:
            out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State"],
                                 capture_output=True, text=True, timeout=10)
            states = [ln.split()[0] for ln in out.stdout.splitlines() if ln.strip()] if out.returncode == 0 else []
        except (subprocess.TimeoutExpired, FileNotFoundError):
            states = []
        if states:
            state = states[-1]
            if state not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "RESIZING"):
                return state
        time.sleep(0.3)
    return state


def report(job, config: TrainerConfig, started: float, out=None) -> int:
    """Wait for ``job``, print its state changes and per-rank results; returns an exit status."""
    out = out or sys.stdout

    def say(event):
        seconds, jid, state = event
        print(f"  +{seconds:6.1f} s  job {jid}: {state}", file=out, flush=True)

    watched = watch(job.job_id, say, started)
    outcomes = task_outcomes(job)
    failed = first_failure(outcomes)
    state = final_state(job.job_id) if failed else "COMPLETED"
    elapsed = time.time() - started
    if failed:
        rank, cause = failed
        err = log_files(config, job.job_id, rank)[1]
        print(f"fixres_dist: job {job.job_id} {state} after {elapsed:.1f} s: rank {rank}: {cause} (log: {err})",
              file=sys.stderr, flush=True)
        return 1
    running = watched["running_after"]
    print(f"job {job.job_id} COMPLETED in {elapsed:.1f} s"
          + (f" (running {running:.1f} s after submission)" if running is not None else ""), file=out)
    print("| rank | host | restarts | resolution | top-1 % | top-5 % | images |", file=out)
    print("|------|------|----------|------------|---------|---------|--------|", file=out)
    for rank, result, _ in sorted(outcomes, key=lambda o: o[0]):
        print(f"| {rank:4d} | {result.get('host', '?')} | {result.get('restart', 0):8d} | "
              f"{result['resolution']:7d} px | {result['top1']:7.2f} | {result['top5']:7.2f} | "
              f"{result['images']:6d} |", file=out)
    return 0


# --------------------------------------------------------------------------- sweeps
def read_before_top1(folder: Path, resolution: int) -> float | None:
    """Top-1 at ``resolution`` before finetuning, from a job folder's metrics.jsonl (if logged)."""
    try:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "eval" and event.get("epoch") == 0 and event.get("resolution") == resolution:
            return event.get("top1")
    return None


def submit_sweep(request: SlurmRequest, resolutions: list[int], main_argv: list[str]):
    """One FixRes finetune per test resolution, submitted together as one SLURM job array.

    Returns ``(jobs, configs, request)``; ``jobs[i]`` finetunes at ``resolutions[i]``.
    """
    if not resolutions or any(r <= 0 for r in resolutions):
        raise FixresError("--resolutions needs one or more positive sizes in pixels, e.g. 32,48,64")
    request = check_request(request, read_partitions())
    args = build_parser("finetune").parse_args(main_argv)
    if args.input_size is not None:
        raise FixresError("--input-size: the sweep sets it to each of --resolutions; drop it")
    overrides = {} if args.epochs is not None else {"epochs": 1}
    configs = [template_config("finetune", main_argv, request, {**overrides, "input_size": r})
               for r in resolutions]
    check_shared_folder(Path(configs[0].shared_folder_path), request.nodes)
    executor = make_executor(request, Path(configs[0].shared_folder_path), "sweep")
    with executor.batch():
        jobs = [executor.submit(SlurmTrainer(cfg)) for cfg in configs]
    return jobs, configs, request


def gather_sweep(jobs, configs) -> list[dict]:
    """One row per resolution: rank 0's result after finetuning (or the error) and top-1 before."""
    rows = []
    for job, config in zip(jobs, configs):
        outcomes = task_outcomes(job)
        result = next((res for rank, res, _ in outcomes if rank == 0), None)
        failed = first_failure(outcomes)
        error = f"rank {failed[0]}: {failed[1]}" if failed else None
        row = {"resolution": config.input_size, "job_id": job.job_id, "error": error,
               "top1_before": read_before_top1(job_folder(config, job.job_id), config.input_size)}
        if result is not None:
            row.update(top1=result["top1"], top5=result["top5"], images=result["images"])
        rows.append(row)
    return rows


def sweep_table(rows: list[dict], weight_path: str, epochs: int) -> str:
    lines = [f"FixRes sweep of {weight_path}: {epochs}-epoch finetune at each test resolution",
             "| test resolution | top-1 % before | top-1 % after | top-5 % after | job |",
             "|-----------------|----------------|---------------|---------------|-----|"]
    for row in rows:
        before = "" if row["top1_before"] is None else f"{row['top1_before']:.2f}"
        if row["error"]:
            lines.append(f"| {row['resolution']:12d} px | {before:>14} | failed: {row['error']} | | {row['job_id']} |")
        else:
            lines.append(f"| {row['resolution']:12d} px | {before:>14} | {row['top1']:13.2f} | "
                         f"{row['top5']:13.2f} | {row['job_id']} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- command lines
def request_parser(description: str, modes: list[str] | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                usage="%(prog)s " + ("{" + ",".join(modes) + "} " if modes else "")
                                + "[cluster options] -- [main_*.py options]")
    if modes:
        p.add_argument("mode", choices=modes, help="main_scratch.py or main_finetune.py")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0, help="one task per GPU; 0: CPU tasks (default)")
    p.add_argument("--tasks-per-node", type=int, help="CPU tasks per node (with --gpus-per-node 0; default 1)")
    p.add_argument("--cpus-per-task", type=int, help="default: the smallest node's CPUs / tasks per node")
    p.add_argument("--mem-gb", type=float, help="memory per node (default: the partition's default)")
    p.add_argument("--partition", help="default: the cluster's default partition")
    p.add_argument("--timeout-min", type=int, default=60, help="time limit in minutes (default 60)")
    p.add_argument("--signal-delay-s", type=int, default=120,
                   help="SLURM sends the warning signal this many seconds before the limit (default 120)")
    p.add_argument("--max-requeues", type=int, default=3, help="requeues on the warning signal (default 3)")
    p.add_argument("--job-name", help="default: fixres-<mode>")
    p.add_argument("--wait", action="store_true", help="wait for the job and report each rank's result")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def request_from_args(args) -> SlurmRequest:
    return SlurmRequest(nodes=args.nodes, gpus_per_node=args.gpus_per_node, tasks_per_node=args.tasks_per_node,
                        cpus_per_task=args.cpus_per_task, mem_gb=args.mem_gb, partition=args.partition,
                        timeout_min=args.timeout_min, signal_delay_s=args.signal_delay_s,
                        job_name=args.job_name, max_requeues=args.max_requeues,
                        array_parallelism=getattr(args, "parallel", None) or 32)


def submit_main(argv: list[str] | None = None) -> int:
    """``python slurm/submit.py {scratch,finetune} [cluster options] -- [main_*.py options]``."""
    own, main_argv = split_argv(sys.argv[1:] if argv is None else argv)
    args = request_parser("Submit main_scratch.py or main_finetune.py to SLURM through submitit.",
                          ["scratch", "finetune"]).parse_args(own)
    started = time.time()
    try:
        job, config, request = submit(args.mode, request_from_args(args), main_argv)
    except FixresError as exc:
        print(f"fixres_dist: submit: {exc}", file=sys.stderr, flush=True)
        return 1
    out, err = log_files(config, job.job_id)
    print(f"submitted SLURM job {job.job_id}: {args.mode}, {request.nodes} node(s) x {request.tasks} task(s) x "
          f"{request.cpus_per_task} CPU(s){f' + {request.gpus_per_node} GPU(s)' if request.gpus_per_node else ''}"
          f", partition {request.partition}, {request.timeout_min} min", flush=True)
    print(f"job folder {job_folder(config, job.job_id)}; logs {out.parent}/{job.job_id}_<rank>_log.{{out,err}}",
          flush=True)
    if not args.wait:
        return 0
    try:
        return report(job, config, started)
    except KeyboardInterrupt:
        print(f"\nstopped waiting; job {job.job_id} goes on (scancel {job.job_id} stops it)", file=sys.stderr)
        return 130


def sweep_main(argv: list[str] | None = None) -> int:
    """``python slurm/sweep.py --resolutions 32,48,64 [cluster options] -- --weight-path CKPT [...]``."""
    own, main_argv = split_argv(sys.argv[1:] if argv is None else argv)
    p = request_parser("FixRes-finetune one checkpoint at several test resolutions as one SLURM job array "
                       "and gather the table (1 epoch each unless --epochs is given).", None)
    p.add_argument("--resolutions", required=True, help="comma-separated test resolutions, e.g. 32,48,64")
    p.add_argument("--parallel", type=int, help="array tasks running at once (default 32)")
    p.add_argument("--output", help="also write the rows as JSON here (default <shared>/sweep-<array id>.json)")
    args = p.parse_args(own)
    try:
        resolutions = [int(x) for x in args.resolutions.split(",") if x.strip()]
    except ValueError:
        print(f"fixres_dist: sweep: --resolutions {args.resolutions!r}: give sizes like 32,48,64", file=sys.stderr)
        return 1
    started = time.time()
    try:
        jobs, configs, request = submit_sweep(request_from_args(args), resolutions, main_argv)
    except FixresError as exc:
        print(f"fixres_dist: sweep: {exc}", file=sys.stderr, flush=True)
        return 1
    array_id = jobs[0].job_id.split("_")[0]
    print(f"submitted SLURM array job {array_id}: {len(jobs)} finetune(s) at {', '.join(map(str, resolutions))} px, "
          f"each {request.nodes} node(s) x {request.tasks} task(s); job folders "
          f"{configs[0].shared_folder_path}/{array_id}_<i>/ (logs in their logs/)", flush=True)
    try:
        watch(array_id, lambda e: print(f"  +{e[0]:6.1f} s  job {e[1]}: {e[2]}", flush=True), started)
        rows = gather_sweep(jobs, configs)
    except KeyboardInterrupt:
        print(f"\nstopped waiting; array job {array_id} goes on (scancel {array_id} stops it)", file=sys.stderr)
        return 130
    print(sweep_table(rows, configs[0].weight_path, configs[0].epochs))
    output = Path(args.output) if args.output else Path(configs[0].shared_folder_path) / f"sweep-{array_id}.json"
    output.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"rows written to {output}")
    return 1 if any(row["error"] for row in rows) else 0
