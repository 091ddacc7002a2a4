"""Training-step overhead of ``fixres_dist.Trainer`` against a raw PyTorch loop (CPU, gloo).

Both loops train the same architecture on the same in-memory batch: a fixed uint8 tensor of shape
(batch, 3, size, size) and its labels, generated once per rank, so neither loop decodes, augments
or loads anything. The Trainer side is the real code path: a ``Trainer(TrainerConfig(...))`` runs
its own setup (process group, job folder, data, model, DDP wrapper, optimizer and LR schedule),
then only its ``train_loader`` is swapped for a loader that yields the fixed batch ``--steps``
times, and ``Trainer._train_one_epoch`` is timed as is (per-step loss bookkeeping, scheduler,
progress bar and the epoch's loss all-reduce and metrics line included). The raw side is
``torchvision.models.get_model`` (in DDP with ``forward_sync_buffers=False`` for 2+ ranks, as the
Trainer's default ``--dist-bn reduce``) and an SGD with the Trainer's settings; per step:
normalize (``fixres_dist.data.normalize``), forward, cross-entropy, zero_grad, backward, step.

Every world size runs in freshly spawned ranks that meet over gloo at tcp://127.0.0.1:<free port>,
with ``cores // world`` torch threads per rank for both loops. Each rank warms up both loops with
one epoch, then alternates raw, Trainer, raw, Trainer... ``--repeats`` times; between barriers,
rank 0 times each epoch. The table gives the median global throughput (images/s over all ranks)
and the ratio Trainer / raw. Target: ratio >= 0.97 (the Trainer costs at most 3 % per step).

Run from the repository root:  .venv/bin/python benchmarks/step_overhead.py  [--world-sizes 1,2 ...]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not installed in .venv
from fixres_dist import Trainer, TrainerConfig, distributed  # noqa: E402
from fixres_dist.data import normalize  # noqa: E402

TARGET = 0.97


class FixedBatchLoader:
    """Stands in for the Trainer's DataLoader: the same (images, labels) batch, ``steps`` times."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, steps: int):
        self.batch, self.steps = (images, labels), steps
        self.batch_sampler = self  # the Trainer calls train_loader.batch_sampler.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        pass

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        return itertools.repeat(self.batch, self.steps)


def raw_epoch(model, optimizer, images, labels, steps: int) -> None:
    model.train()
    for _ in range(steps):
        loss = F.cross_entropy(model(normalize(images)), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def timed(fn, epoch: int) -> float:
    """Seconds for ``fn(epoch)``, between barriers so that every rank has finished."""
    distributed.barrier()
    start = time.perf_counter()
    fn(epoch)
    distributed.barrier()
    return time.perf_counter() - start


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, folder: str) -> None:
    batch, steps = args.batch, args.steps
    cfg = TrainerConfig(num_tasks=world, global_rank=rank, local_rank=rank, job_id=f"bench-w{world}",
                        dist_url=f"tcp://127.0.0.1:{port}", shared_folder_path=folder, mode="scratch",
                        architecture=args.architecture, input_size=args.size, batch=batch,
                        epochs=args.repeats + 1, workers=0, progress=False)
    trainer = Trainer(cfg)
    trainer.log = lambda message: None  # keep the table readable (the Trainer logs once per epoch)
    trainer._setup_process_group()
    try:
        threads = max(1, len(os.sched_getaffinity(0)) // world)
        torch.set_num_threads(threads)
        trainer._prepare_job_folder()
        trainer._build_data()
        generator = torch.Generator().manual_seed(rank)
        images = torch.randint(0, 256, (batch, 3, args.size, args.size), dtype=torch.uint8, generator=generator)
        labels = torch.randint(0, len(trainer.classes), (batch,), generator=generator)
        # Swapped in before the optimizer so that the LR schedule is sized for this loader.
        trainer.train_loader = FixedBatchLoader(images, labels, steps)
        trainer.train_set = range(world * batch * steps)  # only len() is used: the progress bar total
        trainer._build_model()
        trainer._build_optimizer()

        raw = torchvision.models.get_model(args.architecture, weights=None, num_classes=len(trainer.classes))
        raw_optimizer = torch.optim.SGD(raw.parameters(), **trainer.optimizer.defaults)
        if world > 1:
            raw = DistributedDataParallel(raw, forward_sync_buffers=False)
        loops = {"raw": lambda epoch: raw_epoch(raw, raw_optimizer, images, labels, steps),
                 "trainer": trainer._train_one_epoch}
        seconds = {name: [] for name in loops}
        for repeat in range(args.repeats + 1):  # repeat 0 warms both loops up
            for name, loop in loops.items():
                elapsed = timed(loop, repeat)
                if repeat:
                    seconds[name].append(elapsed)
        if rank == 0:
            images_per_epoch = world * batch * steps
            result = {name: images_per_epoch / statistics.median(s) for name, s in seconds.items()}
            result["threads"] = threads
            (Path(folder) / f"result-w{world}.json").write_text(json.dumps(result))
    finally:
        distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--architecture", default="resnet18", help="torchvision model name")
    parser.add_argument("--size", type=int, default=32, help="input size in pixels")
    parser.add_argument("--batch", type=int, default=32, help="images per rank per step")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed epoch")
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per loop (median reported)")
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated numbers of gloo ranks")
    args = parser.parse_args()
    worlds = [int(w) for w in args.world_sizes.split(",")]

    print(f"{args.architecture} @ {args.size}px, batch {args.batch}/rank, {args.steps} steps x "
          f"{args.repeats} repeats (median), target ratio >= {TARGET}")
    print("| world size | threads/rank | raw img/s | Trainer img/s | ratio |")
    print("|-----------:|-------------:|----------:|--------------:|------:|")
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as folder:
        for world in worlds:
            mp.spawn(run_rank, args=(world, free_port(), args, folder), nprocs=world)
            r = json.loads((Path(folder) / f"result-w{world}.json").read_text())
            ratio = r["trainer"] / r["raw"]
            print(f"| {world:>10} | {r['threads']:>12} | {r['raw']:>9,.0f} | {r['trainer']:>13,.0f} | "
                  f"{ratio:5.3f}{'' if ratio >= TARGET else ' (below target)'} |", flush=True)


if __name__ == "__main__":
    main()
