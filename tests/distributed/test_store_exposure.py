"""Who can reach a job (issue 30): a spawned job listens on loopback only (its rendezvous store and
gloo), a client of the store that did not read the rendezvous file learns no nonce, counts as no
rank, is disconnected and named in rank 0's log, and the job goes on; the addresses rank 0's store
binds."""
from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from fixres_dist import FixresError
from fixres_dist.distributed import joiner_hosts, network, rendezvous, store_clients


def test_a_spawned_job_listens_on_loopback_and_refuses_a_foreign_store_client(slowed_job):
    """conftest.slowed_job: 4 spawned ranks, watched while they train."""
    host, port = slowed_job.store
    assert host == "127.0.0.1"
    assert port in {p for _, p in slowed_job.listening}  # the store, and gloo's sockets
    assert {address for address, _ in slowed_job.listening} == {"127.0.0.1"}, slowed_job.listening
    assert slowed_job.keys and not any("nonce" in key for key in slowed_job.keys), slowed_job.keys
    assert slowed_job.refused  # rank 0 ended its connection
    named = [line for line in slowed_job.stdout.splitlines()
             if line.startswith("warning: rendezvous store: refused a ")]
    assert any(f"a client at 127.0.0.1:{p} (pid " in line for p in slowed_job.foreign_ports for line in named), \
        (slowed_job.foreign_ports, named)
    assert len(named) == 1 and "none of this job's ranks" in named[0]  # once per process
    assert "eval @32px" in slowed_job.stdout  # the job went on to its end


def test_the_store_binds_only_what_it_needs(monkeypatch):
    assert rendezvous.bind_address(True) == "127.0.0.1"
    assert rendezvous.bind_address(True, "10.1.2.3") == "127.0.0.1"  # every rank here: loopback whatever asked
    assert rendezvous.bind_address(False, "127.0.0.1") == "127.0.0.1"  # a user's address, as given
    assert rendezvous.bind_address(False, "0.0.0.0") == "0.0.0.0"
    own = set(network.own_addresses())
    assert rendezvous.bind_address(False) in own or (not own and rendezvous.bind_address(False) == "127.0.0.1")
    assert rendezvous.ranks_on_one_host({rendezvous.ONE_HOST: "1"})
    assert rendezvous.ranks_on_one_host({"SLURM_JOB_NUM_NODES": "1"})
    assert not rendezvous.ranks_on_one_host({"SLURM_JOB_NUM_NODES": "2"}) and not rendezvous.ranks_on_one_host({})
    assert rendezvous.bind_address(False, "192.0.2.77") == "0.0.0.0"  # not this host's (a forwarded address)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(FixresError, match=f"^cannot open the rendezvous store on 127.0.0.1:{port}: "):
            rendezvous.make_store(f"tcp://127.0.0.1:{port}", 0, 2, 5)
    assert rendezvous.proof("a" * 32, "rank 1") != rendezvous.proof("b" * 32, "rank 1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "abc")
    with pytest.raises(FixresError, match=r"^MASTER_PORT='abc': not a port number \(1-65535\)$"):
        rendezvous.make_store("env://", 0, 2, 5)
    monkeypatch.setattr(rendezvous.socket, "gethostbyname", lambda name: "127.0.1.1")  # the Debian trap
    assert rendezvous.bind_address(False, "myhost") == "0.0.0.0"  # other hosts resolve it elsewhere


def test_rank_0_learns_where_the_joiners_run_before_opening_the_store(tmp_path):
    """By-hand ranks of a file rendezvous announce their host and network namespace first (a rank
    announced twice is refused): all here ->
    the store may listen on loopback; one elsewhere -> not; an announcement of a dead process of this
    host is not counted (rank 0 keeps waiting, then gives up naming the rank)."""
    path = tmp_path / "rendezvous.json"
    joiner_hosts.announce(path, 1, 3)
    joiner_hosts.announce(path, 2, 3)
    with pytest.raises(FixresError, match="another process already joined this job as rank 2 of 3"):
        joiner_hosts.announce(path, 2, 3)  # while the first announcement's process lives (its lock)
    assert joiner_hosts.all_here(path, 3, give_up=lambda missing: pytest.fail(f"waited for {missing}"))
    here = json.loads(joiner_hosts.announcement(path, 2).read_text())
    joiner_hosts.announcement(path, 2).write_text(json.dumps({**here, "hostname": "elsewhere"}))
    assert not joiner_hosts.all_here(path, 3, give_up=lambda missing: pytest.fail(f"waited for {missing}"))
    dead = subprocess.Popen(["true"])
    dead.wait()
    joiner_hosts.announcement(path, 2).write_text(json.dumps({**here, "pid": dead.pid}))

    def give_up(missing):
        raise FixresError(f"rank(s) {missing} never arrived")
    with pytest.raises(FixresError, match=r"rank\(s\) \[2\] never arrived"):
        joiner_hosts.all_here(path, 3, give_up)
    joiner_hosts.clear(path, 3)
    assert not list(tmp_path.iterdir())


def test_a_store_connection_shared_with_a_child_that_ended_is_not_taken_for_a_foreign_client():
    """psutil names one process per socket, and a loader worker shares its rank's connection to the store: that
    worker may be the one named, and may end before its parents are read. Such a connection is the rank's or
    unknown (looked at again), never foreign: taken for one, rank 0 shut its own store connection and the
    rank's next request failed with a broken pipe (seen: 2 looks in 300 while children came and went)."""
    child = subprocess.Popen(["true"])
    child.wait()
    assert store_clients.of_ranks(child.pid, {os.getpid()}) is None  # gone: cannot be told
    with subprocess.Popen(["sleep", "30"]) as alive:
        try:
            assert store_clients.of_ranks(alive.pid, {os.getpid()}) is True  # a child of a rank
            assert store_clients.of_ranks(alive.pid, {2 ** 22 + 1}) is False  # a process of no rank (no such pid)
        finally:
            alive.kill()
