"""The FixRes effect on the full Fashion-MNIST, as it is and with objects at varied scales (3 seeds).

What it measures. FixRes (Touvron et al., NeurIPS 2019, arXiv 1906.06423): a classifier trained with
RandomResizedCrop (RRC) at K_train sees objects larger than the test preprocessing shows them, so
it is often more accurate at a higher test resolution K_test, and more so after finetuning the
classifier and the last BatchNorm at K_test with the test preprocessing (ResNet-50 on ImageNet:
77.0 % at 224 px -> 79.0 % at 384 px, FixRes Table 2). Per dataset and seed, top-1 on the test split:

1. **train resolution**: the scratch model at K_train (the baseline);
2. **test resolution, no finetuning**: the same model at K_test;
3. **FixRes finetune at the test resolution**: classifier + last norm finetuned at K_test with the
   test preprocessing (``main_finetune.py --input-size K_test``);
4. **control finetune at the train resolution**: the same finetune at K_train, so that the gain of
   (3) is not just extra training;
5. **detail-matched test**: (2) and (3) evaluated on test images first shrunk to K_train, then
   upscaled to K_test: the objects look as large as at K_test but carry only K_train's detail. If
   (3) holds there, its gain comes from the apparent object size (what FixRes corrects), not from
   extra detail;
6. **trained at the test resolution**: a scratch model trained at K_test and tested there, with its
   training cost: the accuracy-for-compute trade the paper sells (train cheap, finetune, test high).

Gains are per seed (same test images), then mean ± sample std over seeds; the goal (FixRes
finetune - train-resolution baseline >= +1.0 top-1 point and >= the control, on the mean) is fixed,
never tuned. Binomial standard error of one top-1 on n images: sqrt(p (100 - p) / n) points.

Datasets (Debian's ``dataset-fashion-mnist``, ``/usr/share/datasets/fashion-mnist``; MIT licence,
Zalando SE), converted once to PNG ImageFolders under ``--data-root``:

* ``plain``: the 28 px garments as they are (they fill the frame: no scale variation);
* ``canvas``: the same garments composed at random scales (45-100 % of the side) and positions on a
  black 48 px canvas (:mod:`fixres_dist.data.canvas`, the recipe of the embedded demo data; index ``i``
  of a split is drawn as in ``scripts/make_embedded_dataset.py``, so the demo's images are a subset).

How. Each training runs the real command-line scripts as subprocesses (``--num-tasks``, default 2)
in ``--output`` (job ids ``<dataset>-<stage>-s<seed>-<hash of the arguments>``, logs
``<job id>.log``); numbers come from each job's ``metrics.jsonl``; the detail-matched evaluations
run in this process. Resume-safe: a finished job is reused, an interrupted one resumes from its
checkpoint when the same command runs again. The report is printed and written to
``<output>/fixres_effect.md``, per-seed numbers to ``<output>/fixres_effect.json``.

Defaults (2 CPU cores): ``resnet20`` (He et al. 2016 section 4.2: total stride 4, so 16-32 px inputs
keep feature maps of 4-8 px and a change of input size does not change the network's geometry,
unlike stride-32 ImageNet networks, see docs/models.md); ``plain`` trained at 16 px and tested at 24 px,
``canvas`` trained at 24 px and tested at 32 px (the apparent-object-size estimate of FixRes section
3.1 is 1.36 x K_train: 21.8 and 32.7 px); the first 1,000 training images per class (10,000), all
10,000 test images (standard error about 0.35 point); scratch: 12 epochs, lr 0.1 per 256 images,
batch 128 per rank; finetunes: 2 epochs, lr 0.05 per 256, no warmup. On a GPU, scale up with
``--train-images-per-class 6000 --epochs 30 --num-tasks N --device cuda``.

Run from the repository root:  .venv/bin/python benchmarks/fixres_effect.py [--seeds 3 ...]
Smoke run: ``--seeds 1 --epochs 1 --finetune-epochs 1 --train-images-per-class 30 --val-images-per-class 20``.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from fixres_dist.data import pipeline
from fixres_dist.errors import FixresError
from fixres_dist.fixres.sweep import standard_error
from fixres_dist.models import architectures
from fixres_dist.models.weights import load_weights, read_weight_file

REPO = Path(__file__).resolve().parents[1]

SOURCE = Path("/usr/share/datasets/fashion-mnist")
IDX_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
             "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
# Seeds of the canvas composition per split: those of scripts/make_embedded_dataset.py --canvas.
CANVAS_SEEDS = {"train": 1, "val": 2}
MARKER = "CONVERTED.json"  # written last: its presence means the conversion is complete
REPORT_FILE, RESULTS_FILE = "fixres_effect.md", "fixres_effect.json"
GOAL_POINTS = 1.0  # FixRes finetune - train-resolution baseline, mean over seeds (the goal)
# dataset -> (canvas side in pixels or None, train resolution, test resolution)
DATASETS = {"plain": (None, 16, 24), "canvas": (48, 24, 32)}
# Log lines of the training scripts echoed to our stdout (all lines go to the job's log file).
ECHO = re.compile(r"^(job |epoch \d|eval |resumed|.*already completed|finetuning \(|fixres_dist:|Traceback|\w*Error)")


class BenchmarkError(Exception):
    """A one-line reason to stop (exit status 1)."""


# ---------------------------------------------------------------------------------------- data
def _embedded_maker():
    """``scripts/make_embedded_dataset.py`` as a module (its IDX reader, PNG writer, classes, licence)."""
    path = REPO / "scripts" / "make_embedded_dataset.py"
    spec = importlib.util.spec_from_file_location("make_embedded_dataset", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prepare_full_dataset(root: Path, source: Path = SOURCE, canvas: int | None = None) -> Path:
    """All 60,000 train / 10,000 test images as an ImageFolder at ``root`` (train/, val/), made once.

    With ``canvas``, each garment is composed on a black canvas of that side (:mod:`fixres_dist.data.canvas`,
    seeds :data:`CANVAS_SEEDS`).

    Written to a sibling temporary folder and renamed into place, with :data:`MARKER` last, so an
    interrupted conversion is never mistaken for a complete one. Reused when the marker is there.
    """
    if (root / MARKER).is_file():
        return root
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise BenchmarkError(f"{root} exists but is not a complete conversion (no {MARKER}); "
                             "remove it or choose another --data-root")
    if not all((source / name).is_file() for pair in IDX_FILES.values() for name in pair):
        raise BenchmarkError(f"no Fashion-MNIST IDX files in {source}: apt-get install dataset-fashion-mnist")
    maker = _embedded_maker()
    root.parent.mkdir(parents=True, exist_ok=True)
    for stale in root.parent.glob(f".{root.name}.partial-*"):  # left by a killed conversion
        pid = stale.name.rsplit("-", 1)[-1]
        if not (pid.isdigit() and _pid_alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = root.parent / f".{root.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    print(f"converting Fashion-MNIST from {source} to PNG in {root} (once) ...", flush=True)
    counts = {}
    for split, (images, labels) in IDX_FILES.items():
        # per_class=None: every image of every class (write_split slices [:per_class]).
        counts[split] = maker.write_split(maker.read_idx(source / images), maker.read_idx(source / labels),
                                          None, tmp / split, canvas, CANVAS_SEEDS[split])
    header = ("Fashion-MNIST, all 60,000 training and 10,000 test images (converted to PNG by "
              "benchmarks/fixres_effect.py with scripts/make_embedded_dataset.py"
              + (f", composed on a {canvas} px canvas" if canvas else "") + ")\n")
    (tmp / "LICENSE").write_text(header + maker.LICENSE.split("\n", 1)[1])
    (tmp / MARKER).write_text(json.dumps({"source": str(source), "canvas": canvas, "images": counts}) + "\n")
    if root.exists():
        root.rmdir()  # empty (checked above)
    os.rename(tmp, root)
    print(f"wrote {counts['train']} train and {counts['val']} val images in {time.perf_counter() - start:.0f} s",
          flush=True)
    return root


def subset(root: Path, train_per_class: int | None, val_per_class: int | None) -> Path:
    """``root`` itself, or an ImageFolder of symlinks to the first N images (by file name) of each class."""
    if train_per_class is None and val_per_class is None:
        return root
    name = f"train{train_per_class or 'all'}-val{val_per_class or 'all'}"
    out = root / "subsets" / name
    if (out / MARKER).is_file():
        return out
    tmp = out.parent / f".{name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for folder in sorted(p for p in (root / split).iterdir() if p.is_dir()):
            (tmp / split / folder.name).mkdir(parents=True)
            for image in sorted(folder.iterdir())[:per_class]:
                (tmp / split / folder.name / image.name).symlink_to(image)
    (tmp / MARKER).write_text(json.dumps({"subset_of": str(root), "train_per_class": train_per_class,
                                          "val_per_class": val_per_class}) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out


# ---------------------------------------------------------------------------------------- jobs
def read_events(job_folder: Path) -> list[dict]:
    path = job_folder / "metrics.jsonl"
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            pass
    return events


def finished(events: list[dict], epochs: int, sweep: bool = True) -> bool:
    """The job trained all its epochs and made its last evaluation: the resolution sweep if ``sweep``."""
    trained = {e["epoch"] for e in events if e.get("event") == "train"}
    if sweep:
        return len(trained) >= epochs and any(e.get("event") == "sweep" for e in events)
    return len(trained) >= epochs and any(e.get("event") == "eval" and not e.get("label") and e["epoch"] == epochs
                                          for e in events)


def job_id(stage: str, seed: int, args: list[str]) -> str:
    """``<stage>-s<seed>-<hash of the arguments>``: a new configuration never meets an old job folder."""
    digest = hashlib.sha1(json.dumps(args).encode()).hexdigest()[:10]
    return f"{stage}-s{seed}-{digest}"


def run_job(script: str, stage: str, seed: int, args: list[str], epochs: int, runs: Path,
            num_tasks: int, workers: int, sweep: bool = True) -> tuple[list[dict], float | None]:
    """Run ``script`` (main_scratch.py / main_finetune.py) as a subprocess unless its job finished.

    Returns the job's ``metrics.jsonl`` events and the wall seconds of the run that finished it
    (``<runs>/<job id>.wall_s``; None if unknown). The output goes to ``<runs>/<job id>.log``; lines
    about epochs and evaluations are echoed. A job interrupted earlier resumes from its checkpoint.
    """
    jid = job_id(stage, seed, [str(num_tasks), *args])
    folder, wall_file = runs / jid, runs / f"{jid}.wall_s"
    tag = f"[{stage} seed {seed}]"
    events = read_events(folder)
    if finished(events, epochs, sweep):
        print(f"{tag} reusing the finished job {folder}", flush=True)
        return events, float(wall_file.read_text()) if wall_file.is_file() else None
    cmd = [sys.executable, str(REPO / script), "--num-tasks", str(num_tasks), "--workers", str(workers),
           "--shared-folder-path", str(runs), "--job-id", jid, "--no-progress", *args]
    log = runs / f"{jid}.log"
    print(f"{tag} {' '.join(cmd[1:])}\n{tag} log: {log}", flush=True)
    start = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        process = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   bufsize=1)
        tail: list[str] = []
        for line in process.stdout:
            out.write(line)
            out.flush()
            tail = (tail + [line.rstrip()])[-15:]
            if ECHO.match(line.strip()):
                print(f"{tag} {line.rstrip()}", flush=True)
        status = process.wait()
    if status != 0:
        print("\n".join(f"{tag} | {line}" for line in tail), file=sys.stderr)
        hint = "; run the same command again to resume" if status == 3 else ""
        raise BenchmarkError(f"{script} (job {jid}) exited with status {status}{hint}; log {log}")
    events = read_events(folder)
    if not finished(events, epochs, sweep):
        raise BenchmarkError(f"{script} (job {jid}) exited 0 but {folder / 'metrics.jsonl'} lacks its "
                             f"{epochs} epochs or its final evaluation")
    wall = time.perf_counter() - start
    wall_file.write_text(f"{wall:.1f}\n")
    print(f"{tag} done in {wall:.0f} s", flush=True)
    return events, wall


def evals(events: list[dict], label: str | None = None) -> dict[int, dict]:
    """``{resolution: latest eval event}`` with this ``label`` (None: the unlabelled per-epoch ones)."""
    return {e["resolution"]: e for e in events if e.get("event") == "eval" and e.get("label") == label}


def final_eval(events: list[dict], resolution: int) -> dict:
    """The last unlabelled (end-of-epoch) evaluation at ``resolution``."""
    return [e for e in events if e.get("event") == "eval" and not e.get("label") and e["resolution"] == resolution][-1]


def run_seed(args, dataset: str, seed: int, data_path: Path, runs: Path) -> dict:
    """Scratch at K_train and K_test, FixRes and control finetunes, detail-matched tests: one seed's numbers."""
    _, train, test = DATASETS[dataset]
    common = ["--data-path", str(data_path), "--architecture", args.architecture, "--batch", str(args.batch),
              "--seed", str(seed), *(["--device", args.device] if args.device else [])]
    scratch_args = [*common, "--epochs", str(args.epochs), "--learning-rate", str(args.lr),
                    "--warmup-epochs", str(args.warmup_epochs)]

    def job(script, stage, extra, epochs):
        return run_job(script, f"{dataset}-{stage}", seed, extra, epochs, runs, args.num_tasks, args.workers,
                       sweep=False)

    low, low_s = job("main_scratch.py", f"scratch{train}", [*scratch_args, "--input-size", str(train)], args.epochs)
    high, high_s = job("main_scratch.py", f"scratch{test}", [*scratch_args, "--input-size", str(test)], args.epochs)
    weights = runs / job_id(f"{dataset}-scratch{train}", seed,
                            [str(args.num_tasks), *scratch_args, "--input-size", str(train)]) / "checkpoint.pth"
    tune = [*common, "--weight-path", str(weights), "--epochs", str(args.finetune_epochs),
            "--learning-rate", str(args.finetune_lr), "--warmup-epochs", "0", "--train-size", str(train)]
    fixres_args = [*tune, "--input-size", str(test)]
    fix, fix_s = job("main_finetune.py", f"fixres{test}", fixres_args, args.finetune_epochs)
    control, control_s = job("main_finetune.py", f"control{train}", [*tune, "--input-size", str(train)],
                             args.finetune_epochs)
    tuned = runs / job_id(f"{dataset}-fixres{test}", seed, [str(args.num_tasks), *fixres_args]) / "checkpoint.pth"
    before = [e for e in fix if e.get("event") == "eval" and e.get("label") == "before" and e["resolution"] == test][-1]
    baseline = final_eval(low, train)
    return {
        "seed": seed, "images": baseline["images"],
        "baseline": baseline["top1"], "no_finetune": before["top1"], "fixres": final_eval(fix, test)["top1"],
        "control": final_eval(control, train)["top1"],
        "detail_no_finetune": detail_matched_top1(weights, data_path, args.architecture, train, test),
        "detail_fixres": detail_matched_top1(tuned, data_path, args.architecture, train, test),
        "trained_at_test": final_eval(high, test)["top1"],
        "img_per_s": {"train": statistics.fmean(e["img_per_s"] for e in low if e.get("event") == "train"),
                      "test": statistics.fmean(e["img_per_s"] for e in high if e.get("event") == "train")},
        "wall_s": {f"scratch{train}": low_s, f"scratch{test}": high_s, f"fixres{test}": fix_s,
                   f"control{train}": control_s},
    }


