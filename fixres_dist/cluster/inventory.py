"""What the cluster has (``sinfo``) and whether a request fits it, before anything is submitted.

:func:`check_request` compares a :class:`~fixres_dist.cluster.request.SlurmRequest` with the
partitions that :func:`read_partitions` reads, and :func:`check_shared_folder` the job folders'
parent, so that an impossible job is refused in seconds instead of pending forever.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs

from fixres_dist.cluster.request import SlurmRequest
from fixres_dist.errors import FixresError

UNUSABLE_NODE_STATES = ("down", "drain", "fail", "inval", "maint", "future")
LOCAL_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs")


@attrs.frozen
class Node:
    name: str
    cpus: int
    memory_mb: int
    gpus: int
    state: str

    @property
    def usable(self) -> bool:
        return not self.state.lower().startswith(UNUSABLE_NODE_STATES)


@attrs.frozen
class Partition:
    name: str
    default: bool
    up: bool
    max_time_min: float | None   # None: no limit
    nodes: tuple[Node, ...]


def run_command(cmd: list[str], timeout: float = 15) -> str:
    """stdout of a SLURM command; FixresError with one line when it is missing, hangs or fails."""
    if shutil.which(cmd[0]) is None:
        raise FixresError(f"no SLURM here: {cmd[0]} is not on PATH (run on a login node, or start the local "
                          "test cluster with slurm/start-local-slurm.sh)")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise FixresError(f"{' '.join(cmd)} did not answer within {timeout:g} s (is slurmctld up?)") from None
    if out.returncode != 0:
        first = (out.stderr.strip() or out.stdout.strip() or f"exit status {out.returncode}").splitlines()[0]
        raise FixresError(f"{cmd[0]} failed: {first}")
    return out.stdout


def parse_time_limit(text: str) -> float | None:
    """SLURM time (``infinite``, ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``) in minutes."""
    text = text.strip()
    if text.lower() in ("infinite", "unlimited", "n/a", ""):
        return None
    days = 0
    if "-" in text:
        day_text, text = text.split("-", 1)
        days = int(day_text)
        hours, minutes, seconds = ([int(p) for p in text.split(":")] + [0, 0])[:3]
    else:
        parts = [int(p) for p in text.split(":")]
        hours, minutes, seconds = ([0, parts[0], 0] if len(parts) == 1 else
                                   [0, *parts] if len(parts) == 2 else parts[-3:])
    return days * 1440 + hours * 60 + minutes + seconds / 60


def parse_gpus(gres: str) -> int:
    """Number of GPUs in a ``sinfo %G`` value such as ``gpu:8``, ``gpu:a100:4(S:0-1),gpu:v100:2``."""
    total = 0
    for item in gres.split(","):
        fields = item.split("(")[0].split(":")
        if fields[0] == "gpu" and len(fields) >= 2 and fields[-1].isdigit():
            total += int(fields[-1])
    return total


def read_partitions() -> dict[str, Partition]:
    """Every partition with its nodes, from one ``sinfo -N`` call (raises FixresError)."""
    out = run_command(["sinfo", "-h", "-N", "-o", "%P|%a|%l|%N|%c|%m|%G|%T"])
    rows: dict[str, dict] = {}
    for line in out.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 8:
            continue
        name, avail, limit, node, cpus, mem, gres, state = fields
        row = rows.setdefault(name.rstrip("*"), {"default": name.endswith("*"), "up": avail == "up",
                                                 "max_time_min": parse_time_limit(limit), "nodes": []})
        row["nodes"].append(Node(node, int(cpus.rstrip("+") or 0), int(mem.rstrip("+") or 0),
                                 parse_gpus(gres), state))
    return {name: Partition(name, r["default"], r["up"], r["max_time_min"], tuple(r["nodes"]))
            for name, r in rows.items()}


def _fs_type(path: Path) -> str:
    best, kind = "", ""
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) >= 3 and str(path).startswith(fields[1]) and len(fields[1]) > len(best):
                    best, kind = fields[1], fields[2]
    except OSError:
        pass
    return kind


def check_shared_folder(path: Path, nodes: int) -> None:
    """The shared folder exists and this user can create files in it; warn if nodes cannot share it."""
    if not path.is_dir():
        raise FixresError(f"shared folder {path} does not exist (create it on a file system that every "
                          "node mounts, e.g. mkdir -p it, and pass it as --shared-folder-path)")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".fixres-write-test-"):
            pass
    except OSError as exc:
        raise FixresError(f"shared folder {path} is not writable: {exc.strerror or exc}") from None
    kind = _fs_type(path.resolve())
    if nodes > 1 and kind in LOCAL_FILESYSTEMS:
        print(f"fixres_dist: warning: shared folder {path} is on {kind}, which other nodes cannot see; "
              "ranks on other nodes will not find the rendezvous or the checkpoints", file=sys.stderr)


def check_request(request: SlurmRequest, partitions: dict[str, Partition]) -> SlurmRequest:
    """Refuse a job that can never run here; returns the request with partition and CPUs filled in.

    Raises :class:`FixresError` with one line for: an unknown or down partition; more nodes, tasks,
    CPUs, GPUs or memory than any usable node of the partition has; a time limit above the
    partition's. (The request checked its own values when it was made.)
    """
    r = request
    if not partitions:
        raise FixresError("sinfo lists no partitions: the cluster has no nodes configured")
    if r.partition is None:
        defaults = [p.name for p in partitions.values() if p.default]
        if not defaults:
            raise FixresError("the cluster has no default partition; give --partition "
                              f"(one of {', '.join(partitions)})")
        r = attrs.evolve(r, partition=defaults[0])
    if r.partition not in partitions:
        raise FixresError(f"partition {r.partition!r} does not exist (partitions: {', '.join(partitions)})")
    part = partitions[r.partition]
    if not part.up:
        raise FixresError(f"partition {part.name!r} is not up (sinfo shows it inactive or down)")
    if part.max_time_min is not None and r.timeout_min > part.max_time_min:
        raise FixresError(f"--timeout-min {r.timeout_min} exceeds the time limit of partition {part.name!r} "
                          f"({part.max_time_min:g} minutes)")

    def fits(node: Node, cpus_per_task: int) -> bool:
        return (node.cpus >= r.tasks * cpus_per_task and node.gpus >= r.gpus_per_node
                and (r.mem_gb is None or node.memory_mb >= r.mem_gb * 1024))

    cpus_per_task = r.cpus_per_task or max(1, min(n.cpus for n in part.nodes) // r.tasks)
    fitting = [n for n in part.nodes if fits(n, cpus_per_task)]
    if len(fitting) < r.nodes:
        biggest = max(part.nodes, key=lambda n: (n.gpus, n.cpus, n.memory_mb))
        want = (f"{r.nodes} node(s) with {r.tasks} task(s) x {cpus_per_task} CPU(s)"
                + (f", {r.gpus_per_node} GPU(s)" if r.gpus_per_node else "")
                + (f", {r.mem_gb:g} GB" if r.mem_gb else ""))
        raise FixresError(f"partition {part.name!r} cannot run {want}: {len(fitting)} of its "
                          f"{len(part.nodes)} node(s) are big enough (largest: {biggest.cpus} CPUs, "
                          f"{biggest.gpus} GPUs, {biggest.memory_mb / 1024:.1f} GB)")
    usable = [n for n in fitting if n.usable]
    if len(usable) < r.nodes:
        states = ", ".join(f"{n.name} {n.state}" for n in fitting)
        raise FixresError(f"partition {part.name!r}: only {len(usable)} of the {len(fitting)} node(s) that fit "
                          f"are usable ({states}); the job would pend until an admin brings them back")
    return attrs.evolve(r, cpus_per_task=cpus_per_task)
