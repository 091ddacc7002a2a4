"""Resolution sweeps: top-1 against test resolution, as a table, a PNG plot, and the best resolution.

A sweep is a list of ``eval`` events (``metrics.jsonl``) at several test resolutions, each from an
exact distributed evaluation, labelled by stage: ``before`` / ``after`` finetuning, ``trained`` (end of a scratch run),
or ``sweep`` (``--eval-only``). The FixRes paper's Figure-style curve (top-1 against K_test, before
and after finetuning) is drawn with matplotlib's object API (no global pyplot state).

Choosing the best resolution (:func:`best_resolution`, used by ``--input-size auto``): the highest
top-1 wins, but resolutions within one binomial standard error of it, ``sqrt(p (100 - p) / n)``
percentage points for top-1 ``p`` % on ``n`` images, count as tied, and the smallest tied one is
chosen: it is the cheapest to run and the differences are within the noise of the validation set.
The choice is made on the validation images, so its top-1 is optimistic; hold out part of the
training set as ``val/`` for an unbiased figure.
"""
from __future__ import annotations

import math
from pathlib import Path

from matplotlib.figure import Figure

from .errors import FixresError

STAGE_NAMES = {"before": "before finetuning", "after": "after finetuning", "trained": "after training",
               "sweep": "checkpoint"}
PLOT_FILE, TABLE_FILE = "resolution_sweep.png", "resolution_sweep.md"


def standard_error(top1: float, images: int) -> float:
    """Binomial standard error of a top-1 of ``top1`` percent measured on ``images`` images (points)."""
    return math.sqrt(max(top1 * (100 - top1), 0.0) / max(images, 1))


def best_resolution(evals: list[dict]) -> int:
    """The resolution (pixels) to use among ``evals`` (dicts with resolution, top1, images).

    The smallest resolution whose top-1 is within one standard error of the highest top-1.
    Raises :class:`FixresError` for an empty list.
    """
    if not evals:
        raise FixresError("no evaluations to choose a resolution from")
    best = max(evals, key=lambda e: e["top1"])
    margin = standard_error(best["top1"], best["images"])
    return min(e["resolution"] for e in evals if e["top1"] >= best["top1"] - margin)


def by_stage(evals: list[dict]) -> dict[str, dict[int, dict]]:
    """``{stage: {resolution: latest eval event}}`` for events labelled before/after/sweep."""
    stages: dict[str, dict[int, dict]] = {}
    for e in evals:
        if e.get("event") == "eval" and e.get("label") in STAGE_NAMES:
            stages.setdefault(e["label"], {})[e["resolution"]] = e
    return stages


def table(stages: dict[str, dict[int, dict]], best: int, train_size: int | None, estimate: float | None,
          title: str) -> str:
    """Markdown table: one row per resolution, top-1 (and top-5) per stage, the best marked."""
    names = [s for s in STAGE_NAMES if s in stages]
    sizes = sorted({r for s in names for r in stages[s]})
    header = "| test resolution | " + " | ".join(f"top-1 % {STAGE_NAMES[s]} | top-5 % {STAGE_NAMES[s]}"
                                                 for s in names) + " |"
    lines = [title, "", header, "|---:|" + "---:|---:|" * len(names)]
    for size in sizes:
        cells = []
        for s in names:
            e = stages[s].get(size)
            cells += [f"{e['top1']:.2f}", f"{e['top5']:.2f}"] if e else ["", ""]
        mark = " (best)" if size == best else ""
        lines.append(f"| {size} px{mark} | " + " | ".join(cells) + " |")
    images = next(iter(stages[names[-1]].values()))["images"]
    lines.append("")
    lines.append(f"best measured test resolution: {best} px (highest top-1 of the {STAGE_NAMES[names[-1]]} "
                 f"sweep; within one standard error, +-{standard_error(stages[names[-1]][best]['top1'], images):.2f} "
                 f"points on {images} images, the smallest resolution is taken)")
    if train_size:
        lines.append(f"train resolution: {train_size} px; apparent-object-size estimate of the best test "
                     f"resolution (FixRes section 3.1, RandomResizedCrop scale 0.08-1): {estimate:.0f} px")
    return "\n".join(lines)


def plot(path: Path, stages: dict[str, dict[int, dict]], best: int, train_size: int | None,
         estimate: float | None, title: str) -> None:
    """Write a PNG of top-1 (percent) against test resolution (pixels), one line per stage."""
    fig = Figure(figsize=(6.4, 4.2), dpi=110)
    ax = fig.add_subplot()
    for stage in (s for s in STAGE_NAMES if s in stages):
        points = sorted(stages[stage].items())
        ax.plot([r for r, _ in points], [e["top1"] for _, e in points], marker="o", label=STAGE_NAMES[stage])
    if train_size:
        ax.axvline(train_size, color="grey", linestyle=":", label=f"train resolution {train_size} px")
    if estimate:
        ax.axvline(estimate, color="tab:green", linestyle="--", label=f"apparent-size estimate {estimate:.0f} px")
    ax.axvline(best, color="tab:red", alpha=0.4, linewidth=6, label=f"best measured {best} px")
    ax.set_xlabel("test resolution (pixels)")
    ax.set_ylabel("top-1 (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(path)
