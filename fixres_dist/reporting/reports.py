"""What a run prints and writes for people: the FixRes table and the resolution sweep report.

* :func:`finetune_table`: top-1/top-5 at the train resolution and at the test resolution before
  the finetune, against after it, and the points the finetune bought (FixRes' headline table);
* :func:`sweep_report`: the sweeps of a run as a markdown table (``resolution_sweep.md``) and a
  PNG plot (``resolution_sweep.png``, the FixRes paper's top-1 against K_test curve, drawn with
  matplotlib's object API: no global pyplot state), naming the best resolution
  (:func:`fixres_dist.fixres.sweep.best_resolution`), the network's lineage (trained from scratch at,
  FixRes-finetuned at: :mod:`fixres_dist.models.lineage`; an unknown train resolution is said to be
  unknown) and the apparent-object-size estimate derived from its train resolution.
"""
from __future__ import annotations

from pathlib import Path

from fixres_dist.fixres import finetuning
from fixres_dist.fixres.sweep import STAGE_NAMES, best_resolution, by_stage, standard_error
from fixres_dist.io import write_private
from fixres_dist.models.lineage import Lineage

PLOT_FILE, TABLE_FILE = "resolution_sweep.png", "resolution_sweep.md"
MARGIN = 0.06  # the plot's x range extends this share of its span beyond the outermost point or marker
FINETUNE_ROWS = {"train-resolution": "train resolution, no finetuning", "before": "test resolution, no finetuning"}


def finetune_table(history: list[dict], architecture: str, num_tasks: int, input_size: int, eval_size: int,
                   new_head: tuple[int, int] | None = None, finetuned_before: int | None = None) -> str:
    """The FixRes table of a finetune from its ``eval`` events (finetuned at ``input_size``,
    evaluated at ``eval_size``, both in pixels).

    A finetune at the train resolution is a control, not FixRes (one row without finetuning, and
    the finetuned row says so). ``new_head``: ``(classes, classes of the weight file's head)`` when the
    model got a new, untrained head; the table then says that its gain is the head's training.
    ``finetuned_before``: the resolution (pixels) the weights had already been finetuned at, if any;
    the rows "without finetuning" are then of those weights, and the table says so.
    """
    evals = [e for e in history if e["event"] == "eval"]
    before = [e for e in evals if e.get("label") == "train-resolution"] + \
             [e for e in evals if e.get("label") == "before" and e["resolution"] == input_size][-1:]
    if len(before) == 2 and before[0]["resolution"] == before[1]["resolution"]:
        before = before[:1]  # finetuned at the train resolution: one evaluation without finetuning
    control = any(e["label"] == "train-resolution" and e["resolution"] == input_size for e in before)
    after = [e for e in evals if not e.get("label") and e["resolution"] == eval_size][-1]
    finetuned = "train resolution, finetuned (control)" if control else "test resolution, FixRes finetuned"
    rows = [(FINETUNE_ROWS[e["label"]], e) for e in before] + [(finetuned, after)]
    lines = ["", f"FixRes finetune of {architecture} ({num_tasks} rank(s), {after['images']} validation images)",
             f"| {'evaluation':<37} | resolution | top-1 % | top-5 % |",
             f"|{'-' * 39}|------------|---------|---------|"]
    lines += [f"| {name:<37} | {e['resolution']:>7} px | {e['top1']:7.2f} | {e['top5']:7.2f} |" for name, e in rows]
    gains = [f"{after['top1'] - e['top1']:+.2f} top-1 points over the {FINETUNE_ROWS[e['label']].split(',')[0]} "
             f"({e['resolution']} px)" for e in before]
    what = "finetuning at the train resolution (a control: no change of resolution, so no FixRes effect)" \
        if control else "finetuning at the test resolution"
    lines.append(f"{what} bought " + "; ".join(gains))
    if finetuned_before:
        lines.append(f"the weights were already finetuned at {finetuned_before} px before this run: \"no finetuning\" "
                     "above means before this finetune")
    if new_head:
        lines.append(f"new head: the weights had {new_head[1]} classes, the model has {new_head[0]}; the rows "
                     "without finetuning evaluate an untrained head, so these points are the head's training, "
                     "not a FixRes gain (FixRes-finetune this checkpoint to measure one)")
    return "\n".join(lines)


