"""Training-step overhead of ``fixres_dist.Trainer`` against a raw PyTorch loop (CPU, gloo).

Both loops train the same architecture on the same in-memory batch: a fixed uint8 tensor of shape
(batch, 3, size, size) and its labels, generated once per rank, so neither loop decodes, augments
or loads anything. The Trainer side is the real code path: a ``Trainer(TrainerConfig(...))`` runs
its own setup (process group, job folder, data, model, DDP wrapper, optimizer), then only its
``train_loader`` is swapped for one that yields the fixed batch ``--steps`` times per epoch, and
``Trainer._train_one_epoch`` runs as is: ``_train_step`` plus the per-step LR schedule, loss
bookkeeping, progress bar, fault/checkpoint hooks and stop-signal all-reduce, and the epoch's loss
all-reduce and metrics line (no evaluation; no checkpoint, ``ckpt_every`` is off). The raw side is
``torchvision.models.get_model`` (in DDP with ``forward_sync_buffers=False`` for 2+ ranks, as the
Trainer's default ``--dist-bn reduce``) and an SGD with the Trainer's settings; per step:
normalize (``fixres_dist.data.normalize``), forward, cross-entropy, zero_grad, backward, step.

Every world size runs in freshly spawned ranks that meet over gloo at tcp://127.0.0.1:<free port>,
with ``cores // world`` torch threads per rank for both loops. Each rank warms both loops up with
one epoch, then runs ``--repeats`` back-to-back pairs of epochs (raw and Trainer; which goes first
alternates). Rank 0 times every step (between two batch requests to the shared loader) and every
epoch (between barriers). Columns: img/s over all ranks from the median step time of each loop;
``ratio`` = Trainer / raw step throughput (target >= 0.97: the Trainer costs at most 3 % a step);
``epoch ratio`` = the median over pairs of the same ratio for whole epochs (epoch-end work
included). Medians resist short bursts of other work on the machine, not steady load: the header
shows the load average; compare runs made on an idle machine.

Run from the repository root:  .venv/bin/python benchmarks/step_overhead.py  [--world-sizes 1,2 ...]
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

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not installed in .venv
from fixres_dist import Trainer, TrainerConfig, distributed  # noqa: E402
from fixres_dist.data import normalize  # noqa: E402
from fixres_dist.samplers import ExactBatchSampler  # noqa: E402

TARGET = 0.97


class FixedBatchLoader:
    """Stands in for the Trainer's DataLoader: the same in-memory batch for each sampler batch.

    Yields ``(images, labels, skipped=0)`` like ``fixres_dist.data.collate_readable``; the
    sampler is the Trainer's own ExactBatchSampler (``set_epoch``, ``images_done``, ``len``).
    ``stamps`` gets the time of every batch request and of the end: its differences are steps.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, sampler: ExactBatchSampler):
        self.images, self.labels, self.batch_sampler = images, labels, sampler
        self.stamps: list[float] = []

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        for _ in self.batch_sampler:
            self.stamps.append(time.perf_counter())
            yield self.images, self.labels, 0
        self.stamps.append(time.perf_counter())


def raw_epoch(model, optimizer, loader: FixedBatchLoader) -> None:
    model.train()
    for images, labels, _ in loader:
        loss = F.cross_entropy(model(normalize(images)), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, folder: str) -> None:
    cfg = TrainerConfig(num_tasks=world, global_rank=rank, local_rank=rank, job_id=f"bench-w{world}",
                        dist_url=f"tcp://127.0.0.1:{port}", shared_folder_path=folder, mode="scratch",
                        architecture=args.architecture, input_size=args.size, batch=args.batch,
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
        images = torch.randint(0, 256, (args.batch, 3, args.size, args.size), dtype=torch.uint8, generator=generator)
        labels = torch.randint(0, len(trainer.classes), (args.batch,), generator=generator)
        # world x batch x steps "images" make `steps` batches per rank and epoch; only len() is used.
        trainer.train_set = range(world * args.batch * args.steps)
        loader = trainer.train_loader = FixedBatchLoader(images, labels, ExactBatchSampler(
            len(trainer.train_set), world, rank, args.batch, shuffle=True, seed=cfg.seed))
        trainer._build_model()
        trainer._build_optimizer()

        raw = torchvision.models.get_model(args.architecture, weights=None, num_classes=len(trainer.classes))
        raw_optimizer = torch.optim.SGD(raw.parameters(), **trainer.optimizer.defaults)
        if world > 1:
            raw = DistributedDataParallel(raw, forward_sync_buffers=False)

        def trainer_epoch(epoch: int) -> None:
            trainer.epoch, trainer.images_in_epoch = epoch, 0  # as Trainer._run sets them
            trainer._train_one_epoch()

        loops = {"raw": lambda epoch: raw_epoch(raw, raw_optimizer, loader), "trainer": trainer_epoch}
        steps = {name: [] for name in loops}
        epochs = {name: [] for name in loops}
        for repeat in range(args.repeats + 1):  # repeat 0 warms both loops up
            for name in sorted(loops, reverse=repeat % 2 == 1):  # alternate which loop goes first
                loader.stamps.clear()
                distributed.barrier()
                start = time.perf_counter()
                loops[name](repeat)
                distributed.barrier()
                if repeat:
                    epochs[name].append(time.perf_counter() - start)
                    steps[name] += [b - a for a, b in zip(loader.stamps, loader.stamps[1:])]
        if rank == 0:
            raw_step, trainer_step = statistics.median(steps["raw"]), statistics.median(steps["trainer"])
            result = {"threads": threads, "raw": world * args.batch / raw_step,
                      "trainer": world * args.batch / trainer_step, "ratio": raw_step / trainer_step,
                      "epoch_ratio": statistics.median(r / t for r, t in zip(epochs["raw"], epochs["trainer"]))}
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
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per loop (after one warmup)")
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated numbers of gloo ranks")
    args = parser.parse_args()

    print(f"{args.architecture} @ {args.size}px, batch {args.batch}/rank, {args.repeats} x {args.steps} "
          f"steps per loop, target ratio >= {TARGET}; load average {os.getloadavg()[0]:.2f} on "
          f"{len(os.sched_getaffinity(0))} cores")
    print("| world size | threads/rank | raw img/s | Trainer img/s | ratio | epoch ratio |")
    print("|-----------:|-------------:|----------:|--------------:|------:|------------:|")
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as folder:
        for world in (int(w) for w in args.world_sizes.split(",")):
            mp.spawn(run_rank, args=(world, free_port(), args, folder), nprocs=world)
            r = json.loads((Path(folder) / f"result-w{world}.json").read_text())
            print(f"| {world:>10} | {r['threads']:>12} | {r['raw']:>9,.0f} | {r['trainer']:>13,.0f} | "
                  f"{r['ratio']:5.3f} | {r['epoch_ratio']:11.3f} |"
                  + ("" if r["ratio"] >= TARGET else " below target"), flush=True)


if __name__ == "__main__":
    main()
