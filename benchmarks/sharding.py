"""Sharded training (issue 25): memory per rank under DDP, full shard and hybrid shard, and the step
time of the project's sharded training step against a raw FSDP2 loop.

**Memory per rank.** For each layout a fresh set of local ranks builds the project's Trainer through
its own configuration (``TrainerConfig(sharding=..., opt="adamw", ...)`` then ``Trainer.build``: the
model, ``Network.wrap``: DDP, or ``fully_shard`` per block then the root on the project's mesh, then
the optimizer) and runs ``Trainer.train_step`` on a fixed in-memory batch: one step that creates the
optimizer state, then ``--memory-steps`` measured steps (a rank's measurement is the package's,
:func:`fixres_dist.bench.trainer_rank.measure_rank`, shared with ``python -m
fixres_dist.bench.strategies``, which puts tensor parallelism and pipeline stages beside these).
Layouts: ``ddp`` and ``full`` on ``--ranks`` ranks, ``hybrid`` on ``--hybrid-ranks`` ranks in shard
groups of ``--shard-group-size`` (2 x 2 on 4 ranks by default), and ``full`` on those ranks too, for
comparison. DDP's memory per rank does not depend on the number of ranks (every rank holds the whole
model), so the DDP row is the reference of both ratios.

* CPU: :class:`fixres_dist.bench.rank_memory.LiveBytes`, a dispatch mode that counts the bytes of
  every live tensor storage made under it (DTensor shards as their local pieces; FSDP2's gathered
  parameters while their storage is allocated). It is entered before ``Trainer.build``, so it holds the model, DDP's
  gradient buckets, FSDP2's shards, the optimizer state and every activation and temporary of the
  steps; gloo's own buffers and the input batch (made before) are not counted. ``peak``: its peak
  over the measured steps (reset after the first step to what is then resident); ``resident``: what
  the rank holds after ``build`` (before any gradient or optimizer state); ``model states``: the
  local bytes of parameters + gradients + optimizer state read off the model and optimizer after
  the last step (ZeRO's "model states", a cross-check that needs no tracker); ``peak - states``:
  the rest at the peak (activations, gathered parameters, communication buffers, DDP's buckets,
  temporaries). torch's own ``MemTracker`` (``torch.distributed._tools.mem_tracker``) gives the
  same peaks here (checked on the ``--quick`` model: 106.5 / 48.0 / 28.5 / 48.0 MiB against
  106.5 / 48.7 / 28.5 / 48.0), but its per-module bookkeeping on every op made a step 50 to 100
  times slower; this one adds 10-25 % to a step (ViT-S @ 64 px on one CPU thread). The memory
  steps are not the timed ones.
* CUDA: ``torch.cuda.max_memory_allocated`` over the measured steps (after
  ``reset_peak_memory_stats``), ``memory_allocated`` after ``build`` for ``resident``.

Figures are per rank, the largest over the ranks (small tensors shard unevenly); ``--json`` has
every rank's.

**Step time.** One set of ``--ranks`` ranks builds both loops, side by side: the project's
(``--sharding full`` through ``TrainerConfig``, ``Trainer.build(train_loader=...)`` with a loader
that yields the same batch ``--steps`` times per epoch, then ``Trainer.train_epoch`` as it is: the
engine's step, the learning-rate schedule, the loss bookkeeping, the stop-signal check, the epoch's
loss all-reduce) and a raw FSDP2 loop written out here with plain PyTorch: the same timm model built
with the same arguments and seed, ``fully_shard`` on each transformer block then the root on a 1-D
mesh of all ranks (``reshard_after_forward=True``, as the project's default), AdamW with the same
learning rate and weight-decay groups, and per step normalise, forward (under autocast with
``--amp``, FSDP2's ``MixedPrecisionPolicy`` then in both), cross-entropy, ``zero_grad``, backward,
step. Each rank warms both loops up with one epoch, then runs ``--rounds`` rounds of one epoch of
each, the order alternating. Step times: on CPU the wall time between two batches (rank 0; the
collectives keep the ranks in step); on CUDA the time between CUDA events recorded there. ``ratio``
= median raw step / median project step (target >= 0.97: the project costs at most 3 % a step),
the pass/fail. Beside it on CPU, the ratio of the median CPU time per step of rank 0's process (all
its threads, gloo's included; waiting for the other rank costs none): less sensitive to other work
on a shared machine than the wall clock, though not immune to it (caches, memory bandwidth).

Local ranks are forked from a forkserver that imports torch, timm and the package once
(:mod:`fixres_dist.bench.local_ranks`); they meet
over gloo at tcp://127.0.0.1:<free port> (NCCL and one GPU per rank with ``--device cuda``); on CPU
the Trainer gives each rank ``cores // ranks`` threads (the raw loop runs in the same processes).
On a shared machine, other work shows in every wall-clock figure: the header prints the load average.

Run from the repository root:
  .venv/bin/python benchmarks/sharding.py                 # CPU, timm vit_small_patch16_224 @ 64 px, batch 16
  .venv/bin/python benchmarks/sharding.py --quick         # smoke run: vit_tiny @ 32 px, fewer steps
  .venv/bin/python benchmarks/sharding.py --device cuda   # NCCL, one GPU per rank (2; 4 for hybrid)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not installed in .venv
from fixres_dist.bench.local_ranks import rank_result, run_ranks
from fixres_dist.bench.trainer_rank import loader_for, measure_rank, rank_setup
from fixres_dist.distributed import collectives

TARGET = 0.97
TIMM = "timm/"
PRESETS = {  # per device; --quick replaces the device's preset; flags given explicitly override
    "cpu": {"architecture": "timm/vit_small_patch16_224", "size": 64, "batch": 16, "steps": 2, "rounds": 6,
            "memory_steps": 1, "amp": "off"},
    "quick": {"architecture": "timm/vit_tiny_patch16_224", "size": 32, "batch": 8, "steps": 2, "rounds": 4,
              "memory_steps": 1, "amp": "off"},
    "cuda": {"architecture": "timm/vit_base_patch16_224", "size": 224, "batch": 64, "steps": 5, "rounds": 3,
             "memory_steps": 2, "amp": "bf16"},
}
AMP_DTYPES = {"bf16": torch.bfloat16, "off": None}  # not fp16: the Trainer adds a GradScaler, the raw loop has none


class Stopwatch:
    """Time stamps (wall clock, and the process's CPU time: all its threads, gloo's included), and on
    CUDA events recorded at the same points; their differences are steps."""

    def __init__(self, cuda: bool):
        self.cuda, self.stamps, self.cpu_stamps, self.events = cuda, [], [], []

    def stamp(self) -> None:
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.process_time())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def clear(self) -> None:
        self.stamps.clear()
        self.cpu_stamps.clear()
        self.events.clear()

    def cpu_intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.cpu_stamps, self.cpu_stamps[1:])]

    def intervals(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in zip(self.events, self.events[1:])]
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


class RawFSDP:
    """The raw FSDP2 loop: the same timm model, ``fully_shard`` per block then the root, AdamW."""

    def __init__(self, spec: dict, num_classes: int, lr: float, weight_decay: float, device: torch.device,
                 mean: tuple, std: tuple):
        import timm
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        torch.manual_seed(0)  # the same initial weights on every rank
        with torch.device(device):
            model = timm.create_model(spec["architecture"][len(TIMM):], pretrained=False, num_classes=num_classes,
                                      img_size=spec["size"], dynamic_img_size=True)
        mesh = init_device_mesh(device.type, (spec["world"],))
        self.amp = AMP_DTYPES[spec["amp"]]
        options = {"mesh": mesh, "reshard_after_forward": True}
        if self.amp is not None:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.amp, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
        decayed = [p for p in model.parameters() if p.ndim > 1]  # weights; biases and norms are not decayed
        exempt = [p for p in model.parameters() if p.ndim <= 1]
        self.optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": weight_decay},
                                            {"params": exempt, "weight_decay": 0.0}], lr=lr)
        self.model, self.device = model, device
        self.mean = torch.tensor(mean, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(std, device=device).view(1, 3, 1, 1) * 255

    def epoch(self, images: torch.Tensor, labels: torch.Tensor, steps: int, watch: Stopwatch) -> None:
        self.model.train()
        for _ in range(steps):
            watch.stamp()
            x = (images.to(self.device, non_blocking=True).float() - self.mean) / self.std
            y = labels.to(self.device, non_blocking=True)
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast(self.device.type, dtype=self.amp or torch.bfloat16, enabled=self.amp is not None):
                logits = self.model(x)
            F.cross_entropy(logits.float(), y).backward()
            self.optimizer.step()
        watch.stamp()


def speed_rank(rank: int, spec: dict, port: int, folder: str) -> None:
    """One rank of the step-time comparison: the project's sharded epoch and the raw FSDP2 loop, interleaved."""
    with rank_result(folder, spec["name"], rank) as result:
        cfg, device, trainer, (images, labels, num_classes) = rank_setup(rank, spec, port, folder)
        try:
            watch = Stopwatch(device.type == "cuda")
            trainer.build(train_loader=loader_for(cfg, images, labels, spec["steps"], watch.stamp))
            mean, std = trainer.network.preprocessing.normalization
            raw = RawFSDP(spec, num_classes, trainer.step.base_lr, cfg.weight_decay, device, mean, std)

            def project(round_: int) -> None:
                trainer.state.epoch, trainer.state.images_in_epoch = round_, 0
                trainer.train_epoch()

            loops = {"raw": lambda round_: raw.epoch(images, labels, spec["steps"], watch), "project": project}
            steps = {name: [] for name in loops}
            cpu_steps = {name: [] for name in loops}
            epochs = {name: [] for name in loops}
            for round_ in range(spec["rounds"] + 1):  # round 0 warms both up
                for name in sorted(loops, reverse=round_ % 2 == 1):
                    watch.clear()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    collectives.barrier()
                    started = time.perf_counter()
                    loops[name](round_)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    if round_:
                        epochs[name].append(time.perf_counter() - started)
                        steps[name] += watch.intervals()
                        cpu_steps[name] += watch.cpu_intervals()
            raw_step, project_step = statistics.median(steps["raw"]), statistics.median(steps["project"])
            raw_cpu, project_cpu = statistics.median(cpu_steps["raw"]), statistics.median(cpu_steps["project"])
            result.update(raw_step=raw_step, project_step=project_step, ratio=raw_step / project_step,
                          raw_steps=steps["raw"], project_steps=steps["project"],
                          raw_cpu=raw_cpu, project_cpu=project_cpu, cpu_ratio=raw_cpu / project_cpu,
                          raw_cpu_steps=cpu_steps["raw"], project_cpu_steps=cpu_steps["project"],
                          epoch_ratio=statistics.median(r / p for r, p in zip(epochs["raw"], epochs["project"])),
                          threads=torch.get_num_threads(),
                          same_shards=[tuple(a.to_local().shape) for a in trainer.network.model.parameters()]
                          == [tuple(b.to_local().shape) for b in raw.model.parameters()])
        finally:
            trainer.close()


