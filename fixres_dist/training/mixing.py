"""Batch MixUp and CutMix for training, with torchvision's ``v2.MixUp`` and ``v2.CutMix``.

* MixUp (Zhang et al. 2018, "mixup: Beyond Empirical Risk Minimization", arXiv 1710.09412): a batch
  becomes ``lam x + (1 - lam) x'`` with ``lam ~ Beta(alpha, alpha)``, ``x'`` the batch rolled by
  one, and the targets the same mix of the one-hot labels.
* CutMix (Yun et al. 2019, "CutMix: Regularization Strategy to Train Strong Classifiers with
  Localizable Features", arXiv 1905.04899): a box of area about ``1 - lam`` of every image is pasted
  from the rolled batch, and the targets mix the labels by the pasted area (``lam`` adjusted to the
  box as clipped at the border).
* Both given: each batch takes one of them with probability 1/2 (``v2.RandomChoice``), as
  torchvision's reference scripts (``references/classification/train.py``) and DeiT do.

One draw per call (per micro-batch of one rank), that depends only on ``(seed, key)``: the trainer
passes ``key = (global_step, rank, micro_batch)``, so a resumed run mixes as the uninterrupted one.
torchvision draws ``lam``, the box and the choice from torch's default *CPU* generator, whatever the
images' device (``torchvision/transforms/v2/_augment.py``: ``Beta`` over CPU tensors, ``torch.randint``
without a device; ``_container.py``: ``torch.multinomial`` over a CPU tensor), and the mixing itself
(``roll``, ``mul_``, slicing, ``one_hot``) draws nothing, so nothing draws from a CUDA generator;
:class:`BatchMixing` seeds the CPU generator for the call and restores it afterwards
(:func:`fixres_dist.data.pipeline.seeded_cpu_generator`).

Partners are the neighbours in a rank's batch (the batch rolled by one);
:class:`~fixres_dist.data.samplers.ExactBatchSampler` shuffles, and with repeated augmentation the
copies of an image go to different ranks (``reps`` <= world size), so partners are other images.

The soft targets go to ``torch.nn.functional.cross_entropy(logits, targets, label_smoothing=eps)``
(class-probability targets take label smoothing too). Evaluation never mixes: top-1 and top-5 are
always measured on the hard labels of unmixed images.
"""
from __future__ import annotations

import math

import torch
from torch.nn.functional import one_hot
from torchvision.transforms import v2

from fixres_dist.data.pipeline import seeded_cpu_generator


def _check_alpha(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0 (0: off), got {value!r}")
    return float(value)


def _check_count(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


class BatchMixing:
    """MixUp and/or CutMix of a training batch, drawn from ``(seed, key)`` only.

    Args:
        mixup_alpha: MixUp's Beta(alpha, alpha) parameter; 0 leaves MixUp out (DeiT: 0.8).
        cutmix_alpha: CutMix's Beta(alpha, alpha) parameter; 0 leaves CutMix out (DeiT: 1.0).
        num_classes: number of classes C (the targets' width).
        seed: base seed, a non-negative int (the run's ``--seed``).

    Both alphas 0: :attr:`enabled` is false and callers skip the call (it would return the batch
    unchanged and one-hot targets). Raises ValueError for a negative or non-finite alpha, ``num_classes
    < 1`` or a negative seed.

    ``mix(images, labels, key) -> (images, targets)``: ``images`` float (B, 3, H, W) on any device,
    already normalised; ``labels`` int64 (B,) class indices on the same device; ``key`` non-negative
    ints, e.g. ``(global_step, rank, micro_batch)``. Returns the mixed images (same shape, dtype and
    device; a new tensor) and float32 (B, C) targets on the labels' device, each row summing to 1.
    Torch's default CPU generator is left as it was.
    """

    def __init__(self, mixup_alpha: float, cutmix_alpha: float, num_classes: int, seed: int):
        self.mixup_alpha = _check_alpha("mixup alpha", mixup_alpha)
        self.cutmix_alpha = _check_alpha("cutmix alpha", cutmix_alpha)
        self.num_classes = _check_count("num_classes", num_classes, 1)
        self.seed = _check_count("mixing seed", seed, 0)
        choices = ([v2.MixUp(alpha=self.mixup_alpha, num_classes=num_classes)] if self.mixup_alpha > 0 else []) + \
                  ([v2.CutMix(alpha=self.cutmix_alpha, num_classes=num_classes)] if self.cutmix_alpha > 0 else [])
        self._transform = v2.RandomChoice(choices) if len(choices) == 2 else (choices[0] if choices else None)

    @property
    def enabled(self) -> bool:
        """Whether a call mixes anything (some alpha > 0)."""
        return self._transform is not None

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, key) -> tuple[torch.Tensor, torch.Tensor]:
        if not images.is_floating_point() or images.ndim != 4:
            raise ValueError(f"mixing takes a float (B, C, H, W) batch, got {images.dtype} {tuple(images.shape)}")
        key = [_check_count("mixing key item", item, 0) for item in key]
        if not self.enabled:
            return images, one_hot(labels, self.num_classes).float()
        with seeded_cpu_generator([self.seed, *key]):
            return self._transform(images, labels)

    def __repr__(self) -> str:
        return (f"BatchMixing(mixup_alpha={self.mixup_alpha}, cutmix_alpha={self.cutmix_alpha}, "
                f"num_classes={self.num_classes}, seed={self.seed})")
