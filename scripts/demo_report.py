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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fixres_dist.fixres.sweep import standard_error


class ReportError(Exception):
    """A one-line reason why the folders do not hold what the table needs (exit status 1)."""


def evals(folder: Path) -> list[dict]:
    """The ``eval`` events of the finetune job in ``folder``; ReportError if it is not one."""
    try:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ReportError(f"{folder} is not a finished job folder ({type(exc).__name__}: {exc})") from None
    if config.get("mode") != "finetune":
        raise ReportError(f"{folder} holds a {config.get('mode')} job, not a main_finetune.py job")
    return [e for e in map(json.loads, lines) if e["event"] == "eval"]


def last(events: list[dict], folder: Path, what: str, **match) -> dict:
    """The last event whose fields equal ``match``; ReportError naming ``what`` if there is none."""
    found = [e for e in events if all(e.get(k) == v for k, v in match.items())]
    if not found:
        raise ReportError(f"{folder}/metrics.jsonl has no {what}: was the job interrupted? run it again to finish it")
    return found[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fixres", type=Path)
    parser.add_argument("control", type=Path)
    parser.add_argument("--seconds", type=float, help="the demo's wall time, printed under the table")
    args = parser.parse_args()
    try:
        table(args)
    except ReportError as exc:
        sys.exit(f"demo_report: {exc}")


def table(args) -> None:
    fixres, control = evals(args.fixres), evals(args.control)
    config = json.loads((args.fixres / "config.json").read_text())
    test_size = config["input_size"]
    train = last(fixres, args.fixres, "evaluation at the train resolution", label="train-resolution")
    before = last(fixres, args.fixres, f"evaluation before finetuning at {test_size} px", label="before",
                  resolution=test_size)
    after = last(fixres, args.fixres, f"evaluation after finetuning at {test_size} px", label=None,
                 resolution=test_size)
    ctrl = last(control, args.control, "evaluation after finetuning", label=None)
    rows = [("train resolution, no finetuning", train), ("test resolution, no finetuning", before),
            ("control: finetuned at the train resolution", ctrl), ("FixRes: finetuned at the test resolution", after)]
    print(f"\nFixRes demo: {config['architecture']} on {after['images']} validation images, "
          f"{config['num_tasks']} rank(s)")
    print(f"| {'evaluation':<42} | resolution | top-1 %        | top-5 % |")
    print(f"|{'-' * 44}|------------|----------------|---------|")
    for name, e in rows:
        se = standard_error(e["top1"], e["images"])
        print(f"| {name:<42} | {e['resolution']:>7} px | {e['top1']:6.2f} ± {se:4.2f}  | {e['top5']:7.2f} |")
    for name, base in (("the train resolution", train), ("no finetuning", before), ("the control", ctrl)):
        gain = after["top1"] - base["top1"]
        se = math.hypot(standard_error(after["top1"], after["images"]), standard_error(base["top1"], base["images"]))
        print(f"FixRes at {after['resolution']} px vs {name} ({base['resolution']} px): {gain:+.2f} top-1 points "
              f"(± {se:.2f})")
    if args.seconds is not None:
        print(f"wall time: {args.seconds / 60:.1f} min")


if __name__ == "__main__":
    main()
