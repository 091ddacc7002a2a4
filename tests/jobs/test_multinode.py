"""Two nodes on one machine (slurm/start-local-cluster.sh): network namespaces n1 and n2 on a bridge,
each with its own hostname and the Debian /etc/hosts that maps that name to 127.0.1.1, sharing the
filesystem. 2 ranks per node, every way of launching them:

* ranks started by hand in shells on each node (explicit flags), which end exactly as the same job
  on one host does;
* torchrun ``--nnodes 2`` with its c10d rendezvous;
* sbatch ``--nodes 2 --ntasks-per-node 2`` of slurm/job.sbatch on a real 2-node SLURM (one slurmd
  per node namespace), preempted with the warning signal, requeued, resumed;
* submitit with ``nodes=2`` (slurm/submit.py);
* losing a node: every process of the node killed, or its link taken down (packets vanish, no
  reset), with explicit ranks, where every surviving rank on both sides exits naming the other
  side; and under SLURM, every process of the node killed or its link taken down, where the
  survivors requeue the job, which resumes from its last checkpoint on the two nodes.

What --dist-timeout bounds (a survivor's exit, a requeue after a loss) is awaited for the timeout
with a wide margin, as machine load stretches it; benchmarks/two_nodes.py measures how long it
takes. The jobs train a ResNet-20 (fast steps, small checkpoints) with ``--dist-timeout 20``: a
node cut off costs the survivors a 10 s collective time-out
(:func:`fixres_dist.distributed.collectives.collective_timeout`). The SLURM tests that stop a job mid-training
leave it enough work for the signal or the loss to land before its end: the default ResNet-18 for
the preemption, 12 epochs for the loss. The lost-node tests with explicit ranks fork their ranks
with torch imported and move them onto their node as slurm/on-node.sh moves a command
(:func:`fork_ranks`): docs/cluster.md's line without 4 Python interpreters to start, which the test of
that line itself starts.

Skipped, with the reason, where the nodes cannot be made (not root, no ``ip netns``) or SLURM cannot
start. Test traffic stays on loopback and the bridge these tests made.
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launched
import shown_commands as shown
from conftest import ROOT, clean_env, run_script, wait_for

CLUSTER_DIR = "/tmp/local-cluster"
SLURM_CONF = f"{CLUSTER_DIR}/slurm.conf"
START, STOP = ROOT / "slurm" / "start-local-cluster.sh", ROOT / "slurm" / "stop-local-cluster.sh"
ON_NODE = ROOT / "slurm" / "on-node.sh"
DIST_TIMEOUT = 20
LOSS_WAIT = 3 * DIST_TIMEOUT  # how long the tests wait for what --dist-timeout bounds (load stretches it)
# sacct looks no further back: SLURM numbers jobs from 1 again once a cluster's state is wiped, and
# its accounting keeps the jobs of earlier runs under the same ids.
SINCE = time.strftime("%Y-%m-%dT%H:%M:%S")


def _nodes_up() -> bool:
    if shutil.which("ip") is None:
        pytest.skip("no cluster nodes: the ip command (iproute2) is not installed")
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return all(f"fxnode{i}" in out.stdout.split() for i in (1, 2))


def _orphan_links() -> list[str]:
    """This machine's ends of node links (``fxv<i>``) whose node namespace is gone. The kernel
    removes them once nothing holds the namespace: at once, or up to about 2 minutes later where
    TCP connections of a node that was cut off still retry their last packets. Until then
    slurm/start-local-cluster.sh cannot make node i again."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [link for link in re.findall(r"^\d+: fxv(\d+)@", out, re.M) if f"fxnode{link}" not in namespaces]


def _start(*flags) -> None:
    """Run the cluster script; skip the module (with its last line) where it cannot start."""
    if os.geteuid() != 0:
        pytest.skip("no cluster nodes: network namespaces need root (slurm/start-local-cluster.sh)")
    out = subprocess.run(["bash", str(START), "--nodes", "2", *flags], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "LOCAL_SLURM_INSTALL": "0"})
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"no cluster nodes: slurm/start-local-cluster.sh {' '.join(flags)} failed: {last}")


