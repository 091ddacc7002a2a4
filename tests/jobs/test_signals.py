"""Stop signals sent to every process of a job (SLURM, timeout, kill -- -PGID, Ctrl-C): one checkpoint,
the documented exit status, one line per rank and no traceback, and no process left behind.

Jobs start forked with torch imported (:func:`conftest.start_script`) as the leader of a process group,
except where the interpreter's start is the behaviour (:func:`start_interpreter_group`): a signal
while it starts, a job started with SIGINT ignored, GNU timeout, and the forkserver and resource
tracker that a fresh ``python main_scratch.py`` starts in its process group."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, SCRATCH, clean_env, free_port, run_script, start_script, wait_for
from fixres_dist.training.checkpoint import CHECKPOINT_FILE, load_checkpoint

# 40 epochs of 5 steps: a job that trains until it is stopped. resnet20, the smallest network (epochs
# and checkpoints in a fraction of resnet18's time): what is trained does not matter here.
LONG = ["--architecture", "resnet20", "--input-size", "32", "--batch", "8", "--epochs", "40", "--no-progress"]
TRAIN_IMAGES = 80  # in tiny_data
JOB_START_S = 180  # the most a job may take to train an epoch (its first: imports), on a loaded 2-core machine
EXIT_S = 60  # the most a job may take to exit once stopped

GROUPS: list[int] = []  # the jobs the running test started: the leaders of their process groups


@pytest.fixture(autouse=True)
def no_job_left_running():
    """A test that fails before its job stopped (or a job that did not stop) leaves no job training
    on for minutes: what is left of its process groups is killed."""
    yield
    while GROUPS:
        leader = GROUPS.pop()
        for kill in (os.killpg, os.kill):  # the group; the leader, should it not lead one yet
            with contextlib.suppress(ProcessLookupError):  # all gone, as it should be
                kill(leader, signal.SIGKILL)


def start_interpreter_group(*args, wrapper: tuple = (), ignore_sigint: bool = False) -> subprocess.Popen:
    """``python main_scratch.py args`` as a new interpreter (run by ``wrapper``, such as ``timeout
    600``) that leads a process group of its own, as a shell job or a SLURM step; ``ignore_sigint``:
    started with SIGINT ignored (a shell script's ``cmd &``)."""
    def ignoring_sigint():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    command = [*wrapper, sys.executable, ROOT / "main_scratch.py", *args]
    proc = subprocess.Popen(list(map(str, command)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(), start_new_session=True,
                            preexec_fn=ignoring_sigint if ignore_sigint else None)
    GROUPS.append(proc.pid)
    return proc


def start_group(*args, script: str = "scratch"):
    """``main_<script>.py args`` forked with torch imported, as the leader of a process group."""
    started = start_script(script, *args, new_session=True)
    GROUPS.append(started.pid)
    return started


def long_job(job_id: str, tmp_path: Path, data: Path, workers: int) -> list:
    """The arguments of a 2-rank job ``job_id`` that trains on ``data`` until it is stopped."""
    return ["--num-tasks", 2, "--job-id", job_id, "--shared-folder-path", tmp_path, "--data-path", data,
            "--workers", workers, *LONG]


def events(folder: Path, kind: str | None = None) -> list[dict]:
    """The events (those of ``kind``: ``train``, ``eval``) of the job in ``folder`` so far, in order."""
    path = folder / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    lines = text[:text.rfind("\n") + 1].splitlines()  # not a line being written
    return [e for e in map(json.loads, lines) if kind in (None, e["event"])]


def wait_for_epoch(folder: Path, epoch: int = 1):
    wait_for(lambda: any(e["epoch"] >= epoch for e in events(folder, "train")), timeout=JOB_START_S,
             what=f"epoch {epoch} of the job in {folder} to be trained")


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask in /proc)."""
    return in_signal_mask(pid, "SigCgt", signum)


def ignores(pid: int, signum: int) -> bool:
    """Whether process ``pid`` ignores ``signum`` (its SigIgn mask in /proc)."""
    return in_signal_mask(pid, "SigIgn", signum)


def in_signal_mask(pid: int, mask: str, signum: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        bits = next(int(line.split()[1], 16) for line in f if line.startswith(f"{mask}:"))
    return bool(bits >> (signum - 1) & 1)


def group_is_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_for_group_exit(pgid: int, timeout: float = EXIT_S):
    """Every process of the job (forkserver, resource tracker, loader workers) exits once the
    launcher's pipes close: within seconds. Else the AssertionError describes what is left, with its stacks."""
    try:
        wait_for(lambda: group_is_gone(pgid), timeout=timeout, what=f"every process of group {pgid} to exit")
    except AssertionError as exc:
        import psutil

        from fixres_dist.distributed import stacks

        left = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == pgid]
        described = "".join(f"{stacks.describe_process(pid)}\n{stacks.process_stacks(pid)}" for pid in left)
        raise AssertionError(f"{exc}; left:\n{described}") from None


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def assert_quiet_stop(status: int, expected: int, err: str, ranks: int):
    """Exit ``expected``, exactly one ``fixres_dist:`` line per rank and nothing else on stderr."""
    assert status == expected, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == ranks and all(line.startswith("fixres_dist: rank ") for line in lines), err[-3000:]


