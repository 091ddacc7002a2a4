"""Who is connected to the job's rendezvous store: rank 0 names every client that is none of the ranks.

TCPStore accepts any TCP client and has no authentication, so a process that reaches the store's
port can connect, list and read its keys, and write some (docs/trust.md). The store listens only
where it must (:func:`fixres_dist.distributed.rendezvous.bind_address`) and a rank proves it read the
owner-only rendezvous file before it counts (:func:`fixres_dist.distributed.rendezvous.proof`); what
is left is to see who else came. Rank 0, which hosts the store, looks at its connections every
:data:`EVERY_S` seconds from a daemon thread: a connection is a rank's when the process at the other
end is one of the ranks (same host: its process id, where this user may see it) or comes from an
address of a rank's host; every other one is logged once, with its address and, where visible, its
process, and one on this host is also ended from the store's side (:func:`refuse`: its next
request fails). One from another host is left connected: an address translation (NAT) between the
hosts would make a rank's connection look foreign, and ending it would end the job. The job goes
on: such a client was never counted as a rank. What it did before it was seen (up to :data:`EVERY_S`
seconds, or before the ranks met) is not undone.
"""
from __future__ import annotations

import os
import socket
import threading
from typing import Callable

import psutil

from fixres_dist.distributed import network

EVERY_S = 2.0  # seconds between two looks at the store's connections


def _ip(address: str) -> str:
    """An IPv4 address as itself, also when a dual-stack socket shows it as ``::ffff:a.b.c.d``."""
    return address.removeprefix("::ffff:")


def of_ranks(pid: int, rank_pids: set[int]) -> bool | None:
    """Whether process ``pid`` is a rank or a child of one (a loader worker shares its sockets); None when
    it cannot be told (the process exited since the look: a loader worker that ended, say)."""
    try:
        return pid in rank_pids or any(p.pid in rank_pids for p in psutil.Process(pid).parents())
    except psutil.Error:
        return None


def foreign_clients(port: int, hosts: dict) -> list[tuple[str, int, bool, tuple[str, int]]]:
    """The store clients at this process' ``port`` that are none of the ranks (``hosts``: global rank
    -> :class:`~fixres_dist.distributed.rendezvous.Host`): ``("ADDRESS:PORT (pid P, NAME)", fd,
    local, (ADDRESS, PORT))`` each, ``fd`` this process' end of the connection, ``local`` whether the client runs on
    this host (then certainly not a rank: the ranks here are this user's processes, all visible). A
    local client counts only when its end of the connection and its process are seen in the same look:
    a rank's connection that opens or closes meanwhile is never taken for a foreign one."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return []
    here, me = socket.gethostname(), psutil.Process()
    family = {me.pid, *(p.pid for p in me.children(recursive=True))}  # loader workers inherit its sockets
    served = [c for c in connections if c.pid in family and c.laddr and c.laddr.port == port and c.raddr
              and c.status == psutil.CONN_ESTABLISHED]
    # A client's end by its local and remote address: an accepted socket shares its local address with its
    # listener (and with its siblings), so the local address alone may name another process's socket.
    by_ends = {((_ip(c.laddr.ip), c.laddr.port), (_ip(c.raddr.ip), c.raddr.port)): c
               for c in connections if c.laddr and c.raddr}
    rank_pids = {h.pid for h in hosts.values() if h.name == here}
    rank_addresses = {a for h in hosts.values() if h.name != here for a in h.addresses}
    local = {address for _, address in network.interface_addresses()}
    found = []
    for server_side in served:
        remote = (_ip(server_side.raddr.ip), server_side.raddr.port)
        client = by_ends.get((remote, (_ip(server_side.laddr.ip), port))) if remote[0] in local else None
        if remote[0] in local and (client is None or client.pid is None):
            continue  # its end not seen in this look (a connection opening or closing): the next look decides
        ours = of_ranks(client.pid, rank_pids) if client is not None else False
        if ours is None:
            continue  # its process ended since the look: the next look decides
        if ours or remote[0] not in local and remote[0] in rank_addresses:
            continue
        what = f"{remote[0]}:{remote[1]}"
        if client is not None and client.pid is not None:
            try:
                what += f" (pid {client.pid}, {psutil.Process(client.pid).name()})"
            except psutil.Error:
                what += f" (pid {client.pid})"
        found.append((what, server_side.fd, remote[0] in local, remote))
    return found


def refuse(fd: int, peer: tuple[str, int], port: int) -> bool:
    """End the connection on this process' socket ``fd`` (both directions) if it is still the one from
    ``peer`` (address, port) to the store's ``port``: the store's event loop sees the client leave; the
    client's next request fails. ``fd`` was read a moment before: if that connection closed meanwhile,
    the number may be another socket's now (a collective's), which is left alone. Returns whether it
    ended it."""
    try:
        end = socket.socket(fileno=os.dup(fd))
    except OSError:  # closed meanwhile
        return False
    with end:
        try:
            if end.getsockname()[1] != port or (_ip(end.getpeername()[0]), end.getpeername()[1]) != peer:
                return False
            end.shutdown(socket.SHUT_RDWR)
        except OSError:  # not a connected socket any more, or already gone
            return False
    return True


class ClientWatch:
    """Rank 0's look at the store's clients (module docstring): :meth:`start` a daemon thread that
    calls ``warn(line)`` once per foreign client; :meth:`stop` ends it."""

    def __init__(self, port: int, hosts: dict, warn: Callable[[str], None], every: float = EVERY_S):
        self.port, self.hosts, self.warn, self.every = port, hosts, warn, every
        self.seen: set[str] = set()
        self._stopped = threading.Event()

    def check(self) -> list[str]:
        """Look once: refuse (disconnect) every foreign client on this host, warn about each process (or
        remote host) not seen before, and return those clients."""
        new = []
        for client, fd, local, peer in foreign_clients(self.port, self.hosts):
            if local and not refuse(fd, peer, self.port):
                continue  # that connection is gone already
            who = client.split(":")[0] + (client.split(" (")[1] if " (" in client else "")  # its host and process
            if who not in self.seen:  # once per process (or remote host), however often it reconnects
                self.seen.add(who)
                new.append(client)
                what = "refused a client" if local else "a client from another host, left connected,"
                self.warn(f"rendezvous store: {what} at {client}: none of this job's ranks (it did not prove the "
                          "rendezvous nonce); the job goes on; who can reach the store: docs/trust.md")
        return new

    def start(self) -> None:
        def watch():
            while not self._stopped.wait(self.every):
                try:
                    self.check()
                except Exception:  # a look that fails (a process gone meanwhile) is skipped
                    pass

        threading.Thread(target=watch, daemon=True, name="fixres-store-clients").start()

    def stop(self) -> None:
        self._stopped.set()
