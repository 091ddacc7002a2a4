"""File locks (``flock``) that tell a lock held by another process from a filesystem that cannot lock.

The job lock, a rank's announcement and a pack's lock are ``flock`` locks: they die with their
process, so nothing stale is ever left to clear. Some filesystems cannot take them: NFS without its
lock daemon (``lockd``; ``flock`` then fails with ENOLCK, "No locks available"), and others that
answer EOPNOTSUPP or ENOSYS. That is no lock held by anybody: :func:`try_lock` says so in one line,
naming the folder, what the lock guards and what to do, instead of reporting the folder as in use.

``FIXRES_NO_LOCKS=1`` (:data:`ENV`) accepts the risk: on such a filesystem the locks are then skipped
with one warning line, and what they guard is not guarded (docs/checkpoints.md says what).
"""
from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from fixres_dist.errors import FixresError, say

ENV = "FIXRES_NO_LOCKS"
CANNOT_LOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
HELD = frozenset({errno.EWOULDBLOCK, errno.EAGAIN})
_warned: set[Path] = set()  # the folders this process said it goes on without locks in


class NoLocks(FixresError):
    """The filesystem of a lock file cannot lock it (no process holds the lock)."""


def _flock(fd: int, shared: bool) -> int | None:
    """``flock`` without waiting: None when taken, else why not: an errno of :data:`HELD` (another
    process holds a conflicting lock) or of :data:`CANNOT_LOCK`. Raises OSError for any other failure."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return None
    except OSError as exc:
        if exc.errno in HELD or exc.errno in CANNOT_LOCK:
            return exc.errno
        raise


def held_elsewhere(fd: int) -> bool:
    """Whether another process holds an exclusive lock on the open file ``fd`` (a probe: a shared lock
    taken and kept until ``fd`` is closed). False where the filesystem cannot lock: nobody holds one."""
    return _flock(fd, shared=True) in HELD


def try_lock(fd: int, path: Path, unguarded: str, warn: bool = True, folder: Path | None = None) -> bool:
    """Lock the open file ``fd`` (at ``path``) exclusively, without waiting: True when taken, False when
    another process holds it. ``unguarded``: what goes unguarded without the lock, for the messages
    (``"a second launch of this job would not be refused"``); ``folder``: the folder they name (default:
    ``path``'s).

    Raises :class:`NoLocks` (a :class:`~fixres_dist.errors.FixresError`) in one line where the
    filesystem cannot lock, unless ``FIXRES_NO_LOCKS=1``: then it returns True, the file unlocked,
    having warned in one line on stderr if ``warn`` (once per folder and process; a rank's
    announcement, which follows the job lock's warning, does not repeat it). Raises
    :class:`FixresError` naming ``path`` for any other failure."""
    path = Path(path)
    try:
        refused = _flock(fd, shared=False)
    except OSError as exc:
        raise FixresError(f"cannot lock {path}: {exc.strerror or exc}") from None
    if refused is None or refused in HELD:
        return refused is None
    named = Path(folder or path.parent)
    guess = "; NFS without its lock daemon?" if refused == errno.ENOLCK else ""
    cause = f"{named} is on a filesystem that cannot lock files (flock: {os.strerror(refused)}{guess})"
    if os.environ.get(ENV) != "1":
        raise NoLocks(f"{cause}, and without the lock {unguarded}: use a folder on a filesystem with locks (a "
                      f"node-local disk for a one-node job), ask for NFS locking (lockd), or set {ENV}=1 to go on "
                      "without locks at your own risk (docs/checkpoints.md)")
    if warn and named not in _warned:
        _warned.add(named)
        say(f"fixres_dist: warning: {cause}: going on without locks ({ENV}=1), so {unguarded}")
    return True


def check_lockable(folder: Path, unguarded: str, existing: Path) -> None:
    """Refuse, before anything is written, a ``folder`` to be made in ``existing`` (its nearest existing
    ancestor, or itself) whose filesystem cannot lock (:func:`try_lock` on a hidden probe file in
    ``existing``, removed at once; with ``FIXRES_NO_LOCKS=1`` it passes in silence: the lock it foretells
    warns). Raises :class:`NoLocks`, :class:`FixresError` for another failure to lock, or OSError when
    the probe cannot be made."""
    probe = Path(existing) / f".lock-probe.{os.uname().nodename}.{os.getpid()}"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try_lock(fd, probe, unguarded, warn=False, folder=folder)
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
