"""Classifiers by torchvision name, and loading weight files into them.

Weight files are read with ``torch.load(weights_only=True)``: nothing in them is executed. A file
is either our ``checkpoint.pth`` (a dict with ``model`` and ``config``) or a plain ``state_dict``;
``module.`` (DDP) and ``_orig_mod.`` (torch.compile) key prefixes are stripped.
"""
from __future__ import annotations

import difflib
import pickle
import warnings
from pathlib import Path

import torch
import torchvision
from torch import nn

from .errors import FixresError


def available_architectures() -> list[str]:
    """Classification model names known to torchvision (``torchvision.models.list_models``)."""
    return sorted(torchvision.models.list_models(module=torchvision.models))


def check_architecture(name: str) -> None:
    """Raise :class:`FixresError` with the closest known names when ``name`` is unknown."""
    known = available_architectures()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see torchvision.models.list_models()"
        raise FixresError(f"unknown --architecture {name!r}{hint}")


def build_model(name: str, num_classes: int) -> nn.Module:
    """A randomly initialised torchvision classifier with ``num_classes`` outputs (no download)."""
    check_architecture(name)
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def _strip_prefixes(state_dict: dict) -> dict:
    """Drop DDP's leading ``module.`` and torch.compile's ``_orig_mod.`` from every key."""
    out = {}
    for key, value in state_dict.items():
        key = key.replace("_orig_mod.", "")
        while key.startswith("module."):
            key = key[len("module."):]
        out[key] = value
    return out


def safe_load(path: Path, what: str):
    """``torch.load(path, weights_only=True)`` with one-line FixresErrors; never runs code from the file."""
    if not path.exists():
        raise FixresError(f"{what} {path} does not exist")
    if not path.is_file():
        raise FixresError(f"{what} {path} is not a file")
    if path.stat().st_size == 0:
        raise FixresError(f"{what} {path} is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise FixresError(f"refused {what} {path}: it holds Python objects other than tensors and plain "
                          "data (not loaded; nothing in it was executed)") from None
    except Exception as exc:  # torch raises many types for corrupt files; we report them all the same way
        raise FixresError(f"cannot read {what} {path}: not a complete PyTorch file ({type(exc).__name__}; "
                          "truncated or corrupt?)") from None


def read_weight_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Return ``(state_dict, config dict or None)`` from a checkpoint or plain state_dict file.

    Raises :class:`FixresError` if the file is missing, unreadable, truncated or holds no tensors.
    """
    path = Path(path)
    payload = safe_load(path, "weight file")
    config = None
    if isinstance(payload, dict) and isinstance(payload.get("model"), dict):
        config = payload.get("config") if isinstance(payload.get("config"), dict) else None
        payload = payload["model"]
    if not isinstance(payload, dict) or not payload or not all(isinstance(v, torch.Tensor) for v in payload.values()):
        raise FixresError(f"weight file {path} holds no state_dict (expected a dict of tensors or a checkpoint)")
    return _strip_prefixes(payload), config


def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Load ``state_dict`` strictly; on mismatch raise :class:`FixresError` naming keys and shapes."""
    own = model.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    shapes = [f"{k} {tuple(state_dict[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in state_dict and state_dict[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append(f"shape mismatch {'; '.join(shapes[:3])}{' ...' if len(shapes) > 3 else ''}")
        if missing:
            parts.append(f"{len(missing)} missing keys e.g. {', '.join(missing[:3])}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys e.g. {', '.join(unexpected[:3])}")
        raise FixresError(f"weights in {source} do not fit this model: {'; '.join(parts)} "
                          "(other --architecture or class count?)")
    model.load_state_dict(state_dict)
