"""Weight files from elsewhere: which entry holds the weights, and loading them into a model.

Reading (:func:`read_weight_file`). A file is read with ``torch.load(weights_only=True)``: nothing
in it is executed. Training scripts also store their arguments and other Python objects beside the
weights (torchvision's references, timm's ``train.py`` and DeiT an ``argparse.Namespace``, numpy
scalars, Lightning its hyper-parameters); those are read as inert placeholders (objects of a class
of ours that only keeps what it is given; the named class is never imported or called), except
anything from the modules torch blocks outright (``os``, ``sys``, ...), which is refused. The
weights are the entry, in this order of preference:

* ``--weight-key KEY`` (``weight_key``): exactly that top-level entry (``model_ema`` or
  ``state_dict_ema`` for the EMA weights);
* else the file itself when it is a plain state_dict (a dict of tensors);
* else the first of ``model`` (fixres_dist's and FixRes' checkpoints, torchvision's references,
  DeiT), ``state_dict`` (timm's ``train.py``, Lightning), ``model_state_dict`` (PyTorch's tutorial
  layout), then the EMA entries ``model_ema``, ``state_dict_ema``;
* else the only entry that is a state_dict.

When nothing fits, the message lists the top-level keys found. A state_dict with NaN or infinite
values is refused.

Loading (:func:`load_weights`) is strict, as ``nn.Module.load_state_dict(strict=True)`` is, with
the differences a real file brings:

* key prefixes of wrappers: DDP's ``module.``, torch.compile's ``_orig_mod.``, Lightning's
  ``model.`` (its module attribute), torchvision's ``AveragedModel`` (``module.`` plus its
  ``n_averaged`` counter). The prefix kept is the one under which the file's keys cover the most of
  the model's; entries outside it are ignored and the note says so;
* what torch itself accepts from files of older versions (a BatchNorm without
  ``num_batches_tracked``, torchvision's ViT MLP keys ``linear_1``/``linear_2`` ...): each module's
  own ``_load_from_state_dict`` upgrades them, and our checks take torch's verdict from a dry run
  on a copy of the model whose tensors are on the meta device (nothing is allocated);
* a timm model's own checkpoint filter (``checkpoint_filter_fn`` of its module: position
  embeddings resampled to the model's grid, patch embeddings, relative position tables ...);
  a torchvision ViT's position embedding is interpolated to the model's patch grid;
* a classifier head for another number of classes: the model keeps its own, freshly initialised;
* weights that record their class names (a fixres_dist checkpoint's ``classes``), loaded for data
  with other names or another order: the head's rows follow the names
  (:mod:`fixres_dist.models.class_names`: kept, new, dropped; no shared name: a fresh head).

Anything else missing, unexpected or misshapen is refused in one line; a refused load leaves the
model as it was.
"""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import attrs
import torch
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

from fixres_dist.distributed import checkpoint_shards
from fixres_dist.errors import FixresError, first_line
from fixres_dist.finite import describe_non_finite, non_finite_tensors
from fixres_dist.fixres.finetuning import find_head_and_last_norm
from fixres_dist.io import safe_load
from fixres_dist.models import class_names
from fixres_dist.models.architectures import build_size, interpolated_pos_embedding, is_timm_model

# Top-level entries that hold a model's weights, in order of preference (the EMA ones last).
WEIGHT_KEYS = ("model", "state_dict", "model_state_dict")
EMA_KEYS = ("model_ema", "state_dict_ema")
# How many leading key components a wrapper prefix may have ("model.module." has two).
_MAX_PREFIX_PARTS = 3


class Placeholder:
    """Stands for a Python object of another program found in a weight file; never that object.

    Keeps the arguments and state the file gives it; ``placeholder_for`` names the class or
    function the file asked for (never imported, never called).
    """

    placeholder_for = "?"

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"<placeholder for {self.placeholder_for}>"


