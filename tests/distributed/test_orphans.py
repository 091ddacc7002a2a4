"""What a rank leaves when it dies is ended with the job (:mod:`fixres_dist.distributed.orphans`), on real
processes: a child (a rank) forks a grandchild that stops itself before anything else (a loader worker
stopped before it asked to die with its rank) and one that exits at once, then exits itself."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from conftest import wait_for
from fixres_dist.distributed import orphans

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child subreapers are Linux's")

RANK = """
import os, signal, sys
stopped = os.fork()
if stopped == 0:  # a loader worker stopped before its worker_init_fn
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)
exited = os.fork()
if exited == 0:
    os._exit(0)
os.waitid(os.P_PID, exited, os.WEXITED | os.WNOWAIT)  # a zombie, not reaped by its parent
os.waitid(os.P_PID, stopped, os.WSTOPPED | os.WNOWAIT)
print(stopped, exited, flush=True)
sys.exit(7)
"""
SLEEPER = "import os, time\nos.fork()\ntime.sleep(600)"  # it and its child sleep


def left_alone(pids) -> list[int]:
    """Those of ``pids`` still there (a zombie too); each then gets SIGKILL, so that a failing test leaves none."""
    left = [pid for pid in pids if psutil.pid_exists(pid)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def test_what_a_dead_child_leaves_is_killed_and_reaped_and_the_kept_childrens_status_is_left_to_read():
    was, left = orphans.is_subreaper(), []
    try:
        with orphans.adopting_orphans() as keep:
            rank = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True)
            keep.add(rank.pid)
            with rank.stdout:
                left = [int(pid) for pid in rank.stdout.readline().split()]
            os.waitid(os.P_PID, rank.pid, os.WEXITED | os.WNOWAIT)  # the rank ended; its status is left to read
            stopped = psutil.Process(left[0])
            assert stopped.status() == psutil.STATUS_STOPPED and stopped.ppid() == os.getpid()  # adopted
    finally:
        assert not left_alone(left)  # killed and reaped: no zombie either
    assert rank.wait(timeout=30) == 7  # a kept child: still the caller's to reap
    assert orphans.is_subreaper() == was


def test_a_child_not_kept_is_killed_and_so_are_the_orphans_it_leaves():
    """A child started in the block that nobody waits for, alive at its end: killed, and then the child of its
    own that it leaves (adopted in turn), both reaped."""
    left = []
    try:
        with orphans.adopting_orphans():
            started = subprocess.Popen([sys.executable, "-c", SLEEPER])
            left = [started.pid, wait_for(lambda: psutil.Process(started.pid).children(), 60, "its child")[0].pid]
    finally:
        assert not left_alone(left)
    started.wait(timeout=30)  # reaped already: nothing left to wait for