def mib(count: float) -> str:
    return f"{count / 2 ** 20:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="smoke run: vit_tiny @ 32 px, batch 8, fewer steps "
                        "(under a minute on 2 CPU cores)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks for DDP, full shard and the step time (default 2)")
    parser.add_argument("--hybrid-ranks", type=int, default=4, help="ranks for hybrid shard (default 4; 0: skip it)")
    parser.add_argument("--shard-group-size", type=int, default=2, help="hybrid: ranks per shard group (default 2)")
    parser.add_argument("--architecture", help="a timm model, timm/NAME (default timm/vit_small_patch16_224; "
                        "the raw loop shards its .blocks)")
    parser.add_argument("--size", type=int, help="input size in pixels")
    parser.add_argument("--batch", type=int, help="images per rank per step")
    parser.add_argument("--steps", type=int, help="steps per timed epoch")
    parser.add_argument("--rounds", type=int, help="timed epochs of each loop (after one warmup epoch)")
    parser.add_argument("--memory-steps", type=int, help="measured steps per memory layout (after one step)")
    parser.add_argument("--amp", choices=sorted(AMP_DTYPES), help="default: off on CPU, bf16 on CUDA")
    parser.add_argument("--only", choices=["memory", "speed"], help="run one part only")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = parser.parse_args()

    preset = dict(PRESETS["quick" if args.quick else args.device])
    for key in ("architecture", "size", "batch", "steps", "rounds", "memory_steps", "amp"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    if not preset["architecture"].startswith(TIMM):
        raise SystemExit("sharding: --architecture must be a timm model (timm/NAME): the raw loop shards its .blocks")
    if args.ranks < 2:
        raise SystemExit("sharding: --ranks must be at least 2 (one rank has nothing to shard)")
    hybrid = args.hybrid_ranks
    if hybrid and (hybrid % args.shard_group_size or hybrid == args.shard_group_size):
        raise SystemExit(f"sharding: --hybrid-ranks {hybrid} is not several shard groups of {args.shard_group_size}")
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus < args.ranks:
            raise SystemExit(f"sharding: --device cuda needs one GPU per rank (NCCL): {gpus} visible for "
                             f"--ranks {args.ranks}; run --device cpu (gloo ranks) instead")
        if hybrid > gpus:
            print(f"sharding: hybrid shard skipped: {hybrid} ranks need {hybrid} GPUs, {gpus} visible")
            hybrid = 0
    base = {**preset, "device": args.device, "epochs": preset["rounds"] + 2}
    where = (f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()}" if args.device == "cuda"
             else f"{len(os.sched_getaffinity(0))} cores")
    started = time.perf_counter()
    print(f"sharding benchmark on {args.device} ({where}, torch {torch.__version__}): {preset['architecture']} @ "
          f"{preset['size']} px, batch {preset['batch']}/rank, AdamW, amp {preset['amp']}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    out = {"settings": {**base, "ranks": args.ranks, "hybrid_ranks": hybrid, "shard_group_size": args.shard_group_size},
           "memory": [], "ratios": {}, "speed": None}
    with tempfile.TemporaryDirectory(prefix="sharding-bench-") as folder:
        if args.only != "speed":
            layouts = [("ddp", args.ranks, None), ("full", args.ranks, None)]
            if hybrid:
                if hybrid != args.ranks:
                    layouts.append(("full", hybrid, None))
                layouts.append(("hybrid", hybrid, args.shard_group_size))
            measure = "live tensor storages" if args.device == "cpu" else "torch.cuda.max_memory_allocated"
            print(f"\nmemory per rank ({measure}; the largest rank; {preset['memory_steps']} measured step(s) "
                  "after one)")
            print("| layout | ranks | mesh     | parameters/rank | resident MiB | model states MiB | peak MiB "
                  "| peak - states MiB | peak / DDP | states / DDP |")
            print("|--------|------:|----------|----------------:|-------------:|-----------------:|---------:"
                  "|------------------:|-----------:|-------------:|")
            reference = None
            for sharding, world, group in layouts:
                mesh = {"ddp": "replicas", "full": f"{world}", "hybrid": f"{world // (group or 1)} x {group}"}
                fields = {"sharding": sharding, "shard_group_size": group if sharding == "hybrid" else None}
                spec = {**base, "fields": fields, "world": world, "name": f"memory-{sharding}-{world}",
                        "warmup": 0, "steps": 0}  # the memory steps only
                results = run_ranks(measure_rank, spec, folder)
                failed = [r for r in results if "error" in r]
                if failed:
                    print(f"| {sharding:<6} | {world:>5} | failed: {failed[0]['error']} |", flush=True)
                    out["memory"].append({"sharding": sharding, "world": world, "error": failed[0]["error"]})
                    continue
                peak = max(r["peak"] for r in results)
                resident = max(r["resident"] for r in results)
                states = max(sum(r["model_states"].values()) for r in results)
                row = {"sharding": sharding, "world": world, "mesh": mesh[sharding], "peak": peak,
                       "resident": resident, "model_states": states, "ranks": results}
                if sharding == "ddp":
                    reference = row
                ratio = peak / reference["peak"] if reference else float("nan")
                states_ratio = states / reference["model_states"] if reference else float("nan")
                row.update(peak_over_ddp=ratio, model_states_over_ddp=states_ratio)
                out["memory"].append(row)
                local = max(r["local_parameters"] for r in results)
                print(f"| {sharding:<6} | {world:>5} | {mesh[sharding]:<8} | {local:>15,} | {mib(resident):>12} | "
                      f"{mib(states):>16} | {mib(peak):>8} | {mib(peak - states):>17} | {ratio:10.2f} | "
                      f"{states_ratio:12.2f} |", flush=True)
            rows = {(r["sharding"], r["world"]): r for r in out["memory"] if "error" not in r}
            if ("full", args.ranks) in rows:
                out["ratios"]["full_over_ddp"] = rows[("full", args.ranks)]["peak_over_ddp"]
            if hybrid and ("hybrid", hybrid) in rows:
                out["ratios"]["hybrid_over_ddp"] = rows[("hybrid", hybrid)]["peak_over_ddp"]
            if out["ratios"]:
                names = {"full_over_ddp": f"full ({args.ranks} ranks) / DDP",
                         "hybrid_over_ddp": f"hybrid ({hybrid} ranks, {hybrid // args.shard_group_size} x "
                                            f"{args.shard_group_size}) / DDP"}
                print("peak memory per rank: " + "; ".join(f"{names[k]} {v:.2f}" for k, v in out["ratios"].items()))
        if args.only != "memory":
            spec = {**base, "fields": {"sharding": "full"}, "world": args.ranks, "name": f"speed-full-{args.ranks}"}
            print(f"\nstep time, --sharding full on {args.ranks} ranks: project (Trainer.train_epoch) against a raw "
                  f"FSDP2 loop, {preset['rounds']} x {preset['steps']} steps each, interleaved; target raw/project >= "
                  f"{TARGET}", flush=True)
            results = run_ranks(speed_rank, spec, folder)
            r = results[0]
            if "error" in r:
                print(f"step time failed: {r['error']}")
                out["speed"] = {"error": r["error"]}
            else:
                world_batch = args.ranks * preset["batch"]
                passed = r["ratio"] >= TARGET and r["same_shards"]
                verdict = "PASS" if passed else "FAIL" + ("" if r["same_shards"] else ": the loops shard differently")
                cpu = args.device == "cpu"
                print("| loop                | median step s | img/s (all ranks) |"
                      + (" median CPU s/step | threads/rank |" if cpu else ""))
                print("|---------------------|--------------:|------------------:|"
                      + ("------------------:|-------------:|" if cpu else ""))
                for label, key in (("raw FSDP2", "raw"), ("project, full shard", "project")):
                    print(f"| {label:<19} | {r[key + '_step']:13.3f} | {world_batch / r[key + '_step']:17.1f} |"
                          + (f" {r[key + '_cpu']:17.3f} | {r['threads']:>12} |" if cpu else ""))
                cpu_note = (f"; CPU-time ratio {r['cpu_ratio']:.3f} (rank 0's process, all threads: less sensitive "
                            "to other work on the machine)") if cpu else ""
                print(f"ratio raw/project {r['ratio']:.3f}: {verdict} (target >= {TARGET}); epoch ratio "
                      f"{r['epoch_ratio']:.3f}{cpu_note}; same parameter shards in both loops: {r['same_shards']}")
                out["speed"] = {**r, "pass": passed, "img_s_raw": world_batch / r["raw_step"],
                                "img_s_project": world_batch / r["project_step"]}
    elapsed = time.perf_counter() - started
    out["seconds"] = elapsed
    print(f"\n{elapsed:.0f} s in all; load average {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
