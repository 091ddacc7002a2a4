"""4 ranks on 2 nodes (2 each) and on one host: start-up, training speed, the stop after losing a node.

The nodes are slurm/start-local-cluster.sh's network namespaces on this machine (root), so the
"network" between them is a veth pair and a bridge in one kernel: what this measures is the cost of
going through real TCP between network namespaces, the address and interface choice, heartbeats
and the per-step stop check across hosts, not that of a physical network. The same 4 ranks are
started by hand with explicit flags (``--num-tasks 4 --global-rank R``), as in
tests/jobs/test_multinode.py, on n1 (ranks 0-1) and n2 (ranks 2-3), then all on this host. Printed per
layout: seconds from starting the ranks to rank 0's "ranks met" line (Python and torch start
included), to the end of the job, and the training speed (images/s, median over epochs 2 and
later, from ``metrics.jsonl``), with the ratio two nodes / one host.

Losing a node (``--dist-timeout``, default 30 s): the 4 ranks on the two nodes again, without an
end (``--epochs`` 1000), and once the first epoch is evaluated, n2's ranks are killed (SIGKILL),
or n2's link is taken down (packets vanish, no reset); printed: seconds from the loss to each
surviving rank's exit (n1's ranks when killed, all 4 when cut off; each must exit within
``--dist-timeout``, naming the ranks it lost: what tests/jobs/test_multinode.py checks, without timing
it), its exit status and its last ``fixres_dist: rank R:`` line.

Run from the repository root, as root, alone on the machine:
    .venv/bin/python benchmarks/two_nodes.py [--epochs 4] [--architecture resnet20] [--dist-timeout 30]
                                             [--only speed|lost-node] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fixres_dist.data.pipeline import embedded_data_path

ROOT = Path(__file__).resolve().parents[1]


def subset(dest: Path, train: int, val: int) -> Path:
    """The first ``train``/``val`` images per class of the embedded Fashion-MNIST canvas set."""
    src = embedded_data_path("fashion_mnist_canvas")
    for split, count in (("train", train), ("val", val)):
        for folder in sorted((src / split).iterdir()):
            (dest / split / folder.name).mkdir(parents=True)
            for image in sorted(folder.iterdir())[:count]:
                shutil.copy(image, dest / split / folder.name / image.name)
    return dest


def rank_commands(layout: str, args, data: Path, shared: Path, job: str, *extra) -> list[list[str]]:
    """The command lines of the 4 ranks of ``job`` (explicit ranks; on n1 and n2 for ``two nodes``)."""
    common = ["--data-path", str(data), "--shared-folder-path", str(shared), "--architecture", args.architecture,
              "--input-size", "32", "--batch", str(args.batch), "--workers", "0", "--no-progress",
              "--num-tasks", "4", "--job-id", job, *map(str, extra)]
    commands = []
    for rank in range(4):
        cmd = [sys.executable, "-u", str(ROOT / "main_scratch.py"), *common, "--global-rank", str(rank),
               "--local-rank", str(rank % 2)]
        if layout == "two nodes":
            cmd = ["bash", str(ROOT / "slurm" / "on-node.sh"), str(rank // 2 + 1), *cmd]
        commands.append(cmd)
    return commands


ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def events(folder: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def run(layout: str, args, data: Path, shared: Path) -> dict:
    """Start the 4 ranks of one layout; returns the times and speeds measured."""
    job = f"bench-{layout.replace(' ', '-')}"
    started, met = time.monotonic(), []
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
             for cmd in rank_commands(layout, args, data, shared, job, "--epochs", args.epochs)]

    def watch(stream):
        for line in stream:
            if "ranks met at the store" in line and not met:
                met.append((time.monotonic() - started, line.strip()))

    watcher = threading.Thread(target=watch, args=(procs[0].stdout,))
    watcher.start()
    codes = [p.wait() for p in procs]
    watcher.join()
    if codes != [0, 0, 0, 0]:
        raise SystemExit(f"{layout}: ranks exited with {codes}")
    speeds = [e["img_per_s"] for e in events(shared / job) if e["event"] == "train"][1:]
    return {"met": met[0][0], "line": met[0][1], "total": time.monotonic() - started,
            "img_per_s": statistics.median(speeds)}


def lose_node(loss: str, args, data: Path, shared: Path, logs: Path) -> dict:
    """The 4 ranks on n1 and n2 without an end; once the first epoch is evaluated, n2's ranks
    killed (``killed``) or n2's link down (``cut off``). Returns, per surviving rank, the seconds
    from the loss to its exit, its exit status and its last line."""
    job = f"lost-{loss.replace(' ', '-')}"
    procs = [subprocess.Popen(cmd, stdout=open(logs / f"{job}-rank{rank}.log", "w"), stderr=subprocess.STDOUT,
                              env=ENV)
             for rank, cmd in enumerate(rank_commands("two nodes", args, data, shared, job, "--epochs", 1000,
                                                      "--dist-timeout", args.dist_timeout))]
    survivors = [0, 1] if loss == "killed" else [0, 1, 2, 3]
    ended = {}
    try:
        while not any(e["event"] == "eval" for e in events(shared / job)):
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"{loss}: a rank ended before the first evaluation (logs in {logs})")
            time.sleep(0.1)
        if loss == "killed":
            for proc in procs[2:]:
                proc.kill()
        else:
            subprocess.run(["ip", "link", "set", "fxv2", "down"], check=True)
        lost = time.monotonic()
        while len(ended) < len(survivors) and time.monotonic() - lost < 10 * args.dist_timeout:
            for rank in survivors:
                if rank not in ended and procs[rank].poll() is not None:
                    ended[rank] = time.monotonic() - lost
            time.sleep(0.05)
    finally:
        subprocess.run(["ip", "link", "set", "fxv2", "up"], check=True)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    said = {rank: [line for line in (logs / f"{job}-rank{rank}.log").read_text().splitlines()
                   if line.startswith(f"fixres_dist: rank {rank}: ")] for rank in survivors}  # not c10d's noise
    lines = {rank: (said[rank] or ["(none)"])[-1] for rank in survivors}
    return {rank: {"seconds": ended.get(rank), "exit": procs[rank].returncode, "last": lines[rank]}
            for rank in survivors}


def print_speed(results: dict, args, load: float) -> None:
    print(f"4 ranks, {args.architecture} @ 32 px, batch {args.batch}/rank, {args.train_per_class * 10} training "
          f"images, {args.epochs} epochs, {os.cpu_count()} CPU cores, load average {load:.2f} at the start")
    print(results["two nodes"]["line"])
    print("| layout | ranks met (s) | whole job (s) | training (img/s) |")
    print("|---|---|---|---|")
    for layout, r in results.items():
        print(f"| {layout} | {r['met']:.1f} | {r['total']:.1f} | {r['img_per_s']:.0f} |")
    two, one = results["two nodes"], results["one host"]
    print(f"two nodes / one host: ranks met x{two['met'] / one['met']:.2f}, "
          f"training speed x{two['img_per_s'] / one['img_per_s']:.3f}")


def print_lost(lost: dict, args, load: float) -> None:
    print(f"\nlosing n2 after the first epoch, --dist-timeout {args.dist_timeout:g} s, "
          f"load average {load:.2f} at the start: seconds from the loss to each surviving rank's exit")
    print("| n2 | rank | exit (s) | within --dist-timeout | status | last line |")
    print("|---|---|---|---|---|---|")
    for loss, ranks in lost.items():
        for rank, r in ranks.items():
            seconds = "-" if r["seconds"] is None else f"{r['seconds']:.1f}"
            within = r["seconds"] is not None and r["seconds"] < args.dist_timeout
            print(f"| {loss} | {rank} | {seconds} | {'yes' if within else 'NO'} | {r['exit']} | {r['last'][:110]} |")


def measure(args) -> dict:
    """Both parts (or the one ``--only`` names) in a temporary folder; returns the figures."""
    with tempfile.TemporaryDirectory() as tmp:
        data = subset(Path(tmp) / "data", args.train_per_class, 20)
        shared = Path(tmp) / "shared"
        shared.mkdir()
        figures = {}
        if args.only in (None, "speed"):
            load = os.getloadavg()[0]
            results = {layout: run(layout, args, data, shared) for layout in ("two nodes", "one host")}
            print_speed(results, args, load)
            figures.update(load_average=load, **results)
        if args.only in (None, "lost-node"):
            load = os.getloadavg()[0]
            lost = {loss: lose_node(loss, args, data, shared, Path(tmp)) for loss in ("killed", "cut off")}
            print_lost(lost, args, load)
            figures["lost_node"] = {"load_average": load, "dist_timeout": args.dist_timeout, **lost}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="images per rank and step")
    parser.add_argument("--architecture", default="resnet20")
    parser.add_argument("--train-per-class", type=int, default=100)
    parser.add_argument("--dist-timeout", type=float, default=30.0, help="--dist-timeout of the lost-node runs")
    parser.add_argument("--only", choices=["speed", "lost-node"], help="one part only (default: both)")
    parser.add_argument("--json", metavar="FILE", help="write the figures here")
    args = parser.parse_args()
    made = "fxnode2" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out = subprocess.run(["bash", str(ROOT / "slurm" / "start-local-cluster.sh"), "--nodes", "2"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"cannot make the nodes: {out.stderr.strip().splitlines()[-1:]}")
    try:
        figures = measure(args)
    finally:
        if made:  # as it was: no nodes
            subprocess.run(["bash", str(ROOT / "slurm" / "stop-local-cluster.sh")], capture_output=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
