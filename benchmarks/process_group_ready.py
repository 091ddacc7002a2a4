"""Process-group ready time: ``main_scratch.py --num-tasks N`` from its spawn to every rank past
``init_process_group``, against the time of one import of the package.

Each attempt runs a fresh launcher process (as a new ``python main_scratch.py`` would) that does
what ``fixres_dist.entry.launch.spawn`` does: takes the job lock, picks ``launch.start_method()``
(forkserver, whose server imports ``launch.FORKSERVER_PRELOAD`` once: torch, torchvision and this
package), starts the resource tracker and the server with the stop signals ignored, and starts N
ranks with ``torch.multiprocessing.start_processes``. Each rank does what a spawned rank does up
to a formed group: ``launch.stop_with_launcher()``, then its Trainer's session,
``RankSession(config, log, locked=True).open()`` (thread count, job folder, the ``file://`` rendezvous in the
job folder where rank 0 publishes a TCPStore, gloo's connections and barrier, the peer table, the
control group). ``--start-method spawn`` measures torch.multiprocessing's ``spawn`` instead (every
rank imports everything itself: the figure before the forkserver).

Figures per attempt: ``import`` = wall seconds of ``python -c "import fixres_dist.training.trainer"`` in a
fresh process, run just before the attempt (the unit of the goal: ready <= 2 x one import);
``ready`` = from the launcher's call to spawn (forkserver not yet running, as in a fresh launch)
to the last rank past ``init_process_group``, split into ``-> last rank running`` (the server's
import and the forks) and ``-> all ready`` (the rendezvous); ``from launch`` = from starting the
launcher's Python (its own import of the package included) to ready. Per rank: CPU seconds from
its start (for a forked rank: since the fork) to running its code, and from there to ready;
whether torch and the Trainer were already imported when its code started (``preloaded``: from
the forkserver; under ``spawn`` the rank imported them itself while unpickling its arguments, which
its CPU seconds to start show), and the modules it imported itself after that. ``--end-to-end``
also runs ``main_scratch.py --num-tasks N`` on the embedded data and times its log lines: the job
line (rank 0 running, before the rendezvous), the ``lr ...`` line (model, optimizer and DDP built:
the first step starts), and the stop after the first step (``--ckpt-every 1`` and
``FIXRES_FAULT=signal:rank=0:step=1``). On a shared machine other work stretches the wall-clock
figures: the load average is printed before and after; the CPU seconds are not affected.

Run from the repository root:  .venv/bin/python benchmarks/process_group_ready.py [--ranks 8] [--end-to-end]
"""
from __future__ import annotations

# Light module top: a forked or spawned rank runs this file again as __mp_main__ before its code.
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package is not installed in .venv


def rank_ready(index: int, config, lock, folder: str) -> None:
    """One rank, as ``fixres_dist.entry.launch._spawned_rank`` up to a formed process group."""
    started, cpu_started = time.time(), time.process_time()
    before = set(sys.modules)
    import attrs

    import fixres_dist.training.trainer  # noqa: F401  (what the forkserver preloads: counted as before the start)
    from fixres_dist.distributed.session import RankSession
    from fixres_dist.entry import launch
    launch.stop_with_launcher()
    session = RankSession(attrs.evolve(config, global_rank=index, local_rank=index), lambda message: None,
                          locked=True)
    session.open()
    ready, cpu_ready = time.time(), time.process_time()
    Path(folder, f"rank{index}.json").write_text(json.dumps({
        "started": started, "ready": ready, "cpu_to_start": cpu_started, "cpu_to_ready": cpu_ready - cpu_started,
        "preloaded": "torch" in before and "fixres_dist.training.trainer" in before,
        "imported_after_start": sorted(set(sys.modules) - before)}))
    session.close()


