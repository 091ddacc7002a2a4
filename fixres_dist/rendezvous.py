"""How the ranks meet: the rendezvous store, and what it tells about peers that failed.

``tcp://HOST:PORT`` and ``env://`` are the usual TCPStore rendezvous (rank 0 hosts the store).
``file://PATH`` (the default, ``<shared>/<job-id>/rendezvous.json``) is a *published* TCPStore:
rank 0 opens a store on a free port and atomically writes its address and a random nonce to PATH;
the other ranks poll PATH, connect, and check the nonce. Ranks can therefore start in any order,
seconds apart, from different shells or nodes that share the folder. A file left behind by a
crashed run is harmless: its address refuses connections (or carries the wrong nonce), so joiners
keep polling until the new rank 0 overwrites it (an address that refuses connections is probed with a
plain socket first, so a stale file costs no c10d error messages). Rank 0 deletes the file once
everyone has arrived. A second process claiming a rank that already arrived is refused.

Under torchrun (``env://`` with ``TORCHELASTIC_USE_AGENT_STORE=True``) the ranks use the store that
torchrun's agent already hosts on ``MASTER_ADDR:MASTER_PORT``, as ``torch.distributed`` itself does,
instead of rank 0 trying to open a second one on the agent's port.

A :class:`Rendezvous` is this process's store once met; it also records every rank's host and
process id, so that after a failed collective :meth:`Rendezvous.lost_peers` can name the rank that
died or failed (:meth:`Rendezvous.announce_failure`).
"""
from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import torch.distributed as dist

from .errors import FixresError, first_line
from .io import write_private

PROBE_SECONDS = 3.0


class RendezvousInterrupted(Exception):
    """A stop signal arrived while this rank waited for its peers (nothing to checkpoint yet)."""


def _never() -> bool:
    return False


def _advertised_host() -> str:
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, is_master, datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