def sweep_report(history: list[dict], network: Lineage, title: str, folder: Path | None,
                 on_figure=None) -> tuple[str, dict]:
    """Table of the sweeps in ``history`` of the network ``network``; with ``folder`` (rank 0) also
    writes the table and the plot there, and gives the plot's matplotlib Figure to ``on_figure``
    (e.g. TensorBoard's, :mod:`fixres_dist.reporting.tensorboard_events`) if given.

    Returns ``(text, fields of the "sweep" event)``: the latest stage, the best resolution, the
    from-scratch train resolution and the FixRes finetune resolution (pixels, None when unknown or
    not finetuned) and the apparent-object-size estimate (pixels) of the best test resolution
    (FixRes section 3.1; None when the train resolution is unknown).
    """
    stages = by_stage(history)
    latest = [s for s in ("sweep", "before", "trained", "after") if s in stages][-1]
    best = best_resolution(list(stages[latest].values()))
    estimate = finetuning.apparent_size_test_resolution(network.train_size) if network.train_size else None
    images = next(iter(stages[latest].values()))["images"]
    title = f"{title}, {images} validation images"
    text = table(stages, best, network, estimate, title)
    if folder is not None:
        write_private(folder / TABLE_FILE, text + "\n")
        figure = plot(folder / PLOT_FILE, stages, best, network, estimate, title)
        if on_figure is not None:
            on_figure(figure)
    return text, {"stage": latest, "best_resolution": best, "train_resolution": network.train_size,
                  "finetuned_at": network.finetuned_at, "apparent_size_estimate": estimate}


def table(stages: dict[str, dict[int, dict]], best: int, network: Lineage, estimate: float | None,
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
    last = stages[names[-1]]
    top = max(last, key=lambda size: last[size]["top1"])
    rule = "the highest top-1" if top == best else \
        (f"the smallest within one standard error (+-{standard_error(last[top]['top1'], images):.2f} points on "
         f"{images} images) of the highest top-1, {last[top]['top1']:.2f} % at {top} px")
    lines.append(f"best measured test resolution: {best} px ({rule}, {STAGE_NAMES[names[-1]]})")
    lines.append(f"network: {network.describe()}")
    if network.train_size:
        lines.append(f"train resolution: {network.train_size} px; from it, FixRes' apparent-object-size estimate "
                     f"of the best test resolution (section 3.1, RandomResizedCrop scale 0.08-1): {estimate:.0f} px")
    else:
        lines.append("no apparent-object-size estimate (FixRes section 3.1): it needs the train resolution")
    return "\n".join(lines)


def x_limits(points, markers, margin: float = MARGIN) -> tuple[float, float]:
    """x range (pixels) that shows every point and every marker line inside it, with ``margin`` x
    the span (at least one pixel) free on each side."""
    xs = [*points, *markers]
    low, high = min(xs), max(xs)
    pad = max(margin * (high - low), 1.0)
    return low - pad, high + pad


def plot(path: Path, stages: dict[str, dict[int, dict]], best: int, network: Lineage,
         estimate: float | None, title: str):
    """Write a PNG of top-1 (percent) against test resolution (pixels), one line per stage, with
    marker lines at the train and finetune resolutions, the estimate and the best; returns the
    matplotlib Figure. The x range holds every point and marker (:func:`x_limits`)."""
    from matplotlib.figure import Figure  # imported here: a second of start-up every rank would pay
    fig = Figure(figsize=(6.4, 4.2), dpi=110)
    ax = fig.add_subplot()
    sizes = []
    for stage in (s for s in STAGE_NAMES if s in stages):
        points = sorted(stages[stage].items())
        sizes += [r for r, _ in points]
        ax.plot([r for r, _ in points], [e["top1"] for _, e in points], marker="o", label=STAGE_NAMES[stage])
    markers = [best]
    if network.train_size:
        markers.append(network.train_size)
        ax.axvline(network.train_size, color="grey", linestyle=":", label=f"train resolution {network.train_size} px")
    if network.finetuned_at:
        markers.append(network.finetuned_at)
        ax.axvline(network.finetuned_at, color="tab:purple", linestyle="-.",
                   label=f"FixRes-finetuned at {network.finetuned_at} px")
    if estimate:
        markers.append(estimate)
        ax.axvline(estimate, color="tab:green", linestyle="--", label=f"apparent-size estimate {estimate:.0f} px")
    ax.axvline(best, color="tab:red", alpha=0.4, linewidth=6, label=f"best measured {best} px")
    ax.set_xlim(*x_limits(sizes, markers))
    ax.set_xlabel("test resolution (pixels)")
    ax.set_ylabel("top-1 (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=3, frameon=False)
    fig.tight_layout()
    write_private(path, lambda f: fig.savefig(f, format="png"))
    return fig