@pytest.fixture(scope="module")
def nodes():
    """Nodes n1 and n2; made here (and removed afterwards) unless they already exist."""
    made = not _nodes_up()
    if made:  # nodes removed just before (by an earlier run) may still be going
        wait_for(lambda: not _orphan_links(), 240, "the links of nodes removed earlier to go")
    _start()
    yield
    if made:  # the kernel removes what is left of them (_orphan_links) on its own
        subprocess.run(["bash", str(STOP)], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def slurm_env(nodes):
    """The environment of a client of the 2-node SLURM (``SLURM_CONF``); its daemons started here
    (and stopped afterwards) unless they were up."""
    was_up = subprocess.run(["sinfo", "-h"], env={**os.environ, "SLURM_CONF": SLURM_CONF},
                            capture_output=True, timeout=15).returncode == 0 if Path(SLURM_CONF).exists() else False
    _start("--slurm")
    env = {k: v for k, v in clean_env().items() if not k.startswith("SLURM_")}
    yield {**env, "SLURM_CONF": SLURM_CONF, "PYTHON": sys.executable, "FIXRES_ROOT": str(ROOT)}
    if not was_up:
        subprocess.run(["bash", str(STOP), "--daemons-only"], capture_output=True, timeout=120)


def on_node(node: int, *cmd) -> list[str]:
    return ["bash", str(ON_NODE), str(node), *map(str, cmd)]


def flags(data: Path, shared: Path, epochs: int = 1, architecture: str = "resnet20") -> list[str]:
    return ["--data-path", str(data), "--shared-folder-path", str(shared), "--architecture", architecture,
            "--input-size", "32", "--batch", "8", "--epochs", str(epochs), "--workers", "0", "--no-progress",
            "--dist-timeout", str(DIST_TIMEOUT)]


def node_of(rank: int) -> int:
    """Ranks 0-1 run on n1, 2-3 on n2."""
    return rank // 2 + 1


def by_hand(rank: int, job_id: str, args: list[str]) -> list[str]:
    """docs/cluster.md's line that starts one rank by hand (``python main_scratch.py ...``), then ``args``."""
    readme = shown.argv(shown.command("python main_scratch.py --num-tasks 4 --global-rank R"), R=rank, L=rank % 2,
                        DATA=args[args.index("--data-path") + 1], SHARED=args[args.index("--shared-folder-path") + 1],
                        myjob=job_id, **{"main_scratch.py": ROOT / "main_scratch.py"})
    return [*readme, *args]


def start_ranks(job_id: str, args: list[str], tmp_path: Path) -> list[subprocess.Popen]:
    """The 4 ranks, each started by hand in a shell on its node: docs/cluster.md's line run by
    slurm/on-node.sh, a Python interpreter of its own; output in rank<R>.log."""
    procs = []
    for rank in range(4):
        log = open(tmp_path / f"rank{rank}.log", "w")
        cmd = on_node(node_of(rank), sys.executable, "-u", *by_hand(rank, job_id, args)[1:])
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=clean_env(), text=True))
    return procs


CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000


