"""Exact distributed evaluation and the run's ``metrics.jsonl``.

Evaluation counts every validation image exactly once whatever the world size: each rank runs
the *unwrapped* model on its share (an :class:`~fixres_dist.samplers.ExactBatchSampler` without
shuffling; no padding duplicates), then per-rank sums (top-1 hits, top-5 hits, summed loss, image
count) are all-reduced in float64. Top-1/top-5 are percentages of the images counted.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

from . import distributed
from .data import to_device
from .fixres import eval_mode

METRICS_FILE = "metrics.jsonl"


@attrs.frozen
class EvalResult:
    """Top-1 and top-5 in percent, mean cross-entropy loss (nats), number of distinct images."""

    top1: float
    top5: float
    loss: float
    images: int


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, amp: torch.dtype | None = None,
             channels_last: bool = False) -> EvalResult:
    """Evaluate ``model`` (unwrapped, put in eval mode) on this rank's share and reduce over ranks.

    ``amp``: autocast dtype (``torch.bfloat16``/``torch.float16``) or None; the sums are float64.
    """
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # top1 hits, top5 hits, loss sum, count
    with eval_mode(model):
        for images, labels, _skipped in loader:
            images = to_device(images, device, channels_last)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
                logits = model(images).float()
            k = min(5, logits.shape[1])
            hits = logits.topk(k, dim=1).indices.eq(labels[:, None])
            sums += torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum(),
                                 F.cross_entropy(logits, labels, reduction="sum"),
                                 torch.tensor(labels.numel(), device=device)]).double()
    top1, top5, loss, count = distributed.all_reduce_sum(sums).tolist()
    count = max(count, 1)
    return EvalResult(100 * top1 / count, 100 * top5 / count, loss / count, int(count))


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl``; a no-op on ranks other than 0."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = Path(path), enabled

    def write(self, event: str, **fields) -> None:
        if not self.enabled:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")

    def rewrite(self, events: list[dict]) -> None:
        """Replace the file, atomically, by ``events`` (the history a resumed checkpoint holds)."""
        if not self.enabled:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in events)
        os.replace(tmp, self.path)
