"""Sharded checkpoints: each rank writes its own shard of the weights, the optimizer state and the
EMA with ``torch.distributed.checkpoint`` (DCP), and any world size or strategy reads them back.

A sharded run (``--sharding full/hybrid``) checkpoints as a pair in the job folder:

* ``checkpoint-<step>.shards/``: the DCP folder: one ``__<rank>_0.distcp`` file per rank (its shards
  of ``model``, ``optimizer``, ``model_ema``) and ``.metadata`` (which file holds which piece);
* ``checkpoint-<step>.pth``: everything else, as any checkpoint (position, schedule, history, the
  per-rank RNG states and BatchNorm buffers, :class:`~fixres_dist.training.checkpoint.Contents`), its
  ``model``/``optimizer``/``model_ema`` entries None and ``shards`` naming the folder.

Written atomically: all ranks write into ``.checkpoint-<step>.shards.partial``, rank 0 renames it
when DCP has written ``.metadata`` (after every rank's file), then writes the ``.pth`` the usual way;
a kill at any point leaves the previous checkpoint whole and the job's next start removes the
partial folder. Read back by :func:`load_into` (a resume, on any world size and under any strategy:
DCP reshards on load) or, in one process, by :func:`read_full` (finetuning, ``--eval-only`` and
export take the full tensors). :func:`verify` checks that ``.metadata`` and every shard file it
names exist at their full length before anything starts.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fixres_dist.distributed import collectives
from fixres_dist.errors import FixresError, first_line
from fixres_dist.finite import NonFiniteWeights, non_finite_tensors
from fixres_dist.io import fsync_folder, private_folder

SUFFIX = ".shards"
PARTIAL = ".partial"
ENTRIES = ("model", "optimizer", "model_ema")  # the Contents entries a sharded checkpoint keeps here
EARLIER = "use an earlier checkpoint-*.pth of the job (each has its own shards)"


def folder_name(global_step: int) -> str:
    """The shards folder of the checkpoint of ``global_step``, beside ``checkpoint-<step>.pth``."""
    return f"checkpoint-{global_step:08d}{SUFFIX}"


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, average: nn.Module | None) -> dict:
    """The state DCP writes and reads: this rank's shards (a plain model: its full tensors)."""
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer),
            **({"model_ema": get_model_state_dict(average)} if average is not None else {})}


def write(job_folder: Path, global_step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
          average: nn.Module | None, rank: int) -> tuple[str, dict[str, str] | None]:
    """All ranks: write this rank's shards of ``model``, ``optimizer`` and the EMA's ``average`` for
    ``global_step``; rank 0 then moves the complete folder into place (owner-only). Returns the
    folder's name and, on rank 0, the SHA-256 of each of its files (DCP keeps no checksums: a damaged
    shard of the right length would load; rank 0 reads every shard once to hash it). Raises
    :class:`FixresError` when it cannot (disk full, read-only), on every rank when a rank's write failed,
    and :class:`~fixres_dist.finite.NonFiniteWeights` on every rank, before writing, when a
    rank's weights or optimizer state hold NaN or infinity."""
    name = folder_name(global_step)
    if collectives.broadcast_object(rank == 0 and _complete(job_folder / name)):
        # this step's shards are on disk already (a resume re-saving it): the same tensors
        return name, digests(job_folder / name) if rank == 0 else None
    partial = job_folder / f".{name}{PARTIAL}"
    state = _state(model, optimizer, average)
    bad = _non_finite(state)
    if _on_any_rank(bool(bad), model):
        detail = f"a rank's weights or optimizer state hold NaN or infinity{f' ({bad[0]})' if bad else ''}"
        raise NonFiniteWeights(f"checkpoint of step {global_step} not written: {detail}; the previous checkpoint is "
                               "kept", detail)
    try:
        dcp.save(state, checkpoint_id=partial)  # a collective; .metadata last
    except CheckpointException as exc:  # on every rank: DCP gathers the failures
        raise FixresError(f"cannot write the checkpoint's shards in {job_folder}: {_cause(exc)}; the previous "
                          "checkpoint is kept") from None
    if rank == 0:
        final = job_folder / name
        try:
            shutil.rmtree(final, ignore_errors=True)  # the same step written again
            private_folder(partial)
            os.replace(partial, final)
            fsync_folder(job_folder)
            return name, digests(final)
        except OSError as exc:
            raise FixresError(f"cannot write the checkpoint's shards in {job_folder}: {exc.strerror or exc}; "
                              "the previous checkpoint is kept") from None
    return name, None


def digests(folder: Path) -> dict[str, str]:
    """SHA-256 (hex) of each file in the shards ``folder``, by name."""
    found = {}
    for path in sorted(folder.iterdir()):
        with open(path, "rb") as f:
            found[path.name] = hashlib.file_digest(f, "sha256").hexdigest()
    return found


def _complete(folder: Path) -> bool:
    try:
        verify(folder)
    except FixresError:
        return False
    return True


def _non_finite(state) -> list[str]:
    """Names of this rank's floating-point tensors in ``state`` holding NaN or infinity
    (:func:`fixres_dist.finite.non_finite_tensors` on the local shards of DTensors)."""
    def local(value):
        if isinstance(value, dict):
            return {key: local(item) for key, item in value.items()}
        return value.to_local() if hasattr(value, "to_local") else value
    return non_finite_tensors(local(state))[0]


def _on_any_rank(flag: bool, model: nn.Module) -> bool:
    """Whether ``flag`` holds on any rank (a collective, on the model's device: NCCL's are CUDA tensors)."""
    device = next(model.parameters()).device
    return bool(collectives.all_reduce_max(torch.tensor([float(flag)], device=device)).item())


