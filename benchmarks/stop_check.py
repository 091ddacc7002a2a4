"""Cost per training step of the stop check: a blocking all-reduce against the pipelined one.

After every training step the ranks agree whether any of them got a stop signal or a non-finite
loss (``fixres_dist.distributed.preemption.StepAgreement``, on the gloo control group). ``blocking`` is what
the Trainer did before: ``StepAgreement.now`` after every step, one all-reduce whose network round
trip every step waits for. ``pipelined`` is what it does now: ``StepAgreement.after_step`` waits
for the all-reduce started after the previous step (it ran in the background during this step)
and starts this step's. ``none`` runs the same steps without any check.

A "step" is, with ``--work``:

* ``sleep`` (default): ``--step-ms`` of ``time.sleep``, the host idle as while a GPU computes;
* ``spin``: ``--step-ms`` of busy Python on the host (a CPU step without communication);
* ``ddp``: a real DDP training step on the CPU (``--architecture`` at ``--size`` px, ``--batch``
  images per rank, one thread per rank, its gradient all-reduce on the same gloo group as the
  check, as in a CPU run of the Trainer).

Each rank runs ``--rounds`` rounds; a round runs ``--steps`` steps of each of none, blocking and
pipelined (in a rotating order, after a barrier). Columns (rank 0's view; ``--json`` holds every
rank's): ``step ms``, the median time of one whole step with its check; ``in check us``, the
median time spent inside the check call; ``cost us/step``, median step time minus that of
``none`` in the same rounds (negative or noisy figures mean the cost is below the noise);
``% of step``, ``in check`` over the ``none`` step time. On a shared machine the header's load
average says how much to trust the wall-clock figures.

Local ranks (spawned here; tcp://127.0.0.1:<free port>):
  .venv/bin/python benchmarks/stop_check.py [--num-tasks 2] [--work sleep|spin|ddp]
One rank per node, e.g. 2 network-namespace nodes (start both; rank 0 listens on HOST:PORT):
  node A: .venv/bin/python benchmarks/stop_check.py --num-tasks 2 --global-rank 0 --dist-url tcp://HOST_A:29600
  node B: .venv/bin/python benchmarks/stop_check.py --num-tasks 2 --global-rank 1 --dist-url tcp://HOST_A:29600
(set GLOO_SOCKET_IFNAME if gloo picks the wrong interface).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not installed in .venv
from fixres_dist.distributed import collectives
from fixres_dist.distributed.preemption import StepAgreement, StopSignals
from fixres_dist.entry.launch import start_method

CHECKS = ("none", "blocking", "pipelined")


def make_work(args):
    """A function running one step of ``args.work``."""
    seconds = args.step_ms / 1000
    if args.work == "sleep":
        return lambda: time.sleep(seconds)
    if args.work == "spin":
        def spin():
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
        return spin
    import torchvision
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(0)
    model = DistributedDataParallel(torchvision.models.get_model(args.architecture, num_classes=10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(args.batch, 3, args.size, args.size)
    labels = torch.randint(0, 10, (args.batch,))

    def ddp_step():
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
    return ddp_step


def run_steps(work, check, agreement: StepAgreement, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` steps with ``check``; returns (seconds per step, seconds inside the check per step)."""
    step_times, check_times = [], []
    collectives.barrier()
    last = time.perf_counter()
    for _ in range(steps):
        work()
        before = time.perf_counter()
        if check == "blocking":
            agreed = agreement.now(None)
        elif check == "pipelined":
            agreed = agreement.after_step(None)
        now = time.perf_counter()
        if check != "none":
            assert agreed.go_on
            check_times.append(now - before)
        step_times.append(now - last)
        last = now
    if check == "pipelined":
        agreement.now(None)  # drain, as before a checkpoint (not timed)
    return step_times, check_times


