"""Which addresses a rank publishes and which interface its collectives use (fixres_dist.distributed.network),
on this machine's real interfaces; the 2-node cases are in test_multinode.py."""
from __future__ import annotations

import os
import socket

import pytest

from fixres_dist.distributed import network
from fixres_dist.errors import FixresError


def test_rank_0_publishes_reachable_addresses_first_and_loopback_last():
    candidates = network.store_candidates()
    assert candidates[-1] == "127.0.0.1"
    assert "127.0.1.1" not in candidates  # the address a Debian host name resolves to on its own host
    assert set(candidates[:-1]) == set(network.own_addresses())


def test_ranks_all_on_this_host_use_the_loopback_interface(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    me = socket.gethostname()
    link = network.choose_link(me, {0: (me, network.own_addresses()), 1: (me, network.own_addresses())})
    assert (link.address, link.reason) == ("127.0.0.1", "all ranks on this host")
    assert link.interface == network.interface_of("127.0.0.1")


def test_a_peer_on_another_host_is_reached_over_the_interface_that_routes_to_it(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    addresses = network.own_addresses()
    if not addresses:
        pytest.skip("this machine has no interface but loopback")
    # a "peer" at one of this machine's own addresses: the kernel routes to it from that address
    link = network.choose_link("here", {0: ("here", []), 1: ("elsewhere", ["127.0.0.1", addresses[0]])})
    assert (link.interface, link.address) == (network.interface_of(addresses[0]), addresses[0])
    assert link.reason == "routes to elsewhere"


def test_no_route_to_a_peer_is_one_clear_error(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with pytest.raises(FixresError, match=r"no network interface of here routes to rank 1 on elsewhere "
                                          r"\(addresses 127\.0\.0\.1\); set GLOO_SOCKET_IFNAME"):
        network.choose_link("here", {0: ("here", []), 1: ("elsewhere", ["127.0.0.1"])})


def test_the_users_interface_wins_and_a_missing_one_is_refused(monkeypatch):
    loopback = network.interface_of("127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", loopback)
    link = network.choose_link("here", {0: ("here", []), 1: ("here", [])})
    assert (link.address, link.reason) == ("127.0.0.1", "GLOO_SOCKET_IFNAME")
    with pytest.raises(FixresError, match=f"GLOO_SOCKET_IFNAME={loopback} is a loopback interface, but the ranks "
                                          r"run on 2 hosts \(elsewhere, here\)"):
        network.choose_link("here", {0: ("here", []), 1: ("elsewhere", ["192.0.2.1"])})
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(FixresError, match="GLOO_SOCKET_IFNAME=nosuch0: this host has no interface nosuch0"):
        network.choose_link("here", {})


def test_the_choice_fills_only_the_variables_the_user_left_unset(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # unset, and restored after the test
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    network.apply_link(network.Link("eth7", "10.0.0.7", "test"))
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == ("eth7", "ib0")
