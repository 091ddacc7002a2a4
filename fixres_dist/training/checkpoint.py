"""Checkpoint files: complete, written atomically, the last K kept, read without executing code.

Layout in the job folder: ``checkpoint-<global step>.pth`` files (the last ``keep`` of them),
``checkpoint.pth``, a hard link to the newest, and with ``--best-metric`` ``best.pth``, a hard link to the
best epoch's (:mod:`~fixres_dist.training.best_checkpoint`), which the rotation never deletes (nor, sharded,
its shards folder). Every file is written by
:func:`fixres_dist.io.write_private` (temporary name, fsync, rename, folder fsync), so a reader sees
a complete old or new checkpoint, never a partial one, whatever kills the writer (full disk,
SIGKILL, lost node).

Contents (a plain dict, readable with ``torch.load(weights_only=True)``): ``format_version``,
``model`` (the unwrapped module's state), ``optimizer``, ``schedule`` (base LR and progress in
epochs), ``scaler`` (the fp16 GradScaler state or None), ``input_size`` (the training resolution,
chosen by ``--input-size auto`` or given), ``epoch`` and ``images_in_epoch`` (where the sampler
resumes), ``global_step``, ``ranks`` (per rank: RNG states of torch, CUDA, numpy, random and the
rank's BatchNorm buffers, and its EMA's with ``--model-ema``), ``config`` (a plain dict),
``metrics`` (the events so far), ``lineage`` (the resolutions the weights were trained from
scratch and FixRes-finetuned at: :mod:`fixres_dist.models.lineage`) and ``classes`` (the training
data's class names in label order, the class of each row of the classifier:
:mod:`fixres_dist.models.class_names`); with ``--model-ema`` also
``model_ema`` (the moving average's state_dict, rank 0's BatchNorm statistics;
``--weight-key model_ema`` loads it) and ``model_ema_state`` (its update count,
:mod:`fixres_dist.models.ema`); with ``--best-metric`` also ``best`` (the best evaluation so far and the
early-stopping count: :meth:`~fixres_dist.training.best_checkpoint.BestCheckpoint.state_dict`). The
learning-rate schedule and the samplers need no state of their own: both are functions of (seed, epoch,
image in the epoch).
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import attrs
import numpy as np
import torch

from fixres_dist.distributed import checkpoint_shards
from fixres_dist.errors import FixresError
from fixres_dist.finite import NonFiniteWeights, describe_non_finite, non_finite_tensors
from fixres_dist.io import fsync_folder, safe_load, write_private

CHECKPOINT_FILE = "checkpoint.pth"
BEST_FILE = "best.pth"  # --best-metric: the best epoch's checkpoint (training.best_checkpoint)
FORMAT_VERSION = 1


def _replace_with_link(source: Path, target: Path) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:  # file systems without hard links: an owner-only copy instead
        with (open(source, "rb") as src,
              os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as dst):
            shutil.copyfileobj(src, dst)
    os.replace(tmp, target)


def numbered(folder: Path, global_step: int) -> Path:
    """The checkpoint file of optimizer step ``global_step`` in ``folder``."""
    return folder / f"checkpoint-{global_step:08d}.pth"


def keep_best(folder: Path, best_step: int | None) -> None:
    """Point ``best.pth`` in ``folder`` at the checkpoint of step ``best_step`` (a hard link, or an owner-only
    copy), unless it already is that file: after that checkpoint was written, or to mend a link that a kill
    between the two renames left behind. Nothing when ``best_step`` is None or its file is gone. Raises
    OSError."""
    source, target = numbered(folder, best_step) if best_step is not None else None, folder / BEST_FILE
    if source is None or not source.exists() or (target.exists() and os.path.samefile(source, target)):
        return
    _replace_with_link(source, target)


def save_checkpoint(folder: str | Path, state: dict, global_step: int, keep: int = 2,
                    fault_hook=None, protect: str | Path | None = None, best_step: int | None = None) -> Path:
    """Write ``state`` as ``checkpoint-<global_step>.pth``, point ``checkpoint.pth`` at it, keep ``keep``.

    Only this job's numbered checkpoints in ``folder`` are deleted to keep ``keep``, never the file
    ``protect`` (the one ``--resume`` named, which this job did not write). ``best_step``: the step of the
    best checkpoint (``--best-metric``), which ``best.pth`` then links (:func:`keep_best`) and whose shards
    folder, for a sharded checkpoint, is kept.
    ``fault_hook(global_step, file)`` is called mid-write (tests). Raises :class:`FixresError` when
    the write fails (full or read-only disk), and :class:`~fixres_dist.finite.NonFiniteWeights`
    before writing anything when ``state["model"]`` or ``state["optimizer"]`` holds NaN or infinity
    (weights that diverged are never a checkpoint); the previous checkpoints are left intact.
    """
    folder = Path(folder)
    bad, total = non_finite_tensors({key: state.get(key) for key in ("model", "optimizer")})
    if bad:
        detail = describe_non_finite(bad, total)
        raise NonFiniteWeights(f"checkpoint of step {global_step} not written: {detail} (training diverged); "
                               "the previous checkpoint is kept", detail)
    path = numbered(folder, global_step)

    def write(f) -> None:
        if fault_hook is not None:
            fault_hook(global_step, f)
        torch.save({"format_version": FORMAT_VERSION, **state}, f)

    try:
        write_private(path, write)
        _replace_with_link(path, folder / CHECKPOINT_FILE)
        keep_best(folder, best_step)
        fsync_folder(folder)
    except OSError as exc:
        raise FixresError(f"cannot write checkpoint in {folder}: {exc.strerror or exc}; "
                          "the previous checkpoint is kept") from None
    protected = Path(protect).resolve() if protect else None
    for old in sorted(folder.glob("checkpoint-[0-9]*.pth"))[:-keep]:
        if old.resolve() != protected:
            old.unlink(missing_ok=True)
    best = {checkpoint_shards.folder_name(best_step)} if best_step is not None else set()
    checkpoint_shards.remove_unused(folder, best | {p.stem + checkpoint_shards.SUFFIX
                                                    for p in folder.glob("checkpoint-[0-9]*.pth")})
    return path


def resume_source(job_folder: str | Path, resume: str | None) -> tuple[Path | None, str | None]:
    """Which checkpoint a run continues from: ``(path or None, a note for the log or None)``.

    The rule (docs/checkpoints.md, "Never losing work"): the job folder's own ``checkpoint.pth`` wins once it
    exists, since it continues this job and is newer than anything the job started from; else
    ``--resume`` (where a new job starts from); else none. So rerunning a command that carries
    ``--resume OLD.pth`` after a preemption continues from the job's latest checkpoint, not from OLD.
    """
    own = Path(job_folder) / CHECKPOINT_FILE
    if os.path.exists(own):
        if resume and Path(resume).resolve() != own.resolve():
            return own, (f"--resume {resume} not used: this job's own checkpoint {own} continues it "
                         "(the job folder's checkpoint wins once the job has one)")
        return own, None
    return (Path(resume), None) if resume else (None, None)


@attrs.frozen
class Contents:
    """A checkpoint's entries (the module docstring), each named once, here: written as
    :meth:`as_dict`, read back with :meth:`from_dict` (entries that older versions did not write
    take their defaults). Shapes: ``epoch_sums`` the epoch's (loss sum, images, skipped) so far, over
    all ranks; ``epoch_seconds`` its training time so far (seconds); ``ranks`` one dict per global rank
    (``rng``, ``buffers``, ``ema_buffers``, ``host``: its host name); ``tensorboard_at`` images trained on
    up to which the job's TensorBoard event files hold the curves (None: not recorded); ``trackers`` the
    run ids of its experiment trackers (``{"mlflow": id, "wandb": id}``), which a resume continues."""

    model: dict
    optimizer: dict
    epoch: int
    images_in_epoch: int
    global_step: int
    ranks: list
    config: dict
    metrics: list
    schedule: dict | None = None
    scaler: dict | None = None
    input_size: int | None = None
    epoch_sums: list | None = None
    epoch_seconds: float = 0.0
    lineage: dict | None = None
    classes: list | None = None  # the data's class names, in label order (older checkpoints: none)
    data: dict | None = None  # the data's identity: images per split and a SHA-256 (older checkpoints: none)
    tensorboard_at: int | None = None
    trackers: dict | None = None  # the experiment trackers' run ids by tracker (reporting/trackers.py; None: none)
    model_ema: dict | None = None
    model_ema_state: dict | None = None
    shards: str | None = None  # a sharded checkpoint's folder of model, optimizer and EMA (checkpoint_shards)
    shard_digests: dict | None = None  # its files' SHA-256 by name
    layout: dict | None = None  # the ranks' parallel layout (Layout.to_dict; older checkpoints: from their config)
    best: dict | None = None  # --best-metric's state (BestCheckpoint.state_dict; None: no metric watched)

    def as_dict(self) -> dict:
        """The dict that :func:`save_checkpoint` writes (without the EMA entries when there is no EMA)."""
        state = attrs.asdict(self, recurse=False)
        return {k: v for k, v in state.items() if v is not None or k not in OPTIONAL_ENTRIES}

    @classmethod
    def from_dict(cls, state: dict) -> "Contents":
        return cls(**{f.name: state[f.name] for f in attrs.fields(cls) if f.name in state})


# left out when None
OPTIONAL_ENTRIES = ("model_ema", "model_ema_state", "shards", "shard_digests", "classes", "data", "layout", "best",
                    "trackers")
REQUIRED_KEYS = tuple(f.name for f in attrs.fields(Contents) if f.default is attrs.NOTHING)


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint with ``weights_only=True``; FixresError if unreadable, incomplete, too new, or
    if its weights hold NaN or infinity."""
    path = Path(path)
    state = safe_load(path, "checkpoint")
    if not isinstance(state, dict):
        raise FixresError(f"{path} is not a fixres_dist checkpoint")
    version = state.get("format_version")
    if not isinstance(version, int):
        raise FixresError(f"{path} is not a fixres_dist checkpoint (no integer format_version)")
    if version > FORMAT_VERSION:
        raise FixresError(f"{path} has checkpoint format {version}, newer than this "
                          f"fixres_dist reads ({FORMAT_VERSION}); upgrade fixres_dist")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise FixresError(f"{path} is not a complete fixres_dist checkpoint (missing {', '.join(missing)}); "
                          "to start from its weights use --weight-path")
    shards = checkpoint_shards.location(path, state)
    if shards is not None:  # its tensors are read when the ranks load them (checkpoint_shards.load_into)
        checkpoint_shards.verify(shards, state.get("shard_digests"))
        return state
    bad, total = non_finite_tensors(state["model"])
    if bad:  # written by a version that did not stop at a diverged loss
        raise FixresError(f"checkpoint {path} cannot be resumed: {describe_non_finite(bad, total)}; "
                          "resume an earlier checkpoint-*.pth with --resume, or use a new --job-id")
    return state


