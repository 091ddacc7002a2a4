"""The stall watchdog (``--stall-timeout``, :mod:`fixres_dist.distributed.watchdog`): a rank that makes no
progress ends the job within the timeout, named with its host and phase, with every rank's and loader
worker's stacks in the job folder and exit status 5; a frozen rank (SIGSTOP) is named as not answering;
a rank stuck in a read dies with its killed launcher; the last checkpoint is kept and the rerun resumes.

The stalls are real: loader workers and ranks stopped with SIGSTOP, an image that is a named pipe (a read
that blocks as on a hung network filesystem). The phases, limits and the diagnosis are tested in-process.
"""
from __future__ import annotations

import os
import shutil
import signal
import stat
import threading
import time
from pathlib import Path

import attrs
import psutil
import torch
from test_signals import EXIT_S, GROUPS, events, ignores, no_job_left_running, start_group, wait_for_group_exit  # noqa: F401 (fixtures)

import hung_fs
from conftest import run_script, wait_for
from fixres_dist.distributed import stacks, watchdog
from fixres_dist.distributed.watchdog import STALL_EXIT_STATUS, Phase, Report, diagnose, limit, phase_of_thread
from fixres_dist.training.checkpoint import CHECKPOINT_FILE

TIMEOUT_S = 15  # --stall-timeout of the jobs: well above a step of theirs on a loaded 2-core machine
# 6 epochs of 5 steps of resnet20 at 32 px; a checkpoint every 5 steps (each epoch's end, before its evaluation).
JOB = ["--architecture", "resnet20", "--input-size", "32", "--batch", "8", "--epochs", "6", "--ckpt-every", "5",
       "--no-progress", "--stall-timeout", TIMEOUT_S]
# From the stall to the job's end: the timeout, the reports' wait, the launcher's grace, and slack for a loaded machine.
ENDS_WITHIN_S = TIMEOUT_S + watchdog.REPORTS_S + 15 + 30


def job_args(job_id: str, tmp_path: Path, data: Path, workers: int, *extra) -> list:
    return ["--num-tasks", 2, "--job-id", job_id, "--shared-folder-path", tmp_path, "--data-path", data,
            "--workers", workers, *JOB, *extra]


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def loader_workers_by_rank(pid: int) -> dict[int, list[int]]:
    """The job ``pid``'s loader workers (``pt_data_worker``) that are set up, by the process id of the rank that
    owns them. Set up: their ``worker_init_fn`` ran (they ignore SIGTERM, and die with their rank:
    fixres_dist.distributed.preemption.loader_worker_init). A worker stopped before it ran (just forked, as the
    evaluation's workers are after a checkpoint) would never ask to die with its rank: no worker stuck in a
    read is so, since the worker_init_fn runs before any read."""
    workers: dict[int, list[int]] = {}
    for process in descendants(pid):
        try:
            if process.name() == "pt_data_worker" and ignores(process.pid, signal.SIGTERM):
                workers.setdefault(process.ppid(), []).append(process.pid)
        except (psutil.Error, OSError):
            pass
    return workers


def wait_for_checkpoint(folder: Path) -> None:
    wait_for(lambda: (folder / CHECKPOINT_FILE).exists(), 180, f"the first checkpoint in {folder}")


def stall_line(err: str) -> str:
    lines = [line for line in err.splitlines() if ": stalled: " in line]
    assert lines, err[-3000:]
    return lines[0]


def assert_stacks(folder: Path, ranks: int) -> dict[int, str]:
    """Every rank's stacks file in ``folder/stalls``, owner-only; their texts by rank."""
    files = {rank: folder / "stalls" / f"rank{rank}.txt" for rank in range(ranks)}
    for path in files.values():
        assert path.exists(), sorted(p.name for p in (folder / "stalls").iterdir())
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    return {rank: path.read_text() for rank, path in files.items()}


def test_a_loader_worker_that_stops_answering_is_named_with_every_stack_and_the_rerun_resumes(tiny_data, tmp_path):
    """One rank's loader workers stopped (SIGSTOP: a worker that never answers) after the first checkpoint: the
    job ends with status 5 within the timeout, its line names that rank (host, pid) waiting for a batch from its
    loader workers; both ranks' stacks are written, the stalled rank's with its stopped workers' stacks; no
    process is left (the stopped workers die with their rank); the same command then resumes and completes."""
    args = job_args("w", tmp_path, tiny_data, 1)
    job = start_group(*args)
    wait_for_checkpoint(tmp_path / "w")
    workers = wait_for(lambda: loader_workers_by_rank(job.pid), 60, "the loader workers")
    rank_pid, stopped = next(iter(workers.items()))
    everything = descendants(job.pid)
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    since = time.monotonic()
    assert job.wait(ENDS_WITHIN_S) == STALL_EXIT_STATUS, job.stderr[-3000:]
    assert time.monotonic() - since < ENDS_WITHIN_S
    line = stall_line(job.stderr)
    assert f"(pid {rank_pid}) made no progress for" in line and "waiting for a batch from its loader workers" in line
    assert f"stacks in {tmp_path / 'w' / 'stalls'}/" in line and "run the same command to resume" in line
    texts = assert_stacks(tmp_path / "w", 2)
    stalled = next(text for text in texts.values() if f"pid {rank_pid} " in text)
    assert all(f"=== pid {pid} (pt_data_worker, state stopped" in stalled for pid in stopped)
    if stacks.py_spy():
        assert "_worker_loop" in stalled, stalled[-3000:]
    gone, alive = psutil.wait_procs(everything, timeout=30)
    assert not alive, alive
    resumed = run_script("scratch", *args)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert [e["epoch"] for e in events(tmp_path / "w", "train")][-1] == 6


