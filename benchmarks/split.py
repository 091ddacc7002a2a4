"""A model split into pipeline stages (issue 28): the step time against the unsplit model, the
bubble (the share of a step a stage waits), and memory per stage.

For each schedule and micro-batch count, ``--stages`` local ranks (gloo on CPU, NCCL with
``--device cuda``) build the same model (seed 0) and cut it with
:class:`fixres_dist.distributed.pipeline.Pipeline` (stages of about equal forward FLOPs), warm up for
``--warmup`` steps, then time ``--steps`` optimizer steps on one fixed batch (``train_step`` then SGD;
the median). Beside it, in the same ranks, each rank times its own stage alone: forward and backward
of one micro-batch (the previous stage's output as input, made by running the preceding pieces
locally once), ``t_stage``. A perfect pipeline runs ``micro-batches x max(t_stage)`` per step;
``bubble`` = 1 - that / the measured step (idle time plus send and receive), against theory's
(stages - 1) / (micro-batches + stages - 1) for GPipe and 1F1B (Narayanan et al., SC 2021, section
2.2). ``vs unsplit``: the measured step / the unsplit model's step on the same batch in one
process (the raw PyTorch loop: forward, cross-entropy, backward, SGD step). Memory per stage: the
rank's peak resident set (CPU, VmHWM) or ``max_memory_allocated`` (CUDA) over the timed steps.

On a CPU the ranks share the cores (each gets cores // stages threads), so a split cannot be faster
than the whole model here: the figures show the bubble and the cost of the split, not a speed-up,
which needs one device per stage. The header prints the load average; run alone.

Run from the repository root:
  .venv/bin/python benchmarks/split.py                  # CPU, timm vit_tiny @ 64 px, batch 32, 2 stages
  .venv/bin/python benchmarks/split.py --quick          # smoke run: timm test_vit @ 32 px
  .venv/bin/python benchmarks/split.py --device cuda    # one GPU per stage
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not installed in .venv
from fixres_dist.bench.cost import timed
from fixres_dist.bench.local_ranks import free_port
from fixres_dist.distributed import collectives
from fixres_dist.distributed import pipeline as pp
from fixres_dist.models.architectures import build_model
from fixres_dist.reporting.step_times import peak_memory, reset_peak_memory

PRESETS = {"cpu": ("timm/vit_tiny_patch16_224", 64, 32), "quick": ("timm/test_vit", 32, 16),
           "cuda": ("timm/vit_base_patch16_224", 224, 64)}
SETTINGS = [("gpipe", 4), ("1f1b", 4), ("1f1b", 8)]  # (schedule, micro-batches)


def stage_alone(model_args, pipe: pp.Pipeline, images, args, device) -> float:
    """This rank's stage, forward and backward of one micro-batch, alone (its input made by running a
    whole model's preceding pieces once)."""
    whole = build_model(*model_args).to(device)
    pieces = pp.pieces(whole)
    x = images[: images.shape[0] // pipe.microbatches]
    first = pipe.starts[pipe.indices[0]]
    with torch.no_grad():
        for piece in pieces[:first]:
            x = piece.run(x)
    x = x.detach().requires_grad_(x.is_floating_point())
    stage = pipe.stages[0]

    def run():
        out = stage(x)
        out.float().sum().backward()
    return timed(run, args.steps, args.warmup, device)


def measure(schedule: str, microbatches: int, mesh, images, labels, args, device) -> dict:
    """This rank's figures for one schedule and micro-batch count."""
    model_args = (args.architecture, 1000, args.size)
    torch.manual_seed(0)
    pipe = pp.Pipeline(build_model(*model_args).to(device), mesh, size=args.size, schedule=schedule,
                       microbatches=microbatches)
    optimizer = torch.optim.SGD(pipe.module.parameters(), lr=0.01)

    def step():
        pipe.train_step(images, labels)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    step()
    reset_peak_memory(device)
    seconds = timed(step, args.steps, args.warmup, device)
    memory, _ = peak_memory(device)
    return {"schedule": schedule, "microbatches": microbatches, "step_s": seconds, "memory_bytes": memory,
            "stage_s": stage_alone(model_args, pipe, images, args, device), "stage": pipe.stages[0].describe()}


def rank_main(rank: int, world: int, port: int, args, out: str) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    collectives.init_process_group("nccl" if device.type == "cuda" else "gloo", f"tcp://127.0.0.1:{port}", rank,
                                   world, 300)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch, 3, args.size, args.size, generator=generator).to(device)
    labels = torch.randint(0, 1000, (args.batch,), generator=generator).to(device)
    mesh = pp.pipeline_mesh(device, world, world)
    results = [measure(schedule, microbatches, mesh, images, labels, args, device)
               for schedule, microbatches in SETTINGS]
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    collectives.destroy_process_group()


def unsplit(args) -> float:
    """The whole model's step on the whole batch in this process (the raw loop)."""
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    model = build_model(args.architecture, 1000, args.size).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch, 3, args.size, args.size, generator=generator).to(device)
    labels = torch.randint(0, 1000, (args.batch,), generator=generator).to(device)

    def step():
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return timed(step, args.steps, args.warmup, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--architecture")
    parser.add_argument("--size", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    preset = PRESETS["quick" if args.quick else args.device]
    args.architecture = args.architecture or preset[0]
    args.size, args.batch = args.size or preset[1], args.batch or preset[2]
    print(f"# {args.architecture} @ {args.size} px, batch {args.batch}, {args.stages} stages on {args.device}; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    if args.device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    whole = unsplit(args)
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(rank_main, args=(args.stages, free_port(), args, out), nprocs=args.stages,
                           start_method="spawn")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.stages)]
    print(f"unsplit step: {1000 * whole:.1f} ms")
    print("| schedule | micro-batches | step (ms) | vs unsplit | bubble | theory | stage times (ms per micro-batch) "
          "| memory per stage (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for index, (schedule, microbatches) in enumerate(SETTINGS):
        rows = [rank[index] for rank in ranks]
        step = max(row["step_s"] for row in rows)
        bubble = 1 - microbatches * max(row["stage_s"] for row in rows) / step
        theory = (args.stages - 1) / (microbatches + args.stages - 1)
        stages = ", ".join(f"{1000 * row['stage_s']:.1f}" for row in rows)
        memory = ", ".join(f"{row['memory_bytes'] / 2**20:.0f}" for row in rows)
        print(f"| {schedule} | {microbatches} | {1000 * step:.1f} | {step / whole:.2f} | {100 * bubble:.0f} % | "
              f"{100 * theory:.0f} % | {stages} | {memory} |")
    print("stages: " + "; ".join(f"rank {r}: {rank[0]['stage']}" for r, rank in enumerate(ranks)))


if __name__ == "__main__":
    main()
