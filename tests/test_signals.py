"""Stop signals sent to every process of a job (SLURM, timeout, kill -- -PGID, Ctrl-C): one checkpoint,
the documented exit status, one line per rank and no traceback, and no process left behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, clean_env, free_port, run_script
from fixres_dist.checkpoint import CHECKPOINT_FILE, load_checkpoint

LONG = ["--input-size", "32", "--batch", "8", "--epochs", "40", "--no-progress"]


def start_group(*args, env=None) -> subprocess.Popen:
    """``main_scratch.py args`` as the leader of its own process group (as a shell job or a SLURM step)."""
    return subprocess.Popen([sys.executable, str(ROOT / "main_scratch.py"), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or clean_env(), start_new_session=True)


def wait_for(predicate, timeout=180.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def events(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (signum - 1) & 1)


def group_is_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def assert_quiet_stop(proc, err: str, status: int, ranks: int):
    """Exit ``status``, exactly one ``fixres_dist:`` line per rank and nothing else on stderr."""
    assert proc.returncode == status, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == ranks and all(line.startswith("fixres_dist: rank ") for line in lines), err[-3000:]


@pytest.mark.parametrize("signum, workers, status", [
    (signal.SIGTERM, 2, 3),  # SLURM at a time limit, timeout(1), kill -- -PGID, docker stop
    (signal.SIGUSR2, 2, 3),  # SLURM's warning signal (--signal USR2@...)
    (signal.SIGINT, 2, 130),  # Ctrl-C in the terminal
    (signal.SIGTERM, 0, 3),
])
def test_a_signal_to_the_whole_group_checkpoints_once_and_exits_quietly(tiny_data, tmp_path, signum, workers, status):
    proc = start_group("--num-tasks", 2, "--job-id", "g", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
                       "--workers", workers, *LONG)
    folder = tmp_path / "g"
    wait_for(lambda: any(e["event"] == "train" for e in events(folder)), what="the first epoch")
    os.killpg(proc.pid, signum)
    out, err = proc.communicate(timeout=120)
    assert_quiet_stop(proc, err, status, ranks=2)
    verb = "interrupted" if signum == signal.SIGINT else "preempted"
    assert f"{verb} by {signal.Signals(signum).name}" in err
    # the forkserver and resource tracker exit as the launcher's pipes close: gone within seconds
    wait_for(lambda: group_is_gone(proc.pid), timeout=20, what="every process of the job to exit")
    state = load_checkpoint(folder / CHECKPOINT_FILE)
    assert state["epoch"] * 80 + state["images_in_epoch"] >= 80 and len(state["ranks"]) == 2  # epoch 1 trained
    assert not list(folder.glob(".*.tmp"))



def test_a_job_started_with_sigint_ignored_keeps_ignoring_it(tiny_data, tmp_path):
    """A shell script's background job (``cmd &``) starts with SIGINT ignored, so that a Ctrl-C
    meant for the script leaves it running: neither the launcher nor its ranks may stop on it."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "main_scratch.py"), *map(str, ["--num-tasks", 2, "--job-id", "bg", "--shared-folder-path", tmp_path, "--data-path",
                             tiny_data, "--workers", 0, "--input-size", 32, "--batch", 8, "--epochs", 2, "--no-progress"])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    folder = tmp_path / "bg"
    wait_for(lambda: any(e["event"] == "train" for e in events(folder)), what="the first epoch")
    os.killpg(proc.pid, signal.SIGINT)  # the script's Ctrl-C, which the whole process group gets
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    assert [e["epoch"] for e in events(folder) if e["event"] == "train"] == [1, 2]

def test_timeout_stops_the_job_with_a_checkpoint(tiny_data, tmp_path):
    """GNU timeout signals its child's whole process group."""
    proc = subprocess.run(["timeout", "25", sys.executable, str(ROOT / "main_scratch.py"), "--num-tasks", "2",
                           "--job-id", "t", "--shared-folder-path", str(tmp_path), "--data-path", str(tiny_data),
                           "--workers", "2", *LONG], capture_output=True, text=True, timeout=180, env=clean_env())
    assert proc.returncode == 124  # timeout's own status once it fired
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("fixres_dist: ") for line in lines), proc.stderr[-3000:]  # ranks, or start-up
    if (tmp_path / "t" / CHECKPOINT_FILE).exists():  # it fired after training had started (not on a slow machine)
        assert "preempted by SIGTERM" in proc.stderr


def test_killing_the_launcher_stops_its_ranks(tiny_data, tmp_path):
    """SIGKILL to the spawn launcher alone: its ranks get SIGTERM from the kernel, checkpoint and exit
    within seconds (they do not train on as orphans), and until they have, the job stays locked."""
    proc = start_group("--num-tasks", 2, "--job-id", "k", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
                       "--workers", 1, *LONG)
    wait_for(lambda: any(e["event"] == "train" for e in events(tmp_path / "k")), what="the first epoch")
    proc.kill()
    killed = time.monotonic()
    _, err = proc.communicate(timeout=60)  # the ranks hold its pipes: this returns once they exited
    wait_for(lambda: group_is_gone(proc.pid), timeout=30, what="the orphaned ranks to stop")
    assert time.monotonic() - killed < 60
    assert err.count("preempted by SIGTERM") == 2, err[-3000:]
    state = load_checkpoint(tmp_path / "k" / CHECKPOINT_FILE)
    assert state["epoch"] < 40 and len(state["ranks"]) == 2


