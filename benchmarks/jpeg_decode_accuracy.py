"""Accuracy with the scaled JPEG decode against the full decode: the FixRes benchmark on the canvas data
stored as JPEG, 3 seeds (issue 44, item 5).

What it measures. ``--jpeg-decode scaled`` (the default, :mod:`fixres_dist.data.scaled_decode`) decodes
a JPEG's kept window at a DCT scale: the same crops as a full decode, pixels that differ by the
scaled IDCT's low-pass (about 1-3 levels of 255 on photos, ``benchmarks/input_pipeline.py``). Does a
network trained and evaluated on those pixels reach the same top-1? Per seed and decode: a scratch
run at the train resolution (24 px) and its FixRes finetune at the test resolution (32 px, the
classifier and last norm; ``main_finetune.py --input-size 32 --train-size 24``). The two decodes are
paired by seed (same initialisation, same crops, same images), so the per-seed difference isolates
the decode; the verdict compares its mean with the seeds' own spread (sample standard deviation).

The data. The canvas Fashion-MNIST of ``benchmarks/fixres_effect.py`` (garments at 45-100 % of a
48 px canvas; Debian's ``dataset-fashion-mnist``, MIT licence, Zalando SE), its first
``--train-images-per-class`` / ``--val-images-per-class`` images, each upscaled once with Pillow's
bicubic filter to ``--jpeg-side`` px (default 144, 3x: so that libjpeg's 1/2 and 1/4 scales occur at
24 and 32 px, as 1/2 to 1/8 do for ImageNet photos at 128-224 px) and saved as a baseline JPEG of
quality 90, under ``--data-root`` (made once, then reused; a marker file is written last).

How. The real scripts as subprocesses (``--num-tasks`` ranks each; fixres_effect's ``run_job``: job
logs ``<output>/<job id>.log``, finished jobs reused, interrupted ones resumed). The report is printed
and written to ``<output>/jpeg_decode_accuracy.md``, per-seed numbers to ``.json``.

Defaults (2 CPU cores): resnet20, 12 scratch epochs at lr 0.1 per 256 images (batch 128 per rank,
warmup 0.5), 2 finetune epochs at lr 0.05, 500 train and 500 val images per class, 3 seeds: about
20 minutes on 2 cores. Smoke run: ``--seeds 1 --epochs 1 --finetune-epochs 1 --train-images-per-class 20
--val-images-per-class 10``.

Run from the repository root:  .venv/bin/python benchmarks/jpeg_decode_accuracy.py
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fixres_effect as fe  # noqa: E402  (the FixRes benchmark's data, jobs and figures)

from fixres_dist.arguments import positive_int  # noqa: E402  (fixres_effect put the repository on sys.path)

DECODES = ("full", "scaled")
TRAIN, TEST = fe.DATASETS["canvas"][1:]  # 24 and 32 px
MARKER = "JPEG.json"


def jpeg_copy(source: Path, out: Path, side: int, quality: int = 90) -> Path:
    """``source`` (an ImageFolder of PNGs) with every image upscaled to ``side`` px (bicubic) and saved as a
    baseline JPEG of ``quality``, at ``out``; made once (written beside it, renamed, :data:`MARKER` last)."""
    if (out / MARKER).is_file():
        return out
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    count = 0
    for image in sorted(source.glob("*/*/*.png")):
        split, label = image.parent.parent.name, image.parent.name
        (tmp / split / label).mkdir(parents=True, exist_ok=True)
        with Image.open(image) as png:
            data = io.BytesIO()
            png.convert("RGB").resize((side, side), Image.Resampling.BICUBIC).save(data, "JPEG", quality=quality)
        (tmp / split / label / f"{image.stem}.jpg").write_bytes(data.getvalue())
        count += 1
    licence = next((p for p in (source / "LICENSE", Path(os.path.realpath(source)).parents[1] / "LICENSE")
                    if p.is_file()), None)
    if licence is not None:
        (tmp / "LICENSE").write_text(f"Converted to {side} px JPEGs (quality {quality}) by "
                                     f"benchmarks/jpeg_decode_accuracy.py.\n" + licence.read_text())
    (tmp / MARKER).write_text(json.dumps({"source": str(source), "side": side, "quality": quality,
                                          "images": count}) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out


def run_seed(args, seed: int, data_path: Path, runs: Path) -> dict:
    """One seed: per decode, the scratch run at 24 px and its FixRes finetune at 32 px."""
    found = {}
    for decode in DECODES:
        common = ["--data-path", str(data_path), "--architecture", args.architecture, "--batch", str(args.batch),
                  "--seed", str(seed), "--jpeg-decode", decode]
        scratch = [*common, "--epochs", str(args.epochs), "--learning-rate", str(args.lr),
                   "--warmup-epochs", str(args.warmup_epochs), "--input-size", str(TRAIN)]
        low, low_s = fe.run_job("main_scratch.py", f"jpeg-{decode}-scratch{TRAIN}", seed, scratch, args.epochs, runs,
                                args.num_tasks, args.workers, sweep=False)
        weights = runs / fe.job_id(f"jpeg-{decode}-scratch{TRAIN}", seed, [str(args.num_tasks), *scratch])
        tune = [*common, "--weight-path", str(weights / "checkpoint.pth"), "--epochs", str(args.finetune_epochs),
                "--learning-rate", str(args.finetune_lr), "--warmup-epochs", "0", "--train-size", str(TRAIN),
                "--input-size", str(TEST)]
        fix, fix_s = fe.run_job("main_finetune.py", f"jpeg-{decode}-fixres{TEST}", seed, tune, args.finetune_epochs,
                                runs, args.num_tasks, args.workers, sweep=False)
        found[decode] = {"baseline": fe.final_eval(low, TRAIN)["top1"], "fixres": fe.final_eval(fix, TEST)["top1"],
                         "images": fe.final_eval(low, TRAIN)["images"],
                         "img_per_s": statistics.fmean(e["img_per_s"] for e in low if e.get("event") == "train"),
                         "wall_s": {"scratch": low_s, "finetune": fix_s}}
    return {"seed": seed, **found}


def inputs_gap(data_path: Path, count: int = 100) -> list[str]:
    """How far the two decodes' inputs are apart on ``count`` images: the train view at 24 px (train split)
    and the test view at 32 px (val split), mean absolute difference in levels of 255 and the share of
    images that differ at all (a comparison where no image differs would compare nothing)."""
    from fixres_dist.data import pipeline
    from fixres_dist.data.samplers import SampleKey

    lines = []
    for split, transform, size in (("train", pipeline.train_transform(TRAIN), TRAIN),
                                   ("val", pipeline.test_transform(TEST), TEST)):
        base = pipeline.image_folder(data_path, split)
        scaled, full = (pipeline.SeededDataset(base, transform, 0, jpeg_decode=d) for d in ("scaled", "full"))
        gaps = [(scaled[SampleKey(i, 1)][0].float() - full[SampleKey(i, 1)][0].float()).abs().mean().item()
                for i in range(0, len(base), max(1, len(base) // count))]
        differ = 100 * sum(g > 0 for g in gaps) / len(gaps)
        lines.append(f"- inputs at {size} px ({split} transform): scaled and full decode differ by "
                     f"{statistics.fmean(gaps):.2f} levels of 255 on average; {differ:.0f} % of {len(gaps)} images "
                     "differ")
    return lines


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def report(args, results: list[dict], wall_s: float, data_path: Path) -> str:
    n = results[0]["full"]["images"]
    lines = [f"# The scaled JPEG decode against the full decode: FixRes on the canvas data as {args.jpeg_side} px "
             "JPEGs", "",
             f"{args.architecture}, {args.num_tasks} ranks, {len(results)} seeds; scratch at {TRAIN} px for "
             f"{args.epochs} epochs, then the FixRes finetune at {TEST} px for {args.finetune_epochs}; top-1 (%) on "
             f"{n:,} test images (binomial standard error of one figure: "
             f"{fe.standard_error(results[0]['full']['fixres'], n):.2f} point); {wall_s / 60:.0f} min", "",
             "| decode | top-1 at 24 px (scratch) | per seed | top-1 at 32 px (FixRes finetune) | per seed | "
             "train img/s |", "|---|---:|---|---:|---|---:|"]
    for decode in DECODES:
        base = [r[decode]["baseline"] for r in results]
        fix = [r[decode]["fixres"] for r in results]
        speed = statistics.fmean(r[decode]["img_per_s"] for r in results)
        lines.append(f"| {decode} | {fe.mean_std(base)} | {fe.per_seed(base)} | {fe.mean_std(fix)} | "
                     f"{fe.per_seed(fix)} | {speed:,.0f} |")
    lines.append("")
    for stage in ("baseline", "fixres"):
        gaps = [r["scaled"][stage] - r["full"][stage] for r in results]
        spread = max(_spread([r[d][stage] for r in results]) for d in DECODES)
        mean = statistics.fmean(gaps)
        verdict = "within the seeds' spread" if abs(mean) <= spread else "outside the seeds' spread"
        lines.append(f"- {'scratch at 24 px' if stage == 'baseline' else 'FixRes finetune at 32 px'}: scaled - full "
                     f"= {fe.mean_std(gaps, sign=True)} points (per seed {fe.per_seed(gaps, sign=True)}); the seeds' "
                     f"spread (the larger sample std of the two decodes) {spread:.2f}: **{verdict}**")
    return "\n".join(lines + inputs_gap(data_path))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-root", type=Path, default=Path.home() / ".cache" / "fixres_dist")
    p.add_argument("--output", type=Path, default=Path("runs") / "jpeg_decode_accuracy")
    p.add_argument("--seeds", type=positive_int, default=3)
    p.add_argument("--architecture", default="resnet20")
    p.add_argument("--epochs", type=positive_int, default=12)
    p.add_argument("--finetune-epochs", type=positive_int, default=2)
    p.add_argument("--batch", type=positive_int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--finetune-lr", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=float, default=0.5)
    p.add_argument("--num-tasks", type=positive_int, default=2)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--train-images-per-class", type=positive_int, default=500)
    p.add_argument("--val-images-per-class", type=positive_int, default=500)
    p.add_argument("--jpeg-side", type=positive_int, default=144, help="pixels of the JPEGs' side (default 144)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        runs = args.output.absolute()
        runs.mkdir(parents=True, exist_ok=True)
        root = args.data_root.expanduser().absolute()
        canvas = fe.prepare_full_dataset(root / "fashion_mnist_full_canvas48", fe.SOURCE, 48)
        pngs = fe.subset(canvas, args.train_images_per_class, args.val_images_per_class)
        data = jpeg_copy(pngs, root / f"canvas48_jpeg{args.jpeg_side}_{pngs.name}", args.jpeg_side)
        results = [run_seed(args, seed, data, runs) for seed in range(args.seeds)]
    except (fe.BenchmarkError, OSError) as exc:
        print(f"jpeg_decode_accuracy: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("jpeg_decode_accuracy: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    text = report(args, results, time.perf_counter() - start, data)
    (runs / "jpeg_decode_accuracy.md").write_text(text + "\n")
    (runs / "jpeg_decode_accuracy.json").write_text(json.dumps({"arguments": {k: str(v) for k, v in vars(args).items()},
                                                                "results": results}, indent=2) + "\n")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