@attrs.frozen
class WeightFile:
    """What :func:`read_weight_file` found.

    ``state_dict``: name -> tensor, as in the file (prefixes are dealt with by :func:`load_weights`);
    ``key``: the top-level entry it came from (None: the file is a state_dict); ``others``: the
    other entries that are state_dicts too (e.g. ``model_ema``); ``config``: a fixres_dist
    checkpoint's configuration (dict) or None; ``placeholders``: the foreign classes and functions
    read as :class:`Placeholder` objects; ``lineage``: a fixres_dist checkpoint's record of the
    resolutions its weights were trained and finetuned at (:mod:`fixres_dist.models.lineage`) or None;
    ``classes``: a fixres_dist checkpoint's class names, in the label order of its head's rows, or None.
    """

    path: str
    state_dict: dict
    key: str | None = None
    others: tuple[str, ...] = ()
    config: dict | None = None
    placeholders: tuple[str, ...] = ()
    lineage: dict | None = None
    classes: tuple[str, ...] | None = None

    def describe(self) -> str:
        """One line for the log: where the weights came from in the file."""
        where = f"entry {self.key!r} of {self.path}" if self.key else self.path
        also = f" (also there: {', '.join(self.others)}; --weight-key picks one)" if self.others else ""
        return f"weights: {len(self.state_dict)} tensors from {where}{also}"


