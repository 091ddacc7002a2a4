"""The images a prediction runs over, each with its id, in one fixed order, read by number.

``DATA`` is one of

* a folder of image files (no labels, no class folders needed): every image file at any depth, hidden
  files and folders skipped (:func:`fixres_dist.data.pipeline.image_files`), read as the training data is
  (:func:`fixres_dist.data.images.read_image`); the id is the file's path relative to ``DATA`` (``/``
  separated), and the order that of the sorted ids;
* packed shards (:mod:`fixres_dist.data.shards`): split ``split`` of the set, in its index's order; the id
  is ``<shard file name>:<key>``;
* a Hugging Face dataset (saved or parquet: :mod:`fixres_dist.data.hf_datasets`): split ``split`` (``val``:
  the first of val, validation, test), in row order; the id is the row number (an int).

Shards and Hugging Face datasets are read with the project's readers, and so with their checks (both
splits there, a class-label column).
"""
from __future__ import annotations

import os
from pathlib import Path

from torch.utils.data import Dataset

from fixres_dist.data import hf_datasets, images, pipeline, shards
from fixres_dist.errors import FixresError


class ImageFiles(Dataset):
    """The image files under ``root`` (module docstring) as a dataset: item ``i`` is ``(image, 0)``, the
    image as :func:`fixres_dist.data.images.read_image` reads it (a JPEG as a uint8 (3, H, W) tensor,
    others as 8-bit RGB PIL images); ``ids``: the relative paths, sorted; ``hidden``: what was skipped."""

    def __init__(self, root: Path):
        found, self.hidden = pipeline.image_files(root)
        relative = sorted((Path(path).relative_to(root).as_posix(), path) for path in found)
        self.ids = [name for name, _ in relative]
        self.paths = [path for _, path in relative]

    def __len__(self) -> int:
        return len(self.paths)

    def item_name(self, index: int) -> str:
        return self.paths[index]

    def __getitem__(self, index: int):
        return images.read_image(self.paths[index]), 0


class Unlabelled(Dataset):
    """A labelled split (:class:`~fixres_dist.data.shards.ShardSplit`, :class:`~fixres_dist.data.hf_datasets.HFSplit`)
    with its labels left out: item ``i`` is ``(image, 0)``; ``ids`` as the module docstring says; ``packed``:
    the :class:`~fixres_dist.data.shards.PackedData` it comes from, or None."""

    def __init__(self, split, ids: list, packed: shards.PackedData | None = None):
        self.split, self.ids, self.packed = split, ids, packed

    def __len__(self) -> int:
        return len(self.split)

    def item_name(self, index: int) -> str:
        return self.split.item_name(index)

    def __getitem__(self, index: int):
        return self.split[index][0], 0


def open_data(path: str | Path, split: str = "val", cache_folder: str | Path | None = None) -> Dataset:
    """``DATA`` (module docstring) as a dataset with ``ids`` and ``item_name(i)`` (the file, shard and key,
    or row a message names); ``split`` (``train`` or ``val``) for shards and Hugging Face datasets;
    ``cache_folder``: where a parquet dataset is converted (:func:`fixres_dist.data.hf_datasets.open_hf_dataset`).
    Raises :class:`FixresError` for a path that is not a folder, a set its reader refuses, or no images."""
    path = Path(path)
    if path.is_file():
        raise FixresError(f"data {path} is a file; give a folder of images, packed shards or a Hugging Face dataset")
    if not path.is_dir():
        raise FixresError(f"data {path} does not exist")
    if shards.is_packed(path):
        packed = shards.open_packed(path)
        split_set = packed.dataset(split)
        ids = [f"{os.path.basename(split_set.shard_paths[shard])}:{key.decode(errors='replace')}"
               for shard, key in zip(split_set.shard, split_set.keys)]
        data = Unlabelled(split_set, ids, packed)  # its --max-side is checked against the model's resize
    elif hf_datasets.is_hf_dataset(path):
        split_set = hf_datasets.open_hf_dataset(path, cache_folder).dataset(split)
        data = Unlabelled(split_set, list(range(len(split_set))))
    else:
        try:
            data = ImageFiles(path)
        except OSError as exc:
            raise FixresError(f"cannot list {exc.filename or path}: {exc.strerror or exc}") from None
    if len(data) == 0:
        raise FixresError(f"data {path} holds no images ({', '.join(sorted(pipeline.IMG_EXTENSIONS))}, hidden "
                          "files skipped)")
    return data