def launcher(folder: str, ranks: int, method: str) -> None:
    """The launcher of one attempt (a fresh process): what ``fixres_dist.entry.launch.spawn`` does."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    import torch.multiprocessing as mp

    from fixres_dist import io
    from fixres_dist.distributed import joblock
    from fixres_dist.distributed.preemption import ignoring, stop_signals
    from fixres_dist.entry import launch
    from fixres_dist.entry.cli import build_parser
    argv = ["--num-tasks", str(ranks), "--shared-folder-path", folder, "--job-id", "ready", "--no-progress"]
    config, source = launch.build_config("scratch", build_parser("scratch").parse_args(argv))  # as main_scratch.py
    assert source == "spawn", source
    io.make_private_folder(config.job_folder)
    lock = joblock.JobLock.acquire(config.job_folder, config.num_tasks)
    imported_all = time.time()
    spawned = time.time()
    if method == "launch":
        method = launch.start_method()
        with ignoring(stop_signals(config.preempt_signal)):
            multiprocessing.resource_tracker.ensure_running()
            if method == "forkserver":
                multiprocessing.forkserver.ensure_running()
    mp.start_processes(rank_ready, args=(config, launch.PassedFd(lock.fd), folder), nprocs=ranks,
                       start_method=method)
    lock.release()
    Path(folder, "launcher.json").write_text(json.dumps({
        "imported_all": imported_all, "spawned": spawned, "method": method}))


def one_import(python: str) -> tuple[float, float]:
    """``python -c "import fixres_dist.training.trainer"`` in a fresh process: (wall seconds of the whole
    process, start and exit included; seconds of the import statement alone)."""
    started = time.perf_counter()
    proc = subprocess.run([python, "-c", "import time; t = time.perf_counter(); import fixres_dist.training.trainer; "
                           "print(time.perf_counter() - t)"], check=True, env=_env(), capture_output=True, text=True)
    return time.perf_counter() - started, float(proc.stdout)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def attempt(python: str, ranks: int, method: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="pg-ready-") as folder:
        started = time.time()
        subprocess.run([python, __file__, "--launcher", folder, "--ranks", str(ranks), "--start-method", method],
                       check=True, env=_env())
        launched = json.loads(Path(folder, "launcher.json").read_text())
        rank_files = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(ranks)]
    spawned, last_running, last_ready = launched["spawned"], max(r["started"] for r in rank_files), \
        max(r["ready"] for r in rank_files)
    imported = sorted({m for r in rank_files for m in r["imported_after_start"]})
    return {"method": launched["method"], "ready": last_ready - spawned, "running": last_running - spawned,
            "rendezvous": last_ready - last_running, "from_launch": last_ready - started,
            "launcher_import": launched["imported_all"] - started,
            "cpu_to_start": statistics.median(r["cpu_to_start"] for r in rank_files),
            "cpu_to_start_max": max(r["cpu_to_start"] for r in rank_files),
            "cpu_to_ready": statistics.median(r["cpu_to_ready"] for r in rank_files),
            "preloaded": all(r["preloaded"] for r in rank_files), "imported_after_start": imported}


def end_to_end(python: str, ranks: int) -> dict:
    """``main_scratch.py --num-tasks N``: seconds from its start to its log lines and its exit."""
    marks = {"job": "job ", "lr": "lr ", "first step": "preempted by SIGUSR2"}
    seen = {}
    with tempfile.TemporaryDirectory(prefix="pg-e2e-") as folder:
        command = [python, str(ROOT / "main_scratch.py"), "--num-tasks", str(ranks), "--shared-folder-path", folder,
                   "--job-id", "e2e", "--input-size", "32", "--batch", "8", "--epochs", "1", "--workers", "0",
                   "--no-progress", "--ckpt-every", "1"]
        started = time.time()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**_env(), "FIXRES_FAULT": "signal:rank=0:step=1"})
        for line in proc.stdout:
            for name, prefix in marks.items():
                if name not in seen and line.startswith(prefix):
                    seen[name] = time.time() - started
        proc.wait()
        seen["exit"] = time.time() - started
        if proc.returncode != 3:
            raise SystemExit(f"main_scratch.py exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        proc.stderr.close()
    return seen


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--start-method", choices=["launch", "spawn"], default="launch",
                        help="launch: what main_scratch.py does (launch.start_method(): forkserver with the preload); "
                             "spawn: every rank imports everything itself (before the forkserver)")
    parser.add_argument("--end-to-end", action="store_true", help="also time main_scratch.py --num-tasks N to its "
                        "first training step")
    parser.add_argument("--json", metavar="FILE", help="write the figures here")
    parser.add_argument("--launcher", metavar="FOLDER", help=argparse.SUPPRESS)  # internal: one attempt's launcher
    args = parser.parse_args()
    if args.launcher:
        launcher(args.launcher, args.ranks, args.start_method)
        return
    python = sys.executable
    cores = len(os.sched_getaffinity(0))
    print(f"process-group ready time: {args.ranks} local ranks, gloo, file:// rendezvous, start method "
          f"{args.start_method}; {cores} cores, load average {load()}", flush=True)
    runs = []
    for _ in range(args.repeats):
        imported, statement = one_import(python)
        runs.append({"import": imported, "import_statement": statement,
                     **attempt(python, args.ranks, args.start_method)})
    print("| attempt | one import (statement) | ready | -> last rank running | -> all ready | ready / import "
          "| from launch | rank CPU s to start (max) | to ready | preloaded |")
    print("|--------:|-----------------------:|------:|---------------------:|------------:|---------------:"
          "|------------:|--------------------------:|---------:|:---------:|")
    for i, r in enumerate(runs, 1):
        print(f"| {i:>7} | {r['import']:>6.2f} s ({r['import_statement']:.2f} s) | {r['ready']:.2f} s "
              f"| {r['running']:>18.2f} s | {r['rendezvous']:>9.2f} s | {r['ready'] / r['import']:>14.2f} "
              f"| {r['from_launch']:>9.2f} s | {r['cpu_to_start']:>17.3f} ({r['cpu_to_start_max']:.3f}) "
              f"| {r['cpu_to_ready']:>8.3f} | {'yes' if r['preloaded'] else 'no':^9} |")
    imports = [r["import"] for r in runs]
    best, median = min(r["ready"] for r in runs), statistics.median(r["ready"] for r in runs)
    ratio = median / statistics.median(imports)
    print(f"ready: best {best:.2f} s, median {median:.2f} s; one import (fresh process): best {min(imports):.2f} s, "
          f"median {statistics.median(imports):.2f} s; ready / one import (medians): {ratio:.2f} (goal <= 2)")
    print(f"modules a rank imported after it started: {', '.join(runs[-1]['imported_after_start']) or 'none'}")
    result = {"ranks": args.ranks, "cores": cores, "start_method": args.start_method, "runs": runs, "best": best,
              "median": median, "import_median": statistics.median(imports), "ratio": ratio}
    if args.end_to_end:
        e2e = end_to_end(python, args.ranks)
        print(f"end to end, main_scratch.py --num-tasks {args.ranks} (embedded data, resnet18 @ 32 px): "
              + ", ".join(f"{name} line {seconds:.2f} s" if name != "exit" else f"exit {seconds:.2f} s"
                          for name, seconds in e2e.items()))
        result["end_to_end"] = e2e
    print(f"load average at the end: {load()}")
    result["load_average"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
