"""What the tests of a split model (pipeline stages, tensor parallelism) share: the small models, the
batches, and the unsplit model's steps to compare with."""
from __future__ import annotations

import torch
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

from fixres_dist.models.architectures import build_model

VIT = "timm/test_vit"  # LayerNorm only: micro-batches and data-parallel shares change nothing but the rounding
TORCHVISION_VIT = "torchvision_vit"  # a 3-block torchvision ViT (nn.MultiheadAttention), 4 heads
BATCH, LR, MOMENTUM = 8, 0.1, 0.9  # SGD with momentum: a resume must carry its state


def model_of(architecture: str) -> nn.Module:
    """The same weights on every rank and in the test (seed 0), 10 classes, 32 px."""
    torch.manual_seed(0)
    if architecture == TORCHVISION_VIT:
        return VisionTransformer(image_size=32, patch_size=8, num_layers=3, num_heads=4, hidden_dim=16, mlp_dim=32,
                                 num_classes=10)
    return build_model(architecture, 10, image_size=32)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s (BATCH, 3, 32, 32) float images and (BATCH,) labels."""
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 3, 32, 32, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator)


def unsplit_steps(architecture: str, steps: range, microbatches: int = 1, clip: float | None = None):
    """The whole model's SGD steps on the whole batch, its gradient accumulated over ``microbatches``
    equal micro-batches (as a pipeline runs them: BatchNorm sees micro-batches), clipped to norm
    ``clip``; the losses, the model and the optimizer."""
    model = model_of(architecture)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in steps:
        images, labels = batch(step)
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