def assert_one_stop_checkpoint(folder: Path, epochs: int = 1):
    """Both ranks' checkpoint, at least ``epochs`` epochs trained, and no temporary file left."""
    state = load_checkpoint(folder / CHECKPOINT_FILE)
    assert state["epoch"] * TRAIN_IMAGES + state["images_in_epoch"] >= epochs * TRAIN_IMAGES
    assert len(state["ranks"]) == 2
    assert not list(folder.glob(".*.tmp"))


def test_a_job_started_with_sigint_ignored_keeps_ignoring_it_and_stops_on_a_group_signal(tiny_data, tmp_path):
    """A shell script's background job (``cmd &``) starts with SIGINT ignored, so that a Ctrl-C
    meant for the script leaves it running: neither the launcher nor its ranks stop on it (they
    train the next epoch). SLURM's warning signal (``--signal USR2@...``) to the whole process group
    (``kill -- -PGID``) then stops it: one checkpoint, exit 3, one line per rank. A fresh
    interpreter: the forkserver and resource tracker it starts are in the group too; they ignore the
    job's stop signals, as do the ranks' loader workers, and exit with the launcher."""
    proc = start_interpreter_group(*long_job("bg", tmp_path, tiny_data, workers=1), ignore_sigint=True)
    folder = tmp_path / "bg"
    wait_for_epoch(folder)
    os.killpg(proc.pid, signal.SIGINT)  # the script's Ctrl-C, which the whole process group gets
    wait_for_epoch(folder, 2)
    os.killpg(proc.pid, signal.SIGUSR2)
    _, err = proc.communicate(timeout=EXIT_S)
    assert_quiet_stop(proc.returncode, 3, err, ranks=2)
    assert err.count("preempted by SIGUSR2") == 2, err[-3000:]
    wait_for_group_exit(proc.pid)
    assert_one_stop_checkpoint(folder, epochs=2)
    assert [e["epoch"] for e in events(folder, "train")][:2] == [1, 2]


def test_repeated_signals_to_the_group_still_end_in_one_line_per_rank(tiny_data, tmp_path):
    """Ctrl-C in the terminal (SIGINT to the whole group: launcher, ranks, their loader workers, the
    job's forkserver), then held down: SIGINT every 0.1 s until the job has exited, also while the
    ranks write the checkpoint and exit. One checkpoint of the trained epoch, exit 130, one line
    per rank, and no process left behind."""
    proc = start_group(*long_job("r", tmp_path, tiny_data, workers=1))
    folder = tmp_path / "r"
    wait_for_epoch(folder)
    deadline = time.monotonic() + EXIT_S
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    _, err = proc.communicate(timeout=EXIT_S)
    assert_quiet_stop(proc.returncode, 130, err, ranks=2)
    assert "interrupted by SIGINT" in err
    wait_for_group_exit(proc.pid)
    assert_one_stop_checkpoint(folder)


