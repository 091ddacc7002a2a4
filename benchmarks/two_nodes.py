"""The same 4-rank job on 2 nodes (2 ranks each) and on one host: start-up and training speed.

The nodes are slurm/start-local-cluster.sh's network namespaces on this machine (root), so the
"network" between them is a veth pair and a bridge in one kernel: what this measures is the cost of
going through real TCP between network namespaces, the address and interface choice, heartbeats
and the per-step stop check across hosts, not that of a physical network. The same 4 ranks are
started by hand with explicit flags (``--num-tasks 4 --global-rank R``), as in
tests/test_multinode.py, on n1 (ranks 0-1) and n2 (ranks 2-3), then all on this host. Printed per
layout: seconds from starting the ranks to rank 0's "ranks met" line (Python and torch start
included), to the end of the job, and the training speed (images/s, median over epochs 2 and
later, from ``metrics.jsonl``), with the ratio two nodes / one host.

Run from the repository root, as root, alone on the machine:
    .venv/bin/python benchmarks/two_nodes.py [--epochs 4] [--architecture resnet20] [--json FILE]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fixres_dist.data import embedded_data_path  # noqa: E402


def subset(dest: Path, train: int, val: int) -> Path:
    """The first ``train``/``val`` images per class of the embedded Fashion-MNIST canvas set."""
    src = embedded_data_path("fashion_mnist_canvas")
    for split, count in (("train", train), ("val", val)):
        for folder in sorted((src / split).iterdir()):
            (dest / split / folder.name).mkdir(parents=True)
            for image in sorted(folder.iterdir())[:count]:
                shutil.copy(image, dest / split / folder.name / image.name)
    return dest


def run(layout: str, args, data: Path, shared: Path) -> dict:
    """Start the 4 ranks of one layout; returns the times and speeds measured."""
    job = f"bench-{layout.replace(' ', '-')}"
    common = ["--data-path", str(data), "--shared-folder-path", str(shared), "--architecture", args.architecture,
              "--input-size", "32", "--batch", str(args.batch), "--epochs", str(args.epochs), "--workers", "0",
              "--no-progress", "--num-tasks", "4", "--job-id", job]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started, met, procs = time.monotonic(), [], []
    for rank in range(4):
        cmd = [sys.executable, "-u", str(ROOT / "main_scratch.py"), *common, "--global-rank", str(rank),
               "--local-rank", str(rank % 2)]
        if layout == "two nodes":
            cmd = ["bash", str(ROOT / "slurm" / "on-node.sh"), str(rank // 2 + 1), *cmd]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))

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
    events = [json.loads(line) for line in (shared / job / "metrics.jsonl").read_text().splitlines()]
    speeds = [e["img_per_s"] for e in events if e["event"] == "train"][1:]
    return {"met": met[0][0], "line": met[0][1], "total": time.monotonic() - started,
            "img_per_s": statistics.median(speeds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="images per rank and step")
    parser.add_argument("--architecture", default="resnet20")
    parser.add_argument("--train-per-class", type=int, default=100)
    parser.add_argument("--json", metavar="FILE", help="write the figures here")
    args = parser.parse_args()
    out = subprocess.run(["bash", str(ROOT / "slurm" / "start-local-cluster.sh"), "--nodes", "2"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"cannot make the nodes: {out.stderr.strip().splitlines()[-1:]}")
    with tempfile.TemporaryDirectory() as tmp:
        data = subset(Path(tmp) / "data", args.train_per_class, 20)
        shared = Path(tmp) / "shared"
        shared.mkdir()
        load = os.getloadavg()[0]
        results = {layout: run(layout, args, data, shared) for layout in ("two nodes", "one host")}
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
    if args.json:
        Path(args.json).write_text(json.dumps({"load_average": load, **results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
