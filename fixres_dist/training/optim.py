"""Optimizers, their parameter groups, the linear scaling rule and the learning-rate schedules.

* :func:`scaled_learning_rate`: ``--learning-rate`` (per 256 images) scaled to the global batch;
* :func:`parameter_groups`: weight decay for weights, ``--norm-weight-decay`` for norms and biases;
* :func:`build_optimizer`: ``--opt {sgd, sgd-nesterov, adamw, rmsprop}`` (torchvision's reference
  names, ``references/classification/train.py``);
* :func:`lr_factor`: linear warmup, then ``--lr-scheduler {cosine, step, exponential}``.

The schedule is a function of training progress in epochs (a float), not of a step count kept in
an LR scheduler object: a resumed run, on any world size, gets the learning rate back from the
checkpoint's position alone, and there is no scheduler state to save.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from fixres_dist.fixres.finetuning import NORM_TYPES

REFERENCE_BATCH = 256  # --learning-rate is per this many images
# torchvision's references/classification/train.py builds RMSprop with these (after the
# EfficientNet/MobileNet recipes, which took TensorFlow's RMSProp epsilon and decay).
RMSPROP_EPS, RMSPROP_ALPHA = 0.0316, 0.9


def scaled_learning_rate(base_lr: float, batch_per_rank: int, num_tasks: int, accumulation: int = 1) -> float:
    """Linear scaling rule: ``base_lr x (batch_per_rank x num_tasks x accumulation) / 256``.

    ``base_lr`` is the rate for a global batch of 256 images; the global batch of one optimizer
    step is the images of every rank over ``accumulation`` accumulated micro-batches (Goyal et
    al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", arXiv 1706.02677, section 2.1).
    """
    return base_lr * batch_per_rank * num_tasks * accumulation / REFERENCE_BATCH


def parameter_groups(model: nn.Module, weight_decay: float, norm_weight_decay: float) -> list[dict]:
    """The trainable parameters of ``model`` as optimizer groups: weights get ``weight_decay``, the
    parameters of normalisation layers and every bias get ``norm_weight_decay``.

    Decaying a BatchNorm scale or a bias towards zero does not regularise the function a network
    computes the way a decayed weight does (the next normalisation undoes the scale), so common
    recipes exempt them (``--norm-weight-decay 0``). Groups without parameters are left out.
    """
    norm_params = {id(p) for m in model.modules() if isinstance(m, NORM_TYPES) for p in m.parameters(recurse=False)}
    weights, others = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            exempt = id(param) in norm_params or name.rsplit(".", 1)[-1] == "bias"
            (others if exempt else weights).append(param)
    groups = [{"params": weights, "weight_decay": weight_decay},
              {"params": others, "weight_decay": norm_weight_decay}]
    return [g for g in groups if g["params"]]


def build_optimizer(name: str, groups: list[dict], lr: float, momentum: float) -> torch.optim.Optimizer:
    """The optimizer ``--opt name`` over ``groups`` (:func:`parameter_groups`, each with its weight decay).

    ``sgd``: SGD with ``momentum``; ``sgd-nesterov``: the same with Nesterov momentum; ``adamw``:
    AdamW (decoupled weight decay, Loshchilov & Hutter, ICLR 2019; torch's default betas 0.9/0.999,
    ``momentum`` unused); ``rmsprop``: RMSprop with ``momentum``, eps 0.0316 and alpha 0.9 as
    torchvision's references. No group at all (a pipeline rank whose stages a finetune froze): one empty
    group, an optimizer that steps nothing. Raises ValueError for another name.
    """
    groups = groups or [{"params": []}]
    if name in ("sgd", "sgd-nesterov"):
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=name == "sgd-nesterov")
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    if name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=lr, momentum=momentum, eps=RMSPROP_EPS, alpha=RMSPROP_ALPHA)
    raise ValueError(f"unknown optimizer {name!r}")


def lr_factor(progress: float, epochs: int, warmup_epochs: float, scheduler: str = "cosine",
              step_size: int = 30, gamma: float = 0.1) -> float:
    """The learning rate's factor (of the scaled base rate) at ``progress`` epochs into training.

    Linear warmup from 0 over ``warmup_epochs`` (Goyal et al., section 2.2), then, counting epochs
    from the warmup's end as torchvision's references do (their main scheduler starts after it):

    * ``cosine``: half a cosine down to 0 at ``epochs``, updated every step (Loshchilov & Hutter,
      SGDR, ICLR 2017);
    * ``step``: ``gamma ** (whole epochs // step_size)`` (torch's ``StepLR`` stepped once per epoch,
      as FixRes' ResNet-50 recipe: gamma 0.1 every 30 epochs);
    * ``exponential``: ``gamma ** whole epochs`` (``ExponentialLR`` stepped once per epoch).

    Raises ValueError for another ``scheduler``.
    """
    if progress < warmup_epochs:
        return progress / warmup_epochs
    after = progress - warmup_epochs
    if scheduler == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(1.0, after / max(1e-12, epochs - warmup_epochs))))
    if scheduler == "step":
        return gamma ** (math.floor(after + 1e-9) // step_size)
    if scheduler == "exponential":
        return gamma ** math.floor(after + 1e-9)
    raise ValueError(f"unknown learning-rate scheduler {scheduler!r}")
