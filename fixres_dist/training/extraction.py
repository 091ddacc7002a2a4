"""Feature extraction: logits, pooled embeddings and labels as ``.npy`` files, in dataset order.

Every rank evaluates its share of the split (an :class:`~fixres_dist.data.samplers.ExactBatchSampler`
without shuffling, so each image is seen by exactly one rank) and writes each row straight into
its place in the shared files with ``os.pwrite``: nothing is gathered, and memory does not grow
with the dataset. Rank 0 first creates the files at their final size (``numpy.lib.format`` headers)
under temporary names; after all ranks have written and fsynced, it renames them into place, so a
folder never holds a partial result under the final names.

Files in the destination folder (which must be reachable by every rank):

* ``logits.npy``: float32 (N, num_classes), the classifier's outputs;
* ``embeddings.npy``: float32 (N, D), the head's input (the pooled features);
* ``labels.npy``: int64 (N,), the ImageFolder class indices;
* ``features.json``: resolution (pixels), split, images, classes and the weights used.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fixres_dist.data.pipeline import IMAGENET_NORMALIZATION, to_device
from fixres_dist.distributed import collectives, sharding, watchdog
from fixres_dist.errors import FixresError
from fixres_dist.fixres.finetuning import eval_mode
from fixres_dist.io import write_private
from fixres_dist.training.engine import autocast

FILES = {"logits": np.float32, "embeddings": np.float32, "labels": np.int64}
INFO_FILE = "features.json"


def check_destination(folder: str | Path, overwrite: bool) -> None:
    """Raise :class:`FixresError` if ``folder`` already holds results (unless ``overwrite``) or is unusable."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise FixresError(f"--extract-features {folder} exists and is not a folder")
    present = [f"{name}.npy" for name in FILES if (folder / f"{name}.npy").exists()]
    if present and not overwrite:
        raise FixresError(f"--extract-features {folder} already holds {', '.join(present)}; "
                          "pass --overwrite to replace them or choose another folder")
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise FixresError(f"--extract-features {folder}: {existing} is not writable")


def _row_writer(path: Path) -> tuple[int, int]:
    """Open the .npy file at ``path`` for row writes; returns ``(fd, data offset in bytes)``."""
    offset = np.load(path, mmap_mode="r").offset
    return os.open(path, os.O_WRONLY), offset


@torch.no_grad()
def extract(model: nn.Module, head: str, loader, device: torch.device, folder: str | Path,
            size: int, info: dict, rank0: bool, amp: torch.dtype | None = None, channels_last: bool = False,
            normalization=IMAGENET_NORMALIZATION, forwards: int = 0) -> dict:
    """Write logits, embeddings and labels of ``loader``'s split into ``folder``; all ranks call it.

    ``model`` is the unwrapped classifier, ``head`` the name of its final ``nn.Linear`` (its input is
    the embedding), ``size`` the test resolution in pixels, ``info`` extra fields for features.json,
    ``amp`` an autocast dtype or None (the files are float32 either way). ``forwards``: a sharded
    model's forwards per rank (:func:`fixres_dist.distributed.sharding.forwards_to_match`).
    Returns features.json's content. Raises :class:`FixresError` on an unreadable image.
    """
    folder = Path(folder)
    num_images = len(loader.dataset)
    captured = {}
    hook = dict(model.named_modules())[head].register_forward_hook(
        lambda module, args, out: captured.__setitem__("embedding", args[0].flatten(1)))
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(hook.remove)
        cleanup.enter_context(eval_mode(model))
        probe = model(torch.zeros(1, 3, size, size, device=device))  # the output widths
        widths = {"logits": probe.shape[1], "embeddings": captured["embedding"].shape[1]}
        temporary = {name: folder / f".{name}.npy.partial" for name in FILES}
        if rank0:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            for name, dtype in FILES.items():
                shape = (num_images, widths[name]) if name in widths else (num_images,)
                os.close(os.open(temporary[name], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600))
                os.chmod(temporary[name], 0o600)  # owner-only, as features.json, whatever the umask
                array = np.lib.format.open_memmap(temporary[name], mode="w+", dtype=dtype, shape=shape)
                array.flush()
                del array  # closes the map: the rows are written through file descriptors below
        collectives.barrier()
        writers = {name: _row_writer(temporary[name]) for name in FILES}
        for fd, _ in writers.values():
            cleanup.callback(os.close, fd)
        ran = 0
        for ran, ((images, labels, skipped), keys) in enumerate(zip(loader, loader.batch_sampler), 1):
            watchdog.progress()  # no agreement per batch here
            if skipped:
                raise FixresError(f"{skipped} unreadable images in the split; features need every image")
            with autocast(device, amp):
                logits = model(to_device(images, device, channels_last, normalization)).float().cpu().numpy()
            rows = {"logits": logits, "embeddings": captured["embedding"].float().cpu().numpy(),
                    "labels": labels.numpy().astype(np.int64)}
            for name, (fd, offset) in writers.items():
                row_bytes = rows[name][0].nbytes
                for key, row in zip(keys, rows[name]):
                    os.pwrite(fd, np.ascontiguousarray(row).tobytes(), offset + key.index * row_bytes)
        sharding.blank_forwards(model, forwards - ran, size, device, channels_last)
        for fd, _ in writers.values():
            os.fsync(fd)
    collectives.barrier()
    result = {"resolution": size, "images": num_images, "embedding_dim": widths["embeddings"],
              "num_classes": widths["logits"], **info}
    if rank0:
        for name in FILES:
            os.replace(temporary[name], folder / f"{name}.npy")
        write_private(folder / INFO_FILE, json.dumps(result, indent=2) + "\n")
    collectives.barrier()
    return result
