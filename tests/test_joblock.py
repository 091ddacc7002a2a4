"""The job lock's record of a run whose ranks have met (fixres_dist/distributed/joblock.py), with real flocks."""
import fcntl
import json
import os
import threading
import time

import pytest

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
