"""The demo's FixRes table, read from the ``metrics.jsonl`` of its two finetune jobs.

Usage: ``python scripts/demo_report.py FIXRES_JOB_FOLDER CONTROL_JOB_FOLDER [--seconds S]``

FIXRES_JOB_FOLDER is a ``main_finetune.py`` job at the test resolution (its ``train-resolution``
and ``before`` evaluations are the two rows without finetuning); CONTROL_JOB_FOLDER the same
finetune at the train resolution, so that the gain is not just extra training. Standard errors are
binomial, ``sqrt(p (100 - p) / n)`` points; that of a difference adds the two in quadrature, which
overstates it for two evaluations of the same images (their errors are correlated).
"""
import argparse
import json
import math
from pathlib import Path


def evals(folder: Path) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "eval"]


def standard_error(top1: float, images: int) -> float:
    """Binomial standard error of a top-1 of ``top1`` percent on ``images`` images, in points."""
    return math.sqrt(top1 * (100 - top1) / images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fixres", type=Path)
    parser.add_argument("control", type=Path)
    parser.add_argument("--seconds", type=float, help="the demo's wall time, printed under the table")
    args = parser.parse_args()
    fixres, control = evals(args.fixres), evals(args.control)
    config = json.loads((args.fixres / "config.json").read_text())
    train = next(e for e in fixres if e.get("label") == "train-resolution")
    test_size = config["input_size"]
    before = [e for e in fixres if e.get("label") == "before" and e["resolution"] == test_size][-1]
    after = [e for e in fixres if not e.get("label") and e["resolution"] == test_size][-1]
    ctrl = [e for e in control if not e.get("label")][-1]
    rows = [("train resolution, no finetuning", train), ("test resolution, no finetuning", before),
            ("control: finetuned at the train resolution", ctrl), ("FixRes: finetuned at the test resolution", after)]
    print(f"\nFixRes demo: {config['architecture']} on {after['images']} validation images, "
          f"{config['num_tasks']} rank(s)")
    print(f"| {'evaluation':<42} | resolution | top-1 %        | top-5 % |")
    print(f"|{'-' * 44}|------------|----------------|---------|")
    for name, e in rows:
        se = standard_error(e["top1"], e["images"])
        print(f"| {name:<42} | {e['resolution']:>7} px | {e['top1']:6.2f} ± {se:4.2f}  | {e['top5']:7.2f} |")
    for name, base in (("the train resolution", train), ("the control", ctrl)):
        gain = after["top1"] - base["top1"]
        se = math.hypot(standard_error(after["top1"], after["images"]), standard_error(base["top1"], base["images"]))
        print(f"FixRes at {after['resolution']} px vs {name} ({base['resolution']} px): {gain:+.2f} top-1 points "
              f"(± {se:.2f})")
    if args.seconds is not None:
        print(f"wall time: {args.seconds / 60:.1f} min")


if __name__ == "__main__":
    main()