def _foreign_globals(path: Path) -> list[str]:
    """Classes and functions a zip-format torch file names that torch's safe loader does not allow."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # not a zip-format torch file, unreadable: safe_load says what is wrong
        return []


def _load_payload(path: Path) -> tuple[object, tuple[str, ...]]:
    """``torch.load(weights_only=True)`` of ``path`` with foreign objects as :class:`Placeholder`s."""
    names = _foreign_globals(path) if path.is_file() else []
    stand_ins = []
    for name in names:
        module, _, attribute = name.rpartition(".")
        stand_in = type(attribute or name, (Placeholder,), {"__module__": module, "placeholder_for": name})
        stand_ins.append((stand_in, name))
    with torch.serialization.safe_globals(stand_ins):
        payload = safe_load(path, "weight file")
    if isinstance(payload, dict) and payload.get("shards"):  # a sharded run's checkpoint: its tensors beside it
        payload = checkpoint_shards.with_full_tensors(path, payload)
    return payload, tuple(names)


def _is_state_dict(value) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())


def _pick(path: Path, payload, weight_key: str | None, placeholders: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """``(entry holding the weights or None for a plain state_dict, other state_dict entries)``."""
    top = list(payload) if isinstance(payload, dict) else []
    top.sort(key=lambda k: not _is_state_dict(payload[k]))  # the entries that could hold weights first
    listed = ", ".join(map(str, top[:12])) + (", ..." if len(top) > 12 else "") if top else \
        f"none: it holds a {type(payload).__name__}"
    foreign = f"; read as inert placeholders: {', '.join(placeholders)}" if placeholders else ""
    if weight_key is not None:
        if _is_state_dict(payload):
            raise FixresError(f"--weight-key {weight_key}: weight file {path} is a plain state_dict, with no "
                              "entries to pick from; leave --weight-key out")
        if weight_key not in top:
            raise FixresError(f"--weight-key {weight_key}: weight file {path} has no entry {weight_key!r}; "
                              f"its top-level keys: {listed}")
        if not _is_state_dict(payload[weight_key]):
            raise FixresError(f"--weight-key {weight_key}: entry {weight_key!r} of weight file {path} is not a "
                              f"state_dict (a dict of tensors) but a {type(payload[weight_key]).__name__}{foreign}")
        return weight_key, [k for k in top if k != weight_key and _is_state_dict(payload[k])]
    if _is_state_dict(payload):
        return None, []
    candidates = [k for k in top if _is_state_dict(payload[k])]
    preferred = [k for k in (*WEIGHT_KEYS, *EMA_KEYS) if k in candidates]
    if preferred or len(candidates) == 1:
        key = (preferred or candidates)[0]
        return key, [k for k in candidates if k != key]
    if candidates:
        raise FixresError(f"weight file {path} holds several state_dicts ({', '.join(map(str, candidates))}); "
                          "pick one with --weight-key")
    raise FixresError(f"weight file {path} holds no state_dict (a dict of tensors); its top-level keys: "
                      f"{listed}{foreign}; if one of them holds the weights, name it with --weight-key")


def read_weight_file(path: str | Path, weight_key: str | None = None, check_values: bool = True) -> WeightFile:
    """The weights in the file at ``path`` (see the module docstring for the layouts accepted).
    ``check_values``: look for NaN and infinite weights, which reads every tensor (False: a rank whose
    values come from rank 0's, which checked them; its tensors stay memory-mapped, unread).

    Raises :class:`FixresError` if the file is missing, unreadable, truncated, holds code from a
    blocked module, has no entry that fits (the message lists its top-level keys), has no entry
    ``weight_key``, holds NaN or infinite weights, or if ``weight_key`` is a checkpoint's
    ``model_ema`` that was never updated (the starting weights, not an average).
    """
    path = Path(path)
    payload, placeholders = _load_payload(path)
    key, others = _pick(path, payload, weight_key, placeholders)
    state = payload if key is None else payload[key]
    ema = payload.get("model_ema_state") if key == "model_ema" and isinstance(payload, dict) else None
    if isinstance(ema, dict) and ema.get("updates") == 0:
        raise FixresError(f"--weight-key model_ema: the average in {path} was never updated (the run trained fewer "
                          "than --model-ema-steps steps): it holds the weights training started from; use its "
                          "trained weights (leave --weight-key out)")
    bad, total = non_finite_tensors(state) if check_values else ([], 0)
    if bad:
        raise FixresError(f"weight file {path}{f' entry {key!r}' if key else ''}: {describe_non_finite(bad, total)}; "
                          "these weights diverged and cannot be used")
    # A fixres_dist checkpoint's configuration and lineage describe its weights and their EMA alike.
    config = payload.get("config") if key in ("model", "model_ema") and isinstance(payload.get("config"), dict) \
        else None
    lineage = payload.get("lineage") if config is not None and isinstance(payload.get("lineage"), dict) else None
    classes = payload.get("classes") if config is not None else None
    classes = tuple(classes) if isinstance(classes, (list, tuple)) and all(isinstance(c, str) for c in classes) \
        else None
    return WeightFile(str(path), dict(state), key, tuple(map(str, others)), config, placeholders, lineage, classes)


def _common_prefix(state: dict, own: dict) -> tuple[dict, str, list[str]]:
    """``(state with a wrapper prefix removed, the prefix, keys outside it)``, see the module docstring.

    The prefix is the one (of at most three leading key components, or none) under which the most
    of ``own``'s keys are found; ties go to no prefix, then to the shortest.
    """
    state = {key.replace("_orig_mod.", ""): value for key, value in state.items()}
    covered = {"": sum(1 for k in own if k in state)}
    for key in state:
        parts = key.split(".")
        for n in range(1, min(len(parts) - 1, _MAX_PREFIX_PARTS) + 1):
            if ".".join(parts[n:]) in own:
                prefix = ".".join(parts[:n]) + "."
                covered[prefix] = covered.get(prefix, 0) + 1
    best = max(covered, key=lambda p: (covered[p], p == "", -len(p), p))
    if not best:
        return state, "", []
    inside = {key[len(best):]: value for key, value in state.items() if key.startswith(best)}
    return inside, best, [key for key in state if not key.startswith(best)]


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers live on the meta device (no memory)."""
    memo = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _torch_verdict(model: nn.Module, state: dict, source: str) -> tuple[list[str], list[str]]:
    """``(missing, unexpected)`` keys as ``model.load_state_dict(state)`` would find them, after the
    modules' own upgrades of older files; a dry run on a meta copy. Raises FixresError for a size
    mismatch torch finds under keys it renamed."""
    try:
        result = _meta_copy(model).load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line]
        raise FixresError(f"weights in {source} do not fit this model: {lines[0] if lines else first_line(exc)}") \
            from None
    return list(result.missing_keys), list(result.unexpected_keys)


