"""Training-step overhead of ``fixres_dist.Trainer`` against a raw PyTorch loop (CPU/gloo or CUDA).

Both loops train the same architecture on the same in-memory batch: a fixed uint8 tensor of shape
(batch, 3, size, size) and its labels, generated once per rank (on the GPU with ``--device cuda``),
so neither loop decodes, augments or loads anything. The Trainer side is the real code path: a
``Trainer(TrainerConfig(...))`` runs its own setup (device, process group, job folder, data, model
with ``--channels-last``, finetune/sync-BN logic, DDP wrapper, optimizer, AMP and GradScaler,
``torch.compile``), given through ``Trainer.build(train_loader=...)`` a loader that yields the
fixed batch ``--steps`` times per epoch, and ``Trainer.train_epoch`` runs as is: the engine's
``train_step`` (device copy, normalisation, autocast, compiled forward, GradScaler) plus the
per-step LR schedule, loss
bookkeeping, progress bar, fault/checkpoint hooks and stop-signal check, and the epoch's loss
all-reduce and metrics line (no evaluation; no checkpoint, ``ckpt_every`` is off). The raw side is
plain PyTorch written out here: ``torchvision.models.get_model`` (in DDP with
``forward_sync_buffers=False`` for 2+ ranks, as the Trainer's default ``--dist-bn reduce``), the
same memory format, ``torch.compile`` backend and SGD settings (parameter groups included); per step: normalize
(``fixres_dist.data.pipeline.normalize``), forward under ``torch.autocast`` (bf16/fp16), cross-entropy,
zero_grad, backward and step (through ``torch.amp.GradScaler`` for fp16).

Every configuration runs in freshly spawned ranks (gloo on CPU, NCCL on CUDA with one GPU per rank)
that meet at tcp://127.0.0.1:<free port>; on CPU with ``cores // world`` torch threads per rank.
Each rank warms both loops up with one epoch (which includes compilation and cuDNN autotuning), then
runs ``--repeats`` back-to-back pairs of epochs (raw and Trainer; which goes first alternates).
Step times: on CPU the time between two batch requests to the shared loader; on CUDA the GPU time
between CUDA events recorded at those requests (the GPU's timeline: the CPU runs ahead of it).
Columns: img/s over all ranks from the median step time of each loop; ``ratio`` = Trainer / raw
step throughput (target >= 0.97: the Trainer costs at most 3 % a step); ``epoch ratio`` = the
median over pairs of the same ratio for whole epochs (epoch-end work included; on CUDA between
``torch.cuda.synchronize()`` calls); ``peak GiB`` = ``torch.cuda.max_memory_allocated`` during each
loop's timed epochs (both loops' models and optimizer states stay resident, a few hundred MiB).
Medians resist short bursts of other work on the machine, not steady load: the header shows the
load average; compare runs made on an idle machine.

``--recipe-options`` turns on, in both loops, every option of the training step itself: Nesterov
momentum, label smoothing 0.1, MixUp 0.2 and CutMix 1.0 (one of the two per micro-batch), gradient
accumulation over 2 micro-batches (the first under DDP's ``no_sync``), gradient clipping at norm 1,
and an EMA of the weights updated after every step (the worst case; torchvision's default is every
32). The Trainer draws each micro-batch's mixing from (seed, step, rank, micro-batch) and restores
the CPU generator; the raw loop calls torchvision's v2 ``RandomChoice([MixUp, CutMix])`` and
``AveragedModel`` directly. The
data-side options (``--auto-augment``, ``--random-erase``, ``--ra-sampler``) run in the loader
workers, not in the step, and are left out here (``benchmarks/input_pipeline.py`` measures loading).

Run from the repository root:
  .venv/bin/python benchmarks/step_overhead.py                      # CPU: resnet18 @ 32 px, 1 and 2 ranks
  .venv/bin/python benchmarks/step_overhead.py --preset gpu         # resnet50 @ 224, @ 288, vit_b_16 @ 224,
                                                                    # eager and compiled, batch 256, bf16
  .venv/bin/python benchmarks/step_overhead.py --device cuda --configs resnet50@224 --amp fp16 --compile
  .venv/bin/python benchmarks/step_overhead.py --recipe-options             # mixing, smoothing, clipping, EMA
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import attrs
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchvision.transforms import v2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not installed in .venv
from fixres_dist import FixresWarning, Trainer, TrainerConfig
from fixres_dist.data.pipeline import check_image_folder, embedded_data_path, normalize
from fixres_dist.data.samplers import ExactBatchSampler
from fixres_dist.distributed import collectives, placement
from fixres_dist.reporting.step_times import StepTimes
from fixres_dist.training.network import BUFFER_SYNC
from fixres_dist.training.optim import parameter_groups

TARGET = 0.97
# --recipe-options: the TrainerConfig fields of the step's own options, mirrored by RawLoop.
RECIPE_OPTIONS = {"opt": "sgd-nesterov", "label_smoothing": 0.1, "mixup_alpha": 0.2, "cutmix_alpha": 1.0,
                  "grad_accum_steps": 2, "clip_grad_norm": 1.0, "model_ema": True, "model_ema_steps": 1,
                  "model_ema_decay": 0.999}
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}
PRESETS = {
    "gpu": {"device": "cuda", "configs": "resnet50@224,resnet50@288,vit_b_16@224", "batch": 256,
            "compile": "none,inductor", "world_sizes": "1", "steps": 20, "repeats": 3},
    "cpu": {"device": "cpu", "configs": "resnet18@32", "batch": 32, "compile": "none", "world_sizes": "1,2",
            "steps": 20, "repeats": 3},
}


class FixedBatchLoader:
    """Stands in for the Trainer's DataLoader: the same in-memory batch for each sampler batch.

    Yields ``(images, labels, skipped=0)`` like ``fixres_dist.data.pipeline.collate_readable``; the
    sampler is the Trainer's own ExactBatchSampler (``set_epoch``, ``images_done``, ``len``).
    ``stamps`` gets the time of every batch request and of the end: its differences are steps.
    On CUDA ``events`` gets a CUDA event recorded at the same points (GPU-side step times).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, sampler: ExactBatchSampler):
        self.images, self.labels, self.batch_sampler = images, labels, sampler
        self.cuda = images.is_cuda
        self.stamps: list[float] = []
        self.events: list = []

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def _stamp(self) -> None:
        self.stamps.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def __iter__(self):
        for _ in self.batch_sampler:
            self._stamp()
            yield self.images, self.labels, 0
        self._stamp()

    def clear(self) -> None:
        self.stamps.clear()
        self.events.clear()

    def step_seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in zip(self.events, self.events[1:])]
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