def test_timeout_stops_the_job_with_a_checkpoint(tiny_data, tmp_path):
    """GNU timeout signals its child's whole process group (SIGTERM) when it fires, here once the
    first epoch is trained (the test sends timeout the SIGALRM of its timer's expiry): timeout's
    status 124, one checkpoint, one line per rank, and no process left behind (the forkserver and
    resource tracker of the fresh interpreter ignore SIGTERM). Without loader workers: the ranks
    load the images themselves."""
    proc = start_interpreter_group(*long_job("t", tmp_path, tiny_data, workers=0), wrapper=("timeout", 600))
    folder = tmp_path / "t"
    wait_for_epoch(folder)
    proc.send_signal(signal.SIGALRM)
    _, err = proc.communicate(timeout=EXIT_S)
    assert_quiet_stop(proc.returncode, 124, err, ranks=2)  # timeout's own status once it fired
    assert err.count("preempted by SIGTERM") == 2, err[-3000:]
    wait_for_group_exit(proc.pid)
    assert_one_stop_checkpoint(folder)


ORPHAN = """
import os, signal, sys, time
from fixres_dist import startup
parent = os.getpid()
if os.fork() == 0:  # a loader worker whose rank ends before its worker_init_fn asks to die with it
    while os.getppid() == parent:
        time.sleep(0.01)
    open(sys.argv[1], "w").write(str(os.getpid()))
    try:
        startup.die_with_parent(signal.SIGKILL, parent)
    finally:  # whatever it raised: an orphan that lives on
        time.sleep(60)
"""


def test_a_worker_whose_parent_ended_before_it_asked_to_die_with_it_ends_at_once(tmp_path):
    """Linux sends the parent-death signal only for a parent that ends after the request: the request, given
    the parent it expects, ends the process itself where that parent is already gone (no orphan is left)."""
    subprocess.run([sys.executable, "-c", ORPHAN, str(tmp_path / "pid")], check=True, timeout=60)
    pid = int(wait_for(lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text(), 30, "the orphan"))

    def gone():
        try:
            return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] in ("Z", "X")
        except OSError:
            return True
    wait_for(gone, 10, f"the orphan (pid {pid}) to end")


@pytest.mark.slow
def test_killing_the_launcher_stops_its_ranks(tiny_data, tmp_path):
    """SIGKILL to the spawn launcher alone: its ranks get SIGTERM from the kernel, checkpoint and exit
    within seconds (they do not train on as orphans), and until they have, the job stays locked."""
    proc = start_group(*long_job("k", tmp_path, tiny_data, workers=1))
    wait_for_epoch(tmp_path / "k")
    proc.kill()
    killed = time.monotonic()
    wait_for_group_exit(proc.pid, timeout=30)  # the orphaned ranks (and their loader workers) stop
    assert time.monotonic() - killed < 60
    assert proc.returncode == -signal.SIGKILL
    assert proc.stderr.count("preempted by SIGTERM") == 2, proc.stderr[-3000:]
    state = load_checkpoint(tmp_path / "k" / CHECKPOINT_FILE)
    assert state["epoch"] < 40 and len(state["ranks"]) == 2


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 3)])
def test_a_signal_while_the_script_starts_is_one_line(tmp_path, signum, status):
    """While Python imports torch (seconds), before any rank exists: one line, nothing written."""
    proc = start_interpreter_group("--num-tasks", 2, "--shared-folder-path", tmp_path / "s", *LONG)
    wait_for(lambda: catches(proc.pid, signal.SIGTERM), timeout=60, what="the script's start-up guard")
    os.killpg(proc.pid, signum)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (status, f"fixres_dist: stopped by {signal.Signals(signum).name} while starting; "
                                              "nothing was written\n")
    assert not (tmp_path / "s").exists()