def _head_name(model: nn.Module) -> str | None:
    """Name of the classifier (the nn.Linear nearest the logits, :func:`fixres.find_head_and_last_norm`),
    or None. One forward pass with gradients on a zero image of the model's build size."""
    try:
        return find_head_and_last_norm(model, build_size(model))[0]
    except FixresError:  # no nn.Linear at all: no head to treat specially
        return None


def _mismatch_message(source: str, missing: list[str], unexpected: list[str], shapes: list[str],
                      trained: dict | None = None) -> str:
    """One line on why ``source``'s weights do not fit; ``trained``: the fixres_dist checkpoint's
    configuration, whose architecture is then named as the likely fix."""
    parts = []
    if shapes:
        parts.append(f"shape mismatch {'; '.join(shapes[:3])}{' ...' if len(shapes) > 3 else ''}")
    if missing:
        parts.append(f"{len(missing)} missing keys e.g. {', '.join(missing[:3])}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys e.g. {', '.join(unexpected[:3])}")
    arch = (trained or {}).get("architecture")
    hint = (f"its run trained --architecture {arch}{' --low-res-stem' if trained.get('low_res_stem') else ''}: "
            "give the same") if arch else "other --architecture, class count or --low-res-stem?"
    return f"weights in {source} do not fit this model: {'; '.join(parts)} ({hint})"


def _timm_filter(model: nn.Module, state: dict, source: str) -> tuple[dict, list[str]]:
    """A timm model's own checkpoint filter applied to ``state``; returns it and the keys whose shape it changed."""
    module = sys.modules.get(type(model).__module__)
    adapt = getattr(module, "checkpoint_filter_fn", None)
    if adapt is None:
        return state, []
    try:
        adapted = adapt(dict(state), model)
    except Exception as exc:  # a filter written for other layouts: report, do not guess
        raise FixresError(f"weights in {source}: timm's checkpoint filter for {type(model).__name__} failed "
                          f"({type(exc).__name__}: {first_line(exc)})") from None
    changed = [k for k, v in adapted.items() if k in state and tuple(state[k].shape) != tuple(v.shape)]
    return dict(adapted), changed


def _vit_pos_embedding(model: VisionTransformer, state: dict, own: dict, source: str) -> list[str]:
    """A torchvision ViT's position embedding in ``state`` interpolated to ``model``'s patch grid, in
    place; returns the note to log, if any. Raises FixresError when it cannot be interpolated."""
    key = "encoder.pos_embedding"
    if key not in state or state[key].shape == own[key].shape:
        return []
    grid_from = math.isqrt(max(state[key].shape[1] - 1, 0)) if state[key].dim() == 3 else 0
    try:
        state[key] = interpolated_pos_embedding(state[key], model.image_size, model.patch_size)
    except FixresError as exc:
        raise FixresError(f"weights in {source}: {exc}") from None
    if state[key].shape != own[key].shape:
        return []
    grid = model.image_size // model.patch_size
    return [f"position embedding interpolated from {grid_from}x{grid_from} to {grid}x{grid} patches"]


@attrs.frozen
class Loaded:
    """What :func:`load_weights` did: ``note`` for the log (prefixes removed, entries ignored,
    embeddings resampled, new head, rows mapped by class name) or None; ``new_head_from``: the class
    count of the weight file's head when the model got a freshly initialised head instead (its class
    count differs, or no class name is shared), else None; ``warning``: a line to warn with (the
    weights share no class name with the data: a new task), else None."""

    note: str | None
    new_head_from: int | None = None
    warning: str | None = None