class RawLoop:
    """The plain PyTorch loop the Trainer is measured against (same model, AMP, memory format, compile)."""

    def __init__(self, spec: dict, num_classes: int, cfg: TrainerConfig, lr: float, device: torch.device, world: int):
        arch, size = spec["architecture"], spec["size"]
        extra = {"image_size": size} if arch.startswith("vit_") else {}
        model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **extra)
        self.memory_format = torch.channels_last if spec["channels_last"] else torch.contiguous_format
        self.model = model.to(device, memory_format=self.memory_format)
        self.optimizer = torch.optim.SGD(parameter_groups(self.model, cfg.weight_decay, cfg.norm_weight_decay),
                                         lr=lr, momentum=cfg.momentum, nesterov=cfg.opt == "sgd-nesterov")
        if world > 1:
            self.model = DistributedDataParallel(self.model,
                                                 device_ids=[device.index] if device.type == "cuda" else None,
                                                 **{BUFFER_SYNC: False})
        self.forward = torch.compile(self.model, backend=spec["compile"]) if spec["compile"] else self.model
        self.compile_failed = None
        self.amp = AMP_DTYPES[spec["amp"]]
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler("cuda") if spec["amp"] == "fp16" else None
        self.options = spec.get("recipe_options", False)
        self.unwrapped = model
        if self.options:
            o = RECIPE_OPTIONS
            self.mix = v2.RandomChoice([v2.MixUp(alpha=o["mixup_alpha"], num_classes=num_classes),
                                        v2.CutMix(alpha=o["cutmix_alpha"], num_classes=num_classes)])
            self.ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(o["model_ema_decay"]), use_buffers=True)

    def _logits(self, images: torch.Tensor) -> torch.Tensor:
        if self.forward is self.model or self.compile_failed is not None:
            return self.forward(images)
        try:
            return self.forward(images)
        except Exception as exc:  # report it; go on eager, as the Trainer does
            self.compile_failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self.forward = self.model
            return self.model(images)

    def _backward(self, images: torch.Tensor, labels: torch.Tensor, share: float) -> None:
        """Forward and backward of one micro-batch; its mean loss weighted by ``share`` of the step."""
        targets, smoothing = labels, 0.0
        if self.options:
            images, targets = self.mix(images, labels)
            smoothing = RECIPE_OPTIONS["label_smoothing"]
        with torch.autocast(self.device_type, dtype=self.amp or torch.bfloat16, enabled=self.amp is not None):
            logits = self._logits(images)
        loss = F.cross_entropy(logits.float(), targets, label_smoothing=smoothing) * share
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def epoch(self, loader: FixedBatchLoader) -> None:
        self.model.train()
        parts = RECIPE_OPTIONS["grad_accum_steps"] if self.options else 1
        for images, labels, _ in loader:
            images = normalize(images).contiguous(memory_format=self.memory_format)
            self.optimizer.zero_grad(set_to_none=True)
            for index, (part, part_labels) in enumerate(zip(images.tensor_split(parts), labels.tensor_split(parts))):
                last = index == parts - 1
                with contextlib.nullcontext() if last or self.model is self.unwrapped else self.model.no_sync():
                    self._backward(part, part_labels, 1 / parts)
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            if self.options:
                torch.nn.utils.clip_grad_norm_(self.unwrapped.parameters(), RECIPE_OPTIONS["clip_grad_norm"])
            if self.scaler is None:
                self.optimizer.step()
            else:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            if self.options:
                self.ema.update_parameters(self.unwrapped)


