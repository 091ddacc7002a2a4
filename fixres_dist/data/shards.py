"""Packed data: WebDataset tar shards and their index, read by sample number.

A data folder of millions of image files costs millions of metadata operations per epoch on a
parallel or network filesystem (Lustre, GPFS, NFS); packed, it is a few hundred large files. Read by
sample number (a map-style dataset), packed data keeps what the samplers give an ImageFolder: every
validation image evaluated once at any world size, a training stream that depends only on (seed,
epoch), a bit-identical mid-epoch resume, repeated augmentation (:mod:`fixres_dist.data.samplers`).

A packed data folder ``ROOT`` (written by ``python -m fixres_dist.data.packing``) holds

* ``train-000000.tar``, ..., ``val-000000.tar``, ...: WebDataset shards. Each sample is two tar
  members with the same key: ``<key>.<ext>``, the image file's bytes as they were (``jpg``, ``png``,
  ``webp``, ...), and ``<key>.cls``, its class number in decimal. WebDataset and other tools read them.
* ``train.index.npz``, ``val.index.npz``: for each sample in order, its shard, the byte offset and
  size of its image inside the shard, its class number and key (numpy arrays; :func:`index_shard`).
* ``shards.json`` (:data:`MANIFEST`), written last: the class names in label order, and for each
  split its shards (file name, images, bytes, SHA-256) and its index file's SHA-256. Without it the
  set is incomplete (a pack that did not finish) and is refused.

Reading a sample is one ``os.pread`` of its image at the recorded offset (no tar parsing at run
time), decoded as an image file of an ImageFolder is (:func:`fixres_dist.data.images.decode_image`).
Every start checks, in milliseconds: every shard present with its recorded size (a truncated or
replaced shard is named), each index against its checksum (a missing or stale index), every class
number within the class list. ``python -m fixres_dist.data.packing verify ROOT`` also reads every
shard (SHA-256, and each shard indexed again and compared).
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import tarfile
from pathlib import Path

import attrs
import numpy as np
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS

from fixres_dist.data import images
from fixres_dist.errors import FixresError, first_line, plural

MANIFEST = "shards.json"
FORMAT = "fixres_dist shards 1"
SPLITS = ("train", "val")
SHARD_NAME = re.compile(r"(train|val)-\d{6}\.tar")
OPEN_SHARDS = 64  # file descriptors a process keeps open (the least recently read shard is closed first)
HASH_CHUNK = 1 << 22
HEADER = 512  # a tar member's header: the block before its data, its name in the first 100 bytes


def index_name(split: str) -> str:
    return f"{split}.index.npz"


def sha256(path: Path) -> str:
    """The SHA-256 of the file at ``path`` (hex), read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@attrs.frozen
class ShardIndex:
    """One shard's samples (:func:`index_shard`): keys, image byte offsets and sizes, class numbers."""

    keys: list[str]
    offsets: np.ndarray  # int64, bytes from the start of the shard
    sizes: np.ndarray  # int64, bytes
    labels: np.ndarray  # int64


def index_shard(path: Path, num_classes: int) -> ShardIndex:
    """Index a WebDataset shard with :mod:`tarfile`: per sample (members grouped by the key before the
    first dot of their name, in order), its image member's offset and size and its ``.cls`` label.

    Raises :class:`FixresError` naming the shard and the sample key for an unreadable or truncated
    tar, a sample without an image or without a label, a label that is not a number or not in
    ``range(num_classes)``.
    """
    samples: dict[str, dict[str, tarfile.TarInfo]] = collections.OrderedDict()
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if member.isfile():
                    key, _, ext = member.name.partition(".")
                    samples.setdefault(key, {})[ext.lower()] = member
            labels = [_label(tar, path, key, members, num_classes) for key, members in samples.items()]
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise FixresError(f"shard {path} cannot be read as a tar file ({type(exc).__name__}: {first_line(exc)}): "
                          "truncated or damaged; pack it again") from None
    found = [_image_member(path, key, members) for key, members in samples.items()]
    return ShardIndex(list(samples), np.array([m.offset_data for m in found], np.int64),
                      np.array([m.size for m in found], np.int64), np.array(labels, np.int64))


def _image_member(path: Path, key: str, members: dict[str, tarfile.TarInfo]) -> tarfile.TarInfo:
    found = [member for ext, member in members.items() if f".{ext}" in IMG_EXTENSIONS]
    if len(found) != 1:
        raise FixresError(f"shard {path}, sample {key}: {len(found) or 'no'} image members "
                          f"({', '.join(sorted(members)) or 'none'}); a sample holds one image "
                          f"({', '.join(sorted(IMG_EXTENSIONS))}) and its .cls")
    return found[0]


def _label(tar: tarfile.TarFile, path: Path, key: str, members: dict[str, tarfile.TarInfo], num_classes: int) -> int:
    if "cls" not in members:
        raise FixresError(f"shard {path}, sample {key}: no label (no {key}.cls member)")
    text = tar.extractfile(members["cls"]).read().strip()
    if not text.isdigit() or int(text) >= num_classes:
        raise FixresError(f"shard {path}, sample {key}: label {text.decode(errors='replace')!r} is not a class "
                          f"number of the class list (0 to {num_classes - 1})")
    return int(text)


