"""Export a checkpoint's weights as one plain state_dict file for other tools.

``python -m fixres_dist.training.export CHECKPOINT OUT [--weight-key model_ema]`` writes the
network's ``state_dict`` (parameter name -> tensor, nothing else) with ``torch.save``, atomically and
owner-only, loadable with ``torch.load(OUT, weights_only=True)`` and ``model.load_state_dict``. A
checkpoint of any strategy (DDP or sharded: :mod:`fixres_dist.distributed.sharding`) holds the full
tensors, so any can be exported. BatchNorm statistics are the average over the ranks (at an epoch's
end they are already equal on every rank; mid-epoch each rank's follow its own images).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fixres_dist.distributed import checkpoint_shards
from fixres_dist.errors import FixresError
from fixres_dist.io import write_private
from fixres_dist.training import checkpoint

ENTRIES = ("model", "model_ema")


def checkpoint_weights(source: str | Path, key: str = "model") -> tuple[dict, dict]:
    """``source``'s ``key`` weights (``model`` or ``model_ema``) as one state_dict (name -> CPU tensor:
    parameters and buffers, BatchNorm statistics averaged over the ranks), and the checkpoint's whole
    state (sharded entries filled in). Raises :class:`FixresError` for an unreadable, incomplete or
    foreign checkpoint, or one without ``key``."""
    state = checkpoint_shards.with_full_tensors(Path(source), checkpoint.load_checkpoint(source))
    if state.get(key) is None:
        raise FixresError(f"{source} has no {key} weights (a run without --model-ema keeps none)" if key == "model_ema"
                          else f"{source} has no {key} entry")
    buffers = "ema_buffers" if key == "model_ema" else "buffers"
    return {**state[key], **checkpoint.rank_buffers(state["ranks"], None, buffers)}, state


def export(source: str | Path, out: str | Path, key: str = "model") -> tuple[int, int | None]:
    """Write ``source``'s ``key`` weights (``model``, or ``model_ema``: the weights' moving average) to
    ``out``; returns the number of tensors and the resolution (pixels) they were trained at, the size
    to build a ViT for (its position embedding has that grid), or None when unknown. Raises
    :class:`FixresError` for an unreadable or incomplete checkpoint, a checkpoint without ``key``, or an
    ``out`` that exists (never overwritten)."""
    out = Path(out)
    if out.exists():
        raise FixresError(f"{out} exists; export writes a new file (remove it or give another path)")
    weights, state = checkpoint_weights(source, key)
    try:
        write_private(out, lambda f: torch.save(weights, f))
    except OSError as exc:
        raise FixresError(f"cannot write {out}: {exc.strerror or exc}") from None
    return len(weights), state.get("input_size")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fixres_dist.training.export",
                                     description="write a checkpoint's weights as a plain state_dict file")
    parser.add_argument("checkpoint", help="a fixres_dist checkpoint.pth (of any --sharding)")
    parser.add_argument("out", help="the file to write (must not exist)")
    parser.add_argument("--weight-key", choices=ENTRIES, default="model",
                        help="the weights to export: the trained ones, or their moving average (default model)")
    args = parser.parse_args(argv)
    try:
        count, size = export(args.checkpoint, args.out, args.weight_key)
    except FixresError as exc:
        print(f"fixres_dist: {exc}", file=sys.stderr)
        return 1
    trained = f", trained at {size} px (build a ViT for that size)" if size else ""
    print(f"{args.out}: {count} tensors of {args.checkpoint}'s {args.weight_key}{trained}; load with "
          "torch.load(..., weights_only=True)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