def test_a_frozen_rank_is_named_as_not_answering_and_the_job_ends(tiny_data, tmp_path):
    """A rank frozen by SIGSTOP (a node that stops answering but keeps its sockets): the other rank names it,
    with its pid and state, writes its stacks (read from this host with py-spy) and the job ends with status 5."""
    job = start_group(*job_args("f", tmp_path, tiny_data, 1))
    wait_for_checkpoint(tmp_path / "f")
    frozen = next(iter(wait_for(lambda: loader_workers_by_rank(job.pid), 60, "the loader workers")))
    os.kill(frozen, signal.SIGSTOP)
    assert job.wait(ENDS_WITHIN_S) == STALL_EXIT_STATUS, job.stderr[-3000:]
    line = stall_line(job.stderr)
    assert f"(pid {frozen}, stopped): no report and no heartbeat" in line, line
    texts = assert_stacks(tmp_path / "f", 2)
    assert any(f"=== pid {frozen} (python, state stopped" in text for text in texts.values())
    wait_for_group_exit(job.pid)


def test_a_rank_stuck_in_a_read_ends_with_its_killed_launcher_and_the_next_launch_resumes(tiny_data, tmp_path):
    """A rank blocked reading a validation image on a filesystem whose server stopped answering (a real FUSE
    filesystem, tests/hung_fs.py, as a hard NFS mount), the launcher then killed with SIGKILL (the OOM killer, a
    scheduler's last kill): the ranks get SIGTERM, cannot reach a step, and end within the timeout with the line
    and their stacks. The read itself cannot be interrupted (the kernel waits for the server, as for NFS): the
    stuck rank's process is left with only that thread, asleep in the kernel, and goes as soon as the
    filesystem answers (here: is aborted). Meanwhile a second launch is told that the lock is held by what is
    left of a run whose launcher is gone, with the pids; then the same command, on a copy of the data that
    answers, resumes from the last checkpoint and completes."""
    data = shutil.copytree(tiny_data, tmp_path / "data")
    first = sorted((data / "val").rglob("*.png"))[0]
    first.rename(first.with_name("hung.png"))  # the one file of that name
    with hung_fs.mounted(tmp_path / "nfs", hung=("hung.png",)) as mount:
        shutil.copytree(data, mount / "data")
        args = job_args("r", tmp_path, mount / "data", 0)
        job = start_group(*args)
        wait_for(lambda: len(events(tmp_path / "r", "train")) >= 1, 180, "the first epoch")
        everything = descendants(job.pid)
        time.sleep(2)  # into the evaluation, blocked in the read
        os.kill(job.pid, signal.SIGKILL)
        refused = run_script("scratch", *args)
        assert refused.returncode == 1, refused.stderr[-3000:]
        assert f"whose launcher (pid {job.pid} on " in refused.stderr and "is gone: pid " in refused.stderr, \
            refused.stderr[-3000:]
        wait_for(lambda: all(p.status() == psutil.STATUS_DISK_SLEEP and p.num_threads() == 1
                             for p in alive(everything)), ENDS_WITHIN_S,
                 "every process to end but the thread waiting for the filesystem")
        assert len(alive(everything)) <= 1
    gone, left = psutil.wait_procs(everything, timeout=30)  # the filesystem aborted, the read returns
    assert not left, left
    line = stall_line(job.stderr)
    assert "after its launcher's end, reading images (in the rank's own process) (evaluating)" in line
    assert_stacks(tmp_path / "r", 2)
    resumed = run_script("scratch", *job_args("r", tmp_path, data, 0))
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    found = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found


def test_a_peer_stuck_past_the_collective_timeout_is_named_by_the_rank_whose_collective_failed(tiny_data, tmp_path):
    """--dist-timeout shorter than --stall-timeout: the waiting rank's collective fails first; it finds the peer
    that does not wait in a collective (its loader workers stopped) and names it rather than the network."""
    job = start_group(*job_args("c", tmp_path, tiny_data, 1, "--dist-timeout", 20, "--stall-timeout", 300))
    wait_for_checkpoint(tmp_path / "c")
    rank_pid, stopped = next(iter(wait_for(lambda: loader_workers_by_rank(job.pid), 60, "the loader workers").items()))
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    assert job.wait(ENDS_WITHIN_S) != 0
    line = stall_line(job.stderr)
    assert f"(pid {rank_pid}) made no progress" in line and "waiting for a batch from its loader workers" in line
    assert "although every peer is alive" not in job.stderr
    wait_for_group_exit(job.pid)