def enter_node(node: int) -> None:
    """Make this single-threaded process one of node ``node``'s, as slurm/on-node.sh makes its
    command: the node's network namespace, its host name (a UTS namespace of its own) and its
    /etc/hosts, bound over this machine's in a mount namespace of its own (mounts private, as
    unshare(1) makes them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/fxnode{node}") as netns:
        if libc.setns(netns.fileno(), CLONE_NEWNET) != 0 or libc.unshare(CLONE_NEWUTS | CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter node n{node}")
    socket.sethostname(f"n{node}")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "--bind", f"/etc/netns/fxnode{node}/hosts", "/etc/hosts"], check=True)


def fork_ranks(job_id: str, args: list[str], tmp_path: Path) -> list[launched.Started]:
    """The same 4 ranks as :func:`start_ranks` (docs/cluster.md's line and ``args``, on the same nodes),
    each a process forked with torch already imported (no interpreter to start: for the tests
    about what happens once they run); output in rank<R>.log."""
    return [launched.start("scratch", *by_hand(rank, job_id, args)[2:], env=clean_env(),
                           before=functools.partial(enter_node, node_of(rank)), log=tmp_path / f"rank{rank}.log")
            for rank in range(4)]


def events(folder: Path, kind: str | None = None) -> list[dict]:
    """The job's metrics.jsonl events (of ``kind`` only), [] while it cannot be read."""
    try:
        found = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
    return [e for e in found if kind is None or e["event"] == kind]


def final_eval(folder: Path) -> dict:
    return [e for e in events(folder) if e["event"] == "eval"][-1]


MET = re.compile(r"4 ranks met at the store (10\.78\.0\.1|n1):\d+ on 2 host\(s\): "
                 r"n1 ranks 0-1 over fxp1 10\.78\.0\.1; n2 ranks 2-3 over fxp2 10\.78\.0\.2")


def test_ranks_started_in_shells_on_two_nodes_train_like_the_same_job_on_one_host(nodes, tiny_data, tmp_path):
    """Each node's name resolves to 127.0.1.1 on that node: the ranks must meet at addresses the
    other node reaches and use the bridge interface for gloo. The job then ends exactly as the same
    4-rank job on one host (same evaluation of all 30 validation images, same loss)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    procs = start_ranks("two-nodes", flags(tiny_data, shared), tmp_path)
    port = wait_for(lambda: re.search(r"met at the store 10\.78\.0\.1:(\d+)", (tmp_path / "rank0.log").read_text()),
                    240, "the ranks to meet").group(1)
    listening = subprocess.run(["ip", "netns", "exec", "fxnode1", "ss", "-Hltn", f"sport = :{port}"],
                               capture_output=True, text=True, check=True).stdout.split()
    assert listening[3] == f"10.78.0.1:{port}", listening  # issue 30: the bridge address only, not every interface
    codes = [p.wait(timeout=300) for p in procs]
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(4)]
    assert codes == [0, 0, 0, 0], logs
    assert MET.search(logs[0]), logs[0]
    one_host = run_script("scratch", *flags(tiny_data, shared), "--num-tasks", "4", "--job-id", "one-host")
    assert one_host.returncode == 0, one_host.stderr[-3000:]
    assert "4 ranks met at the store" in one_host.stdout and "on 1 host(s)" in one_host.stdout
    two, one = final_eval(shared / "two-nodes"), final_eval(shared / "one-host")
    assert two["images"] == one["images"] == 30
    assert (two["top1"], two["top5"], two["loss"]) == (one["top1"], one["top5"], one["loss"])


def test_torchrun_with_two_nodes_and_its_c10d_rendezvous(nodes, tiny_data, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    torchrun = Path(sys.executable).with_name("torchrun")
    readme = shown.argv(shown.command("torchrun --nnodes 2"), DATA=tiny_data, SHARED=shared,
                        **{"main_scratch.py": ROOT / "main_scratch.py"})
    procs = [subprocess.Popen(on_node(node, torchrun, *readme[1:], *flags(tiny_data, shared)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env())
             for node in (1, 2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert MET.search(outs[0]), outs[0]
    (folder,) = [p for p in shared.iterdir() if p.name != "file_index"]  # both nodes derived the same job id
    assert final_eval(folder)["images"] == 30


def _command_name(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # already gone
        return ""


def lose_n2(loss: str) -> bool:
    """Every process of node n2 killed (``killed``), or its link taken down (``cut off``).
    Returns whether that killed n2's slurmd (the 2-node SLURM was up)."""
    if loss == "cut off":
        subprocess.run(["ip", "link", "set", "fxv2", "down"], check=True)
        return False
    pids = subprocess.run(["ip", "netns", "pids", "fxnode2"], capture_output=True, text=True).stdout.split()
    slurmd = "slurmd" in map(_command_name, pids)
    subprocess.run(["kill", "-KILL", *pids])
    return slurmd


def bring_back_n2(loss: str, slurmd: bool) -> None:
    """Undo :func:`lose_n2`: n2's link up and, if it was killed, n2's slurmd again. Cut off, the
    connections that processes which ended meanwhile left half-closed on either node go too: they
    would retry their last packets for up to 2 minutes more, keeping the node namespaces (and
    their links) alive after the nodes are removed."""
    subprocess.run(["ip", "link", "set", "fxv2", "up"], check=True)
    if slurmd:
        _start("--slurm")
    elif loss == "cut off":
        for node in (1, 2):
            subprocess.run(["ip", "netns", "exec", f"fxnode{node}", "ss", "-K", "-t", "state", "fin-wait-1",
                            "state", "fin-wait-2", "state", "closing", "state", "last-ack"], capture_output=True)


# The last line of each surviving rank once n2 is lost: n1's name the ranks on n2, which fell
# silent; n2's (cut off) name rank 0 on n1, whose store they no longer reach.
LOST_N2 = "lost ranks 2-3 on n2 (no heartbeat"
LOST_STORE = "lost rank 0 on n1, which hosts the rendezvous store"


def expected_loss(rank: int, ended: list[int]) -> tuple[str, ...]:
    """What ``rank``'s last line may name, given the order the survivors ended in (``ended``).

    Rank 1 may be blocked in a collective on rank 0 rather than on n2's ranks; rank 0 keeps its
    store up after its own line only until the ranks still running have said why they stop, for at
    most 6 s (:meth:`fixres_dist.distributed.rendezvous.Rendezvous.hold_store`). Where rank 1 is still blocked
    then (a loaded machine), rank 0's exit is what ends its wait, and it names rank 0's store: only
    after rank 0 ended."""
    if rank >= 2:
        return (LOST_STORE,)
    if rank == 1 and ended.index(0) < ended.index(1):
        return LOST_N2, LOST_STORE
    return (LOST_N2,)


@pytest.mark.parametrize("loss", [pytest.param("killed", marks=pytest.mark.slow), "cut off"])  # killed: the easier case
def test_a_lost_node_ends_every_rank_within_the_timeout_naming_the_ranks_lost_and_their_host(nodes, tiny_data,
                                                                                            tmp_path, loss):
    """Mid-training (the first epoch evaluated, all 4 ranks running), every process of n2 is killed,
    or n2's link goes down (no reset: packets vanish). Killed, ranks 2-3 end by SIGKILL; every
    surviving rank exits 1, without a traceback, its last line naming the ranks it lost and their
    host: n1's name ranks 2-3 on n2 (rank 1 may name rank 0's store instead, once rank 0 ended
    first: :func:`expected_loss`); cut off, n2's name rank 0 on n1 (the store). Their exits are
    awaited for --dist-timeout with a wide margin; benchmarks/two_nodes.py measures them."""
    shared = tmp_path / "shared"
    shared.mkdir()
    procs = fork_ranks("lost", flags(tiny_data, shared, epochs=1000), tmp_path)
    survivors = [0, 1] if loss == "killed" else [0, 1, 2, 3]
    ended = []  # the survivors, in the order they were seen to end

    def all_ended() -> bool:
        ended.extend(r for r in survivors if r not in ended and procs[r].poll() is not None)
        return len(ended) == len(survivors)

    slurmd = False
    try:
        wait_for(lambda: any(e["event"] == "eval" for e in events(shared / "lost")), 240, "the first epoch")
        assert [p.poll() for p in procs] == [None] * 4, "a rank ended before n2 was lost"
        slurmd = lose_n2(loss)
        wait_for(all_ended, LOSS_WAIT, poll=0.05,
                 what=f"the surviving ranks to exit after n2 was {loss} (--dist-timeout {DIST_TIMEOUT})")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        bring_back_n2(loss, slurmd)
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(4)]
    assert [p.returncode for p in procs] == [1 if r in survivors else -signal.SIGKILL for r in range(4)], logs
    for rank in range(4):
        said = [line for line in logs[rank].splitlines() if line.startswith(f"fixres_dist: rank {rank}: ")]
        if rank in survivors:
            lost = tuple(f"fixres_dist: rank {rank}: {what}" for what in expected_loss(rank, ended))
            assert said and said[-1].startswith(lost), (ended, logs[rank])
        else:
            assert said == [], logs[rank]  # killed: not a word
    assert not any("Traceback" in log or "frame #" in log for log in logs), logs