class ShardSplit(Dataset):
    """One split of a packed data folder (module docstring) as a map-style dataset, ImageFolder's
    counterpart for :class:`~fixres_dist.data.pipeline.SeededDataset`.

    Item ``i``: ``(image, class number)``, the image a uint8 (3, H, W) RGB tensor for a JPEG, else an
    8-bit RGB PIL image (:func:`fixres_dist.data.images.decode_image`). ``classes``, ``class_to_idx``,
    ``targets`` and ``hidden`` (none) as torchvision's ImageFolder has them. Each process (rank,
    loader worker) opens the shards it reads, at most :data:`OPEN_SHARDS` at a time. Reading raises
    :class:`FixresError` (:meth:`read`) for a shard that is not the one packed.
    """

    def __init__(self, root: Path, split: str, classes: list[str], shard_names: list[str],
                 index: dict[str, np.ndarray]):
        self.root, self.split, self.classes = root, split, classes
        self.class_to_idx = {name: number for number, name in enumerate(classes)}
        self.shard_paths = [str(root / name) for name in shard_names]
        self.shard, self.offset, self.size = index["shard"], index["offset"], index["size"]
        self.targets = index["label"].tolist()
        self.keys = index["key"]
        self.hidden: list[str] = []
        self._open: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.targets)

    def item_name(self, index: int) -> str:
        """``<shard path>:<key>``: what a message about sample ``index`` names."""
        return f"{self.shard_paths[self.shard[index]]}:{self.keys[index].decode()}"

    def read(self, index: int) -> bytes:
        """The image file's bytes of sample ``index``, read with the tar header before them, whose member
        name must be the sample's key (a shard replaced by another of the same size is found at its
        first read). Raises :class:`FixresError` naming the shard and key when it is not, or when the
        shard ends before the sample does."""
        shard, offset, size = int(self.shard[index]), int(self.offset[index]), int(self.size[index])
        data = os.pread(self._descriptor(shard), size + HEADER, offset - HEADER)
        key = self.keys[index]
        if len(data) != size + HEADER:
            raise FixresError(f"{self.item_name(index)}: the shard ends before this sample does (truncated since "
                              "it was packed); pack the data again")
        if data[:len(key) + 1] != key + b".":
            found = data[:100].split(b"\0")[0].decode(errors="replace")
            raise FixresError(f"{self.item_name(index)}: the shard holds {found!r} there, not this sample (replaced "
                              "since it was packed); pack the data again, or run verify")
        return data[HEADER:]

    def __getitem__(self, index: int):
        return images.decode_image(self.read(index)), self.targets[index]

    def _descriptor(self, shard: int) -> int:
        if self._pid != os.getpid():  # a forked loader worker: the parent's descriptors are not its own
            self._open, self._pid = collections.OrderedDict(), os.getpid()
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        if len(self._open) >= OPEN_SHARDS:
            os.close(self._open.popitem(last=False)[1])
        try:
            self._open[shard] = os.open(self.shard_paths[shard], os.O_RDONLY)
        except OSError as exc:
            raise FixresError(f"shard {self.shard_paths[shard]} cannot be opened ({exc.strerror}): the packed data "
                              "changed while the run was reading it") from None
        return self._open[shard]

    def __getstate__(self):
        return {**self.__dict__, "_open": collections.OrderedDict()}

    def __del__(self):
        if getattr(self, "_pid", None) == os.getpid():
            for descriptor in self._open.values():
                os.close(descriptor)


class PackedData:
    """A packed data folder ``root`` (module docstring), checked (:func:`open_packed`); the
    counterpart of :class:`~fixres_dist.data.file_index.DataIndex` for a run. ``classes``: the class
    names in label order; ``manifest``: ``shards.json``."""

    built = False  # nothing is walked or cached: the index is part of the packed data

    def __init__(self, root: Path, manifest: dict, indexes: dict[str, dict[str, np.ndarray]]):
        self.root, self.manifest, self.indexes = root, manifest, indexes
        self.classes: list[str] = list(manifest["classes"])

    def images(self, split: str) -> int:
        return len(self.indexes[split]["label"])

    @property
    def train_images(self) -> int:
        return self.images("train")

    def identity(self) -> dict:
        """What a resumed run must see again (its checkpoint records it): the images of each split and a
        SHA-256 (hex) of the class list and the shards' and indexes' SHA-256s (the same images packed
        again give the same bytes, hence the same identity)."""
        content = json.dumps([self.classes, self.manifest["splits"]], sort_keys=True).encode()
        return {**{split: self.images(split) for split in SPLITS}, "sha256": hashlib.sha256(content).hexdigest()}

    def dataset(self, split: str) -> ShardSplit:
        """Split ``split`` (``train`` or ``val``) as a dataset."""
        names = [shard["name"] for shard in self.manifest["splits"][split]["shards"]]
        return ShardSplit(self.root, split, self.classes, names, self.indexes[split])

    def save(self) -> None:
        """Nothing to save: the index is part of the packed data (DataIndex's interface)."""

    def describe(self) -> str:
        shards = sum(len(self.manifest["splits"][s]["shards"]) for s in SPLITS)
        return (f"data: packed: {self.images('train'):,} train and {self.images('val'):,} val images in "
                f"{len(self.classes):,} classes, {plural(shards, 'shard')} of {self.root} ({MANIFEST}), checked")


