"""One live run per job folder: the job lock, who holds it, and whether its ranks have met.

A job folder belongs to one running launch at a time. Before any rendezvous, the process that
starts the job's rank 0 (the spawn launcher, or rank 0 itself under torchrun, SLURM or separate
shells) takes an exclusive ``flock`` on ``<job folder>/.lock`` (:meth:`JobLock.acquire`); a second
launch of the same job is refused at once with "job folder ... in use", before it touches the
rendezvous file or anything else, and the running job is not disturbed. The lock dies with its
process (``kill -9``, a lost node), so a crashed run never blocks the rerun that resumes it.

A filesystem that cannot lock (NFS without its lock daemon: ``flock`` fails with ENOLCK) is no lock held
by another run: it is refused in one line that says so (:mod:`fixres_dist.locks`), or, with
``FIXRES_NO_LOCKS=1``, the job runs without its lock after one warning line.

The lock file also says who holds it and, once every rank has arrived, that the ranks have met
(:func:`record_met`). A non-zero rank of a second launch checks that first
(:func:`check_joinable`): a job whose ranks have all met has no place for it.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import psutil

from fixres_dist import locks
from fixres_dist.errors import FixresError

LOCK_FILE = ".lock"
ACQUIRE_SECONDS = 2.0  # a joining rank's probe holds a shared lock for microseconds: retry that long
CONFIRM_SECONDS = 1.0  # how long a joining rank watches a "met" record before it believes it
UNGUARDED = "a second launch of this job would not be refused (two runs would overwrite each other's checkpoints)"


def _describe(info: dict | None) -> str:
    if not info:
        return "holder unknown"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"pid {info.get('pid')} on {info.get('host')}, since {started}"


def _holders(path: Path) -> list[psutil.Process]:
    """The processes of this host that have ``path`` open (those this user may look at)."""
    found = []
    for process in psutil.process_iter():
        try:
            if any(os.path.samefile(f.path, path) for f in process.open_files() if f.path.endswith(LOCK_FILE)):
                found.append(process)
        except (psutil.Error, OSError):
            pass
    return found


def in_use(folder: Path) -> FixresError:
    """The refusal of a launch whose job lock is held: by another run, or by processes left by a run whose
    launcher is gone (its ranks still ending: they end within their stall watchdog's limit), named."""
    info = read_holder(folder)
    launcher = info.get("pid") if info and info.get("host") == socket.gethostname() else None
    if not isinstance(launcher, int) or psutil.pid_exists(launcher):
        return FixresError(f"job folder {folder} in use by another run ({_describe(info)}); wait for it to end, "
                           "stop it, or use another --job-id")
    left = [p.pid for p in _holders(folder / LOCK_FILE) if p.pid != os.getpid()]
    named = ", ".join(f"pid {pid}" for pid in left) or "processes this user cannot see"
    kill = f", or end them now (kill -9 {' '.join(map(str, left))})" if left else ""
    return FixresError(f"job folder {folder} is still locked by what is left of a run whose launcher "
                       f"({_describe(info)}) is gone: {named}; its ranks end by themselves within --stall-timeout "
                       f"(30 s by default) of their launcher's end{kill}; then run the same command again to resume")


def read_holder(folder: Path) -> dict | None:
    """What the lock file says about its holder (``host``, ``pid``, ``started``, ``met``), or None."""
    try:
        info = json.loads((Path(folder) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _write_holder(folder: Path, info: dict) -> None:
    """Rewrite the lock file's content in place (a rename would leave the lock on the old file)."""
    with open(Path(folder) / LOCK_FILE, "r+") as f:
        f.truncate(0)
        f.write(json.dumps(info))
        f.flush()


def is_held(folder: Path) -> bool:
    """Whether a live process holds the job lock of ``folder`` (probes without keeping a lock). False
    on a filesystem that cannot lock (:func:`fixres_dist.locks.held_elsewhere`): nobody holds it."""
    try:
        fd = os.open(Path(folder) / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        return locks.held_elsewhere(fd)
    except OSError:  # any other failure of the probe: as before, taken for a holder that cannot be named
        return True
    finally:
        os.close(fd)  # releases the probe's shared lock, if it got one


class JobLock:
    """The exclusive lock of one job folder, held by this process until :meth:`release` or exit."""

    def __init__(self, folder: Path, fd: int):
        self.folder, self.fd = Path(folder), fd

    @classmethod
    def acquire(cls, folder: str | Path, num_tasks: int) -> "JobLock":
        """Lock ``folder`` (which must exist) for this launch of a ``num_tasks``-rank job.

        Raises :class:`FixresError` "job folder ... in use by another run" when a live process holds it,
        and :class:`fixres_dist.locks.NoLocks` on a filesystem that cannot lock (unless
        ``FIXRES_NO_LOCKS=1``), having removed the lock file if it made it.
        """
        folder = Path(folder)
        try:
            fd, made = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), True
        except FileExistsError:
            fd, made = os.open(folder / LOCK_FILE, os.O_RDWR), False
        deadline = time.monotonic() + ACQUIRE_SECONDS
        try:
            while not locks.try_lock(fd, folder / LOCK_FILE, UNGUARDED):
                if time.monotonic() > deadline:
                    raise in_use(folder)
                time.sleep(0.05)
        except BaseException as exc:
            os.close(fd)
            if made and isinstance(exc, locks.NoLocks):  # nothing left behind by a launch that cannot lock
                (folder / LOCK_FILE).unlink(missing_ok=True)
            raise
        os.fchmod(fd, 0o600)
        lock = cls(folder, fd)
        _write_holder(folder, {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                               "num_tasks": num_tasks, "met": False})
        return lock

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def record_met(folder: str | Path) -> None:
    """Rank 0, once every rank has arrived: note in the lock file that the job's ranks have met."""
    info = read_holder(folder)
    if info is not None:
        _write_holder(Path(folder), {**info, "met": True})


def check_joinable(folder: str | Path, rank: int) -> None:
    """A non-zero rank before its rendezvous: refuse to join a live job whose ranks have all met.

    Raises :class:`FixresError` "job folder ... in use"; a stale lock file (no live holder) is ignored.

    The record and the lock are read one after the other, so a record from a finished run can be
    seen just as the lock passes to a new launch (a requeued SLURM job's rank 0), before that
    launch rewrites the record. A "met" record is therefore believed only if, the lock still held,
    it is unchanged :data:`CONFIRM_SECONDS` later (a new holder rewrites it at once on acquiring).
    """
    folder = Path(folder)
    info = read_holder(folder)
    if not (info and info.get("met") and is_held(folder)):
        return
    time.sleep(CONFIRM_SECONDS)
    if read_holder(folder) == info and is_held(folder):
        raise FixresError(f"job folder {folder} in use by a running job whose {info.get('num_tasks')} ranks have all "
                          f"met ({_describe(info)}); this rank {rank} has no place in it: wait for it to end, stop it, "
                          "or use another --job-id")