def assert_kept_global_batch(folder: Path) -> list[dict]:
    """A job of 4 ranks (2 on each node, 8 images each) that lost n2 and grew back: two ``world_change``
    events, 4 ranks on n1, n2 -> 2 on n1 (2 micro-batches each: the same 32-image steps; images trained
    since the last checkpoint counted) -> 4 on both; every epoch trained once, on all 80 images, and
    the final evaluation on all 30. Returns the events."""
    changes = events(folder, "world_change")
    assert [(e["ranks_before"], e["ranks_after"], e["hosts_before"], e["hosts_after"], e["accumulation"])
            for e in changes] == [(4, 2, ["n1", "n2"], ["n1"], 2), (2, 4, ["n1"], ["n1", "n2"], 1)], changes
    assert all(e["global_batch"] == e["global_batch_before"] == 32 for e in changes), changes
    assert changes[0]["images_lost"] is not None and changes[0]["images_lost"] >= 0, changes
    trained = events(folder, "train")
    assert [e["epoch"] for e in trained] == list(range(1, len(trained) + 1))
    assert all(e["images"] == 80 for e in trained), trained
    assert final_eval(folder)["images"] == 30
    return changes


@pytest.mark.slow
def test_torchrun_elastic_continues_on_the_surviving_node_and_grows_back(nodes, tiny_data, tmp_path):
    """docs/cluster.md's elastic torchrun line on both nodes (a LayerNorm ViT, 8 images a rank): every
    process of n2 killed mid-training, n1's agent restarts its 2 ranks, which continue from the last
    checkpoint with the global batch of 32 kept; n2's agent started again, the job grows back to 4 ranks at
    a checkpoint (torchrun stops the workers with SIGTERM) and completes (``-s`` prints the time from the
    loss to training again)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    torchrun = Path(sys.executable).with_name("torchrun")
    readme = shown.argv(shown.command("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2"), DATA=tiny_data,
                        SHARED=shared, **{"main_scratch.py": ROOT / "main_scratch.py"})
    variable, value = readme[0].split("=")
    argv = [*readme[2:], *flags(tiny_data, shared, epochs=150, architecture="timm/test_vit"), "--ckpt-every", "5"]

    def agent(node: int, name: str) -> subprocess.Popen:
        with open(tmp_path / name, "w") as out:
            return subprocess.Popen(on_node(node, torchrun, *argv), stdout=out, stderr=subprocess.STDOUT, text=True,
                                    env=clean_env(**{variable: value}))
    folder = shared / "myjob"
    n1, n2 = agent(1, "n1.log"), agent(2, "n2.log")
    back, slurmd = None, False
    try:
        wait_for(lambda: (folder / "checkpoint.pth").exists(), 240, "the first checkpoint")
        slurmd = lose_n2("killed")
        lost = time.time()
        wait_for(lambda: events(folder, "world_change"), LOSS_WAIT, "the job to continue on n1")
        print(f"node killed: training again on n1 {events(folder, 'world_change')[0]['time'] - lost:.1f} s after "
              "the loss")
        bring_back_n2("killed", slurmd)
        back, started = agent(2, "n2-back.log"), time.time()
        wait_for(lambda: len(events(folder, "world_change")) == 2, 120, "the job to grow back to both nodes")
        grown = events(folder, "world_change")[1]["time"]
        print(f"n2's agent started again: training on both nodes {grown - started:.1f} s later")
        assert n1.wait(timeout=300) == 0 and back.wait(timeout=60) == 0, (tmp_path / "n1.log").read_text()[-3000:]
    finally:
        for proc in (n1, n2, back):
            if proc is not None and proc.poll() is None:
                proc.kill()
        if back is None:
            bring_back_n2("killed", slurmd)
    assert n2.returncode == -signal.SIGKILL
    changes = assert_kept_global_batch(folder)
    log = (tmp_path / "n1.log").read_text()
    assert "world change: 4 ranks on n1, n2 -> 2 ranks on n1: " in log and "lr 0.0125 = 0.1 x 32 (global batch kept: " \
        "2 ranks x 2 accumulated) / 256" in log, log[-3000:]
    assert "lost ranks 2-3 on n2" in changes[0]["lost"], changes
    assert "preempted by SIGTERM" in log  # the restart point that admitted n2 again

# ------------------------------------------------------------------------------------------ SLURM
def sbatch(env: dict, tmp_path: Path, data: Path, shared: Path, *args, command: str = "") -> str:
    """docs/cluster.md's 2-node sbatch line (``slurm/job.sbatch main_scratch.py``), or ``command``, then ``args``."""
    command = command or shown.command("sbatch --nodes 2 --ntasks-per-node 2 slurm/job.sbatch")
    readme = shown.argv(command, DATA=data, SHARED=shared, **{"slurm/job.sbatch": ROOT / "slurm" / "job.sbatch"})
    out = subprocess.run([readme[0], "--parsable", "--time", "10", "--output", str(tmp_path / "job.out"), *readme[1:],
                          *map(str, args)], capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def sacct_states(env: dict, job_id: str) -> list[str]:
    """Every run of the job in sacct since these tests started (``SINCE``), oldest first."""
    out = subprocess.run(["sacct", "-n", "-X", "-D", "-P", "-S", SINCE, "-j", job_id, "-o", "State"],
                         capture_output=True, text=True, timeout=15, env=env)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def restarts(env: dict, job_id: str) -> int:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=15, env=env)
    found = re.search(r"Restarts=(\d+)", out.stdout)
    return int(found.group(1)) if found else 0


