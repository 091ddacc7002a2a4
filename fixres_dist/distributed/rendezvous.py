"""How the ranks meet: the rendezvous store, and what it tells about peers that failed.

``tcp://HOST:PORT`` and ``env://`` are the usual TCPStore rendezvous (rank 0 hosts the store).
``file://PATH`` (the default, ``<shared>/<job-id>/rendezvous.json``) is a *published* TCPStore:
rank 0 opens a store on a free port of the one address it needs (:func:`bind_address`: loopback when
every rank is known to run on its host, else the routed interface's address, never the ``127.0.1.1``
its host name may resolve to) and atomically writes that address, the port and a random nonce to
PATH, an owner-only file; the other ranks poll PATH, connect, and check that the store knows the
nonce. Neither side sends the nonce itself: rank 0 sets a key named by an HMAC of it
(:func:`proof`), and a joining rank arrives under a key named by an HMAC of the nonce and its rank,
so a client of the store that did not read the file cannot pass for a rank or learn the nonce
(TCPStore itself has no authentication: what such a client can still do is in docs/trust.md).
Ranks can therefore start in any order,
seconds apart, from different shells or nodes that share the folder. A file left behind by a
crashed run is harmless: its address refuses connections (or carries the wrong nonce), so joiners
keep polling until the new rank 0 overwrites it (an address that refuses connections is probed with a
plain socket first, so a stale file costs no c10d error messages). Rank 0 deletes the file once
everyone has arrived. A second process claiming a rank that already arrived is refused.

Under torchrun (``env://`` with ``TORCHELASTIC_USE_AGENT_STORE=True``) the ranks use the store that
torchrun's agent already hosts on ``MASTER_ADDR:MASTER_PORT``, as ``torch.distributed`` itself does,
instead of rank 0 trying to open a second one on the agent's port.

Once the store is up, every rank publishes its host name, process id and addresses
(:func:`meet_hosts`), picks the network interface its collectives use
(:func:`fixres_dist.distributed.network.choose_link`) and sets ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``
accordingly, before the process group exists. A :class:`Rendezvous` is this process's store once
met; each rank also adds to a heartbeat counter in the store every second (a thread with its own
connection), so that after a failed collective :meth:`Rendezvous.lost_peers` can name the ranks
that died, failed (:meth:`Rendezvous.announce_failure`) or fell silent, and their host: a node
killed or cut off the network.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import attrs
import psutil
import torch.distributed as dist

from fixres_dist.distributed import joiner_hosts, network, store_clients, store_threads
from fixres_dist.errors import FixresError, first_line
from fixres_dist.io import write_private

PROBE_SECONDS = 3.0
HEARTBEAT_S = 1.0  # a rank adds to its heartbeat counter this often (seconds)
STALL_KEY = "fixres/stall"  # set when a rank found the job stalled; its reports under STALL_KEY/<rank>
STORE_HOST = "which hosts the rendezvous store"  # how a loss of rank 0 seen only as its store's silence is named
STORE_ANSWER_S = 3.0  # after a failed collective, a store that does not answer this fast is lost
POLL_S = 0.2  # a rank waiting to connect to a store checks for stop signals this often (seconds)
CONNECT_GRACE_S = 30.0  # a store client's own connect timeout exceeds the rank's deadline by this (seconds)


FAILED = ", which failed: "  # in a lost peer's description: it raised an error (the cause follows)


class PeersUnreachable(FixresError):
    """A collective failed because of the other ranks or the network between them, not because of
    this rank: the job's last checkpoint is intact. ``reason``: what happened, as a phrase
    ("losing rank 2 on n2 ..."); ``resumable``: whether running the job again may get past it
    (peers killed or cut off, a network outage: yes; a peer that raised an error: no, it would
    fail again)."""

    def __init__(self, message: str, reason: str, resumable: bool = True):
        super().__init__(message)
        self.reason, self.resumable = reason, resumable


class LostPeers(PeersUnreachable):
    """Peer ranks died, failed or were cut off; ``lost`` names them and their host
    (:meth:`Rendezvous.lost_peers`)."""

    def __init__(self, lost: str):
        super().__init__(f"lost {lost}; stopping", f"losing {lost}", resumable=FAILED not in lost)
        self.lost = lost

    @property
    def only_the_store(self) -> bool:
        """Whether all this rank could tell is that the rendezvous store (rank 0) stopped answering: what a
        survivor also sees when rank 0 was stopped after another loss (torchrun's agent stops its workers
        once one fails), so another survivor's diagnosis naming the ranks whose heartbeats stopped is
        better evidence of the same failure."""
        return STORE_HOST in self.lost


class NetworkInterrupted(PeersUnreachable):
    """A collective failed (timed out, or a connection was closed) although every peer is alive
    and answers: the network between the ranks was interrupted for longer than a collective may
    wait (:func:`fixres_dist.distributed.collectives.collective_timeout`)."""

    def __init__(self, cause: str, waited: float):
        cause = re.sub(r"^\[[^\]]*\]\s*", "", cause).split(". ")[0].rstrip(".")  # gloo's "[file:line] What. Advice."
        super().__init__(f"a collective failed although every peer is alive: the network between the ranks was "
                         f"interrupted for more than {waited:g} s? ({cause}); stopping",
                         "a collective failed with every peer alive")


class RendezvousInterrupted(Exception):
    """A stop signal arrived while this rank waited for its peers (nothing to checkpoint yet)."""


def _never() -> bool:
    return False


ONE_HOST = "FIXRES_RANKS_ON_ONE_HOST"  # set to 1 by the launcher for the ranks it spawns on its host


def ranks_on_one_host(environ=None) -> bool:
    """Whether every rank of this job is known to run on this host before any has met: ranks the
    launcher spawned here (:data:`ONE_HOST`), or a SLURM allocation (submitit's too) of one node."""
    environ = os.environ if environ is None else environ
    return environ.get(ONE_HOST) == "1" or environ.get("SLURM_JOB_NUM_NODES", environ.get("SLURM_NNODES")) == "1"


def bind_address(one_host: bool, wanted: str | None = None) -> str:
    """The IPv4 address rank 0's store listens on. All ranks on this host: ``127.0.0.1``. Else
    ``wanted`` (``--dist-url tcp://HOST``'s or ``MASTER_ADDR``'s host, resolved) as given, unless it
    resolves to a loopback address while the ranks may be elsewhere (the ``127.0.1.1`` trap: other
    hosts resolve the name to another address) or to none of this host's (a service or NAT address
    that forwards here): then every interface (``0.0.0.0``), as torch's own store would; without
    one, the first of :func:`~fixres_dist.distributed.network.store_candidates` that is an address of
    this host (the routed interface's), or loopback on a host with no other."""
    if one_host:
        return "127.0.0.1"
    if wanted:
        try:
            address = socket.gethostbyname(wanted)
        except OSError:
            raise FixresError(f"the rendezvous store's host {wanted!r} does not resolve to an IPv4 address") from None
        loopback = ipaddress.ip_address(address).is_loopback
        if loopback and wanted not in (address, "localhost") or not loopback and address != "0.0.0.0" \
                and address not in network.own_addresses():
            return "0.0.0.0"
        return address
    own = set(network.own_addresses())
    return next((a for a in network.store_candidates() if a in own), "127.0.0.1")


def _tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: float,
               listen: str | None = None) -> dist.TCPStore:
    """A TCPStore client of ``host:port``, or with ``is_master`` its server, listening on ``listen``
    (an IPv4 address; ``0.0.0.0``: every interface) through a socket bound here and handed over."""
    fd = None
    if is_master and listen is not None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((listen, port))
            sock.listen(1024)
        except OSError as exc:
            sock.close()
            raise FixresError(f"cannot open the rendezvous store on {listen}:{port}: {exc.strerror or exc}") from None
        port, fd = sock.getsockname()[1], sock.detach()  # the store owns the socket from now on
        host = listen if listen != "0.0.0.0" else "127.0.0.1"  # the server's own client: where it listens
    return dist.TCPStore(host, port, world_size, is_master, datetime.timedelta(seconds=timeout),
                         wait_for_workers=False, **({"master_listen_fd": fd} if fd is not None else {}))