def load_weights(model: nn.Module, weights: WeightFile | dict, source: str | None = None,
                 classes: list[str] | None = None) -> Loaded:
    """Load ``weights`` (a :class:`WeightFile` or a state_dict) into ``model``; returns :class:`Loaded`.

    See the module docstring for what is tolerated. ``source`` names the weights in messages
    (default: the file's path); ``classes``: the data's class names in label order, which the head's
    rows follow when ``weights`` records its own (:func:`fixres_dist.models.class_names.map_head_rows`).
    ``weights`` is not modified. Raises a one-line :class:`FixresError` for any other missing,
    unexpected or misshapen key, when the file lacks only the head ("weight file X has no classifier
    head (missing fc.weight, fc.bias)"), and for class names the rows cannot follow (see
    :func:`~fixres_dist.models.class_names.map_head_rows`); then ``model`` is unchanged. A ``model`` on the
    meta device is checked only: its values come later (``fixres_dist.distributed.sharding.load_from_rank0``).
    """
    if isinstance(weights, WeightFile):
        source, state_dict = source or weights.path, weights.state_dict
    else:
        source, state_dict = source or "the state_dict", weights
    own = model.state_dict()
    notes, new_head_from = [], None
    state, prefix, ignored = _common_prefix(dict(state_dict), own)
    if prefix:
        outside = (f"; ignored {len(ignored)} other {'entry' if len(ignored) == 1 else 'entries'}: "
                   f"{', '.join(ignored[:2])}{', ...' if len(ignored) > 2 else ''}") if ignored else ""
        notes.append(f"weights under {prefix!r}{outside}")
    if is_timm_model(model):
        state, changed = _timm_filter(model, state, source)
        if changed:
            notes.append(f"timm resampled {', '.join(changed[:3])} to this model's size")
    if isinstance(model, VisionTransformer):
        notes += _vit_pos_embedding(model, state, own, source)
    mapped = class_names.Mapped()
    if classes is not None and isinstance(weights, WeightFile) and weights.classes is not None:
        match = class_names.ClassMatch(weights.classes, classes)
        mapped = class_names.map_head_rows(state, own, None if match.same else _head_name(model), match, source)
        notes += [mapped.note] if mapped.note else []
        new_head_from = len(match.trained) if mapped.fresh_head else None
    shapes = [k for k in own if k in state and state[k].shape != own[k].shape]
    trial = {**state, **{k: own[k] for k in shapes}}  # torch's verdict on the keys, sizes checked by us
    missing, unexpected = _torch_verdict(model, trial, source)
    if missing or unexpected or shapes:
        head = _head_name(model)
        head_keys = [k for k in own if head is not None and k.startswith(f"{head}.")]
        if head_keys and not unexpected and not shapes and sorted(missing) == sorted(head_keys):
            raise FixresError(f"weight file {source} has no classifier head (missing {', '.join(head_keys)})")
        weight = f"{head}.weight"
        head_only = (head_keys and not missing and not unexpected and set(shapes) <= set(head_keys)
                     and weight in shapes and state[weight].dim() == own[weight].dim() == 2
                     and state[weight].shape[1] == own[weight].shape[1])
        if not head_only:
            described = [f"{k} {tuple(state[k].shape)} vs model {tuple(own[k].shape)}" for k in shapes]
            raise FixresError(_mismatch_message(source, missing, unexpected, described,
                                                weights.config if isinstance(weights, WeightFile) else None))
        new_head_from = state[weight].shape[0]
        notes.append(f"new {own[weight].shape[0]}-class head {head} (weights had {new_head_from} classes)")
        state = trial
    if not any(p.is_meta for p in model.parameters()):  # on the meta device: checked, its values come later
        model.load_state_dict(state)
    return Loaded("; ".join(notes) or None, new_head_from, mapped.warning)
