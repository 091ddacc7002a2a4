"""End-to-end training throughput of a real run against the synthetic-data raw loop.

The real run: ``main_scratch.py`` as a user runs it (one rank), on the JPEG ImageFolder of
``benchmarks/input_pipeline.py`` (foolbox's 20 ImageNet photos copied ``--train-images`` times, from
disk, page-cached), with ``--workers`` real DataLoader worker processes decoding and augmenting
(``train_transform``), pinned memory on CUDA, and the speed flags given here (``--amp``,
``--channels-last``, ``--compile``). Its figure is the Trainer's own ``img_per_s`` of the last
training epoch in ``metrics.jsonl`` (the first epoch also starts the workers and compiles); it
counts loading, the device copy and the step, not the evaluation.

The reference: the raw PyTorch loop of ``benchmarks/step_overhead.py`` (same architecture, size,
batch, AMP, memory format and compile backend) on one fixed batch already on the device: what the
device does when data costs nothing. ``ratio`` = real / raw; near 1 the input pipeline keeps up,
well below 1 the run waits for data (more workers or cores, or a cheaper decode, would help).

Run from the repository root:
  .venv/bin/python benchmarks/end_to_end.py                 # CPU: resnet18 @ 64 px, batch 32, 1 worker
  .venv/bin/python benchmarks/end_to_end.py --preset gpu    # CUDA: resnet50 @ 224, batch 256, bf16,
                                                            # channels-last, workers = cores - 2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not installed in .venv
from fixres_dist import TrainerConfig
from fixres_dist.data.samplers import ExactBatchSampler
from input_pipeline import make_jpeg_folder  # benchmarks/ is this script's folder
from step_overhead import FixedBatchLoader, RawLoop

ROOT = Path(__file__).resolve().parents[1]

PRESETS = {
    "cpu": {"device": "cpu", "architecture": "resnet18", "size": 64, "batch": 32, "train_images": 640,
            "workers": 1, "epochs": 2, "amp": "off", "channels_last": False},
    "gpu": {"device": "cuda", "architecture": "resnet50", "size": 224, "batch": 256, "train_images": 5120,
            "workers": max(1, len(os.sched_getaffinity(0)) - 2), "epochs": 3, "amp": "bf16", "channels_last": True},
}


def real_run(args, data: Path, folder: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "main_scratch.py"), "--job-id", "e2e", "--shared-folder-path", str(folder),
           "--data-path", str(data), "--architecture", args.architecture, "--input-size", str(args.size),
           "--batch", str(args.batch), "--epochs", str(args.epochs), "--workers", str(args.workers),
           "--device", args.device, "--amp", args.amp, "--no-progress",
           "--channels-last" if args.channels_last else "--no-channels-last"]
    if args.compile:
        cmd += ["--compile", args.compile]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")}
    env["PYTHONPATH"] = str(ROOT)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"end_to_end: main_scratch.py failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    events = [json.loads(line) for line in (folder / "e2e" / "metrics.jsonl").read_text().splitlines()]
    train = [e for e in events if e["event"] == "train"]
    return {"img_per_s": train[-1]["img_per_s"], "epochs": [e["img_per_s"] for e in train], "seconds": seconds}


def raw_loop(args, num_classes: int, steps: int) -> float:
    """img/s of the raw loop on one fixed batch on the device (one warm-up epoch, then one timed)."""
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = device.type == "cuda"
    spec = {"architecture": args.architecture, "size": args.size, "channels_last": args.channels_last,
            "compile": args.compile, "amp": args.amp}
    cfg = TrainerConfig(weight_decay=5e-5)  # SGD, momentum 0.9, as the real run's defaults
    raw = RawLoop(spec, num_classes, cfg, 0.1, device, world=1)
    images = torch.randint(0, 256, (args.batch, 3, args.size, args.size), dtype=torch.uint8).to(device)
    labels = torch.randint(0, num_classes, (args.batch,)).to(device)
    loader = FixedBatchLoader(images, labels, ExactBatchSampler(args.batch * steps, 1, 0, args.batch, shuffle=False))
    best = 0.0
    for epoch in range(3):  # the first warms up (compiles, autotunes)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        raw.epoch(loader)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if epoch:
            best = max(best, args.batch * steps / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="default: gpu with --device cuda, else cpu")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--architecture")
    parser.add_argument("--size", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--train-images", type=int)
    parser.add_argument("--workers", type=int, help="DataLoader worker processes of the real run")
    parser.add_argument("--epochs", type=int, help="epochs of the real run; the last one counts")
    parser.add_argument("--amp", choices=["bf16", "fp16", "off"])
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND")
    parser.add_argument("--raw-steps", type=int, default=20, help="steps per epoch of the raw loop")
    parser.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "fixres_dist_jpeg_e2e"))
    parser.add_argument("--source-dir",
                        help="folder of foolbox's imagenet_*_*.jpg (default: foolbox's own data folder)")
    parser.add_argument("--json", metavar="FILE", help="write the figures here")
    args = parser.parse_args()
    preset = PRESETS[args.preset or ("gpu" if args.device == "cuda" else "cpu")]
    for key, value in preset.items():  # flags given win over the preset
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("end_to_end: --device cuda but no CUDA GPU is visible")

    data = make_jpeg_folder(args.data_dir, args.train_images, 100, args.source_dir)
    print(f"end to end: {args.architecture} @ {args.size} px, batch {args.batch}, {args.device}, amp {args.amp}, "
          f"channels_last {args.channels_last}, compile {args.compile or 'off'}; {args.train_images} JPEGs, "
          f"{args.workers} loader worker(s); load average {os.getloadavg()[0]:.2f} on "
          f"{len(os.sched_getaffinity(0))} cores", flush=True)
    with tempfile.TemporaryDirectory(prefix="e2e-") as folder:
        real = real_run(args, data, Path(folder))
    classes = len([p for p in (data / "train").iterdir() if p.is_dir()])
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    raw = raw_loop(args, classes, args.raw_steps)
    ratio = real["img_per_s"] / raw
    print("| what                                        |   img/s |")
    print("|---------------------------------------------|--------:|")
    print(f"| real run (main_scratch.py, JPEGs from disk) | {real['img_per_s']:7,.0f} |")
    print(f"| raw loop, synthetic batch on the device     | {raw:7,.0f} |")
    print(f"real / raw = {ratio:.2f} (per-epoch img/s of the real run: "
          f"{', '.join(f'{v:,.0f}' for v in real['epochs'])}; the run took {real['seconds']:.0f} s with startup "
          "and evaluation)")
    if args.json:
        Path(args.json).write_text(json.dumps({**vars(args), "real": real["img_per_s"], "real_epochs": real["epochs"],
                                               "raw": raw, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
