"""The job lock's record of a run whose ranks have met (fixres_dist/distributed/joblock.py), with real flocks;
a filesystem that cannot lock (a real one: tests/hung_fs.py) said to be so, not taken for a run in use."""
import fcntl
import json
import os
import threading
import time

import pytest

import hung_fs
from conftest import run_script
from fixres_dist import locks
from fixres_dist.distributed import joblock
from fixres_dist.errors import FixresError


def test_a_joining_rank_is_refused_by_a_live_job_whose_ranks_have_met(tmp_path):
    lock = joblock.JobLock.acquire(tmp_path, 2)
    joblock.record_met(tmp_path)
    started = time.monotonic()
    with pytest.raises(FixresError, match=r"in use by a running job whose 2 ranks have all met \(pid \d+ on .*"
                                          r"this rank 1 has no place in it"):
        joblock.check_joinable(tmp_path, 1)
    # it watched the record for its confirmation window, then refused (not waiting for the job to end)
    assert joblock.CONFIRM_SECONDS <= time.monotonic() - started < joblock.CONFIRM_SECONDS + 30
    lock.release()
    joblock.check_joinable(tmp_path, 1)  # the record stays, but nobody holds the lock: a rerun may join


def test_a_finished_runs_record_is_not_believed_while_a_new_launch_takes_the_lock(tmp_path):
    """The race a requeued SLURM job met: the previous run's "met" record is still in the file when
    the new rank 0 has the lock but has not rewritten the record yet. Its rank 1 must not be refused."""
    finished = joblock.JobLock.acquire(tmp_path, 2)  # the finished run: its ranks met, then it ended
    joblock.record_met(tmp_path)
    finished.release()
    previous = joblock.read_holder(tmp_path)
    assert not joblock.is_held(tmp_path)
    new = os.open(tmp_path / joblock.LOCK_FILE, os.O_RDWR)
    fcntl.flock(new, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the new rank 0: locked, record not yet rewritten

    def rewrite():  # the new rank 0 writes its own record, in place, through the descriptor it locked
        time.sleep(0.2)
        os.ftruncate(new, 0)
        record = {**previous, "pid": previous["pid"] + 1, "started": time.time(), "met": False}
        os.pwrite(new, json.dumps(record).encode(), 0)

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        joblock.check_joinable(tmp_path, 1)
    finally:
        writer.join()
        os.close(new)
    assert joblock.read_holder(tmp_path)["pid"] == previous["pid"] + 1  # the new holder's record


@pytest.fixture
def cannot_lock(tmp_path, monkeypatch):
    """A real filesystem whose flock fails with ENOLCK, as NFS's does without its lock daemon
    (tests/hung_fs.py, FUSE), with FIXRES_NO_LOCKS unset."""
    monkeypatch.delenv(locks.ENV, raising=False)
    with hung_fs.mounted(tmp_path / "nfs") as folder:
        yield folder


def test_a_filesystem_that_cannot_lock_is_said_so_at_once_not_taken_for_a_run_in_use(cannot_lock, tmp_path):
    job = cannot_lock / "job"
    job.mkdir()
    started = time.monotonic()
    with pytest.raises(locks.NoLocks) as refused:
        joblock.JobLock.acquire(job, 2)
    assert time.monotonic() - started < joblock.ACQUIRE_SECONDS  # no wait for a holder that cannot exist
    assert str(refused.value) == (
        f"{job} is on a filesystem that cannot lock files (flock: No locks available; NFS without its lock daemon?), "
        "and without the lock a second launch of this job would not be refused (two runs would overwrite each "
        "other's checkpoints): use a folder on a filesystem with locks (a node-local disk for a one-node job), ask "
        "for NFS locking (lockd), or set FIXRES_NO_LOCKS=1 to go on without locks at your own risk "
        "(docs/checkpoints.md)")
    assert os.listdir(job) == []  # the lock file it made is gone
    # a "met" record left there is no live job: nobody can hold the lock, so a joining rank may join
    (job / joblock.LOCK_FILE).write_text(json.dumps({"host": "h", "pid": 1, "started": 0, "num_tasks": 2, "met": True}))
    assert not joblock.is_held(job)
    started = time.monotonic()
    joblock.check_joinable(job, 1)
    assert time.monotonic() - started < joblock.CONFIRM_SECONDS
    # where locks work, a live holder is still a run in use
    held = joblock.JobLock.acquire(tmp_path, 2)
    with pytest.raises(FixresError, match=rf"^job folder {tmp_path} in use by another run \(pid {os.getpid()} on "):
        joblock.JobLock.acquire(tmp_path, 2)
    held.release()


def test_a_run_on_it_is_refused_in_one_line_leaving_nothing_or_goes_on_unlocked_when_asked(cannot_lock, tiny_data):
    shared = cannot_lock / "shared"
    command = ["--num-tasks", 2, "--job-id", "nfs", "--shared-folder-path", shared, "--data-path", tiny_data,
               "--architecture", "resnet20", "--input-size", 16, "--batch", 8, "--epochs", 1, "--workers", 0,
               "--no-progress"]
    refused = run_script("scratch", *command)
    assert refused.returncode == 1 and refused.stderr == (
        f"fixres_dist: rank 0: {shared / 'nfs'} is on a filesystem that cannot lock files (flock: No locks available; "
        f"NFS without its lock daemon?), and without the lock {joblock.UNGUARDED}: use a folder on a filesystem with "
        "locks (a node-local disk for a one-node job), ask for NFS locking (lockd), or set FIXRES_NO_LOCKS=1 to go "
        "on without locks at your own risk (docs/checkpoints.md)\n"), refused.stderr
    assert os.listdir(cannot_lock) == []  # refused before anything was written
    unlocked = run_script("scratch", *command, env={locks.ENV: "1"})
    assert unlocked.returncode == 0, unlocked.stderr[-3000:]
    assert unlocked.stderr == (f"fixres_dist: warning: {shared / 'nfs'} is on a filesystem that cannot lock files "
                               "(flock: No locks available; NFS without its lock daemon?): going on without locks "
                               f"(FIXRES_NO_LOCKS=1), so {joblock.UNGUARDED}\n")
    assert (shared / "nfs" / "checkpoint.pth").is_file()