def rng_state() -> dict:
    """This process's RNG states (torch, CUDA, numpy, random) as plain data."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                      "has_gauss": has_gauss, "gauss": gauss},
            "random": random.getstate()}


BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")  # BatchNorm's per-rank state


def buffers_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s BatchNorm buffers (running mean and variance, batch count) on the CPU: what
    differs between ranks (each rank's statistics follow its own images), kept per rank."""
    return {k: v.cpu() for k, v in module.state_dict().items() if k.endswith(BUFFER_SUFFIXES)}


def rank_buffers(ranks: list[dict], rank: int | None, key: str = "buffers") -> dict[str, torch.Tensor]:
    """The per-rank buffers ``key`` (``buffers``: the model's, ``ema_buffers``: its EMA's) of a
    checkpoint's ``ranks`` for global rank ``rank``; ``None`` (resumed on another world size): each
    buffer's average over the ranks that hold it (in float64, back to its dtype)."""
    if rank is not None:
        return ranks[rank][key]
    keys = dict.fromkeys(k for r in ranks for k in r[key])  # a pipeline's ranks hold different layers
    held = {k: [r[key][k] for r in ranks if k in r[key]] for k in keys}
    return {k: (sum(t.double() for t in ts) / len(ts)).to(ts[0].dtype) for k, ts in held.items()}


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    version, internal, gauss = state["random"]
    random.setstate((version, tuple(internal), gauss))


