"""Resolution sweeps: top-1 against test resolution by stage, and the choice of the best resolution.

A sweep is a list of ``eval`` events (``metrics.jsonl``) at several test resolutions, each from an
exact distributed evaluation, labelled by stage: ``before`` / ``after`` finetuning, ``trained`` (end of a scratch run),
or ``sweep`` (``--eval-only``). Their table and plot are in :mod:`fixres_dist.reporting.reports`.

Choosing the best resolution (:func:`best_resolution`, used by ``--input-size auto``): the highest
top-1 wins, but resolutions within one binomial standard error of it, ``sqrt(p (100 - p) / n)``
percentage points for top-1 ``p`` % on ``n`` images, count as tied, and the smallest tied one is
chosen: it is the cheapest to run and the differences are within the noise of the validation set.
The choice is made on the validation images, so its top-1 is optimistic; hold out part of the
training set as ``val/`` for an unbiased figure.
"""
from __future__ import annotations

import math

from fixres_dist.errors import FixresError

STAGE_NAMES = {"before": "before finetuning", "after": "after finetuning", "trained": "after training",
               "sweep": "checkpoint"}


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
