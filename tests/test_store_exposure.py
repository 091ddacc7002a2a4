"""Who can reach a job (issue 30): a 2-rank job on one host listens on loopback only (its rendezvous
store and gloo), a client of the store that did not read the rendezvous file learns no nonce, counts
as no rank, is disconnected and named in rank 0's log, and the job goes on; the addresses rank 0's
store binds."""
from __future__ import annotations

import datetime
import re
import socket

import psutil
import pytest
import torch.distributed as dist

from conftest import clean_env, start_script, wait_for
from fixres_dist import FixresError
from fixres_dist.distributed import network, rendezvous


def _ip(address: str) -> str:
    return address.removeprefix("::ffff:")


def _output(job) -> str:
    try:
        return job.stdout
    except FileNotFoundError:  # not begun yet
        return ""


def test_a_spawned_job_listens_on_loopback_and_names_a_foreign_store_client(tiny_data, tmp_path):
    job = start_script("scratch", "--num-tasks", 2, "--job-id", "exposed", "--shared-folder-path", tmp_path,
                       "--data-path", tiny_data, "--architecture", "resnet20", "--input-size", 32, "--batch", 4,
                       "--epochs", 1, "--workers", 0, "--no-progress",
                       env=clean_env(FIXRES_FAULT="slow-step:rank=0:seconds=0.5"))  # 10 steps: 5 s at least
    try:
        met = wait_for(lambda: re.search(r"2 ranks met at the store ([\d.]+):(\d+)", _output(job)), 120, "the ranks")
        host, port = met.group(1), int(met.group(2))
        assert host == "127.0.0.1"
        ranks = psutil.Process(job.pid).children(recursive=True)
        listening = wait_for(lambda: [c for p in ranks for c in p.net_connections(kind="tcp")
                                      if c.status == psutil.CONN_LISTEN], 30, "the listening sockets")
        assert port in {c.laddr.port for c in listening}  # the store, and gloo's sockets
        assert {_ip(c.laddr.ip) for c in listening} == {"127.0.0.1"}, listening
        foreign = dist.TCPStore(host, port, 2, False, datetime.timedelta(seconds=10))
        mine = [c.laddr.port for c in psutil.Process().net_connections(kind="tcp")
                if c.raddr and c.raddr.port == port]
        keys = foreign.list_keys()
        assert not any("nonce" in key for key in keys), keys  # only HMACs of it: see rendezvous.proof
        foreign.set("fixres/arrived/1", "1")  # an arrival without the proof counts for nothing
        foreign.set("fixres/junk", "x")
        wait_for(lambda: "warning: rendezvous store: refused a client at " in job.stdout, 60, "the refusal")
        with pytest.raises((RuntimeError, dist.DistError)):  # rank 0 ended its connection
            foreign.list_keys()
        assert job.wait(240) == 0, job.stderr[-3000:]
    finally:
        if job.returncode is None:
            job.kill()
    named = [line for line in job.stdout.splitlines() if line.startswith("warning: rendezvous store: refused a ")]
    assert any(f"a client at 127.0.0.1:{p} (pid " in line for p in mine for line in named), (mine, named)
    assert all("none of this job's ranks" in line for line in named) and len(named) == len(mine)
    assert "eval @32px" in job.stdout


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