# ---------------------------------------------------------------------------------------- detail-matched test
class _Transformed(Dataset):
    def __init__(self, base, transform):
        self.base, self.transform = base, transform

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        image, label = self.base[index]
        return self.transform(image), label


def detail_matched_top1(weights: Path, data_path: Path, architecture: str, train: int, test: int) -> float:
    """Top-1 (%) at ``test`` px of test images that carry only ``train`` px of detail.

    The standard test view at ``test`` px (shorter side resized to ``round(test / 0.875)``, centre
    crop), shrunk to ``train`` px and upscaled back to ``test`` px (antialiased bilinear both ways):
    objects look as large as in the standard test at ``test`` px, with the detail of the test at
    ``train`` px. One process, eval mode.
    """
    val = pipeline.image_folder(data_path, "val")
    model = architectures.build_model(architecture, len(val.classes), image_size=test)
    load_weights(model, read_weight_file(weights))
    model.eval()
    transform = v2.Compose([v2.Resize(round(test / pipeline.CROP_RATIO), antialias=True), v2.CenterCrop(test),
                            v2.Resize(train, antialias=True), v2.Resize(test, antialias=True), v2.PILToTensor()])
    loader = DataLoader(_Transformed(val, transform), batch_size=500, num_workers=1)
    correct = 0
    with torch.no_grad():
        for images, labels in loader:
            correct += int((model(pipeline.normalize(images)).argmax(1) == labels).sum())
    return 100 * correct / len(val)


