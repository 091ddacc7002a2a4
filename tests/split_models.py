"""What the tests of a split or sharded model share: the small models, the batches, the unsplit
model's steps to compare with, and two jobs' metrics and weights compared."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torchvision.models.convnext import CNBlockConfig, ConvNeXt
from torchvision.models.vision_transformer import VisionTransformer

from fixres_dist.distributed import checkpoint_shards
from fixres_dist.models.architectures import build_model
from fixres_dist.training.checkpoint import CHECKPOINT_FILE, load_checkpoint
from numeric import assert_within_spread, floating

VIT = "timm/test_vit"  # LayerNorm only: micro-batches and data-parallel shares change nothing but the rounding
TORCHVISION_VIT = "torchvision_vit"  # a 3-block torchvision ViT (nn.MultiheadAttention), 4 heads
CONVNEXT = "small_convnext"  # a torchvision ConvNeXt of 2 stages of 2 blocks (16, 32 channels)
BATCH, LR, MOMENTUM = 8, 0.1, 0.9  # SGD with momentum: a resume must carry its state


def model_of(architecture: str) -> nn.Module:
    """The same weights on every rank and in the test (seed 0), 10 classes, 32 px."""
    torch.manual_seed(0)
    if architecture == CONVNEXT:
        return ConvNeXt([CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 2)], num_classes=10)
    if architecture == TORCHVISION_VIT:
        return VisionTransformer(image_size=32, patch_size=8, num_layers=3, num_heads=4, hidden_dim=16, mlp_dim=32,
                                 num_classes=10)
    return build_model(architecture, 10, image_size=32)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s (BATCH, 3, 32, 32) float images and (BATCH,) labels."""
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 3, 32, 32, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator)


def unsplit_steps(architecture: str, steps: range, microbatches: int = 1, clip: float | None = None,
                  dtype: torch.dtype = torch.float32):
    """The whole model's SGD steps on the whole batch, its gradient accumulated over ``microbatches``
    equal micro-batches (as a pipeline runs them: BatchNorm sees micro-batches), clipped to norm
    ``clip``; the losses, the model and the optimizer. ``dtype`` float64: the float64 reference of the
    same steps (:func:`numeric.assert_near_reference`), from the same initial weights and images."""
    model = model_of(architecture).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in steps:
        images, labels = batch(step)
        images = images.to(dtype)
        total = 0.0
        for x, y in zip(images.chunk(microbatches), labels.chunk(microbatches)):
            loss = nn.functional.cross_entropy(model(x), y) / microbatches
            loss.backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, model, optimizer


def share(tensor: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Data-parallel rank ``index``'s share of ``count`` equal shares of a batch."""
    size = tensor.shape[0] // count
    return tensor[index * size:(index + 1) * size]


# ------------------------------------------------------------------ two jobs compared
def events(job_folder: Path, kind: str) -> list[dict]:
    """The ``kind`` events of a job's metrics.jsonl, in order."""
    return [e for e in map(json.loads, (job_folder / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


def full(path: Path) -> dict:
    """A checkpoint with its tensors, also those of a sharded one (in the shards folder beside it)."""
    return checkpoint_shards.with_full_tensors(path, load_checkpoint(path))


def assert_same_run(a: Path, b: Path, other: Path, ema: bool = True) -> None:
    """Job ``a`` (split, sharded, resumed elsewhere) ran as job ``b`` (the same job under DDP), to rounding: the
    same learning rates and image counts (equal), the same top-1 (a count: equal, but where ``b`` run in
    another summation order, job ``other``, itself moves it: then by at most as much), and losses and
    final weights (and the EMA's with ``ema``) within rounding of ``b``'s as measured by the spread of
    ``b`` and ``other`` (:func:`numeric.assert_within_spread`): ``other`` is ``b`` run again with the
    other memory format (``--channels-last``)."""
    kinds = [("train", ("lr",)), ("eval", ("images",))] + ([("ema_eval", ())] if ema else [])
    for kind, exact in kinds:
        ours, theirs, spread = (events(job, kind) for job in (a, b, other))
        assert len(ours) == len(theirs) == len(spread) > 0, kind
        for x, y, z in zip(ours, theirs, spread):
            assert all(x[field] == y[field] == z[field] for field in exact), (kind, exact, x, y)
            if "top1" in y:  # a count; moved only by an image within rounding of changing class
                assert abs(x["top1"] - y["top1"]) <= abs(z["top1"] - y["top1"]), (kind, x, y, z)
        assert_within_spread(*({"loss": [e["loss"] for e in run]} for run in (ours, theirs, spread)),
                             f"{a.name} vs {b.name}: {kind} losses")
    weights_a, weights_b, weights_o = (full(f / CHECKPOINT_FILE) for f in (a, b, other))
    for entry in ("model", "model_ema") if ema else ("model",):
        assert_within_spread(floating(weights_a[entry]), floating(weights_b[entry]), floating(weights_o[entry]),
                             f"{a.name} vs {b.name}: {entry}")
        counts = [{k: v for k, v in w[entry].items() if not v.is_floating_point()} for w in (weights_a, weights_b)]
        assert counts[0].keys() == counts[1].keys() and all(torch.equal(v, counts[1][k]) for k, v in counts[0].items())
