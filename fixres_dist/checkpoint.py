"""Checkpoint files: written atomically (temporary file, fsync, rename), read without executing code.

A checkpoint is a plain dict ``{"format_version", "model", "optimizer", "scheduler", "epoch",
"config", "metrics"}``; the model state is the unwrapped module's (no ``module.`` prefix), the
config a plain dict so that ``torch.load(weights_only=True)`` reads it.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .errors import FixresError

CHECKPOINT_FILE = "checkpoint.pth"
FORMAT_VERSION = 1


def save_checkpoint(path: str | Path, state: dict) -> None:
    """Write ``state`` to ``path`` atomically: a reader sees the old file or the new one, never half.

    Raises :class:`FixresError` (and leaves the previous file intact) when the write fails, e.g. on
    a full or read-only disk.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            torch.save({"format_version": FORMAT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise FixresError(f"cannot write checkpoint {path}: {exc.strerror or exc}; the previous checkpoint is kept") from None


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint with ``weights_only=True``; raises FixresError if unreadable or too new."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt files raise many types inside torch.load
        raise FixresError(f"cannot read checkpoint {path}: {type(exc).__name__} (truncated or corrupt?)") from None
    if not isinstance(state, dict) or "model" not in state:
        raise FixresError(f"{path} is not a fixres_dist checkpoint")
    if state.get("format_version", 0) > FORMAT_VERSION:
        raise FixresError(f"{path} has checkpoint format {state['format_version']}, newer than this "
                          f"fixres_dist reads ({FORMAT_VERSION}); upgrade fixres_dist")
    return state
