"""From a command line to running ranks: resolve placement, check inputs, run or spawn, exit status.

Exit status: 0 on success; 1 on any failure, after one line ``fixres_dist: rank R: <cause>`` on
stderr (a traceback is printed before it only for unexpected errors, i.e. bugs); 2 for command-line
usage errors (argparse); 3 after a preemption (SIGTERM or the preemption signal) and 130 after
Ctrl-C (SIGINT): every rank wrote the checkpoint (if anything was trained since the last one), and
running the same command again resumes. Bad input is found here, before any rank starts or anything
is written; a second launch of a running job is refused before any rendezvous (:mod:`fixres_dist.distributed.joblock`).
"""
from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.reduction
import multiprocessing.resource_tracker
import os
import signal
import sys
import time
import traceback

import attrs
import torch.multiprocessing as mp

from fixres_dist import io
from fixres_dist.config import TrainerConfig
from fixres_dist.deploy import export, exported
from fixres_dist.distributed import collectives, joblock, layout, orphans, placement, rendezvous
from fixres_dist.distributed.preemption import (
    INTERRUPTED_EXIT_STATUS,
    PREEMPTED_EXIT_STATUS,
    Preempted,
    exit_status,
    ignoring,
    stop_signals,
    stop_with_launcher,
)
from fixres_dist.distributed.watchdog import REPORTS_S, STALL_EXIT_STATUS
from fixres_dist.entry import config_file
from fixres_dist.entry.cli import build_parser, config_fields
from fixres_dist.errors import FixresError, first_line, say, user_message
from fixres_dist.reporting import trackers
from fixres_dist.training import world_change
from fixres_dist.training.checkpoint import CHECKPOINT_FILE
from fixres_dist.training.inputs import JobInputs, preflight
from fixres_dist.training.trainer import RunResult, Trainer


def build_config(mode: str, args: argparse.Namespace, environ=None) -> tuple[TrainerConfig, str]:
    """Resolve ranks for parsed ``args``; returns ``(config, placement source)``.

    In spawn mode the config is rank 0's; :func:`spawn` derives the others.
    Raises :class:`FixresError` on invalid or conflicting values.
    """
    where = placement.resolve_placement(args.num_tasks, args.global_rank, args.local_rank,
                                        args.job_id, args.dist_url, environ)
    config = TrainerConfig(**config_fields(args, mode)).placed(
        num_tasks=where.num_tasks, global_rank=where.global_rank, local_rank=where.local_rank,
        job_id=where.job_id, dist_url=where.dist_url)
    return config, where.source


def rank_name(config: TrainerConfig) -> str:
    """``rank R``, and where a split model puts it: its stage and pipeline, or its tensor group."""
    try:
        return layout.of(config).rank_name(config.global_rank)
    except FixresError:  # a layout that does not fit the ranks: its own error line says so
        return f"rank {config.global_rank}"


def run_rank(config: TrainerConfig, inputs: JobInputs | None = None, locked: bool = False, announce: bool = False,
             index_note: str | None = None, config_note: str | None = None) -> RunResult:
    """Run one rank; on failure print one stderr line and exit 1 (3 or 130 after a stop checkpoint).

    ``inputs``: what :func:`~fixres_dist.training.inputs.preflight` returned in this process;
    ``locked``, ``announce``, ``index_note`` (the launcher's line about the file index), ``config_note``
    (its line about its ``--config`` file, :mod:`fixres_dist.entry.config_file`): see
    :class:`~fixres_dist.training.trainer.Trainer`.
    """
    prefix = f"fixres_dist: {rank_name(config)}:"
    try:
        return Trainer(config, inputs, locked=locked, announce=announce, index_note=index_note,
                       config_note=config_note)()
    except Preempted as exc:
        say(f"{prefix} {exc}")
        raise SystemExit(exit_status(exc.signal)) from None
    except KeyboardInterrupt:  # Ctrl-C outside the Trainer's stop handling (before it started)
        say(f"{prefix} interrupted by SIGINT before training started; nothing to checkpoint")
        raise SystemExit(INTERRUPTED_EXIT_STATUS) from None
    except Exception as exc:  # every failure ends with one line; bugs also get their traceback
        message = user_message(exc)
        if message is None:
            traceback.print_exc()
        say(f"{prefix} {message or f'{type(exc).__name__}: {first_line(exc)}'}")
    finally:
        collectives.destroy_process_group()
    raise SystemExit(1)


class PassedFd:
    """An open file descriptor of the launcher, passed to a spawned rank as a duplicate (the rank
    gets its own number for the same open file). The job lock passed so is held as long as the
    launcher *or any rank* lives (a rank that outlives a killed launcher still keeps a rerun out of
    its folder)."""

    def __init__(self, fd):
        self.fd = fd.detach() if hasattr(fd, "detach") else fd  # in the rank: the duplicate's number

    def __reduce__(self):
        return PassedFd, (multiprocessing.reduction.DupFd(self.fd),)


