"""Process-group ready time: from spawning N local ranks to every rank past ``init_process_group``.

What ``main_scratch.py --num-tasks N`` does before any training: the parent starts N processes with
torch.multiprocessing's ``spawn`` (as ``fixres_dist.launch.spawn``); each starts Python and imports
what a rank of main_scratch.py imports (torch, torchvision, ``fixres_dist.launch`` and the
Trainer), then meets the others through ``fixres_dist.distributed.init_process_group`` (default:
the ``file://`` rendezvous in the job folder, where rank 0 publishes a TCPStore; then gloo's own
connections, a barrier and the peer table). Each rank notes when it started running (imports done)
and when ``init_process_group`` returned; ready = the last rank's return - the moment the parent
called spawn. Best and median of ``--repeats`` attempts. The CPU seconds a rank spent importing
and meeting are printed too: on a shared machine other work stretches the wall-clock figures (the
header shows the load average), not these; on an idle machine with C cores the ready time is
about max(1, N / C) x the import CPU time.

Run from the repository root:  .venv/bin/python benchmarks/process_group_ready.py [--ranks 8]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not installed in .venv
from fixres_dist import distributed, launch  # noqa: E402,F401  (launch: what a spawned rank imports)


def rank_main(rank: int, world: int, url: str, backend: str, folder: str) -> None:
    started, import_cpu = time.time(), time.process_time()
    distributed.init_process_group(backend, url, rank, world, timeout=300)
    ready, ready_cpu = time.time(), time.process_time()
    distributed.destroy_process_group()
    Path(folder, f"rank{rank}.json").write_text(json.dumps({"started": started, "ready": ready,
                                                            "import_cpu": import_cpu,
                                                            "init_cpu": ready_cpu - import_cpu}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def attempt(world: int, rendezvous: str, backend: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="pg-ready-") as folder:
        url = f"file://{folder}/rendezvous.json" if rendezvous == "file" else f"tcp://127.0.0.1:{free_port()}"
        spawned = time.time()
        mp.start_processes(rank_main, args=(world, url, backend, folder), nprocs=world, start_method="spawn")
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]
    return {"imports": max(r["started"] for r in ranks) - spawned,
            "rendezvous": max(r["ready"] for r in ranks) - max(r["started"] for r in ranks),
            "ready": max(r["ready"] for r in ranks) - spawned,
            "import_cpu": statistics.median(r["import_cpu"] for r in ranks),
            "init_cpu": statistics.median(r["init_cpu"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rendezvous", choices=["file", "tcp"], default="file",
                        help="file: the default file:// rendezvous in the job folder; tcp: a fixed tcp:// address")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--json", metavar="FILE", help="write the figures here")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"process-group ready time: {args.ranks} local ranks, {args.backend}, {args.rendezvous}:// rendezvous, "
          f"spawn start method; {cores} cores, load average {os.getloadavg()[0]:.2f}", flush=True)
    runs = [attempt(args.ranks, args.rendezvous, args.backend) for _ in range(args.repeats)]
    print("| attempt | spawn -> last rank running (imports) | -> all past init_process_group | ready (total) "
          "| CPU s per rank: imports | init_process_group |")
    print("|--------:|-------------------------------------:|-------------------------------:|--------------:"
          "|------------------------:|-------------------:|")
    for i, r in enumerate(runs, 1):
        print(f"| {i:>7} | {r['imports']:>34.2f} s | {r['rendezvous']:>28.2f} s | {r['ready']:>11.2f} s "
              f"| {r['import_cpu']:>23.2f} | {r['init_cpu']:>18.3f} |")
    best, median = min(r["ready"] for r in runs), statistics.median(r["ready"] for r in runs)
    print(f"ready: best {best:.2f} s, median {median:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": args.ranks, "cores": cores, "runs": runs,
                                               "best": best, "median": median}, indent=2))


if __name__ == "__main__":
    main()