def test_repeated_signals_to_the_group_still_end_in_one_line_per_rank(tiny_data, tmp_path):
    """Ctrl-C held down: SIGINT every 0.1 s until the job has exited."""
    proc = start_group("--num-tasks", 2, "--job-id", "r", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
                       "--workers", 2, *LONG)
    wait_for(lambda: any(e["event"] == "train" for e in events(tmp_path / "r")), what="the first epoch")
    while proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    out, err = proc.communicate(timeout=60)
    assert_quiet_stop(proc, err, 130, ranks=2)


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 3)])
def test_a_signal_while_the_script_starts_is_one_line(tmp_path, signum, status):
    """While Python imports torch (seconds), before any rank exists: one line, nothing written."""
    proc = start_group("--num-tasks", 2, "--shared-folder-path", tmp_path / "s", *LONG)
    wait_for(lambda: catches(proc.pid, signal.SIGTERM), timeout=60, what="the script's start-up guard")
    os.killpg(proc.pid, signum)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (status, f"fixres_dist: stopped by {signal.Signals(signum).name} while starting; "
                                              "nothing was written\n")
    assert not (tmp_path / "s").exists()


def test_a_signal_during_evaluation_stops_it_and_resumes_bit_identical(tiny_data, tmp_path):
    """The preemption signal at the end-of-epoch evaluation: checkpoint of the trained epoch, exit 3;
    the rerun evaluates it and goes on, ending with the same weights as a run never stopped."""
    common = ["--num-tasks", 2, "--shared-folder-path", tmp_path, "--data-path", tiny_data, "--input-size", 32,
              "--batch", 8, "--epochs", 2, "--workers", 1, "--no-progress"]
    straight = run_script("scratch", "--job-id", "straight", *common)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = run_script("scratch", "--job-id", "e", *common, env=clean_env(FIXRES_FAULT="eval-signal:rank=1:step=5"))
    assert first.returncode == 3 and "preempted by SIGUSR2" in first.stderr, first.stderr[-3000:]
    stopped = load_checkpoint(tmp_path / "e" / CHECKPOINT_FILE)
    assert (stopped["epoch"], stopped["images_in_epoch"], stopped["global_step"]) == (0, 80, 5)
    assert [e["event"] for e in stopped["metrics"]] == ["train"]
    second = run_script("scratch", "--job-id", "e", *common)
    assert second.returncode == 0, second.stderr[-3000:]
    assert [(e["event"], e["epoch"]) for e in events(tmp_path / "e")] == \
        [("train", 1), ("eval", 1), ("train", 2), ("eval", 2)]
    a = load_checkpoint(tmp_path / "e" / CHECKPOINT_FILE)["model"]
    b = load_checkpoint(tmp_path / "straight" / CHECKPOINT_FILE)["model"]
    assert all((a[k] == b[k]).all() for k in a)


def test_sigterm_during_an_eval_only_sweep_exits_3_promptly(tiny_data, tmp_path):
    trained = run_script("scratch", "--job-id", "w", "--shared-folder-path", tmp_path, "--data-path", tiny_data,
                         "--input-size", 32, "--batch", 8, "--epochs", 1, "--workers", 0, "--no-progress")
    assert trained.returncode == 0, trained.stderr[-3000:]
    proc = subprocess.Popen([sys.executable, str(ROOT / "main_finetune.py"), "--eval-only", "--num-tasks", "2",
                             "--weight-path", str(tmp_path / "w" / CHECKPOINT_FILE), "--job-id", "sweep",
                             "--shared-folder-path", str(tmp_path), "--test-sizes", "32,64,96,128,160,192,224",
                             "--batch", "8", "--workers", "1", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                            start_new_session=True)
    wait_for(lambda: any(e["event"] == "eval" for e in events(tmp_path / "sweep")), what="the first evaluation")
    os.killpg(proc.pid, signal.SIGTERM)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - sent < 30
    assert_quiet_stop(proc, err, 3, ranks=2)
    assert "nothing trained yet" in err
    assert len([e for e in events(tmp_path / "sweep") if e["event"] == "eval"]) < 7


def test_a_rank_waiting_for_rank_0_over_env_stops_on_sigterm_and_keeps_its_deadline(tmp_path):
    """env:// (MASTER_ADDR/MASTER_PORT) with no rank 0 there: torch's store client blocks in C++ for
    about twice its timeout, deaf to signals. A SIGTERM stops the rank at once (exit 3, one line),
    and without one it gives up after --dist-timeout, in one line."""
    env = clean_env(RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    args = [sys.executable, str(ROOT / "main_scratch.py"), "--shared-folder-path", str(tmp_path), "--no-progress"]
    waiting = subprocess.Popen([*args, "--dist-timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    time.sleep(12)  # imported torch, checked its inputs, now waiting to connect (seconds on 2 cores)
    sent = time.monotonic()
    waiting.send_signal(signal.SIGTERM)
    out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 3 and time.monotonic() - sent < 5, err
    assert err.strip().splitlines() == ["fixres_dist: rank 1: stopped by a signal while waiting for rank 0's store at "
                                        f"127.0.0.1:{env['MASTER_PORT']}; nothing to checkpoint yet"]
    started = time.monotonic()
    alone = subprocess.run([*args, "--dist-timeout", "5"], capture_output=True, text=True, env=env, timeout=60)
    assert alone.returncode == 1 and time.monotonic() - started < 5 + 15, alone.stderr  # 15 s: imports, checks
    assert alone.stderr.strip().splitlines() == [f"fixres_dist: rank 1: cannot reach rank 0's store at 127.0.0.1:"
                                                 f"{env['MASTER_PORT']} within 5 s: no store answered"]