def is_packed(root: str | Path) -> bool:
    """Whether ``root`` is a packed data folder (it holds :data:`MANIFEST`), or holds tar shards
    without it (then :func:`open_packed` says why it cannot be read)."""
    root = Path(root)
    return (root / MANIFEST).is_file() or (not (root / "train").is_dir() and any(root.glob("*.tar")))


def open_packed(root: str | Path, min_train_images: int = 1) -> PackedData:
    """Read and check the packed data folder ``root`` (module docstring: sizes, index checksums,
    labels). Raises :class:`FixresError` naming the file, shard or sample for a missing or unreadable
    ``shards.json``, a missing, truncated or replaced shard, a missing or stale index, a label outside
    the class list, or fewer than ``min_train_images`` training images."""
    root = Path(root)
    manifest = read_manifest(root)
    indexes = {split: _checked_index(root, split, manifest) for split in SPLITS}
    data = PackedData(root, manifest, indexes)
    empty = [name for name, count in zip(data.classes, np.bincount(indexes["train"]["label"],
                                                                   minlength=len(data.classes))) if count == 0]
    if empty:
        raise FixresError(f"{root / MANIFEST}: class {empty[0]!r} has no training images; pack the data again")
    if data.train_images < min_train_images:
        raise FixresError(f"{root} holds {data.train_images} training images, too few for the ranks "
                          f"(at least {min_train_images}: 2 per rank)")
    return data


def _require(condition, problem: str) -> None:
    """A manifest check that holds also under ``python -O`` (which drops ``assert``)."""
    if not condition:
        raise ValueError(problem)


def read_manifest(root: Path) -> dict:
    """``root/shards.json``, its fields checked. Raises :class:`FixresError` (see :func:`open_packed`)."""
    path = root / MANIFEST
    if not path.is_file():
        raise FixresError(f"{root} holds tar shards but no {MANIFEST}: a pack that did not finish (run the "
                          "pack command again: it continues) or shards packed elsewhere; pack them with "
                          "python -m fixres_dist.data.packing")
    try:
        manifest = json.loads(path.read_text())
        _require(manifest["format"] == FORMAT, f"format {manifest['format']!r}, not {FORMAT!r}")
        classes = manifest["classes"]
        _require(isinstance(classes, list) and classes and all(isinstance(c, str) and c for c in classes),
                 "the class list is not a list of names")
        _require(len(set(classes)) == len(classes), "a class name appears twice")
        for split in SPLITS:
            for shard in manifest["splits"][split]["shards"]:
                _require(isinstance(shard["name"], str) and SHARD_NAME.fullmatch(shard["name"]),
                         f"shard name {shard['name']!r} is not <split>-NNNNNN.tar")
                _require(all(isinstance(shard[k], int) and shard[k] >= 0 for k in ("images", "bytes")),
                         f"{shard['name']}: images or bytes is not a count")
                _require(isinstance(shard["sha256"], str), f"{shard['name']}: no SHA-256")
            _require(isinstance(manifest["splits"][split]["index_sha256"], str), f"no {split} index checksum")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FixresError(f"{path} is not a packed data manifest ({type(exc).__name__}: {first_line(exc)}); "
                          "pack the data again") from None
    return manifest


def _checked_index(root: Path, split: str, manifest: dict) -> dict[str, np.ndarray]:
    entry = manifest["splits"][split]
    for shard in entry["shards"]:
        path = root / shard["name"]
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise FixresError(f"shard {path} ({split}) is missing ({exc.strerror}): copy the packed folder whole, "
                              f"or pack the data again") from None
        if size != shard["bytes"]:
            raise FixresError(f"shard {path} is {size:,} bytes, {MANIFEST} says {shard['bytes']:,}: truncated or "
                              "replaced since it was packed; pack the data again")
    path = root / index_name(split)
    try:
        digest = sha256(path)
    except OSError as exc:
        raise FixresError(f"index {path} is missing ({exc.strerror}): pack the data again") from None
    if digest != entry["index_sha256"]:
        raise FixresError(f"index {path} does not match {MANIFEST} (stale, or changed since packing): pack the "
                          "data again")
    with np.load(path) as arrays:
        index = {name: arrays[name] for name in ("shard", "offset", "size", "label", "key")}
    counts = np.bincount(index["shard"], minlength=len(entry["shards"]))
    expected = [shard["images"] for shard in entry["shards"]]
    if counts.tolist() != expected or (index["label"] >= len(manifest["classes"])).any():
        raise FixresError(f"index {path} does not match {MANIFEST} (samples per shard or class numbers differ); "
                          "pack the data again")
    return index