def _publish_and_wait(path: Path, world_size: int, timeout: float, should_stop) -> tuple[dist.TCPStore, str]:
    """Rank 0 of a file rendezvous: host a store on the address of :func:`bind_address` (loopback when
    every joiner announced this host: :mod:`~fixres_dist.distributed.joiner_hosts`), publish it, wait
    for every other rank. Returns the store and its ``HOST:PORT``."""
    deadline = time.monotonic() + timeout

    def give_up(missing: list[int]) -> None:  # while waiting for the other ranks' hosts, then their arrivals
        if should_stop():
            path.unlink(missing_ok=True)
            joiner_hosts.clear(path, 1)
            raise RendezvousInterrupted(f"stopped by a signal while waiting at {path}")
        if time.monotonic() > deadline:
            raise FixresError(f"rank(s) {', '.join(map(str, missing))} of {world_size} never arrived at {path} "
                              f"within {timeout:g} s (same --job-id and --shared-folder-path?)")
    wanted, one_host = os.environ.get("MASTER_ADDR"), ranks_on_one_host()
    joiner_hosts.announce(path, 0, world_size)
    if not wanted and not one_host:
        one_host = joiner_hosts.all_here(path, world_size, give_up)
    address = bind_address(one_host, wanted)
    hosts = [address] if address != "0.0.0.0" else \
        [h for h in dict.fromkeys([os.environ.get("MASTER_ADDR", ""), *network.store_candidates()]) if h]
    try:
        store = _tcp_store(hosts[0], 0, world_size, True, timeout, listen=address)
    except (RuntimeError, OSError) as exc:
        raise FixresError(f"cannot open the rendezvous store on {address}: {first_line(exc)}") from None
    nonce = secrets.token_hex(16)
    store.set(f"fixres/store/{proof(nonce, 'store')}", "1")
    write_private(path, json.dumps({"hosts": hosts, "port": store.port, "nonce": nonce, "pid": os.getpid(),
                                    "hostname": socket.gethostname(), "time": time.time()}))
    expected = [_arrival(nonce, r) for r in range(1, world_size)]
    while not store.check(expected):
        give_up([r for r, k in enumerate(expected, 1) if not store.check([k])])
        time.sleep(0.05)
    path.unlink(missing_ok=True)
    joiner_hosts.clear(path, world_size)
    return store, f"{hosts[0]}:{store.port}"


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
        and not joiner_hosts.process_alive(info["pid"])