# ---------------------------------------------------------------------------------------- report
ROWS = [("train resolution (baseline)", "baseline", "train"),
        ("test resolution, no finetuning", "no_finetune", "test"),
        ("FixRes finetune at the test resolution", "fixres", "test"),
        ("control: the same finetune at the train resolution", "control", "train"),
        ("detail-matched test, no finetuning", "detail_no_finetune", "test"),
        ("detail-matched test, FixRes finetuned", "detail_fixres", "test"),
        ("trained at the test resolution", "trained_at_test", "test")]


def mean_std(values: list[float], sign: bool = False) -> str:
    """``mean ± sample standard deviation`` (2 decimals); the value alone for one seed."""
    f = "{:+.2f}" if sign else "{:.2f}"
    if len(values) == 1:
        return f.format(values[0])
    return f"{f.format(statistics.fmean(values))} ± {statistics.stdev(values):.2f}"


def per_seed(values: list[float], sign: bool = False) -> str:
    return ", ".join(f"{v:+.2f}" if sign else f"{v:.2f}" for v in values)


def report_dataset(args, dataset: str, results: list[dict]) -> list[str]:
    canvas, train, test = DATASETS[dataset]
    n = results[0]["images"]
    what = f"garments composed at 45-100 % of a {canvas} px canvas" if canvas else "28 px garments as they are"
    lines = [f"### {dataset}: {what}; train {train} px, test {test} px; {len(results)} seed(s), {n} test images", "",
             "| evaluation | resolution | top-1 % (mean ± std) | per seed |", "|---|---:|---:|---|"]
    for name, key, res in ROWS:
        values = [r[key] for r in results]
        lines.append(f"| {name} | {train if res == 'train' else test} px | {mean_std(values)} | {per_seed(values)} |")
    gain = [r["fixres"] - r["baseline"] for r in results]
    over_control = [r["fixres"] - r["control"] for r in results]
    no_ft = [r["no_finetune"] - r["baseline"] for r in results]
    detail = [r["detail_fixres"] - r["fixres"] for r in results]
    met = statistics.fmean(gain) >= GOAL_POINTS and statistics.fmean(gain) >= statistics.fmean(
        [r["control"] - r["baseline"] for r in results])
    cost = statistics.fmean(r["img_per_s"]["train"] / r["img_per_s"]["test"] for r in results)
    lines += ["",
              f"- FixRes finetune - train-resolution baseline: {mean_std(gain, True)} points "
              f"(per seed {per_seed(gain, True)}); goal >= +{GOAL_POINTS:.1f} and >= the control: "
              f"{'MET' if met else 'NOT MET'}",
              f"- FixRes finetune - control finetune: {mean_std(over_control, True)} points "
              f"(per seed {per_seed(over_control, True)}): what the change of resolution buys",
              f"- test resolution without finetuning - baseline: {mean_std(no_ft, True)} points",
              f"- detail-matched - standard test, FixRes finetuned: {mean_std(detail, True)} points "
              "(0: the test resolution helps by the apparent object size alone; below 0: it also uses "
              "the extra detail, or the upscaling blur costs by itself)",
              f"- training cost: at {train} px "
              f"{statistics.fmean(r['img_per_s']['train'] for r in results):,.0f} img/s, "
              f"at {test} px {statistics.fmean(r['img_per_s']['test'] for r in results):,.0f} img/s "
              f"({cost:.2f}x cheaper at the train resolution); binomial standard error of one top-1 here: "
              f"{standard_error(statistics.fmean(r['baseline'] for r in results), n):.2f} point"]
    return lines