def job_log(tmp_path: Path):
    """What a failed wait shows: the end of the job's output (``sbatch --output``)."""
    return lambda: (tmp_path / "job.out").read_text()[-3000:] if (tmp_path / "job.out").exists() else "(no job.out)"


def finished(env: dict, job_id: str) -> bool:
    return (sacct_states(env, job_id) or ["?"])[-1] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


@pytest.mark.slow
def test_sbatch_on_two_nodes_is_preempted_requeued_and_resumes(slurm_env, tiny_data, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    job = sbatch(slurm_env, tmp_path, tiny_data, shared, *flags(tiny_data, shared, epochs=3, architecture="resnet18"),
                 "--ckpt-every", "2")
    wait_for(lambda: list((shared / job).glob("checkpoint-*.pth")), 240, "the first periodic checkpoint",
             shown=job_log(tmp_path))
    subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30, env=slurm_env)
    wait_for(lambda: finished(slurm_env, job), 300, f"job {job} to finish", shown=job_log(tmp_path))
    log = (tmp_path / "job.out").read_text()
    assert wait_for(lambda: sacct_states(slurm_env, job) == ["REQUEUED", "COMPLETED"], 15, "requeued, completed"), log
    assert f"job {job} restart 0: 4 task(s) on n[1-2]" in log and f"job {job} restart 1: 4 task(s) on n[1-2]" in log
    assert len(MET.findall(log)) == 2, log  # both runs met across the two nodes
    assert re.search(rf"job {job} restart 1: .*\n(.*\n)*resumed from ", log), log
    assert final_eval(shared / job)["images"] == 30