def _probe_store(host: str, port: int, world_size: int) -> dist.TCPStore | None:
    """A client of the store at ``host:port``, or None if none answers within PROBE_SECONDS.

    Connecting runs in a daemon thread (:func:`_within`): a port taken over by another server (not
    a TCPStore) accepts the connection and never answers the handshake, which would block this rank,
    deaf to signals, beyond any timeout.
    """
    return _within(PROBE_SECONDS + 1.0, lambda: _tcp_store(host, port, world_size, False, PROBE_SECONDS))


def proof(nonce: str, what: str) -> str:
    """Hex HMAC-SHA256 of ``what`` keyed by the rendezvous ``nonce``: what only a reader of the
    rendezvous file can compute, and from which the nonce cannot be recovered."""
    return hmac.new(nonce.encode(), what.encode(), hashlib.sha256).hexdigest()


def _arrival(nonce: str, rank: int) -> str:
    """The store key under which ``rank`` arrives: named by its proof of the nonce."""
    return f"fixres/arrived/{rank}/{proof(nonce, f'rank {rank}')}"


def _arrive(store: dist.Store, nonce: str, rank: int, world_size: int) -> None:
    """Record this rank's arrival; FixresError if another process already arrived as this rank."""
    if store.add(_arrival(nonce, rank), 1) > 1:
        raise FixresError(f"another process already joined this job as rank {rank} of {world_size}: "
                          "is this rank (or the whole job) started twice?")