@attrs.frozen
class LauncherContext:
    """What a spawned rank takes from its launcher as it starts: the environment and where stdout
    and stderr go *now*. A rank is forked from the forkserver, which has what the launcher had when
    the server started; the two differ when one Python process launches several jobs (a notebook,
    a test session) after changing its environment or redirecting its output."""

    environ: dict
    stdout: PassedFd
    stderr: PassedFd

    @classmethod
    def of_this_process(cls) -> "LauncherContext":
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        return cls(dict(os.environ), PassedFd(1), PassedFd(2))

    def adopt(self) -> None:
        """In the rank: the launcher's environment and standard output and error."""
        os.environ.clear()
        os.environ.update(self.environ)
        for passed, target in ((self.stdout, 1), (self.stderr, 2)):
            os.dup2(passed.fd, target)
            os.close(passed.fd)


def _spawned_rank(index: int, config: TrainerConfig, lock: PassedFd, index_note: str | None,
                  config_note: str | None, launcher: LauncherContext) -> None:
    launcher.adopt()
    stop_with_launcher()
    os.environ[rendezvous.ONE_HOST] = "1"  # rank 0's store listens on loopback only
    run_rank(attrs.evolve(config, global_rank=index, local_rank=index), locked=True, index_note=index_note,
             config_note=config_note)


# What the forkserver imports once, before it forks each rank (instead of every rank importing it).
FORKSERVER_PRELOAD = ["fixres_dist.training.trainer"]


def start_method() -> str:
    """How :func:`spawn` starts ranks: ``forkserver``, with torch, torchvision and this package
    imported once in the server (a rank then starts in a fraction of a second instead of importing
    them for seconds); each rank is still a fresh process forked from a server that never ran a
    kernel, initialised CUDA or started threads. Where forkserver is missing: ``spawn``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    return "forkserver"


def spawn(config: TrainerConfig, index_note: str | None = None, config_note: str | None = None) -> None:
    """Hold the job lock, start ``config.num_tasks`` local ranks and wait (``index_note``: what
    :func:`preflight` returned, ``config_note``: the ``--config`` file's line, for rank 0's log).

    SIGTERM, SIGINT and the preemption signal received by this parent are forwarded to the ranks
    (again every second until they exit, should one arrive before a rank listens). The forkserver
    and the resource tracker ignore them: a signal to the whole process group reaches the ranks
    (and this parent) only. When a rank fails the others are terminated; the parent exits 1 (3, or
    130 for SIGINT, if the ranks stopped on a signal and wrote their checkpoint). What the ranks leave (loader
    workers) is killed once they have ended, before the lock is released (:mod:`fixres_dist.distributed.orphans`).
    """
    io.make_private_folder(config.job_folder)
    lock = joblock.JobLock.acquire(config.job_folder, config.num_tasks)
    signals = stop_signals(config.preempt_signal)
    method = start_method()
    with ignoring(signals):  # helper processes started now ignore the job's stop signals for good
        multiprocessing.resource_tracker.ensure_running()
        if method == "forkserver":
            multiprocessing.forkserver.ensure_running()
    received, context = [], None

    def send(signum) -> None:
        for process in context.processes if context is not None else ():
            if process.is_alive():
                try:
                    os.kill(process.pid, signum)
                except ProcessLookupError:  # it exited since is_alive()
                    pass

    def forward(signum, frame):
        received[:] = [signum]
        send(signum)

    previous = {s: signal.signal(s, forward) for s in signals}
    try:
        with orphans.adopting_orphans() as keep:
            try:
                context = mp.start_processes(_spawned_rank, args=(config, PassedFd(lock.fd), index_note, config_note,
                                                   LauncherContext.of_this_process()),
                                             nprocs=config.num_tasks, join=False, start_method=method)
                keep.update(p.pid for p in context.processes)
                failed = _wait_for_ranks(context.processes, lambda: [send(signum) for signum in received])
            except BaseException:  # leaving without the ranks' end (a bug, a caller's time limit): none outlives this
                _stop_ranks(context.processes if context is not None else [])
                raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        lock.release()
    codes = [p.exitcode for p in context.processes]
    if failed is not None and failed[1] == STALL_EXIT_STATUS:  # each rank that could said which one stalled
        raise SystemExit(STALL_EXIT_STATUS)
    if failed is not None:
        rank, code = failed
        cause = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        say(f"fixres_dist: rank {rank} {cause}; stopped the other ranks")
        raise SystemExit(1)
    for status in (INTERRUPTED_EXIT_STATUS, PREEMPTED_EXIT_STATUS):
        if status in codes:
            raise SystemExit(status)


def _stop_ranks(processes) -> None:
    """SIGTERM to the ranks still running (each checkpoints and exits), SIGKILL to those still
    running :data:`TERMINATE_GRACE_S` later."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


