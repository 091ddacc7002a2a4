"""The FixRes effect on the full Fashion-MNIST: train low, test higher, finetune there (3 seeds).

DOCSTRING_PLACEHOLDER
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fixres_dist import fixres  # noqa: E402

SOURCE = Path("/usr/share/datasets/fashion-mnist")
IDX_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
             "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
MARKER = "CONVERTED.json"  # written last: its presence means the conversion is complete
REPORT_FILE, RESULTS_FILE = "fixres_effect.md", "fixres_effect.json"
GOAL_POINTS = 1.0  # the goal: finetuned at the test resolution beats the baseline by >= 1 top-1 point
# Log lines of the training scripts echoed to our stdout (all lines go to the job's log file).
ECHO = re.compile(r"^(job |lr |epoch \d|eval |--input-size|resumed|.*already completed|finetuning \(|"
                  r"fixres_dist:|Traceback|\w*Error)")


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


def prepare_full_dataset(root: Path, source: Path = SOURCE) -> Path:
    """All 60,000 train / 10,000 test images as an ImageFolder at ``root`` (train/, val/), made once.

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
                                          None, tmp / split)
    header = ("Fashion-MNIST, all 60,000 training and 10,000 test images (converted to PNG by "
              "benchmarks/fixres_effect.py with scripts/make_embedded_dataset.py)\n")
    (tmp / "LICENSE").write_text(header + maker.LICENSE.split("\n", 1)[1])
    (tmp / MARKER).write_text(json.dumps({"source": str(source), "images": counts}) + "\n")
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


def finished(events: list[dict], epochs: int) -> bool:
    """The job trained all its epochs and reported its resolution sweep (its last act)."""
    trained = {e["epoch"] for e in events if e.get("event") == "train"}
    return len(trained) >= epochs and any(e.get("event") == "sweep" for e in events)


def job_id(stage: str, seed: int, args: list[str]) -> str:
    """``<stage>-s<seed>-<hash of the arguments>``: a new configuration never meets an old job folder."""
    digest = hashlib.sha1(json.dumps(args).encode()).hexdigest()[:10]
    return f"{stage}-s{seed}-{digest}"


def run_job(script: str, stage: str, seed: int, args: list[str], epochs: int, runs: Path,
            num_tasks: int, workers: int) -> list[dict]:
    """Run ``script`` (main_scratch.py / main_finetune.py) as a subprocess unless its job finished.

    Returns the job's ``metrics.jsonl`` events. The output goes to ``<runs>/<job id>.log``; lines
    about epochs and evaluations are echoed. A job interrupted earlier resumes from its checkpoint.
    """
    jid = job_id(stage, seed, [str(num_tasks), *args])
    folder = runs / jid
    tag = f"[{stage} seed {seed}]"
    events = read_events(folder)
    if finished(events, epochs):
        print(f"{tag} reusing the finished job {folder}", flush=True)
        return events
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
    if not finished(events, epochs):
        raise BenchmarkError(f"{script} (job {jid}) exited 0 but {folder / 'metrics.jsonl'} lacks its "
                             f"{epochs} epochs or its sweep")
    print(f"{tag} done in {time.perf_counter() - start:.0f} s", flush=True)
    return events


def evals(events: list[dict], label: str | None = None) -> dict[int, dict]:
    """``{resolution: latest eval event}`` with this ``label`` (None: the unlabelled per-epoch ones)."""
    return {e["resolution"]: e for e in events if e.get("event") == "eval" and e.get("label") == label}


