"""The FixRes finetune (Touvron et al., "Fixing the train-test resolution discrepancy", NeurIPS 2019).

A classifier trained with RandomResizedCrop at K_train sees objects larger than at test time; at a
higher test resolution K_test the apparent sizes match better, but the pooled activations change
statistics. FixRes (section 4) therefore finetunes, at K_test and with the *test* preprocessing,
only the classifier and the normalisation just before pooling. The reference code named those
layers per architecture; here they are found from the module graph: the head is the last
``nn.Linear`` to run in a forward pass and the last norm is the last BatchNorm/LayerNorm/GroupNorm
to run before it.

Frozen normalisation layers stay in eval mode during training (:func:`set_train_mode`), so only
the trainable norm's running statistics move.
"""
from __future__ import annotations

import torch
from torch import nn

from .errors import FixresError

NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)


def execution_order(model: nn.Module, input_size: int) -> list[str]:
    """Names of leaf-ish modules (Linear and norm layers) in the order a forward pass runs them.

    Runs one forward pass on a zero batch of shape (2, 3, input_size, input_size) in eval mode.
    """
    order: list[str] = []
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: order.append(name))
             for name, m in model.named_modules() if isinstance(m, (nn.Linear, *NORM_TYPES))]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            device = next(model.parameters()).device
            model(torch.zeros(2, 3, input_size, input_size, device=device))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return order


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


def freeze_for_finetune(model: nn.Module, input_size: int) -> list[str]:
    """Freeze all parameters except the head's and the last norm's (``requires_grad``).

    Call before wrapping in DDP. Returns the names of the parameters left trainable.
    """
    head, norm = find_head_and_last_norm(model, input_size)
    keep = tuple(f"{name}." for name in (head, norm) if name is not None)
    trainable = []
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(keep))
        if param.requires_grad:
            trainable.append(name)
    return trainable


def set_train_mode(model: nn.Module) -> None:
    """``model.train()``, then put every norm layer whose parameters are all frozen back in eval mode.

    Frozen BatchNorms then keep their running statistics (FixRes trained only the last BN's).
    """
    model.train()
    for module in model.modules():
        if isinstance(module, NORM_TYPES):
            params = list(module.parameters(recurse=False))
            if params and not any(p.requires_grad for p in params):
                module.eval()
