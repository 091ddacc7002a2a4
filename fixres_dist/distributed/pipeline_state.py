"""A pipeline's state as a one-file checkpoint holds it: the whole model's, whatever the split.

Each rank of a pipeline (:class:`~fixres_dist.distributed.pipeline.Pipeline`) holds its stages'
parameters under the whole model's names, and its optimizer numbers only those. A one-file
checkpoint holds the *unsplit* model's ``state_dict`` and its optimizer's ``state_dict``, numbered as
an optimizer over the whole model numbers them (its parameter groups in order, each group's
parameters in the model's order), and with ``--model-ema`` the EMA's ``state_dict`` (the whole model's keys,
as a DDP run's ``model_ema``). :func:`gather_whole` builds them from the stages' ranks;
:func:`own_optimizer_state` takes a rank's part back out. So a pipeline's checkpoint resumes unsplit
(DDP, tensor parallel) or on another split, and theirs resume split.

``whole_groups``, the whole model's optimizer numbering: the names of each parameter group's
parameters, in order (what :func:`fixres_dist.training.optim.parameter_groups` makes of the whole
model, before it is cut).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fixres_dist.distributed.pipeline import Pipeline
from fixres_dist.errors import FixresError


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def gather_whole(pipe: Pipeline, optimizer: torch.optim.Optimizer, whole_groups: list[list[str]],
                 average: nn.Module | None = None) -> dict | None:
    """Every rank of each pipeline (a collective over its stage group): ``{"model": state_dict,
    "optimizer": state_dict}`` of the whole model and its optimizer (CPU tensors), and ``"model_ema"``,
    the whole ``state_dict`` of ``average`` (the EMA's copy of this rank's stages) when given, on the first
    rank of each pipeline (global rank 0 among them); None on the others. ``optimizer``: over ``pipe.module``."""
    names = {param: name for name, param in pipe.module.named_parameters()}
    held = [(param, group) for group in optimizer.param_groups for param in group["params"]]
    mine = {"model": _to_cpu(pipe.module.state_dict()),
            "state": {names[p]: _to_cpu(optimizer.state[p]) for p, _ in held if p in optimizer.state},
            "groups": {names[p]: {k: v for k, v in group.items() if k != "params"} for p, group in held},
            "model_ema": _to_cpu(average.state_dict()) if average is not None else {}}
    first = dist.get_global_rank(pipe.group, 0)
    parts = [None] * dist.get_world_size(pipe.group) if dist.get_rank() == first else None
    dist.gather_object(mine, parts, dst=first, group=pipe.group)
    if parts is None:
        return None
    model, state, groups, ema = {}, {}, {}, {}
    for part in parts:
        model.update(part["model"])
        state.update(part["state"])
        groups.update(part["groups"])
        ema.update(part["model_ema"])
    number = {name: index for index, name in enumerate(name for group in whole_groups for name in group)}
    return {"model": model,
            "optimizer": {"state": {number[name]: value for name, value in state.items()},
                          "param_groups": [{**groups[group[0]], "params": [number[name] for name in group]}
                                           for group in whole_groups if group]},
            **({"model_ema": ema} if average is not None else {})}


def own_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict,
                        whole_groups: list[list[str]]) -> dict:
    """The part of ``state`` (a whole model's optimizer ``state_dict``, numbered as ``whole_groups``)
    that ``optimizer`` (over ``module``, a pipeline rank's stages) holds, in its own numbering, for its
    ``load_state_dict``; each group keeps the saved hyperparameters of the group its parameters were
    in. Raises :class:`FixresError` when the saved optimizer numbers another count of parameters."""
    whole = [name for group in whole_groups for name in group]
    saved = sum(len(group["params"]) for group in state["param_groups"])
    if saved != len(whole):
        raise FixresError(f"the checkpoint's optimizer has {saved} parameters, this run's whole model {len(whole)}")
    number = {name: index for index, name in enumerate(whole)}
    saved_group = {index: group for group in state["param_groups"] for index in group["params"]}
    names = {param: name for name, param in module.named_parameters()}
    own, groups, count = {}, [], 0
    for group in optimizer.param_groups:
        indices = [number[names[param]] for param in group["params"]]
        saved = saved_group[indices[0]] if indices else group  # no parameter: nothing trained here
        groups.append({**saved, "params": list(range(count, count + len(indices)))})
        for index in indices:
            if index in state["state"]:
                own[count] = state["state"][index]
            count += 1
    return {"state": own, "param_groups": groups}