def _publish_and_wait(path: Path, world_size: int, timeout: float, should_stop) -> dist.TCPStore:
    """Rank 0 of a file rendezvous: host a store, publish it, wait for every other rank."""
    host = _advertised_host()
    store = _tcp_store(host, 0, world_size, True, timeout)
    nonce = secrets.token_hex(16)
    store.set("fixres/nonce", nonce)
    write_private(path, json.dumps({"host": host, "port": store.port, "nonce": nonce, "pid": os.getpid(),
                                    "hostname": socket.gethostname(), "time": time.time()}))
    expected = [f"fixres/arrived/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + timeout
    while not store.check(expected):
        if should_stop():
            path.unlink(missing_ok=True)
            raise RendezvousInterrupted(f"stopped by a signal while waiting at {path}")
        if time.monotonic() > deadline:
            missing = [k.rsplit("/", 1)[1] for k in expected if not store.check([k])]
            raise FixresError(f"rank(s) {', '.join(missing)} of {world_size} never arrived at {path} "
                              f"within {timeout:g} s (same --job-id and --shared-folder-path?)")
        time.sleep(0.05)
    path.unlink(missing_ok=True)
    return store


def _answers(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at ``host:port`` (within a second)."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
        return True
    except OSError:
        return False


def _stale(info: dict) -> bool:
    """Whether a published rendezvous is certainly stale: its rank 0 ran on this host and is gone."""
    return info.get("hostname") == socket.gethostname() and isinstance(info.get("pid"), int) \
        and not _process_alive(info["pid"])


def _probe_store(host: str, port: int, world_size: int) -> dist.TCPStore | None:
    """A client of the store at ``host:port``, or None if none answers within PROBE_SECONDS.

    Connecting runs in a daemon thread: a port taken over by another server (not a TCPStore)
    accepts the connection and never answers the handshake, which would block this rank, deaf to
    signals, beyond any timeout.
    """
    box = []

    def connect():
        try:
            box.append(_tcp_store(host, port, world_size, False, PROBE_SECONDS))
        except (RuntimeError, OSError):
            pass

    thread = threading.Thread(target=connect, daemon=True, name="fixres-rendezvous-probe")
    thread.start()
    thread.join(PROBE_SECONDS + 1.0)
    return box[0] if box else None


def _arrive(store: dist.Store, rank: int, world_size: int) -> None:
    """Record this rank's arrival; FixresError if another process already arrived as this rank."""
    if store.add(f"fixres/arrived/{rank}", 1) > 1:
        raise FixresError(f"another process already joined this job as rank {rank} of {world_size}: "
                          "is this rank (or the whole job) started twice?")


def _join_published(path: Path, rank: int, world_size: int, timeout: float, should_stop,
                    check_joinable) -> dist.TCPStore:
    """A non-zero rank of a file rendezvous: poll the file until its store answers with its nonce."""
    deadline = time.monotonic() + timeout
    tried = None
    while time.monotonic() < deadline:
        if should_stop():
            raise RendezvousInterrupted(f"stopped by a signal while waiting for {path}")
        check_joinable()
        try:
            info = json.loads(path.read_text())
            key = (info["host"], int(info["port"]), info["nonce"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            key = None
        if key is not None and key != tried and not _stale(info) and _answers(key[0], key[1]):
            tried = key
            try:
                store = _probe_store(key[0], key[1], world_size)
                if store is not None and store.check(["fixres/nonce"]) \
                        and store.get("fixres/nonce").decode() == key[2]:
                    store.set_timeout(datetime.timedelta(seconds=timeout))
                    _arrive(store, rank, world_size)
                    return store
            except (RuntimeError, OSError):
                pass  # a stale file from an earlier run: wait for the new rank 0 to replace it
        time.sleep(0.1)
    raise FixresError(f"rank 0 did not open the rendezvous {path} within {timeout:g} s "
                      "(is rank 0 running with the same --job-id and --shared-folder-path?)")


def _tcp_rendezvous(host: str, port: int, rank: int, world_size: int, timeout: float) -> dist.TCPStore:
    try:
        return _tcp_store(host, port, world_size, rank == 0, timeout)
    except (RuntimeError, OSError) as exc:
        raise FixresError(f"cannot meet the other ranks at {host}:{port} within {timeout:g} s: "
                          f"{first_line(exc)}") from None


def make_store(dist_url: str, rank: int, world_size: int, timeout: float, should_stop=_never,
               check_joinable=_never) -> dist.Store:
    """Build the rendezvous store for ``dist_url`` (file://, tcp:// or env://).

    ``should_stop()`` is polled while waiting at a file rendezvous; when it returns True,
    :class:`RendezvousInterrupted` is raised. A joining rank also polls ``check_joinable()``, which
    raises to give up (the job it waits for is already running without it). Raises
    :class:`FixresError` when the peers do not show up within ``timeout`` seconds.
    """
    url = urlparse(dist_url)
    if url.scheme == "file":
        path = Path(url.path)
        if not path.parent.is_dir():
            raise FixresError(f"rendezvous folder {path.parent} does not exist")
        if rank == 0:
            return _publish_and_wait(path, world_size, timeout, should_stop)
        return _join_published(path, rank, world_size, timeout, should_stop, check_joinable)
    if url.scheme == "tcp":
        return _tcp_rendezvous(url.hostname, url.port, rank, world_size, timeout)
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise FixresError("--dist-url env:// needs MASTER_ADDR and MASTER_PORT in the environment")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts the store
        try:
            return _tcp_store(addr, int(port), world_size, False, timeout)
        except (RuntimeError, OSError) as exc:
            raise FixresError(f"cannot reach torchrun's store at {addr}:{port}: {first_line(exc)}") from None
    return _tcp_rendezvous(addr, int(port), rank, world_size, timeout)


def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and line.split()[1] in ("Z", "X") for line in f)
    except OSError:
        return False


class Rendezvous:
    """This rank's rendezvous store once the ranks have met, and where every rank runs.

    Built by :func:`fixres_dist.distributed.init_process_group`; :meth:`register` publishes this
    process and reads the others' (a collective: every rank calls it once the group exists).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.peers: dict[int, tuple[str, int]] = {}  # rank -> (host, pid)

    def register(self) -> None:
        self.store.set(f"fixres/process/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        dist.barrier()
        for peer in range(self.world_size):
            host, pid = self.store.get(f"fixres/process/{peer}").decode().split()
            self.peers[peer] = (host, int(pid))

    def announce_failure(self, reason: str) -> None:
        """Tell the other ranks, through the store, why this rank is about to stop (best effort)."""
        try:
            self.store.set(f"fixres/failed/{self.rank}", reason[:300])
        except Exception:  # best effort: the store may be gone with rank 0
            pass

    def lost_peers(self, wait: float = 3.0) -> str:
        """Which peer ranks failed or vanished, as a phrase, after a collective failed ("" if none known).

        Ranks on this host that died are found by process id; a rank that failed with an exception
        announced it in the store (:meth:`announce_failure`) before exiting, and is named with its
        cause even once its process is gone; if the store (hosted by rank 0) no longer answers, rank
        0 is gone. Polls for up to ``wait`` seconds, as a dying peer may still be exiting.
        """
        self.store.set_timeout(datetime.timedelta(seconds=3))
        deadline = time.monotonic() + wait
        while True:
            lost = {rank: f"rank {rank} (pid {pid} is gone)" for rank, (host, pid) in self.peers.items()
                    if rank != self.rank and host == socket.gethostname() and not _process_alive(pid)}
            try:
                for rank in self.peers:
                    if rank != self.rank and self.store.check([f"fixres/failed/{rank}"]):
                        lost[rank] = f"rank {rank}, which failed: {self.store.get(f'fixres/failed/{rank}').decode()}"
            except Exception:  # the store died with its host process, rank 0
                if not lost:
                    return "rank 0 (and with it the rendezvous store)"
            if lost or time.monotonic() > deadline:
                return "; ".join(lost[rank] for rank in sorted(lost))
            time.sleep(0.2)
