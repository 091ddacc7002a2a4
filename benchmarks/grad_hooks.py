"""What the step times' all-reduce mark costs a DDP step: the post-accumulate-grad hooks on a model's
first 4 trainable parameters (:meth:`fixres_dist.distributed.ddp_strategy.Replicated.time_gradient_reduction`),
as an A/B within the same 2 gloo ranks, so that the noise between two launches (about 5 % on a
shared 2-core machine) does not hide it.

Each rank builds the same model (DDP, SGD, one fixed batch, one thread), warms up 5 steps, then runs
``--rounds`` rounds of ``--steps`` steps with the hooks and without, the order alternating each round;
a round's time is between two barriers. Prints the median step of each and their ratio.

Then the hooks' cost timed directly, in this process, where nothing else moves: the backward of a tiny
model (two 16 x 16 linear layers, one thread), with the 4 hooks calling what the step times' mark
calls and without, in ``--direct-blocks`` alternating blocks of 2,000 backwards; the median difference
per backward is what the hooks add to any step, printed against the median DDP step above.

Run from the repository root: ``.venv/bin/python benchmarks/grad_hooks.py`` (about a minute).
"""
from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not installed in .venv
from fixres_dist.distributed.ddp_strategy import LAST_GRADIENTS
from fixres_dist.models.architectures import build_model


def rank_main(rank: int, port: int, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = build_model(args.architecture, 10, image_size=args.size)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images, labels = torch.randn(args.batch, 3, args.size, args.size), torch.randint(0, 10, (args.batch,))
    marks: list[float] = []

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(images), labels).backward()
        optimizer.step()
    for _ in range(5):
        step()
    times: dict[bool, list[float]] = {False: [], True: []}
    handles = []
    for round_ in range(args.rounds):
        for hooked in (False, True) if round_ % 2 == 0 else (True, False):
            for handle in handles:
                handle.remove()
            first = [p for p in model.parameters() if p.requires_grad][:LAST_GRADIENTS]
            handles = [p.register_post_accumulate_grad_hook(lambda _: marks.append(time.perf_counter()))
                       for p in first] if hooked else []
            dist.barrier()
            started = time.perf_counter()
            for _ in range(args.steps):
                step()
            dist.barrier()
            times[hooked].append((time.perf_counter() - started) / args.steps)
    if rank == 0:
        without, with_hooks = statistics.median(times[False]), statistics.median(times[True])
        print(f"{args.architecture} @ {args.size} px, batch {args.batch}, 2 gloo ranks: median step without the hooks "
              f"{1000 * without:.2f} ms, with {1000 * with_hooks:.2f} ms: {100 * (with_hooks / without - 1):+.2f} % "
              f"({args.rounds} alternating rounds of {args.steps} steps)")
    dist.destroy_process_group()


def direct_cost(blocks: int, steps: int = 2000) -> float:
    """Microseconds the 4 hooks add to one backward, timed directly (median over alternating blocks)."""
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    x = torch.randn(4, 16)
    marks: list[float] = []
    per_backward: dict[bool, list[float]] = {False: [], True: []}
    for block in range(blocks):
        for hooked in (False, True) if block % 2 == 0 else (True, False):
            handles = [p.register_post_accumulate_grad_hook(lambda _: marks.append(time.perf_counter()))
                       for p in list(model.parameters())[:LAST_GRADIENTS]] if hooked else []
            started = time.perf_counter()
            for _ in range(steps):
                model(x).sum().backward()
            per_backward[hooked].append((time.perf_counter() - started) / steps)
            marks.clear()
            for handle in handles:
                handle.remove()
    return 1e6 * (statistics.median(per_backward[True]) - statistics.median(per_backward[False]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--architecture", default="resnet18")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--direct-blocks", type=int, default=20)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(rank_main, args=(port, args), nprocs=2, start_method="spawn")
    added = direct_cost(args.direct_blocks)
    print(f"timed directly: the {LAST_GRADIENTS} hooks add {added:.2f} us per backward "
          f"({args.direct_blocks} alternating blocks of 2,000 backwards of a tiny model, one thread)")


if __name__ == "__main__":
    main()