def trainer_config(spec: dict, rank: int, world: int, port: int, folder: str) -> TrainerConfig:
    fields = dict(num_tasks=world, global_rank=rank, local_rank=rank, job_id=f"bench-{spec['name']}",
                  dist_url=f"tcp://127.0.0.1:{port}", shared_folder_path=folder, mode="scratch",
                  architecture=spec["architecture"], input_size=spec["size"], batch=spec["batch"],
                  epochs=spec["repeats"] + 1, workers=0, progress=False, device=spec["device"],
                  dist_backend="nccl" if spec["device"] == "cuda" else "gloo")
    speed = {"amp": spec["amp"], "channels_last": spec["channels_last"], "compile": spec["compile"]}
    known = {field.name for field in attrs.fields(TrainerConfig)}
    missing = [k for k, v in speed.items() if k not in known and v not in (None, False, "off")]
    if missing:
        raise SystemExit(f"step_overhead: this TrainerConfig has no {', '.join(missing)} field(s) yet")
    fields.update({k: v for k, v in speed.items() if k in known})
    if spec.get("recipe_options"):
        fields.update(RECIPE_OPTIONS)
    return TrainerConfig(**fields, step_times=spec.get("step_times", True))


def run_rank(rank: int, world: int, port: int, spec: dict, folder: str) -> None:
    warnings.simplefilter("ignore", FixresWarning)  # e.g. the EMA's horizon on these short epochs
    cfg = trainer_config(spec, rank, world, port, folder)
    trainer = Trainer(cfg, log=lambda message: None)  # keep the table readable (the Trainer logs per epoch)
    result = {"name": spec["name"]}
    try:
        device = placement.cuda_device(rank) if spec["device"] == "cuda" else torch.device("cpu")  # as the Trainer's
        threads = max(1, len(os.sched_getaffinity(0)) // world)
        if device.type == "cpu":
            torch.set_num_threads(threads)
        num_classes = len(check_image_folder(embedded_data_path()))
        generator = torch.Generator().manual_seed(rank)
        images = torch.randint(0, 256, (spec["batch"], 3, spec["size"], spec["size"]), dtype=torch.uint8,
                               generator=generator).to(device)
        labels = torch.randint(0, num_classes, (spec["batch"],), generator=generator).to(device)
        # world x batch x steps "images" make `steps` batches per rank and epoch.
        loader = FixedBatchLoader(images, labels, ExactBatchSampler(
            world * spec["batch"] * spec["steps"], world, rank, spec["batch"], shuffle=True, seed=cfg.seed))
        trainer.build(train_loader=loader)
        if device.type == "cpu":
            torch.set_num_threads(threads)  # the Trainer set its own share; both loops get the same
        raw = RawLoop(spec, num_classes, cfg, trainer.step.base_lr, device, world)

        def trainer_epoch(epoch: int) -> None:
            trainer.state.epoch, trainer.state.images_in_epoch = epoch, 0
            trainer.train_epoch()

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            collectives.barrier()

        loops = {"raw": lambda epoch: raw.epoch(loader), "trainer": trainer_epoch}
        steps = {name: [] for name in loops}
        epochs = {name: [] for name in loops}
        peak = {name: 0 for name in loops}
        for repeat in range(spec["repeats"] + 1):  # repeat 0 warms both loops up (and compiles)
            for name in sorted(loops, reverse=repeat % 2 == 1):  # alternate which loop goes first
                loader.clear()
                sync()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                loops[name](repeat)
                sync()
                if repeat:
                    epochs[name].append(time.perf_counter() - start)
                    steps[name] += loader.step_seconds()
                    if device.type == "cuda":
                        peak[name] = max(peak[name], torch.cuda.max_memory_allocated())
        if rank == 0:
            raw_step, trainer_step = statistics.median(steps["raw"]), statistics.median(steps["trainer"])
            compile_notes = []
            if spec["compile"] and getattr(trainer, "forward", None) is getattr(trainer, "ddp", None):
                compile_notes.append("Trainer fell back to eager")
            if raw.compile_failed:
                compile_notes.append(f"raw compile failed ({raw.compile_failed})")
            result.update({
                "threads": threads if device.type == "cpu" else None, "world": world,
                "raw": world * spec["batch"] / raw_step, "trainer": world * spec["batch"] / trainer_step,
                "ratio": raw_step / trainer_step,
                "epoch_ratio": statistics.median(r / t for r, t in zip(epochs["raw"], epochs["trainer"])),
                "peak_raw_gib": peak["raw"] / 2 ** 30, "peak_trainer_gib": peak["trainer"] / 2 ** 30,
                "note": "; ".join(compile_notes)})
    except Exception as exc:
        if rank == 0:
            traceback.print_exc()
            result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise
    finally:
        if rank == 0:
            (Path(folder) / f"result-{spec['name']}.json").write_text(json.dumps(result))
        trainer.close()


def marks_cost(device: str, steps: int = 20000) -> float:
    """Microseconds per step of the step times' own work, timed directly: the five marks and the
    bucket mark of ``steps`` steps, then the epoch's summary (CUDA events on a GPU)."""
    times = StepTimes(torch.device(device), rank=0)
    times.start_epoch()
    start = time.perf_counter()
    for _ in range(steps):
        times.mark("batch")
        times.bucket_ready()
        for point in ("backward", "optimizer", "done"):
            times.mark(point)
    times.summary()
    return 1e6 * (time.perf_counter() - start) / steps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_configs(text: str) -> list[tuple[str, int]]:
    configs = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        arch, _, size = entry.partition("@")
        if not size.isdigit():
            raise SystemExit(f"step_overhead: --configs entry {entry!r} is not ARCHITECTURE@SIZE (e.g. resnet50@224)")
        configs.append((arch, int(size)))
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="gpu: resnet50@224, resnet50@288, vit_b_16@224, eager and compiled, batch 256, bf16, "
                             "channels-last, 1 rank; cpu: resnet18@32, 1 and 2 ranks (the default). Flags given "
                             "explicitly override the preset's")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--configs", metavar="ARCH@SIZE,...", help="architectures (torchvision names) and input sizes")
    parser.add_argument("--architecture", help="with --size: one configuration (same as --configs ARCH@SIZE)")
    parser.add_argument("--size", type=int, help="input size in pixels (with --architecture)")
    parser.add_argument("--batch", type=int, help="images per rank per step")
    parser.add_argument("--steps", type=int, help="steps per timed epoch")
    parser.add_argument("--repeats", type=int, help="timed epochs per loop (after one warmup)")
    parser.add_argument("--world-sizes", help="comma-separated numbers of ranks (CUDA: one GPU each)")
    parser.add_argument("--amp", choices=["bf16", "fp16", "off"], help="default: bf16 on CUDA, off on CPU")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                        help="default: on for CUDA")
    parser.add_argument("--compile", nargs="?", const="inductor", metavar="BACKENDS",
                        help="torch.compile backend(s), comma-separated; 'none' = not compiled; "
                             "bare --compile = inductor "
                             "(dynamo's 'eager' backend traces without generating code: a cheap check)")
    parser.add_argument("--recipe-options", action="store_true",
                        help="both loops with Nesterov momentum, label smoothing, MixUp/CutMix, "
                             "2 accumulated micro-batches, gradient clipping and an EMA per step")
    parser.add_argument("--step-times", choices=["on", "off", "both"], default="on",
                        help="the Trainer's always-on step breakdown (--step-times of the scripts); both: each "
                             "configuration with and without it, and its overhead = 1 - (Trainer/raw with it) / "
                             "(Trainer/raw without it), each against its own raw loop run side by side")
    parser.add_argument("--json", metavar="FILE", help="also write the rows here (list of dicts)")
    args = parser.parse_args()

    preset = dict(PRESETS[args.preset or ("gpu" if args.device == "cuda" else "cpu")])
    if args.device == "cuda" and not args.preset:
        preset.update(configs="resnet50@224", compile="none")  # one quick configuration unless asked
    if args.architecture or args.size:
        preset["configs"] = f"{args.architecture or 'resnet18'}@{args.size or 32}"
    for key in ("device", "configs", "batch", "steps", "repeats", "world_sizes", "compile"):
        if getattr(args, key, None) is not None:
            preset[key] = getattr(args, key)
    device = preset["device"]
    amp = args.amp or ("bf16" if device == "cuda" else "off")
    channels_last = device == "cuda" if args.channels_last is None else args.channels_last
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("step_overhead: --device cuda but no CUDA GPU is visible")
    variants = [None if b.strip() in ("none", "off", "") else b.strip() for b in str(preset["compile"]).split(",")]
    worlds = [int(w) for w in str(preset["world_sizes"]).split(",")]
    timings = {"on": [True], "off": [False], "both": [True, False]}[args.step_times]

    where = (f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()}" if device == "cuda"
             else f"{len(os.sched_getaffinity(0))} cores")
    print(f"step overhead on {device} ({where}): batch {preset['batch']}/rank, {preset['repeats']} x {preset['steps']} "
          f"steps per loop, amp {amp}, channels_last {channels_last}"
          f"{', recipe options ' + str(RECIPE_OPTIONS) if args.recipe_options else ''}; target ratio >= {TARGET}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    print("| model @ px        | world | compile  | threads/rank | raw img/s | Trainer img/s | ratio | epoch ratio "
          "| peak GiB raw | peak GiB Trainer |")
    print("|-------------------|------:|----------|-------------:|----------:|--------------:|------:|------------:"
          "|-------------:|-----------------:|")
    rows = []
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as folder:
        for arch, size in parse_configs(preset["configs"]):
            for backend, timed in ((b, t) for b in variants for t in timings):
                for world in worlds:
                    if device == "cuda" and world > torch.cuda.device_count():
                        print(f"| {arch + ' @ ' + str(size):<17} | {world:>5} | "
                              f"skipped: {torch.cuda.device_count()} GPU(s) visible |")
                        continue
                    spec = {"name": f"{arch}-{size}-{backend or 'off'}-w{world}-t{int(timed)}", "architecture": arch,
                            "size": size, "step_times": timed,
                            "batch": preset["batch"], "steps": preset["steps"], "repeats": preset["repeats"],
                            "device": device, "amp": amp, "channels_last": channels_last, "compile": backend,
                            "recipe_options": args.recipe_options}
                    try:
                        mp.spawn(run_rank, args=(world, free_port(), spec, folder), nprocs=world)
                    except Exception as exc:  # the rank printed its traceback; keep going with the others
                        print(f"step_overhead: {spec['name']} failed: {type(exc).__name__}", file=sys.stderr)
                    path = Path(folder) / f"result-{spec['name']}.json"
                    r = json.loads(path.read_text()) if path.exists() else {"error": "no result"}
                    r.update(architecture=arch, size=size, world=world, compile=backend or "off", amp=amp,
                             channels_last=channels_last, device=device, batch=preset["batch"], step_times=timed)
                    rows.append(r)
                    if "error" in r:
                        print(f"| {arch + ' @ ' + str(size):<17} | {world:>5} | {backend or 'off':<8} | "
                              f"failed: {r['error']} |", flush=True)
                        continue
                    mem = (f"{r['peak_raw_gib']:12.2f} | {r['peak_trainer_gib']:16.2f}" if device == "cuda"
                           else f"{'-':>12} | {'-':>16}")
                    print(f"| {arch + ' @ ' + str(size):<17} | {world:>5} | {backend or 'off':<8} | "
                          f"{r['threads'] or '-':>12} | "
                          f"{r['raw']:>9,.0f} | {r['trainer']:>13,.0f} | {r['ratio']:5.3f} | "
                          f"{r['epoch_ratio']:11.3f} | "
                          f"{mem} |" + ("" if r["ratio"] >= TARGET else " below target")
                          + (f" ({r['note']})" if r.get("note") else "")
                          + ("" if timed else " (without step times)"), flush=True)
    for on in (r for r in rows if r["step_times"] and "error" not in r):
        off = next((r for r in rows if not r["step_times"] and "error" not in r
                    and all(r[k] == on[k] for k in ("architecture", "size", "world", "compile"))), None)
        if off is not None:
            on["step_times_overhead"] = 1 - on["ratio"] / off["ratio"]
            print(f"step times, {on['architecture']} @ {on['size']}, {on['world']} rank(s), compile {on['compile']}: "
                  f"Trainer/raw {on['ratio']:.3f} with them, {off['ratio']:.3f} without: overhead "
                  f"{100 * on['step_times_overhead']:+.1f} % of a step (target <= 1 %)")
            on["marks_us"] = marks_cost(device)
            step_us = 1e6 * on["world"] * on["batch"] / on["trainer"]
            print(f"  timed directly: the marks and the epoch's summary cost {on['marks_us']:.1f} us per step, "
                  f"{100 * on['marks_us'] / step_us:.3f} % of this {step_us / 1000:.1f} ms step (the 4 "
                  "post-accumulate-grad hooks not included)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