STOPPED = (0, PREEMPTED_EXIT_STATUS, INTERRUPTED_EXIT_STATUS)  # how a rank ends without failing
TERMINATE_GRACE_S = 30.0  # after a rank failed, the others get SIGTERM, then SIGKILL this much later
# ... after a rank stalled: the others still running end within the stall reports' wait, or are frozen
STALLED_GRACE_S = REPORTS_S + 5.0


def _wait_for_ranks(processes, every_second) -> tuple[int, int] | None:
    """Wait until every rank process has exited; returns ``(rank, exit code)`` of the first that
    failed (after terminating the others), or None. Ranks that stop on a signal (3, 130) are waited
    for, not terminated: each writes its part of the checkpoint and exits by itself."""
    failed, deadline = None, None
    while any(p.exitcode is None for p in processes):
        multiprocessing.connection.wait([p.sentinel for p in processes if p.exitcode is None], timeout=1.0)
        every_second()
        for rank, process in enumerate(processes):
            if failed is None and process.exitcode not in (None, *STOPPED):
                grace = STALLED_GRACE_S if process.exitcode == STALL_EXIT_STATUS else TERMINATE_GRACE_S
                failed, deadline = (rank, process.exitcode), time.monotonic() + grace
                for other in processes:
                    if other.exitcode is None:
                        other.terminate()
        if deadline is not None and time.monotonic() > deadline:
            for other in processes:
                if other.exitcode is None:
                    other.kill()
    return failed


def main(mode: str, argv: list[str] | argparse.Namespace | None = None) -> None:
    """Run ``main_scratch.py`` (``mode="scratch"``) or ``main_finetune.py`` (``"finetune"``).

    ``argv``: the command line (default ``sys.argv[1:]``), or what :func:`fixres_dist.entry.cli.build_parser`
    parsed of it (the scripts parse before importing this module: :func:`fixres_dist.entry.scripts.run_script`).
    """
    args = argv if isinstance(argv, argparse.Namespace) else build_parser(mode).parse_args(argv)
    try:
        config, source = build_config(mode, args)
        checked = source in ("spawn", "single") or config.global_rank == 0  # else after meeting the peers
        inputs = preflight(config) if checked else None
        if inputs is not None and inputs.resume is None:  # a fresh job below --min-world-size: before any rank starts
            world_change.check_minimum(config, None)
        if source == "torchrun" and config.local_rank == 0 and placement.elastic_shared_store():  # on every node
            say(f"fixres_dist: warning: {placement.ELASTIC_SHARED_STORE}")
    except FixresError as exc:
        rank = args.global_rank if args.global_rank is not None else \
            os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
        say(f"fixres_dist: rank {rank}: {exc}")
        raise SystemExit(1) from None
    note = getattr(args, config_file.NOTE, None)  # the --config file's line, for rank 0's log
    if source == "spawn":
        try:
            spawn(config, inputs.index.describe(), note)
        except FixresError as exc:  # the job folder is in use
            say(f"fixres_dist: rank 0: {exc}")
            raise SystemExit(1) from None
    else:
        run_rank(config, inputs, announce=source in ("flags", "slurm"), config_note=note)
    if config.export and config.global_rank == 0:  # the run ended well (else SystemExit): rank 0 or the launcher
        export_run(config)
    trackers.log_final_artifacts(config, config.job_folder)


def export_run(config: TrainerConfig) -> None:
    """``--export``, after the run ended successfully: the export folder of the job's last checkpoint in
    ``<job folder>/export/`` (:func:`fixres_dist.deploy.export.export_folder`), one line on stdout; kept as it is
    when an earlier run of the job wrote it (the same configuration, so the same last checkpoint). A failure is
    one line and exit status 1; the job's checkpoints are untouched. Something else named ``export`` there (a
    file, a folder that :func:`fixres_dist.deploy.exported.read_export` refuses) is one line and exit status 1,
    left as it is."""
    out = config.job_folder / export.RUN_FOLDER
    if out.exists() or out.is_symlink():
        try:
            exported.read_export(out)
        except FixresError as exc:
            say(f"fixres_dist: rank 0: --export: {out} exists and is not an export folder ({exc}); remove it and "
                "run again to export")
            raise SystemExit(1) from None
        print(f"--export: {out} kept (an earlier run of this job wrote it)", flush=True)
        return
    try:
        export.export_folder(config.job_folder / CHECKPOINT_FILE, out,
                             warn=lambda line: say(f"fixres_dist: rank 0: warning: --export: {line}"))
    except FixresError as exc:
        say(f"fixres_dist: rank 0: --export: {exc}")
        raise SystemExit(1) from None
    print(f"--export: {export.describe(out)}", flush=True)
