"""No process of a local job outlives it: the launcher adopts what its ranks leave behind, and ends it.

A rank's loader workers ask Linux to kill them when their rank dies
(:func:`fixres_dist.distributed.preemption.loader_worker_init`), but only once they run: a worker forked
just before its rank died, or stopped (SIGSTOP) or stuck before its request, would live on as an orphan,
holding a copy of the job lock and the user's allocation. While the ranks run, :func:`adopting_orphans`
makes the launcher a child subreaper (``PR_SET_CHILD_SUBREAPER``, Linux): whatever a dead rank leaves is
reparented to the launcher instead of init; when the ranks have ended, however they ended, every child of
the launcher that is neither one it had before (the forkserver, the resource tracker) nor one of its ranks
gets SIGKILL (which also ends a stopped process) and is reaped. Elsewhere, best effort: the launcher's own
children that are left are ended the same way.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from typing import Iterator

import psutil

from fixres_dist import startup

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
PR_GET_CHILD_SUBREAPER = 37
REAP_S = 5.0  # how long the orphans killed have to exit (a process in an uninterruptible read may take a while)


def is_subreaper() -> bool:
    """Whether this process is a child subreaper (False where Linux cannot say)."""
    flag = ctypes.c_int(0)
    return startup.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag)) and bool(flag.value)


def set_subreaper(on: bool) -> bool:
    """Make this process a child subreaper, or no longer one; whether Linux did."""
    return startup.prctl(PR_SET_CHILD_SUBREAPER, int(on))


def child_pids() -> set[int]:
    """The process ids of this process's children (zombies too)."""
    try:
        return {child.pid for child in psutil.Process().children()}
    except psutil.Error:
        return set()


@contextlib.contextmanager
def adopting_orphans(timeout: float = REAP_S) -> Iterator[set[int]]:
    """While the block runs, this process adopts the orphans of its descendants (a child subreaper); when it
    ends (any outcome), :func:`end_orphans`. Yields the set of the children to keep: those it had as the
    block started; add the ranks started in the block as they start (their exit status is the caller's to
    read). Afterwards this process is a subreaper again only if it was one before."""
    was = is_subreaper()
    set_subreaper(True)
    keep = child_pids()
    try:
        yield keep
    finally:
        try:
            end_orphans(keep, timeout)
        finally:
            if not was:
                set_subreaper(False)


def end_orphans(keep: set[int], timeout: float = REAP_S) -> list[int]:
    """SIGKILL every child of this process but those in ``keep``, and reap them (waiting at most ``timeout``
    seconds in all); again for the orphans each of them leaves in turn. Returns the process ids ended. Their
    exit statuses are nobody's: an orphan ended here is not a failure of the job."""
    ended, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        orphans = []
        for pid in sorted(child_pids() - keep - set(ended)):
            try:
                orphans.append(psutil.Process(pid))
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, psutil.Error):  # reaped since, by whoever waits for it
                pass
        if not orphans:
            break
        psutil.wait_procs(orphans, timeout=max(0.0, deadline - time.monotonic()))
        ended += [orphan.pid for orphan in orphans]
    return ended
