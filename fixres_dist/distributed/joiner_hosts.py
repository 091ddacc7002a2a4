"""Where the joining ranks of a file rendezvous run, known before rank 0 opens its store.

Ranks started by hand (or by any launcher that does not say they share a host) meet through the
rendezvous file in the owner-only job folder (:mod:`fixres_dist.distributed.rendezvous`). Each
rank first writes ``<rendezvous file>.rank<R>`` there, locked while it lives (a second process
announcing the same rank is refused at once): its host name, its network namespace
(``/proc/self/ns/net``) and its pid. Rank 0 reads them all before it opens the store: when every
joiner runs on its host, in its network namespace, the store listens on loopback only (nothing
outside the host can reach it); otherwise on the interface the rendezvous publishes. An announcement
left by a dead process of this host is not counted (the rank is awaited); one from another host is
taken as it is, which at worst opens the store beyond loopback, as before.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

from fixres_dist import locks
from fixres_dist.errors import FixresError

_held: list[int] = []  # this process' announcements, locked while it lives


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (exists and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and line.split()[1] in ("Z", "X") for line in f)
    except OSError:
        return False


def _here() -> dict:
    try:
        namespace = os.readlink("/proc/self/ns/net")
    except OSError:  # not Linux: the host name alone
        namespace = ""
    return {"hostname": socket.gethostname(), "netns": namespace, "pid": os.getpid()}


def announcement(path: Path, rank: int) -> Path:
    """The file in which ``rank`` announces its host, beside the rendezvous file ``path``."""
    return path.with_name(f"{path.name}.rank{rank}")


def announce(path: Path, rank: int, world_size: int) -> None:
    """Write where this rank runs (owner-only) and hold the file locked while the process lives: rank 0
    reads the joiners' before it opens the store (its own says that it waits). Raises
    :class:`FixresError` when another live process already announced itself as ``rank``, and
    :class:`fixres_dist.locks.NoLocks` on a filesystem that cannot lock (unless ``FIXRES_NO_LOCKS=1``)."""
    file = announcement(path, rank)
    fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        taken = locks.try_lock(fd, file, f"a second process started as rank {rank} would not be refused", warn=False)
    except BaseException:
        os.close(fd)
        raise
    if not taken:
        os.close(fd)
        raise FixresError(f"another process already joined this job as rank {rank} of {world_size}: is this rank "
                          "(or the whole job) started twice?")
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(_here()).encode())
    _held.append(fd)  # the lock lasts as long as this process


def _read(file: Path) -> dict | None:
    try:
        found = json.loads(file.read_text())
        return found if isinstance(found, dict) and isinstance(found.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def all_here(path: Path, world_size: int, give_up: Callable[[list[int]], None], poll: float = 0.05) -> bool:
    """Rank 0: wait until ranks 1 .. ``world_size`` - 1 have announced themselves beside ``path``, then
    whether all run on this host and in this network namespace. ``give_up(missing ranks)`` is called at
    each poll and raises to stop waiting (a signal, the rendezvous' deadline)."""
    me = _here()
    while True:
        found = {rank: _read(announcement(path, rank)) for rank in range(1, world_size)}
        local = {rank: a is not None and a.get("hostname") == me["hostname"] and a.get("netns") == me["netns"]
                 for rank, a in found.items()}
        missing = [rank for rank, a in found.items() if a is None or local[rank] and not process_alive(a["pid"])]
        if not missing:
            return all(local.values())
        give_up(missing)
        time.sleep(poll)


def clear(path: Path, world_size: int) -> None:
    """Rank 0, once every rank has met (or it stops waiting: ``world_size`` 1): remove the announcements."""
    for rank in range(world_size):
        announcement(path, rank).unlink(missing_ok=True)