def report(args, results: dict[str, list[dict]], wall_s: float) -> str:
    r0 = next(iter(results.values()))
    lines = [f"## FixRes effect on Fashion-MNIST: {args.architecture}, seeds {', '.join(str(r['seed']) for r in r0)}, "
             f"{args.num_tasks} rank(s)", "",
             f"scratch: {args.epochs} epochs, RandomResizedCrop + flip, lr {args.lr:g} per 256, batch {args.batch} "
             f"x {args.num_tasks}, first {args.train_images_per_class or 6000} training images per class; finetunes: "
             f"classifier + last BatchNorm, test preprocessing, {args.finetune_epochs} epoch(s), lr "
             f"{args.finetune_lr:g} per 256", ""]
    for dataset, rows in results.items():
        lines += report_dataset(args, dataset, rows) + [""]
    lines.append("paper (FixRes Table 2, ResNet-50 on ImageNet): 77.0 at 224 px -> 79.0 at 384 px after finetuning")
    walls = [w for rows in results.values() for r in rows for w in r["wall_s"].values() if w is not None]
    lines.append(f"wall time: {wall_s / 60:.1f} min for this invocation ({sum(walls) / 60:.1f} min in the runs that "
                 f"completed the jobs); {os.cpu_count()} CPU cores, load average at the end "
                 f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- main
def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _datasets(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in DATASETS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(DATASETS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-root", type=Path, default=Path.home() / ".cache" / "fixres_dist",
                   help="where the PNG ImageFolders of the full datasets are made once and reused")
    p.add_argument("--source", type=Path, default=SOURCE, help="folder of the Debian package's IDX files")
    p.add_argument("--output", type=Path, default=Path("runs") / "fixres_effect",
                   help="job folders (the shared folder of the runs), logs, and the report")
    p.add_argument("--datasets", type=_datasets, default=list(DATASETS), help="comma-separated: plain, canvas")
    p.add_argument("--seeds", type=_positive, default=3, help="number of seeds (0, 1, ...)")
    p.add_argument("--architecture", default="resnet20")
    p.add_argument("--epochs", type=_positive, default=12, help="scratch training epochs")
    p.add_argument("--batch", type=_positive, default=128, help="images per rank per step")
    p.add_argument("--lr", type=float, default=0.1, help="scratch learning rate per 256 images")
    p.add_argument("--warmup-epochs", type=float, default=0.5)
    p.add_argument("--finetune-epochs", type=_positive, default=2)
    p.add_argument("--finetune-lr", type=float, default=0.05, help="finetune learning rate per 256 images")
    p.add_argument("--num-tasks", type=_positive, default=2, help="ranks per run")
    p.add_argument("--workers", type=int, default=1, help="data loader workers per rank")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: the scripts' own (cuda where there is one)")
    p.add_argument("--train-images-per-class", type=_positive, default=1000,
                   help="train on the first N images per class (all: 6000)")
    p.add_argument("--val-images-per-class", type=_positive, default=None,
                   help="evaluate on the first N test images per class only (default: all 1,000)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    results: dict[str, list[dict]] = {}
    try:
        runs = args.output.absolute()
        try:
            runs.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BenchmarkError(f"cannot use --output {runs}: {exc.strerror or exc}") from None
        for dataset in args.datasets:
            canvas = DATASETS[dataset][0]
            name = "fashion_mnist_full" + (f"_canvas{canvas}" if canvas else "")
            root = prepare_full_dataset(args.data_root.expanduser().absolute() / name, args.source, canvas)
            data_path = subset(root, args.train_images_per_class, args.val_images_per_class)
            results[dataset] = [run_seed(args, dataset, seed, data_path, runs) for seed in range(args.seeds)]
    except (BenchmarkError, FixresError) as exc:
        print(f"fixres_effect: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fixres_effect: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    text = report(args, results, time.perf_counter() - start)
    (runs / REPORT_FILE).write_text(text + "\n")
    (runs / RESULTS_FILE).write_text(json.dumps({"arguments": {k: str(v) for k, v in vars(args).items()},
                                                 "results": results}, indent=2) + "\n")
    print("\n" + text + f"\n\nreport: {runs / REPORT_FILE}; per-seed numbers: {runs / RESULTS_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