# In-process: the watchdog's parts.
LOADER = Phase("waiting for a batch from its loader workers")

def test_the_phase_is_read_off_the_watched_threads_stack():
    """A thread waiting for a DataLoader's batch is named so, as not waiting for its peers; an ended one as not
    running."""
    release = threading.Event()

    class Blocking(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, index):
            release.wait(30)
            return torch.zeros(1)

    thread = threading.Thread(target=lambda: list(torch.utils.data.DataLoader(Blocking())))
    thread.start()
    try:
        phase = wait_for(lambda: phase_of_thread(thread.ident) == LOADER, 10, "the thread to wait for its batch")
    finally:
        release.set()
        thread.join()
    assert phase and phase_of_thread(thread.ident) == Phase("not running")


def test_the_limit_is_derived_from_the_steps_seen_and_patient_where_slowness_is_normal():
    work, patient = Phase("x"), Phase("checkpoint", patient=True)
    assert limit(None, work, 0, 0.0, False) == watchdog.AUTO_STARTUP_S  # start-up
    assert limit(5.0, work, 0, 0.0, False) == watchdog.AUTO_STARTUP_S  # the first step may be slow whatever is set
    assert limit(None, work, 10, 0.5, False) == watchdog.AUTO_FLOOR_S
    assert limit(None, work, 10, 60.0, False) == 600.0  # 10 x the longest gap
    assert limit(None, patient, 10, 0.5, False) == watchdog.AUTO_STARTUP_S
    assert limit(5.0, patient, 10, 0.5, False) == 5.0  # as set, for every phase
    assert limit(None, work, 10, 0.5, True) == watchdog.STOP_GRACE_S  # a stop signal: reach the next step or end
    assert limit(5.0, work, 10, 0.5, True) == 5.0


def test_the_diagnosis_names_the_silent_then_the_stuck_then_says_every_rank_waits():
    waits = Report(0, "a", 10, "in a collective, waiting for its peers", True, 20.0, 7)
    stuck = Report(1, "b", 11, "reading images", False, 21.0, 7)
    assert diagnose({0: waits}, {1: "rank 1 on b"}) == ("rank 1 on b: no report and no heartbeat (stopped, frozen, "
                                                        "or cut off from the network)")
    assert diagnose({0: waits, 1: stuck}, {}) == "rank 1 on b (pid 11) made no progress for 21 s, reading images"
    assert diagnose({0: waits, 1: stuck}, {}, "SIGTERM").startswith("rank 1 on b (pid 11) made no progress for 21 s "
                                                                    "after SIGTERM")
    assert "none is stuck elsewhere" in diagnose({0: waits, 1: attrs.evolve(waits, rank=1)}, {})


def test_a_stacks_file_holds_this_process_threads_and_a_stopped_child_and_is_private(tmp_path):
    child = psutil.Popen(["sleep", "30"])
    try:
        child.send_signal(signal.SIGSTOP)
        wait_for(lambda: child.status() == psutil.STATUS_STOPPED, 10, "the child to stop")
        path = stacks.write_stacks(tmp_path / "s" / "rank0.txt", "header", others=[child.pid])
        text = path.read_text()
        assert text.startswith("header\n") and "Thread MainThread" in text and "test_stalls.py" in text
        assert f"=== pid {child.pid} (sleep, state stopped" in text
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        child.kill()
        child.wait()


def test_a_rank_handling_its_peers_failure_is_waiting_not_stalled():
    """A rank finding out which peer failed (the rendezvous' lost-peer search, on a real store, here of a peer
    that is silent) counts as waiting for its peers and as already ending: it is neither named as the stalled
    rank nor ended by another's stall."""
    import datetime
    import socket

    import torch.distributed as dist

    from fixres_dist.distributed import network, rendezvous

    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10))
    here = rendezvous.Host(socket.gethostname(), os.getpid(), ())
    peer = rendezvous.Host("elsewhere", 1, ())
    meeting = rendezvous.Rendezvous(store, 0, 2, f"127.0.0.1:{store.port}", {0: here, 1: peer},
                                    network.Link("lo", "127.0.0.1", "all ranks on this host"))
    found = []
    thread = threading.Thread(target=lambda: found.append(meeting.lost_peers(wait=4.0)))
    thread.start()
    try:
        phase = wait_for(lambda: phase_of_thread(thread.ident).failing and phase_of_thread(thread.ident), 10,
                         "the thread to look for lost peers")
        assert phase.waits and phase == watchdog.FAILING
    finally:
        thread.join()
    assert found and "rank 1 on elsewhere" in found[0]