def check_same_data(saved: dict | None, now: dict, path, root, saved_root: str | None = None) -> None:
    """A resumed run must see the images its checkpoint at ``path`` was trained on: ``saved`` and
    ``now`` are the identities (``identity()`` of :class:`~fixres_dist.data.file_index.DataIndex`,
    :class:`~fixres_dist.data.shards.PackedData` or :class:`~fixres_dist.data.hf_datasets.HFData`)
    recorded and of ``root`` now, wherever the data lie now. An older checkpoint, which recorded no
    identity (``saved`` None), continues only from its own ``--data-path`` (``saved_root``, resolved).
    Raises a one-line :class:`FixresError` otherwise."""
    if saved is None:
        if saved_root is not None and os.path.realpath(saved_root) != os.path.realpath(root):
            raise FixresError(f"{path} was written by an older fixres_dist, which did not record its data's "
                              f"identity: it continues only on its own --data-path {saved_root}")
        return
    if saved == now:
        return
    counts = ", ".join(f"{split} {saved.get(split, 0):,} images then, {now[split]:,} now" for split in ("train", "val"))
    raise FixresError(f"{path} was trained on other images than {root} holds now ({counts}; their names or packed "
                      "shards differ): a resumed run must see the same data to continue exactly; restore the data, or "
                      f"start a new job from its weights with another --job-id and --weight-path {path}")


def check_resumable(config, saved: dict, path) -> None:
    """Raise FixresError if the checkpoint at ``path`` (its config dict ``saved``) is of another run.

    Only fields marked resumable on :class:`~fixres_dist.config.TrainerConfig` may differ.
    """
    changed = config.changed_since(saved)
    if changed:
        diff = ", ".join(f"{k}: {saved[k]!r} -> {getattr(config, k)!r}" if k in saved else
                         f"{k}: absent (an older fixres_dist) -> {getattr(config, k)!r}" for k in changed[:3])
        raise FixresError(f"{path} holds a checkpoint of another configuration ({diff}); a checkpoint continues only "
                          f"its own: for a new run from its weights give another --job-id and --weight-path {path} "
                          "(a fresh optimizer and schedule)")
