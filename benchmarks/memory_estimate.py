"""The preflight's memory estimate (``fixres_dist.training.memory_estimate``) against measured peaks.

For each case (an architecture at a resolution, a batch per rank, one rank, the run's optimizer and
``--amp``) the estimate is :func:`fixres_dist.training.memory_estimate.estimate`: two training steps on fake
tensors under torch's ``MemTracker``, in this process. The measurements run the same two steps
with real tensors, in a fresh process per case (``--measure``): the model built by
``fixres_dist.models.architectures.build_model``, the optimizer by ``fixres_dist.training.optim``, each
step the run's ``fixres_dist.training.engine.train_step`` on a random uint8 batch. Columns (MiB):

* ``allocator``: the peak of the bytes the tensor allocator holds from the model's creation to the
  end of the steps, in-kernel workspaces included: on CUDA ``torch.cuda.max_memory_allocated()``
  less ``torch.cuda.memory_allocated()`` before (no CUDA context, no cached-but-free blocks); on the
  CPU the running sum of the allocations and frees that ``torch.profiler`` records
  (``profile_memory=True``), its maximum;
* ``RSS`` (CPU only): the process's peak resident memory during the steps (``VmHWM`` of
  ``/proc/self/status``, reset through ``/proc/self/clear_refs`` just before) less its resident
  memory then (``VmRSS``). One step of the same model at batch 2 warms the process up first and is
  freed (``malloc_trim``): the libraries, kernels and thread pools the first step loads (about 250
  MiB here, no tensors) are not counted, as the CUDA context is not on a GPU. What the C allocator
  and oneDNN hold beyond the tensors (their own scratch memory, freed memory not yet returned)
  counts here;
* ``tracker``: torch's ``MemTracker`` on the real tensors of the steps (what the estimate would be
  without fake tensors).

``alloc ratio`` and ``RSS ratio`` = estimate / that measure: above 1 the estimate is on the safe side.

Run from the repository root:
  .venv/bin/python benchmarks/memory_estimate.py                 # CPU: 3 models x 2 resolutions (~2 min)
  .venv/bin/python benchmarks/memory_estimate.py --device cuda --amp bf16 --batch-scale 8
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MIB = 2 ** 20
CLASSES = 100
# (architecture, resolution in pixels, batch per rank)
CASES = [("resnet18", 64, 16), ("resnet18", 128, 16),
         ("mobilenet_v3_small", 112, 16), ("mobilenet_v3_small", 224, 16),
         ("timm/vit_tiny_patch16_224", 112, 8), ("timm/vit_tiny_patch16_224", 224, 8)]


def run_config(args, architecture: str, size: int, batch: int):
    from fixres_dist.config import TrainerConfig

    return TrainerConfig(architecture=architecture, input_size=size, batch=batch * args.batch_scale,
                         device=args.device, amp=args.amp, opt=args.opt, num_tasks=args.ranks, sharding=args.sharding)


def status_bytes(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process, in bytes."""
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+) kB", status.read()).group(1)) * 1024


def wrapped(config, model, device):
    """``(forward, strategy)`` of ``model`` as a run of ``config`` on more than one rank trains it (DDP,
    or sharded per block: ``fixres_dist.distributed``'s strategies); the model itself on one rank."""
    import torch.distributed as dist

    from fixres_dist.distributed.ddp_strategy import Replicated
    from fixres_dist.distributed.fsdp_strategy import FullySharded
    from fixres_dist.distributed.strategy import SINGLE
    from fixres_dist.training.engine import AMP_DTYPES

    if not dist.is_initialized():
        return model, SINGLE
    strategy = Replicated(device, broadcast_buffers=True) if config.sharding == "ddp" else \
        FullySharded(config, device, AMP_DTYPES[config.amp], log=lambda line: None, warn=lambda line: None)
    return strategy.wrap(model, None, config.input_size)[1], strategy


def real_steps(config, device, track: bool, steps: int = 2) -> int | None:
    """``steps`` training steps of ``config`` with real tensors on ``device`` (on every rank of the
    process group, if there is one); with ``track``, under torch's MemTracker, whose peak (bytes) is
    returned."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from fixres_dist.models import architectures
    from fixres_dist.training import engine, optim

    model = architectures.build_model(config.architecture, CLASSES, image_size=config.input_size).to(device).train()
    forward, strategy = wrapped(config, model, device)
    optimizer = optim.build_optimizer(config.opt, optim.parameter_groups(model, config.weight_decay,
                                                                         config.norm_weight_decay),
                                      0.01, config.momentum)
    images = torch.randint(0, 256, (config.batch, 3, config.input_size, config.input_size), dtype=torch.uint8)
    labels = torch.randint(0, CLASSES, (config.batch,))
    scaler = torch.amp.GradScaler(device.type, enabled=config.amp == "fp16")
    tracker = MemTracker() if track else None
    if tracker is not None:
        tracker.track_external(model, optimizer)
    with tracker if tracker is not None else torch.enable_grad():
        for _ in range(steps):
            engine.train_step(forward, optimizer, scaler, images, labels, engine.StepSettings(
                device, world=config.num_tasks, amp=engine.AMP_DTYPES[config.amp]), strategy=strategy)
            if tracker is not None:
                tracker.reset_mod_stats()
    if tracker is None:
        return None
    peaks = tracker.get_tracker_snapshot("peak")
    return max(snapshot["Total"] for snapshot in peaks.values())


def rank_main(rank: int, config_json: str, port: int, out: str) -> None:
    """One rank of a ``--ranks N`` measurement (gloo): rank 0 writes its allocator peak to ``out``."""
    import torch
    import torch.distributed as dist

    from fixres_dist.config import TrainerConfig

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = TrainerConfig.from_json(config_json)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=config.num_tasks)
    try:
        peak = allocator_peak(config, torch.device("cpu"))
        if rank == 0:
            Path(out).write_text(json.dumps({"rss": None, "tracker": None, "allocator": peak}))
    finally:
        dist.destroy_process_group()


def measure_ranks(config) -> dict:
    """The allocator peak of rank 0 of ``config.num_tasks`` local gloo ranks (CPU)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank0.json")
        mp.start_processes(rank_main, args=(config.to_json(), port, out), nprocs=config.num_tasks,
                           start_method="spawn")
        return json.loads(Path(out).read_text())


