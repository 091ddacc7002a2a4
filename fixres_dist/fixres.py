"""The FixRes method (Touvron et al., "Fixing the train-test resolution discrepancy", NeurIPS 2019).

A classifier trained with RandomResizedCrop at K_train sees objects larger than at test time; at a
higher test resolution K_test the apparent sizes match better, but the pooled activations change
statistics. FixRes (section 4) therefore finetunes, at K_test and with the *test* preprocessing,
only the classifier and the normalisation just before pooling. The reference code named those
layers per architecture; here they are found from the module graph: the head is the last
``nn.Linear`` to run in a forward pass and the last norm is the last BatchNorm/LayerNorm/GroupNorm
to run before it.

What trains is ``--finetune-scope`` (:data:`SCOPES`). The frozen part stays in eval mode during
training (:func:`set_train_mode`), so only trainable norms' running statistics move, and
trainable BatchNorms are synchronised over the ranks (:mod:`fixres_dist.batchnorm`), so their
statistics are those of the union of all ranks' images.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from .errors import FixresError

NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)
# --finetune-scope: what trains. FixRes trained the head and the last BatchNorm (section 4).
SCOPES = ("head+last-norm", "head", "norms+head", "all")
# torchvision RandomResizedCrop's default area range, the fraction of the image a training crop covers.
RRC_SCALE = (0.08, 1.0)


def execution_order(model: nn.Module, input_size: int) -> list[str]:
    """Names of leaf-ish modules (Linear and norm layers) in the order a forward pass runs them.

    Runs one forward pass on a zero batch of shape (2, 3, input_size, input_size) in eval mode.
    """
    order: list[str] = []
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: order.append(name))
             for name, m in model.named_modules() if isinstance(m, (nn.Linear, *NORM_TYPES))]
    try:
        with eval_mode(model), torch.no_grad():
            device = next(model.parameters()).device
            model(torch.zeros(2, 3, input_size, input_size, device=device))
    finally:
        for h in hooks:
            h.remove()
    return order


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """``model.eval()`` inside the block; afterwards every module gets back its *own* mode.

    ``model.train(was_training)`` would instead put the frozen part of a finetune (eval mode, see
    :func:`set_train_mode`) back in training mode.
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


def find_head_and_last_norm(model: nn.Module, input_size: int) -> tuple[str, str | None]:
    """``(head module name, last norm module name or None)``; raises FixresError without a head."""
    order = execution_order(model, input_size)
    modules = dict(model.named_modules())
    linears = [n for n in order if isinstance(modules[n], nn.Linear)]
    if not linears:
        raise FixresError(f"{type(model).__name__} has no nn.Linear classifier head to finetune")
    head = linears[-1]
    before = order[:order.index(head)]
    norms = [n for n in before if isinstance(modules[n], NORM_TYPES)]
    return head, (norms[-1] if norms else None)


def trainable_modules(model: nn.Module, input_size: int, scope: str = "head+last-norm") -> list[str]:
    """Names of the modules whose parameters train under ``scope`` (one of :data:`SCOPES`).

    ``"all"`` returns ``[""]`` (the whole model). Raises :class:`FixresError` when the model lacks
    what the scope names (no head; no norm before the head for ``head+last-norm``; no norm layer
    with parameters for ``norms+head``).
    """
    if scope not in SCOPES:
        raise FixresError(f"--finetune-scope must be one of {', '.join(SCOPES)}; got {scope!r}")
    head, norm = find_head_and_last_norm(model, input_size)
    if scope == "all":
        return [""]
    if scope == "head":
        return [head]
    if scope == "head+last-norm":
        if norm is None:
            raise FixresError(f"--finetune-scope head+last-norm: {type(model).__name__} has no normalisation "
                              f"layer before its head {head}; use --finetune-scope head")
        return [head, norm]
    norms = [name for name, m in model.named_modules()
             if isinstance(m, NORM_TYPES) and any(True for _ in m.parameters(recurse=False))]
    if not norms:
        raise FixresError(f"--finetune-scope norms+head: {type(model).__name__} has no normalisation layer "
                          "with parameters; use --finetune-scope head")
    return [*norms, head]


def freeze_for_finetune(model: nn.Module, input_size: int, scope: str = "head+last-norm") -> list[str]:
    """Set ``requires_grad`` so that only the modules of ``scope`` train (see :func:`trainable_modules`).

    Call before wrapping in DDP. Returns the names of the parameters left trainable.
    """
    keep = tuple(f"{name}." if name else "" for name in trainable_modules(model, input_size, scope))
    trainable = []
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(keep))
        if param.requires_grad:
            trainable.append(name)
    return trainable


def set_train_mode(model: nn.Module) -> None:
    """Training mode for what trains, eval mode for the frozen rest.

    With every parameter trainable this is ``model.train()``. Otherwise the model is put in eval
    mode and only modules holding a trainable parameter of their own go back to train mode, so
    frozen BatchNorms keep their running statistics (FixRes trained only the last BN's) and the
    frozen backbone's dropout and stochastic depth stay off: the trainable norm then sees the same
    activations as at test time, and its statistics are estimated under test-time behaviour.
    """
    if all(p.requires_grad for p in model.parameters()):
        model.train()
        return
    model.eval()
    for module in model.modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            module.train()


def apparent_size_test_resolution(train_size: int, scale: tuple[float, float] = RRC_SCALE,
                                  crop_ratio: float = 0.875) -> float:
    """The test resolution (pixels) at which objects look, on average, as large as in training.

    FixRes section 3.1 ("apparent object size"): a RandomResizedCrop covering a fraction ``s`` of the
    image area is resized to ``train_size``, so an object spanning a fraction ``r`` of the image side
    appears ``r * train_size / sqrt(s)`` pixels wide; at test time the shorter side is resized to
    ``K_test / crop_ratio`` and the object appears ``r * K_test / crop_ratio`` pixels wide. With ``s``
    uniform on ``[a, b]`` (torchvision's sampling; aspect-ratio jitter ignored),
    ``E[s^-1/2] = 2 (sqrt(b) - sqrt(a)) / (b - a)``, and equal mean apparent sizes give
    ``K_test = crop_ratio * train_size * E[s^-1/2]``: 1.364 x train_size for the default scale
    (0.08, 1). (With aspect-ratio jitter torchvision redraws crops
    that do not fit the image, which favours small crops: sampled, the factor is about 5 % larger.)
    Example: 306 px for 224 px training (the paper found ResNet-50 trained at 224 px best near
    288 px without finetuning). Our derivation under the section's model: an analytic first guess,
    not a measurement; sweep to choose (``--test-sizes``).
    """
    a, b = scale
    if not 0 < a <= b:
        raise FixresError(f"RandomResizedCrop scale must satisfy 0 < min <= max, got {scale}")
    mean_inverse_side = 1 / math.sqrt(a) if a == b else 2 * (math.sqrt(b) - math.sqrt(a)) / (b - a)
    return crop_ratio * train_size * mean_inverse_side