def _published(path: Path) -> tuple[list[str], int, str, dict] | None:
    """``(addresses to try, port, nonce, the whole record)`` of a rendezvous file, or None if it is
    missing or unreadable. On rank 0's host, loopback is tried first."""
    try:
        info = json.loads(path.read_text())
        hosts = [str(h) for h in info.get("hosts") or [info["host"]]]
        port, nonce = int(info["port"]), str(info["nonce"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if info.get("hostname") == socket.gethostname():
        hosts = list(dict.fromkeys(["127.0.0.1", *hosts]))
    return hosts, port, nonce, info


def _join_published(path: Path, rank: int, world_size: int, timeout: float, should_stop,
                    check_joinable) -> tuple[dist.TCPStore, str]:
    """A non-zero rank of a file rendezvous: poll the file until one of its addresses answers
    with the nonce. Returns the store and the ``HOST:PORT`` it was reached at."""
    deadline = time.monotonic() + timeout
    tried = None
    joiner_hosts.announce(path, rank, world_size)
    while time.monotonic() < deadline:
        if should_stop():
            raise RendezvousInterrupted(f"stopped by a signal while waiting for {path}")
        check_joinable()
        published = _published(path)
        key = published[:3] if published is not None else None
        if key is not None and key != tried and not _stale(published[3]):
            hosts, port, nonce = key
            for host in hosts:
                if not _answers(host, port):
                    continue
                tried = key  # something answers: if it is not our store, the file is stale
                try:
                    store = _probe_store(host, port, world_size)
                    if store is not None and store.check([f"fixres/store/{proof(nonce, 'store')}"]):
                        store.set_timeout(datetime.timedelta(seconds=timeout))
                        _arrive(store, nonce, rank, world_size)
                        return store, f"{host}:{port}"
                except (RuntimeError, OSError):
                    pass  # a stale file from an earlier run: wait for the new rank 0 to replace it
        time.sleep(0.1)
    raise FixresError(f"rank 0 did not open the rendezvous {path} within {timeout:g} s "
                      "(is rank 0 running with the same --job-id and --shared-folder-path?)")


def _connect(host: str, port: int, world_size: int, timeout: float, should_stop, what: str) -> dist.TCPStore:
    """A client of the TCPStore at ``host:port``, connected from a daemon thread while this one
    polls ``should_stop()`` (a stop signal: :class:`RendezvousInterrupted`) and keeps the deadline
    of ``timeout`` seconds (the client alone retries for longer, and a signal handler cannot run
    while it blocks in C++). FixresError naming ``what`` when no store answers in time."""
    box, errors = [], []

    def connect():
        try:  # the client's own timeout outlasts the deadline, so that this rank reports first, in one line
            store = _tcp_store(host, port, world_size, False, timeout + CONNECT_GRACE_S)
            store.set_timeout(datetime.timedelta(seconds=timeout))
            box.append(store)
        except (RuntimeError, OSError) as exc:
            errors.append(exc)

    thread = store_threads.start(connect, "fixres-store-connect")
    deadline = time.monotonic() + timeout
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(POLL_S)
        if should_stop():
            raise RendezvousInterrupted(f"stopped by a signal while waiting for {what} at {host}:{port}")
    if box:
        return box[0]
    cause = first_line(errors[0]) if errors else "no store answered"
    raise FixresError(f"cannot reach {what} at {host}:{port} within {timeout:g} s: {cause}")


def _tcp_rendezvous(host: str, port: int, rank: int, world_size: int, timeout: float,
                    should_stop=_never) -> tuple[dist.TCPStore, str]:
    if rank != 0:
        return _connect(host, port, world_size, timeout, should_stop, "rank 0's store"), f"{host}:{port}"
    try:
        return _tcp_store(host, port, world_size, True, timeout, listen=bind_address(False, host)), f"{host}:{port}"
    except (RuntimeError, OSError) as exc:
        raise FixresError(f"cannot open the rendezvous store at {host}:{port}: {first_line(exc)}") from None


def make_store(dist_url: str, rank: int, world_size: int, timeout: float, should_stop=None,
               check_joinable=None) -> tuple[dist.Store, str]:
    """Build the rendezvous store for ``dist_url`` (file://, tcp:// or env://); returns it and the
    ``HOST:PORT`` of the TCPStore behind it.

    ``should_stop()``, if given, is polled while waiting at a file rendezvous; when it returns True,
    :class:`RendezvousInterrupted` is raised. A joining rank also polls ``check_joinable()``, if
    given, which raises to give up (the job it waits for is already running without it). Raises
    :class:`FixresError` when the peers do not show up within ``timeout`` seconds.
    """
    should_stop, check_joinable = should_stop or _never, check_joinable or _never
    url = urlparse(dist_url)
    if url.scheme == "file":
        path = Path(url.path)
        if not path.parent.is_dir():
            raise FixresError(f"rendezvous folder {path.parent} does not exist")
        if rank == 0:
            return _publish_and_wait(path, world_size, timeout, should_stop)
        return _join_published(path, rank, world_size, timeout, should_stop, check_joinable)
    if url.scheme == "tcp":
        return _tcp_rendezvous(url.hostname, url.port, rank, world_size, timeout, should_stop)
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise FixresError("--dist-url env:// needs MASTER_ADDR and MASTER_PORT in the environment")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise FixresError(f"MASTER_PORT={port!r}: not a port number (1-65535)")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts the store
        store = _connect(addr, int(port), world_size, timeout, should_stop, "torchrun's store")
        # as torch.distributed's env:// does: keys of an earlier attempt (--max-restarts) are not seen
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"/worker/attempt_{attempt}", store), f"{addr}:{port}"
    return _tcp_rendezvous(addr, int(port), rank, world_size, timeout, should_stop)


@attrs.frozen
class Host:
    """Where one rank runs: host name, process id, and the non-loopback IPv4 addresses of its host."""

    name: str
    pid: int
    addresses: tuple[str, ...]


def meet_hosts(store: dist.Store, rank: int, world_size: int, timeout: float) -> dict[int, Host]:
    """Every rank's :class:`Host` (global rank -> Host), exchanged through ``store``; every rank
    calls it. Raises :class:`FixresError` if a rank does not publish its own within ``timeout`` s."""
    me = Host(socket.gethostname(), os.getpid(), tuple(network.own_addresses()))
    store.set(f"fixres/host/{rank}", json.dumps(attrs.asdict(me)))
    keys = [f"fixres/host/{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError):
        missing = _within(STORE_ANSWER_S, lambda: [k.rsplit("/", 1)[1] for k in keys if not store.check([k])])
        if missing is None:  # the store itself is gone: rank 0 died or its host is unreachable
            raise LostPeers(f"rank 0, {STORE_HOST} (it died, or its host is unreachable)") from None
        raise FixresError(f"rank(s) {', '.join(missing)} met the store but did not say where they run "
                          f"within {timeout:g} s") from None
    hosts = {}
    for r, key in enumerate(keys):
        info = json.loads(store.get(key))
        hosts[r] = Host(info["name"], int(info["pid"]), tuple(info["addresses"]))
    return hosts


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _ranks_on(ranks: list[int], hosts: dict[int, Host], here: str) -> str:
    """``"ranks 2-3 on n2"``, grouped by host in rank order (no host named for those on ``here``)."""
    by_host: dict[str, list[int]] = {}
    for rank in sorted(ranks):
        by_host.setdefault(hosts[rank].name, []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {_ranges(r)}{'' if host == here else f' on {host}'}"
                     for host, r in by_host.items())


class Rendezvous:
    """This rank's rendezvous store once the ranks have met, where every rank runs, and how.

    Built by :func:`fixres_dist.distributed.collectives.init_process_group` (:func:`meet_hosts`): ``hosts`` (global
    rank -> :class:`Host`) and this rank's :class:`~fixres_dist.distributed.network.Link` are known before the
    process group exists; :meth:`register` (a collective, once the group exists) collects every
    rank's link for :meth:`describe`. A heartbeat thread (:meth:`start_heartbeat`) lets
    :meth:`lost_peers` tell a silent rank from a live one.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, address: str, hosts: dict[int, Host],
                 link: network.Link):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.address, self.hosts, self.link = address, hosts, link  # address: the store's HOST:PORT
        self.links: dict[int, str] = {}  # rank -> "interface address", after register()
        self._beating = threading.Event()
        self.clients = None  # rank 0's ClientWatch of the store it hosts, from watch_clients()
        self._stall_store = None  # the stall watchdog's own connection (_watch_store)

    def watch_clients(self, warn) -> None:
        """Rank 0 hosting the store (not torchrun's agent): name each of its clients that is none of
        the ranks, once, through ``warn(line)`` (:mod:`fixres_dist.distributed.store_clients`)."""
        if self.rank == 0 and isinstance(self.store, dist.TCPStore):
            self.clients = store_clients.ClientWatch(int(self.address.rsplit(":", 1)[1]), self.hosts, warn)
            self.clients.check()
            self.clients.start()

    def register(self) -> None:
        """Every rank, once the process group exists: publish this rank's link, read everyone's."""
        self.store.set(f"fixres/link/{self.rank}", f"{self.link.interface} {self.link.address}")
        dist.barrier()
        self.links = {peer: self.store.get(f"fixres/link/{peer}").decode() for peer in range(self.world_size)}

    def describe(self, most: int = 8) -> str:
        """One line: where the store was reached and, per host, its ranks and the interface they use
        (the first ``most`` hosts, then how many more)."""
        by_host: dict[tuple[str, str], list[int]] = {}
        for rank, host in sorted(self.hosts.items()):
            by_host.setdefault((host.name, self.links.get(rank, "?")), []).append(rank)
        hosts = len({name for name, _ in by_host})
        parts = [f"{name} rank{'s' if len(r) > 1 else ''} {_ranges(r)} over {link}"
                 for (name, link), r in by_host.items()]
        if len(parts) > most:
            parts = [*parts[:most], f"{len(parts) - most} more"]
        return (f"{self.world_size} ranks met at the store {self.address} on {hosts} host(s): {'; '.join(parts)} "
                f"(interface: {self.link.reason})")

    def start_heartbeat(self) -> None:
        """Add 1 to this rank's heartbeat counter in the store every HEARTBEAT_S seconds, from a
        daemon thread with a connection of its own (a store that stops answering blocks only it)."""
        def beat():
            try:
                store = self.store.clone()  # a connection of its own (torchrun's key prefix kept)
                store.set_timeout(datetime.timedelta(seconds=5 * HEARTBEAT_S))
                while not self._beating.wait(HEARTBEAT_S):
                    store.add(f"fixres/beat/{self.rank}", 1)
            except Exception:  # the store is gone or unreachable: lost_peers will say so
                pass

        store_threads.start(beat, "fixres-heartbeat")

    def stop_heartbeat(self) -> None:
        self._beating.set()
        if self.clients is not None:
            self.clients.stop()

    def announce_failure(self, reason: str) -> None:
        """Tell the other ranks, through the store, why this rank is about to stop (best effort,
        at most STORE_ANSWER_S seconds: the store may be gone with rank 0)."""
        _within(STORE_ANSWER_S, lambda: self.store.set(f"fixres/failed/{self.rank}", reason[:300]))

    def announce_lost(self, lost: str) -> None:
        """Tell the other ranks which peers this rank found lost (as :meth:`announce_failure`):
        they then name those, not this rank that exits because of them."""
        _within(STORE_ANSWER_S, lambda: self.store.set(f"fixres/lost/{self.rank}", lost[:300]))

    def hold_store(self, most: float = 2 * STORE_ANSWER_S, silent_after: float = 2.5 * HEARTBEAT_S) -> None:
        """Rank 0, about to exit after a failure: the store dies with this process, so keep it up
        until every other rank still running (its heartbeat moved within ``silent_after`` s) has
        announced why it stops, and thus had the chance to read what this rank announced; at most
        ``most`` seconds. Other ranks return at once."""
        if self.rank != 0:
            return
        start = time.monotonic()
        moved: dict[int, tuple[int, float]] = {}  # rank -> (beat count, when it was first seen)
        while time.monotonic() - start < most:
            beats = _within(STORE_ANSWER_S, lambda: self._beats(self.store))
            told = _within(STORE_ANSWER_S, lambda: {rank for kind in ("lost", "failed")
                                                    for rank, _ in self._announced(self.store, kind)})
            if beats is None or told is None:
                return
            now = time.monotonic()
            for rank, count in beats.items():
                if moved.get(rank, (None,))[0] != count:
                    moved[rank] = (count, now)
            if all(rank in told or now - moved[rank][1] > silent_after for rank in beats):
                return
            time.sleep(0.2)

    def _announced(self, store: dist.Store, kind: str) -> list[tuple[int, str]]:
        """``(rank, text)`` of the peers that announced ``kind`` ("lost" or "failed")."""
        return [(rank, store.get(f"fixres/{kind}/{rank}").decode()) for rank in range(self.world_size)
                if rank != self.rank and store.check([f"fixres/{kind}/{rank}"])]

    def _watch_store(self) -> dist.Store | None:
        """The stall watchdog's own connection to the store (made once; None while the store does not answer)."""
        if self._stall_store is None:
            self._stall_store = _within(STORE_ANSWER_S, self.store.clone)
            if self._stall_store is not None:
                self._stall_store.set_timeout(datetime.timedelta(seconds=STORE_ANSWER_S))
        return self._stall_store

    def mark_stall(self) -> None:
        """Tell every rank that the job stalled (:mod:`fixres_dist.distributed.watchdog`; best effort)."""
        store = self._watch_store()
        if store is not None:
            _within(STORE_ANSWER_S, lambda: store.set(STALL_KEY, str(self.rank)))

    def stall_marked(self) -> bool:
        """Whether some rank marked the job stalled (False while the store does not answer)."""
        store = self._watch_store()
        return store is not None and bool(_within(STORE_ANSWER_S, lambda: store.check([STALL_KEY])))

    def stall_reports(self, mine: dict, wait: float) -> tuple[dict[int, dict], dict[int, str]]:
        """Publish this rank's stall report ``mine`` (JSON-able) and read every rank's, for up to ``wait``
        seconds. Returns ``(reports by rank, silent)``: ``silent`` the ranks without a report whose
        heartbeat did not move meanwhile (rank -> "rank R on H" and, on this host, its process state);
        rank 0, which hosts the store, when the store does not answer."""
        store, reports = self._watch_store(), {self.rank: mine}
        before = _within(STORE_ANSWER_S, lambda: self._beats(store)) if store is not None else None
        if before is None:
            return reports, {0: self._silent(0) + ", " + STORE_HOST} if self.rank else {}
        _within(STORE_ANSWER_S, lambda: store.set(f"{STALL_KEY}/{self.rank}", json.dumps(mine)))
        deadline = time.monotonic() + wait
        while len(reports) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.2)
            for rank in set(range(self.world_size)) - set(reports):
                text = _within(STORE_ANSWER_S, lambda rank=rank: store.get(f"{STALL_KEY}/{rank}")
                               if store.check([f"{STALL_KEY}/{rank}"]) else None)
                if text:
                    reports[rank] = json.loads(text)
        after = _within(STORE_ANSWER_S, lambda: self._beats(store)) or {}
        return reports, {rank: self._silent(rank) for rank in range(self.world_size)
                         if rank not in reports and after.get(rank) == before.get(rank)}

    def _silent(self, rank: int) -> str:
        host = self.hosts[rank]
        if host.name != socket.gethostname():
            return f"rank {rank} on {host.name}"
        try:
            return f"rank {rank} on {host.name} (pid {host.pid}, {psutil.Process(host.pid).status()})"
        except psutil.Error:
            return f"rank {rank} on {host.name} (pid {host.pid}, gone)"

    def local_pids(self, ranks) -> dict[int, int]:
        """The process ids of those of ``ranks`` that run on this host."""
        return {rank: self.hosts[rank].pid for rank in ranks if self.hosts[rank].name == socket.gethostname()}

    def _beats(self, store: dist.Store) -> dict[int, int]:
        """Every peer's heartbeat count."""
        return {rank: store.add(f"fixres/beat/{rank}", 0) for rank in range(self.world_size) if rank != self.rank}

    def lost_peers(self, wait: float = 3.0) -> str:
        """Which peer ranks failed or vanished, as a phrase, after a collective failed ("" if none known).

        In this order: what a peer that found ranks lost announced (:meth:`announce_lost`); ranks
        that announced a failure (:meth:`announce_failure`), with its cause; ranks on this host
        whose process is gone; ranks whose heartbeat did not move for ``wait`` seconds (killed on
        another host, or that host cut off the network), with their host; and if the store does
        not answer within STORE_ANSWER_S, rank 0, which hosts it (or the network to its host is
        down). Takes about ``wait`` seconds (a dying peer may still be exiting), at most
        ``wait + 2 * STORE_ANSWER_S``.
        """
        me = self.hosts[self.rank].name
        store = _within(STORE_ANSWER_S, self.store.clone)  # the old connection may hang on a dead link
        if store is not None:
            store.set_timeout(datetime.timedelta(seconds=STORE_ANSWER_S))
            before, deadline = _within(STORE_ANSWER_S, lambda: self._beats(store)), time.monotonic() + wait
            found = None
            while before is not None:
                found = _within(STORE_ANSWER_S, lambda: self._announced_loss(store, me))
                if found is None or found or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            if found:
                return found
            after = _within(STORE_ANSWER_S, lambda: self._beats(store)) if found is not None else None
            if after is not None:
                silent = [rank for rank, count in after.items() if count == before[rank]]
                return f"{_ranks_on(silent, self.hosts, me)} (no heartbeat for {wait:g} s: killed, or the " \
                       "host is cut off)" if silent else ""
        return (f"rank 0 on {self.hosts[0].name}, {STORE_HOST} (it died, or the "
                f"network to {self.hosts[0].name} is down)")

    def _announced_loss(self, store: dist.Store, me: str) -> str:
        """What :meth:`lost_peers` reports before looking at heartbeats ("" if nothing yet)."""
        lost = self._announced(store, "lost")
        if lost:
            return lost[0][1]
        failed = [f"{_ranks_on([rank], self.hosts, me)}{FAILED}{cause}"
                  for rank, cause in self._announced(store, "failed")]
        if failed:
            return "; ".join(failed)
        dead = [rank for rank, host in self.hosts.items()
                if rank != self.rank and host.name == me and not joiner_hosts.process_alive(host.pid)]
        return "; ".join(f"rank {rank} (pid {self.hosts[rank].pid} is gone)" for rank in dead)


def _within(seconds: float, call):
    """``call()``'s result, or None if it raised or did not return within ``seconds`` (it then
    goes on in a daemon thread: a store client blocked on a link that silently drops packets does
    not return for minutes, whatever its timeout)."""
    box = []

    def run():
        try:
            box.append(call())
        except Exception:
            pass

    thread = store_threads.start(run, "fixres-store-query")
    thread.join(seconds)
    return box[0] if box else None