def allocator_peak(config, device) -> int:
    """The CPU allocator's peak (bytes) from the model's creation to the end of the steps, from the
    allocations and frees ``torch.profiler`` records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        real_steps(config, device, track=False)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def measure(config_json: str) -> None:
    """The ``--measure`` child: one JSON line with the measured peaks (bytes)."""
    import attrs
    import torch

    from fixres_dist.config import TrainerConfig

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = TrainerConfig.from_json(config_json)
    device = torch.device(config.device)
    result = {"rss": None}
    if config.num_tasks > 1:
        print(json.dumps(measure_ranks(config)))
        return
    if device.type == "cuda":
        torch.cuda.init()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        real_steps(config, device, track=False)
        result["allocator"] = torch.cuda.max_memory_allocated() - before
    else:
        real_steps(attrs.evolve(config, batch=2), device, track=False, steps=1)  # warm-up, freed
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # the peak resident memory starts again from now
        before = status_bytes("VmRSS")
        real_steps(config, device, track=False)
        result["rss"] = status_bytes("VmHWM") - before
        result["allocator"] = allocator_peak(config, device)
    result["tracker"] = real_steps(config, device, track=True)
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--amp", choices=("off", "bf16", "fp16"), default="off")
    parser.add_argument("--opt", default="sgd", help="sgd, sgd-nesterov, adamw or rmsprop (default: sgd)")
    parser.add_argument("--ranks", type=int, default=1, help="ranks per case: more than one runs local gloo ranks "
                        "(CPU only) and measures rank 0's allocator peak (default: 1)")
    parser.add_argument("--sharding", choices=("ddp", "full"), default="ddp", help="with --ranks N (default: ddp)")
    parser.add_argument("--batch-scale", type=int, default=1, help="multiply every case's batch (GPU: 8)")
    parser.add_argument("--only", help="only the cases whose architecture contains this text")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the child: a TrainerConfig as JSON
    args = parser.parse_args()
    if args.measure:
        measure(args.measure)
        return
    from fixres_dist.training import memory_estimate

    print(f"estimate ({memory_estimate.METHOD}) against measured peaks, {args.ranks} rank(s), {args.sharding}, "
          f"{args.device}, {args.opt}, amp {args.amp}, {CLASSES} classes; MiB; load average {os.getloadavg()[0]:.1f}")
    print(f"{'model':<27}{'px':>4}{'batch':>6}{'estimate':>9}{'tracker':>9}{'allocator':>10}{'RSS':>8}"
          f"{'alloc ratio':>12}{'RSS ratio':>10}{'est s':>6}")
    rows = []
    for architecture, size, batch in CASES:
        if args.only and args.only not in architecture:
            continue
        config = run_config(args, architecture, size, batch)
        started = time.perf_counter()
        found = memory_estimate.estimate(config, CLASSES)
        seconds = time.perf_counter() - started
        child = subprocess.run([sys.executable, __file__, "--measure", config.to_json()], capture_output=True,
                               text=True, cwd=ROOT, timeout=600)
        if child.returncode != 0 or not found.known:
            print(f"{architecture:<27}{size:>4}{config.batch:>6}  failed: {found.reason or child.stderr[-300:]}")
            continue
        measured = json.loads(child.stdout.strip().splitlines()[-1])
        row = {"architecture": architecture, "size": size, "batch": config.batch, "estimate": found.peak,
               "parts": {k: getattr(found, k) for k in ("parameters", "gradients", "optimizer", "activations")},
               "estimate_seconds": seconds, **measured, "allocator_ratio": found.peak / measured["allocator"],
               "rss_ratio": found.peak / measured["rss"] if measured["rss"] else None}
        rows.append(row)
        rss = f"{measured['rss'] / MIB:>8.1f}" if measured["rss"] else f"{'-':>8}"
        tracker = f"{measured['tracker'] / MIB:>9.1f}" if measured["tracker"] else f"{'-':>9}"
        rss_ratio = f"{row['rss_ratio']:>10.2f}" if row["rss_ratio"] else f"{'-':>10}"
        print(f"{architecture:<27}{size:>4}{config.batch:>6}{found.peak / MIB:>9.1f}{tracker}"
              f"{measured['allocator'] / MIB:>10.1f}{rss}{row['allocator_ratio']:>12.2f}{rss_ratio}{seconds:>6.1f}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