@pytest.mark.numeric
def test_a_signal_during_evaluation_stops_it_and_resumes_bit_identical(scratch_job, tiny_data, tmp_path):
    """The preemption signal at the end-of-epoch evaluation: checkpoint of the trained epoch, exit 3;
    the rerun evaluates it and goes on, ending with the same weights as a run never stopped
    (:func:`conftest.scratch_job`, the same command)."""
    command = ["--num-tasks", 2, "--job-id", "e", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
               *SCRATCH]
    first = run_script("scratch", *command, env={"FIXRES_FAULT": "eval-signal:rank=1:step=5"})
    assert first.returncode == 3 and "preempted by SIGUSR2" in first.stderr, first.stderr[-3000:]
    stopped = load_checkpoint(tmp_path / "e" / CHECKPOINT_FILE)
    assert (stopped["epoch"], stopped["images_in_epoch"], stopped["global_step"]) == (0, 80, 5)
    assert [e["event"] for e in stopped["metrics"]] == ["train", "step_times"]
    second = run_script("scratch", *command)
    assert second.returncode == 0, second.stderr[-3000:]
    assert [(e["event"], e["epoch"]) for e in events(tmp_path / "e") if e["event"] != "step_times"] == \
        [("train", 1), ("eval", 1), ("train", 2), ("eval", 2)]
    a = load_checkpoint(tmp_path / "e" / CHECKPOINT_FILE)["model"]
    b = load_checkpoint(scratch_job / CHECKPOINT_FILE)["model"]
    assert all((a[k] == b[k]).all() for k in a)


def test_sigterm_during_an_eval_only_sweep_exits_3_promptly(scratch_job, tmp_path):
    """SIGTERM to the whole group (launcher, ranks, their loader workers) once the sweep's first
    resolution is evaluated: it stops within seconds, before the seven are, with exit 3 and one
    line per rank (nothing trained, nothing to checkpoint)."""
    proc = start_group("--eval-only", "--num-tasks", 2, "--weight-path", scratch_job / CHECKPOINT_FILE,
                       "--job-id", "sweep", "--shared-folder-path", tmp_path, "--batch", 8, "--workers", 1,
                       "--test-sizes", "32,64,96,128,160,192,224", "--no-progress", script="finetune")
    wait_for(lambda: events(tmp_path / "sweep", "eval"), timeout=JOB_START_S, what="the first evaluation")
    os.killpg(proc.pid, signal.SIGTERM)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=EXIT_S)
    assert time.monotonic() - sent < 30
    assert_quiet_stop(proc.returncode, 3, err, ranks=2)
    assert "nothing trained yet" in err
    assert len(events(tmp_path / "sweep", "eval")) < 7


def test_a_rank_waiting_for_rank_0_over_env_stops_on_sigterm_and_keeps_its_deadline(tmp_path):
    """env:// (MASTER_ADDR/MASTER_PORT) with no rank 0 answering there: torch's store client blocks
    in C++ (where nothing listens, for about twice its timeout), deaf to signals. A SIGTERM stops the
    rank at once (exit 3, one line), here while its client waits on a port that took its connection
    and stays silent (a hung rank 0); with nothing listening and no signal, it gives up after
    --dist-timeout, in one line. The two ranks wait at the same time."""
    def rank_1(port: int, dist_timeout: int):
        env = {"RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 1, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        return start_script("scratch", "--shared-folder-path", tmp_path, "--no-progress", "--dist-timeout",
                            dist_timeout, env=env)

    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.settimeout(JOB_START_S)
        port = silent.getsockname()[1]
        waiting = rank_1(port, 60)
        alone_port, started = free_port(), time.monotonic()
        alone = rank_1(alone_port, 5)
        connection, _ = silent.accept()  # the rank's store client reached the port: it waits in C++
        with connection:
            sent = time.monotonic()
            waiting.send_signal(signal.SIGTERM)
            waiting.wait(timeout=30)
            assert waiting.returncode == 3 and time.monotonic() - sent < 5, waiting.stderr
    assert waiting.stderr.strip().splitlines() == ["fixres_dist: rank 1: stopped by a signal while waiting for rank "
                                                   f"0's store at 127.0.0.1:{port}; nothing to checkpoint yet"]
    alone.wait(timeout=60)
    assert alone.returncode == 1 and time.monotonic() - started < 5 + 15, alone.stderr  # 15 s: checks, a loaded CPU
    assert alone.stderr.strip().splitlines() == [f"fixres_dist: rank 1: cannot reach rank 0's store at 127.0.0.1:"
                                                 f"{alone_port} within 5 s: no store answered"]