@pytest.mark.slow
def test_submitit_with_two_nodes(slurm_env, tiny_data, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    readme = shown.argv(shown.command("python slurm/submit.py scratch --nodes 2"), DATA=tiny_data, SHARED=shared)
    split = readme.index("--")
    out = subprocess.run([sys.executable, *readme[1:split], "--timeout-min", "10", "--poll-s", "1", *readme[split:],
                          *flags(tiny_data, shared)], capture_output=True, text=True, timeout=400, env=slurm_env,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = re.findall(r"^\|\s+(\d) \| (n\d) \|\s+0 \|\s+32 px \|", out.stdout, re.M)
    assert sorted(rows) == [("0", "n1"), ("1", "n1"), ("2", "n2"), ("3", "n2")], out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["killed", "cut off"])
def test_a_lost_node_under_slurm_requeues_the_job_which_resumes_on_two_nodes(slurm_env, tiny_data, tmp_path, loss):
    """Every process of n2 (its slurmd too) killed, or n2's link down: the ranks on n1 name ranks 2-3
    on n2 and requeue the job (awaited for --dist-timeout with a wide margin; ``-s`` prints how
    long it took); once n2 is back, the job runs again on both nodes and resumes."""
    shared = tmp_path / "shared"
    shared.mkdir()
    job = sbatch(slurm_env, tmp_path, tiny_data, shared, *flags(tiny_data, shared, epochs=12))
    wait_for(lambda: (shared / job / "checkpoint.pth").exists(), 240, "the first checkpoint", shown=job_log(tmp_path))
    slurmd = lose_n2(loss)
    lost = time.monotonic()
    try:
        wait_for(lambda: restarts(slurm_env, job) == 1, LOSS_WAIT, "the survivors to requeue the job",
                 shown=job_log(tmp_path))
        print(f"node {loss}: job requeued {time.monotonic() - lost:.1f} s after the loss")
    finally:
        bring_back_n2(loss, slurmd)
    wait_for(lambda: finished(slurm_env, job), 400, f"job {job} to finish after the requeue",
             shown=job_log(tmp_path))
    log = (tmp_path / "job.out").read_text()
    assert sacct_states(slurm_env, job)[-1] == "COMPLETED", log
    assert re.search(rf"job {job}: rank [01] requeued it \(restart 1 of at most 3\) after losing ranks 2-3 on n2",
                     log), log
    assert re.search(rf"job {job} restart 1: .*\n(.*\n)*resumed from ", log), log
    assert final_eval(shared / job)["images"] == 30


@pytest.mark.slow
def test_with_a_node_range_under_slurm_a_lost_node_leaves_the_job_on_the_survivors_until_it_grows_back(
        slurm_env, tiny_data, tmp_path):
    """``sbatch --nodes 1-2``: every process of n2 (its slurmd too) killed after the first checkpoint;
    the step starts again at once on n1 alone (2 ranks) from that checkpoint, without waiting for n2
    (``-s`` prints how long from the loss to training again); n2 back, the job stops at a checkpoint,
    requeues itself, grows back to 4 ranks on both nodes and completes."""
    shared = tmp_path / "shared"
    shared.mkdir()
    env = {**slurm_env, "FIXRES_GROW_CHECK_S": "3", "FIXRES_MIN_NODES": "1"}  # sacct: not from the nodes here
    job = sbatch(env, tmp_path, tiny_data, shared, *flags(tiny_data, shared, epochs=12), "--ckpt-every", "2",
                 command=shown.command("sbatch --nodes 1-2 --ntasks-per-node 2 slurm/job.sbatch"))
    log = tmp_path / "job.out"
    wait_for(lambda: (shared / job / "checkpoint.pth").exists(), 240, "the first checkpoint", shown=job_log(tmp_path))
    slurmd = lose_n2("killed")
    lost = time.monotonic()
    try:
        resumed = rf"job {job} restart 0\.1: 2 task\(s\) on n1: .*\n(.*\n)*resumed from "
        # SLURM's part: srun returns once slurmctld counts n2 out (SlurmdTimeout=30 here, and slurmctld looks
        # every SlurmdTimeout/3), then the step starts again: 2 interpreters importing torch, then the resume.
        # 60-100 s on 2 idle cores; seen past 120 s with other tests running beside it.
        wait_for(lambda: re.search(resumed, log.read_text()), 3 * LOSS_WAIT, "the step to start again on n1",
                 shown=job_log(tmp_path))
        print(f"node killed: training again on n1 {time.monotonic() - lost:.1f} s after the loss")
    finally:
        bring_back_n2("killed", slurmd)
    wait_for(lambda: finished(env, job), 400, f"job {job} to finish after growing back",
             shown=job_log(tmp_path))
    text = log.read_text()
    assert sacct_states(env, job) == ["RESIZING", "COMPLETED"], text  # n2 removed from the job, then requeued
    assert re.search(rf"job {job}: rank [01] stops after losing ranks 2-3 on n2", text), text
    assert "world change: 4 ranks on n1, n2 -> 2 ranks on n1: " in text, text
    assert re.search(rf"job {job}: 1 node\(s\) idle in partition debug while it runs on 1 of at most 2", text), text
    assert f"job {job} restart 1: 4 task(s) on n[1-2]" in text, text
    assert re.search(rf"job {job} restart 1: .*\n(.*\n)*world change: 2 ranks on n1 -> 4 ranks on n1, n2: ", text), text
    assert_kept_global_batch(shared / job)
