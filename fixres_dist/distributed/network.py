"""Which addresses a rank publishes, and which network interface it talks to its peers over.

The trap this module exists for: Debian and Ubuntu map a host's own name to ``127.0.1.1`` in
``/etc/hosts``, so ``gethostbyname(gethostname())`` (what a naive rendezvous publishes, and how
gloo picks its interface when ``GLOO_SOCKET_IFNAME`` is unset) gives an address that no other node
can reach. Instead:

* rank 0 of a file rendezvous publishes every address of its interfaces that are up
  (:func:`store_candidates`), and a joining rank tries them in turn until one answers;
* once the ranks have met, every rank knows every rank's host name and addresses, and picks the
  interface that routes to a rank on another host (:func:`choose_link`): the kernel's own routing
  decision (a UDP ``connect`` sends no packet), so the interface that the cluster network uses is
  chosen, not a management or container bridge that happens to come first. All ranks on this host:
  the loopback interface. ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` set by the user win;
  the ones left unset are set to the choice (:func:`apply_link`).

IPv4 only, as gloo's interface lookup by name.
"""
from __future__ import annotations

import ipaddress
import os
import socket

import attrs
import psutil

from fixres_dist.errors import FixresError

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def interface_addresses() -> list[tuple[str, str]]:
    """``(interface name, IPv4 address)`` of every interface that is up, non-loopback ones first
    (then in the order the system lists them)."""
    stats = psutil.net_if_stats()
    found = [(name, a.address) for name, addresses in psutil.net_if_addrs().items()
             if name in stats and stats[name].isup for a in addresses if a.family == socket.AF_INET]
    return sorted(found, key=lambda item: _is_loopback(item[1]))


def own_addresses() -> list[str]:
    """This host's non-loopback IPv4 addresses (what the other ranks may reach it at)."""
    return [address for _, address in interface_addresses() if not _is_loopback(address)]


def store_candidates() -> list[str]:
    """The addresses rank 0 publishes for its rendezvous store, most likely reachable first: the
    address its host name resolves to unless that is a loopback one (the 127.0.1.1 trap), then
    every non-loopback interface address, then ``127.0.0.1`` (ranks on this host)."""
    try:
        named = [socket.gethostbyname(socket.gethostname())]
    except OSError:
        named = []
    ordered = [a for a in named if not _is_loopback(a)] + own_addresses() + ["127.0.0.1"]
    return list(dict.fromkeys(ordered))


def route_source(address: str) -> str | None:
    """The local IPv4 address this host sends from to reach ``address``, or None if no route
    leads there. Asks the kernel's routing table through a UDP socket's ``connect`` (no packet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))
            return probe.getsockname()[0]
        except OSError:
            return None


def interface_of(address: str) -> str | None:
    """The name of the interface that holds the local ``address`` (None if none does)."""
    return next((name for name, a in interface_addresses() if a == address), None)


@attrs.frozen
class Link:
    """How this rank talks to its peers: the interface (e.g. ``eth0``), its IPv4 address, and why."""

    interface: str
    address: str
    reason: str  # "GLOO_SOCKET_IFNAME", "routes to <host>" or "all ranks on this host"


def _user_link() -> Link | None:
    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if not name:
        return None
    address = next((a for n, a in interface_addresses() if n == name), None)
    if address is None:
        raise FixresError(f"GLOO_SOCKET_IFNAME={name}: this host has no interface {name} that is up "
                          f"with an IPv4 address (it has: {', '.join(sorted({n for n, _ in interface_addresses()}))})")
    return Link(name, address, "GLOO_SOCKET_IFNAME")


def choose_link(my_host: str, peers: dict[int, tuple[str, list[str]]]) -> Link:
    """The interface this rank uses for the collectives (module docstring).

    ``peers``: global rank -> (host name, non-loopback IPv4 addresses) of every rank, this one
    included. Raises :class:`FixresError` when ``GLOO_SOCKET_IFNAME`` names no usable interface or a
    loopback one while ranks run on other hosts, or when no interface of this host routes to any
    address of a rank on another host.
    """
    user = _user_link()
    elsewhere = {rank: (host, addresses) for rank, (host, addresses) in sorted(peers.items()) if host != my_host}
    if user is not None and elsewhere and _is_loopback(user.address):
        hosts = sorted({my_host, *(host for host, _ in elsewhere.values())})
        raise FixresError(f"GLOO_SOCKET_IFNAME={user.interface} is a loopback interface, but the ranks run on "
                          f"{len(hosts)} hosts ({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''}): "
                          "unset it, or name an interface the hosts reach each other over")
    if user is not None:
        return user
    if not elsewhere:
        name = interface_of("127.0.0.1") or "lo"
        return Link(name, "127.0.0.1", "all ranks on this host")
    for host, addresses in elsewhere.values():
        for address in addresses:
            source = route_source(address)
            if source is not None and not _is_loopback(source) and (name := interface_of(source)):
                return Link(name, source, f"routes to {host}")
    rank, (host, addresses) = next(iter(elsewhere.items()))
    raise FixresError(f"no network interface of {my_host} routes to rank {rank} on {host} "
                      f"(addresses {', '.join(addresses) or 'none published'}); set GLOO_SOCKET_IFNAME")


def apply_link(link: Link) -> None:
    """Set ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to ``link``'s interface where unset
    (before the process group is created: gloo and NCCL read them then)."""
    for variable in IFNAME_VARIABLES:
        if not os.environ.get(variable):
            os.environ[variable] = link.interface