def run_seed(args, seed: int, data_path: Path, runs: Path) -> dict:
    """Scratch training then FixRes finetune for one seed; the numbers of the table."""
    sizes = ",".join(map(str, args.test_sizes))
    common = ["--data-path", str(data_path), "--architecture", args.architecture, "--batch", str(args.batch),
              "--seed", str(seed), "--test-sizes", sizes]
    scratch_args = [*common, "--input-size", str(args.train_size), "--epochs", str(args.epochs),
                    "--learning-rate", str(args.lr), "--warmup-epochs", str(args.warmup_epochs)]
    scratch = run_job("main_scratch.py", "scratch", seed, scratch_args, args.epochs, runs, args.num_tasks,
                      args.workers)
    weights = runs / job_id("scratch", seed, [str(args.num_tasks), *scratch_args]) / "checkpoint.pth"
    finetune_args = [*common, "--weight-path", str(weights), "--input-size", "auto",
                     "--epochs", str(args.finetune_epochs), "--learning-rate", str(args.finetune_lr),
                     "--warmup-epochs", "0"]
    finetune = run_job("main_finetune.py", "finetune", seed, finetune_args, args.finetune_epochs, runs,
                       args.num_tasks, args.workers)
    last = max(e["epoch"] for e in scratch if e.get("event") == "train")
    baseline = [e for e in scratch if e.get("event") == "eval" and not e.get("label")
                and e["resolution"] == args.train_size and e["epoch"] == last][-1]
    chosen = [e for e in finetune if e.get("event") == "input_size"][-1]["resolution"]
    before, after = evals(finetune, "before"), evals(finetune, "after")
    return {
        "seed": seed, "train_resolution": args.train_size, "chosen_resolution": chosen,
        "baseline": baseline["top1"], "images": baseline["images"],
        "no_finetune": before[chosen]["top1"], "finetuned": after[chosen]["top1"],
        "trained_sweep": {r: e["top1"] for r, e in sorted(evals(scratch, "trained").items())},
        "before_sweep": {r: e["top1"] for r, e in sorted(before.items())},
        "after_sweep": {r: e["top1"] for r, e in sorted(after.items())},
        "train_loss": [e["loss"] for e in scratch if e.get("event") == "train"],
        "finetune_train_resolution_top1": next((e["top1"] for e in finetune if e.get("event") == "eval"
                                               and e.get("label") == "train-resolution"), None),
    }