def rank_main(rank: int, args) -> dict:
    torch.set_num_threads(1)
    collectives.init_process_group("gloo", args.dist_url, rank, args.num_tasks, timeout=300)
    work = make_work(args)
    agreement = StepAgreement(StopSignals(), collectives.control_group())
    for check in CHECKS:  # warm-up: connections, allocator, the model's first steps
        run_steps(work, check, agreement, max(2, args.steps // 5))
    times = {check: {"step": [], "check": []} for check in CHECKS}
    for round_index in range(args.rounds):
        order = CHECKS[round_index % 3:] + CHECKS[:round_index % 3]
        for check in order:
            step_times, check_times = run_steps(work, check, agreement, args.steps)
            times[check]["step"] += step_times
            times[check]["check"] += check_times
    result = {"rank": rank, "host": socket.gethostname(), "times": times}
    gathered = collectives.gather_object(result)
    collectives.destroy_process_group()
    if rank == 0:
        report(args, gathered)
    return result


def summary(times: dict) -> dict:
    base = statistics.median(times["none"]["step"])
    rows = {}
    for check in CHECKS:
        step = statistics.median(times[check]["step"])
        inside = statistics.median(times[check]["check"]) if times[check]["check"] else 0.0
        rows[check] = {"step_ms": step * 1e3, "in_check_us": inside * 1e6,
                       "mean_in_check_us": (statistics.fmean(times[check]["check"]) * 1e6 if times[check]["check"]
                                            else 0.0),
                       "cost_us": (step - base) * 1e6, "percent_of_step": 100 * inside / base}
    return rows


def report(args, gathered: list[dict]) -> None:
    per_rank = [summary(g["times"]) for g in gathered]
    hosts = ", ".join(sorted({g["host"] for g in gathered}))
    work = {"sleep": f"sleep {args.step_ms:g} ms", "spin": f"busy host {args.step_ms:g} ms",
            "ddp": f"DDP step {args.architecture} @ {args.size} px, batch {args.batch}/rank"}[args.work]
    print(f"stop check per step: {args.num_tasks} gloo ranks on {hosts}; step = {work}; {args.rounds} rounds x "
          f"{args.steps} steps per check; {os.cpu_count()} CPUs here, load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| check     | step ms | in check us (median) | in check us (mean) | cost us/step | % of step |")
    print("|-----------|--------:|---------------------:|-------------------:|-------------:|----------:|")
    for check in CHECKS:
        r = per_rank[0][check]
        print(f"| {check:<9} | {r['step_ms']:>7.2f} | {r['in_check_us']:>20.1f} | {r['mean_in_check_us']:>18.1f} "
              f"| {r['cost_us']:>12.1f} | {r['percent_of_step']:>8.3f}% |")
    blocking = max(p["blocking"]["in_check_us"] for p in per_rank)
    pipelined = max(p["pipelined"]["in_check_us"] for p in per_rank)
    print(f"in the check, median, slowest rank: blocking {blocking:.1f} us, pipelined {pipelined:.1f} us "
          f"({blocking / max(pipelined, 1e-9):.1f}x less)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "load_average": os.getloadavg(),
                                               "ranks": per_rank}, indent=2))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-tasks", type=int, default=2)
    parser.add_argument("--global-rank", type=int, help="run this one rank here (one process per node); "
                        "default: spawn all --num-tasks ranks locally")
    parser.add_argument("--dist-url", help="tcp://HOST:PORT where rank 0 listens (default: a free local port)")
    parser.add_argument("--work", choices=["sleep", "spin", "ddp"], default="sleep")
    parser.add_argument("--step-ms", type=float, default=20.0, help="sleep/spin: the step's length")
    parser.add_argument("--architecture", default="resnet18", help="ddp: a torchvision model name")
    parser.add_argument("--size", type=int, default=32, help="ddp: image size in pixels")
    parser.add_argument("--batch", type=int, default=16, help="ddp: images per rank and step")
    parser.add_argument("--steps", type=int, default=50, help="steps per check and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="write the figures here (rank 0)")
    args = parser.parse_args()
    if args.global_rank is not None:
        if not args.dist_url:
            parser.error("--global-rank needs --dist-url tcp://HOST:PORT (rank 0 listens there)")
        rank_main(args.global_rank, args)
        return
    args.dist_url = args.dist_url or f"tcp://127.0.0.1:{free_port()}"
    mp.start_processes(rank_main, args=(args,), nprocs=args.num_tasks, start_method=start_method())


if __name__ == "__main__":
    main()