def _cause(exc: BaseException) -> str:
    """The first rank's failure inside DCP's :class:`CheckpointException` (which holds every rank's)."""
    failures = getattr(exc, "failures", None) or {}
    first = next(iter(failures.values()), exc)
    return f"{type(first).__name__}: {first_line(first)}"


def remove_unused(job_folder: Path, keep: set[str]) -> None:
    """Rank 0, after a checkpoint: delete the shards folders that no kept checkpoint names."""
    for folder in job_folder.glob(f"checkpoint-*{SUFFIX}"):
        if folder.name not in keep:
            shutil.rmtree(folder, ignore_errors=True)


def remove_partial(job_folder: Path) -> None:
    """Rank 0, as a job starts: delete the partial shards folders a killed run left."""
    for partial in job_folder.glob(f".checkpoint-*{SUFFIX}{PARTIAL}"):
        shutil.rmtree(partial, ignore_errors=True)


def location(checkpoint_path: Path, state: dict) -> Path | None:
    """The shards folder a checkpoint ``state`` read from ``checkpoint_path`` names, or None (a
    checkpoint of one file)."""
    name = state.get("shards")
    return Path(checkpoint_path).parent / name if name else None


def verify(folder: Path, expected: dict[str, str] | None = None) -> None:
    """Raise :class:`FixresError` naming what is wrong when ``folder`` lacks ``.metadata`` or a shard
    file it names, a file is shorter than the pieces it should hold (truncated), or (``expected``: the
    SHA-256 by file name its ``.pth`` recorded) a file's content changed."""
    if not folder.is_dir():
        raise FixresError(f"the shards folder {folder} of this sharded checkpoint is missing: its .pth holds no "
                          "weights without it (copy or move the two together)")
    if not (folder / ".metadata").is_file():
        raise FixresError(f"sharded checkpoint {folder} has no .metadata (incomplete or damaged: a kill while "
                          f"it was copied?); {EARLIER}")
    try:
        metadata = FileSystemReader(folder).read_metadata()
    except Exception as exc:  # unpickling a damaged file raises many types
        raise FixresError(f"cannot read {folder / '.metadata'} ({type(exc).__name__}: {first_line(exc)})") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, length in sorted(needed.items()):
        shard = folder / relative
        if not shard.is_file():
            raise FixresError(f"sharded checkpoint {folder} is missing the shard {relative}; {EARLIER}")
        if shard.stat().st_size < length:
            raise FixresError(f"shard {shard} is truncated ({shard.stat().st_size:,} of {length:,} bytes); {EARLIER}")
    if expected:
        found = digests(folder)
        changed = sorted(name for name, digest in expected.items() if found.get(name) != digest)
        if changed:
            raise FixresError(f"sharded checkpoint {folder}: {', '.join(changed)} changed since it was written "
                              f"(its SHA-256 differs from the one its .pth recorded: damaged?); {EARLIER}")


def load_into(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, average: nn.Module | None) -> None:
    """All ranks: load the shards in ``folder`` into ``model`` (sharded or plain), ``optimizer`` and the
    EMA's ``average``, whatever world size and strategy wrote them."""
    state = _state(model, optimizer, average)
    # each group's parameter names are this rank's own: the checkpoint holds one rank's lists (a pipeline
    # stage's, or the whole model's), which name other parameters than this rank's stage has
    own = [group["params"] for group in state["optimizer"]["param_groups"]]
    try:
        with warnings.catch_warnings():  # one rank without a process group: "a single process", as meant
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=folder)
    except CheckpointException as exc:  # every rank's failures: a damaged shard
        raise FixresError(f"cannot load the sharded checkpoint {folder} (damaged shard?): {_cause(exc)}") from None
    bad = _non_finite({"model": state["model"], "model_ema": state.get("model_ema", {})})
    if _on_any_rank(bool(bad), model):
        raise FixresError(f"sharded checkpoint {folder} cannot be resumed: its weights hold NaN or infinity"
                          f"{f' ({bad[0]})' if bad else ''}; use an earlier checkpoint-*.pth of the job")
    for group, names in zip(state["optimizer"]["param_groups"], own):
        group["params"] = names
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if average is not None:
        set_model_state_dict(average, state["model_ema"])


def read_full(folder: Path, entries: tuple[str, ...] = ("model", "model_ema")) -> dict[str, dict]:
    """In one process: the full tensors of ``entries`` (those the checkpoint has) as state_dicts on the
    CPU, e.g. ``{"model": {name: tensor}, "model_ema": {...}}``."""
    reader = FileSystemReader(folder)
    metadata = reader.read_metadata()
    state: dict[str, dict] = {}
    for key, info in metadata.state_dict_metadata.items():
        entry, _, name = key.partition(".")
        if entry in entries and isinstance(info, TensorStorageMetadata):
            state.setdefault(entry, {})[name] = torch.empty(info.size, dtype=info.properties.dtype)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (CheckpointException, Exception) as exc:  # CheckpointException is a BaseException
        raise FixresError(f"cannot read the sharded checkpoint {folder} (damaged shard?): {_cause(exc)}") from None
    bad = _non_finite(state)
    if bad:
        raise FixresError(f"sharded checkpoint {folder}: its weights hold NaN or infinity ({bad[0]}); these weights "
                          "diverged and cannot be used")
    return state


def with_full_tensors(checkpoint_path: Path, state: dict) -> dict:
    """A checkpoint ``state`` with its sharded entries' full tensors filled in (``model``, ``model_ema``),
    as one-file checkpoints hold them; ``state`` itself when it is not sharded."""
    folder = location(checkpoint_path, state)
    if folder is None:
        return state
    verify(folder, state.get("shard_digests"))
    return {**state, **read_full(folder)}