# ---------------------------------------------------------------------------------------- report
def mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):.2f} ± {std:.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def report(args, results: list[dict], wall_s: float) -> str:
    seeds = [r["seed"] for r in results]
    n = len(results)
    train = args.train_size
    chosen = [r["chosen_resolution"] for r in results]
    chosen_text = str(chosen[0]) if len(set(chosen)) == 1 else "/".join(map(str, chosen))
    rows = [("train resolution (baseline), no finetuning", str(train), [r["baseline"] for r in results]),
            ("best test resolution, no finetuning", chosen_text, [r["no_finetune"] for r in results]),
            ("best test resolution, FixRes finetuned", chosen_text, [r["finetuned"] for r in results])]
    lines = [f"FixRes effect on Fashion-MNIST: {args.architecture}, {n} seed(s) ({', '.join(map(str, seeds))}), "
             f"{args.num_tasks} rank(s), {results[0]['images']} test images",
             f"scratch: {args.epochs} epochs at {train} px, RandomResizedCrop + flip, lr {args.lr:g} per 256, "
             f"batch {args.batch} x {args.num_tasks}; finetune (head + last BatchNorm, test preprocessing): "
             f"{args.finetune_epochs} epoch(s), lr {args.finetune_lr:g} per 256, at the test resolution picked "
             "by --input-size auto", "",
             "| evaluation | train res | test res | top-1 % (mean ± std) | per seed |",
             "|---|---:|---:|---:|---|"]
    for name, test, values in rows:
        lines.append(f"| {name} | {train} px | {test} px | {mean_std(values)} | "
                     + ", ".join(f"{v:.2f}" for v in values) + " |")
    gains = [r["finetuned"] - r["baseline"] for r in results]
    gains_nf = [r["no_finetune"] - r["baseline"] for r in results]
    met = statistics.fmean(gains) >= GOAL_POINTS
    lines += ["",
              f"gain of FixRes-finetuned over the train-resolution baseline: {mean_std(gains)} top-1 points "
              f"(per seed {', '.join(f'{g:+.2f}' for g in gains)}); goal >= {GOAL_POINTS:.1f} point: "
              f"{'MET' if met else 'NOT MET'}",
              f"gain of the best test resolution without finetuning: {mean_std(gains_nf)} points "
              f"(per seed {', '.join(f'{g:+.2f}' for g in gains_nf)})",
              f"paper (FixRes, ResNet-50 on ImageNet): 77.0 at 224 px -> 79.0 at 384 px after finetuning (+2.0)"]
    sizes = sorted(results[0]["before_sweep"])
    mean_before = {s: statistics.fmean(r["before_sweep"][s] for r in results) for s in sizes}
    best_mean = max(sizes, key=lambda s: mean_before[s])
    estimate = fixres.apparent_size_test_resolution(train)
    lines += [f"best test resolution: picked per seed by --input-size auto {chosen_text} px "
              "(highest top-1 before finetuning, smallest within one standard error); highest mean top-1 "
              f"without finetuning at {best_mean} px; apparent-object-size estimate (FixRes section 3.1, "
              f"fixres_dist.fixres.apparent_size_test_resolution({train})): {estimate:.1f} px", "",
              "top-1 % against test resolution (mean ± std over seeds; 'finetuned' = the model finetuned at "
              "its seed's picked resolution, evaluated at each resolution):", "",
              "| test res | no finetuning | finetuned | per seed, no finetuning | per seed, finetuned |",
              "|---:|---:|---:|---|---|"]
    for s in sizes:
        b = [r["before_sweep"][s] for r in results]
        a = [r["after_sweep"][s] for r in results]
        mark = " (train)" if s == train else ""
        lines.append(f"| {s} px{mark} | {mean_std(b)} | {mean_std(a)} | {', '.join(f'{v:.2f}' for v in b)} | "
                     f"{', '.join(f'{v:.2f}' for v in a)} |")
    lines += ["", f"wall time {wall_s / 60:.1f} min (this invocation; reused jobs cost nothing)"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- main
def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of pixel sizes") from None
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct positive pixel sizes")
    return sizes


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-root", type=Path, default=Path.home() / ".cache" / "fixres_dist" / "fashion_mnist_full",
                   help="where the PNG ImageFolder of the full dataset is made once and reused")
    p.add_argument("--source", type=Path, default=SOURCE, help="folder of the Debian package's IDX files")
    p.add_argument("--output", type=Path, default=Path("runs") / "fixres_effect",
                   help="job folders (the shared folder of the runs), logs, and the report")
    p.add_argument("--seeds", type=_positive, default=3, help="number of seeds (0, 1, ...)")
    p.add_argument("--architecture", default="resnet18")
    p.add_argument("--train-size", type=_positive, default=16, help="training resolution (pixels)")
    p.add_argument("--test-sizes", type=_sizes, default=_sizes("16,20,24,28,32"),
                   help="test resolutions swept before and after finetuning (pixels)")
    p.add_argument("--epochs", type=_positive, default=8, help="scratch training epochs")
    p.add_argument("--batch", type=_positive, default=64, help="images per rank per step")
    p.add_argument("--lr", type=float, default=0.2, help="scratch learning rate per 256 images")
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--finetune-epochs", type=_positive, default=1)
    p.add_argument("--finetune-lr", type=float, default=0.05, help="finetune learning rate per 256 images")
    p.add_argument("--num-tasks", type=_positive, default=2, help="ranks per run")
    p.add_argument("--workers", type=int, default=1, help="data loader workers per rank")
    p.add_argument("--train-images-per-class", type=_positive, default=None,
                   help="train on the first N images per class only (smoke runs; default: all 6,000)")
    p.add_argument("--val-images-per-class", type=_positive, default=None,
                   help="evaluate on the first N test images per class only (smoke runs; default: all 1,000)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        root = prepare_full_dataset(args.data_root.expanduser().absolute(), args.source)
        data_path = subset(root, args.train_images_per_class, args.val_images_per_class)
        runs = args.output.absolute()
        runs.mkdir(parents=True, exist_ok=True)
        results = [run_seed(args, seed, data_path, runs) for seed in range(args.seeds)]
    except BenchmarkError as exc:
        print(f"fixres_effect: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fixres_effect: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    text = report(args, results, time.perf_counter() - start)
    (runs / REPORT_FILE).write_text(text + "\n")
    (runs / RESULTS_FILE).write_text(json.dumps({"arguments": {k: str(v) for k, v in vars(args).items()},
                                                 "data_path": str(data_path), "seeds": results}, indent=2) + "\n")
    print("\n" + text + f"\n\nreport: {runs / REPORT_FILE}; per-seed numbers: {runs / RESULTS_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
