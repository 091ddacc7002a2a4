"""Packed data: WebDataset tar shards and their index, read by sample number.

A data folder of millions of image files costs millions of metadata operations per epoch on a
parallel or network filesystem (Lustre, GPFS, NFS); packed, it is a few hundred large files. Read by
sample number (a map-style dataset), packed data keeps what the samplers give an ImageFolder: every
validation image evaluated once at any world size, a training stream that depends only on (seed,
epoch), a bit-identical mid-epoch resume, repeated augmentation (:mod:`fixres_dist.data.samplers`).

A packed data folder ``ROOT`` (written by ``python -m fixres_dist.data.packing pack``, or shards
written by another tool indexed in place by ``... packing index``) holds

* ``train-000000.tar``, ..., ``val-000000.tar``, ...: WebDataset shards (another tool's have its own
  names). Each sample is tar members with the same key (WebDataset's: the member name up to the first
  dot of its last path component): ``<key>.<ext>``, the image file's bytes as they were (``jpg``,
  ``png``, ``webp``, ...), and ``<key>.cls``, its class number in decimal. WebDataset and other tools
  read them. Members whose file name starts with a dot (``._x.jpg`` of macOS tar) are not samples.
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
import tarfile
from pathlib import Path

import attrs
import numpy as np
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS

from fixres_dist.data import images, pipeline
from fixres_dist.errors import FixresError, first_line, plural

MANIFEST = "shards.json"
FORMAT = "fixres_dist shards 1"
SPLITS = ("train", "val")
OPEN_SHARDS = 64  # file descriptors a process keeps open (the least recently read shard is closed first)
HASH_CHUNK = 1 << 22
HEADER = 512  # a tar member's header: the block before its data, its name in the first 100 bytes
NAME_FIELD = 100
LABEL_LIMIT = 2 ** 31  # labels are below it, class list or not
# Compressed tar files, which are not read (no byte offset to read a sample at), and what decompresses
# them in place into .tar files.
COMPRESSED = {".tar.gz": "gunzip", ".tgz": "gunzip", ".tar.bz2": "bunzip2", ".tbz2": "bunzip2", ".tar.xz": "unxz",
              ".txz": "unxz", ".tar.zst": "unzstd --rm"}
PACKED = ("packed", "pack the data again")  # what made a folder's index, and what to do when it no longer holds
INDEXED = ("indexed", "index the shards again")


def origin(manifest: dict) -> tuple[str, str]:
    """How the folder of ``manifest`` was made (``packed`` or ``indexed``: another tool's shards indexed
    in place) and what to do when its shards no longer match it, for messages."""
    return INDEXED if manifest.get("indexed") else PACKED


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


def split_name(name: str) -> tuple[str, str]:
    """A tar member's ``(key, extension)`` as WebDataset splits them: at the first dot of its last
    path component (``./a/b.seg.png``: ``./a/b`` and ``seg.png``)."""
    folder, slash, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return folder + slash + stem, ext


def index_shard(path: Path, num_classes: int | None) -> ShardIndex:
    """Index a WebDataset shard with :mod:`tarfile`: per sample (members grouped by key,
    :func:`split_name`, in order; hidden files skipped), its image member's offset and size and its
    ``.cls`` label. ``num_classes``: labels are below it (``None``: below :data:`LABEL_LIMIT`).

    Raises :class:`FixresError` naming the shard and the sample key for an unreadable or truncated
    tar, a key repeated (two members of one sample with the same extension: one would be left out), a
    sample without an image or without a label, a label that is not a number or out of range, an image
    whose tar header :meth:`ShardSplit.read` could not check (a tar dialect it does not know).
    """
    samples: dict[str, dict[str, tarfile.TarInfo]] = collections.OrderedDict()
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if member.isfile() and not member.name.rpartition("/")[2].startswith("."):
                    key, ext = split_name(member.name)
                    _add_member(path, samples.setdefault(key, {}), key, ext.lower(), member)
            tar.fileobj.seek(tar.offset)  # where tarfile stopped: a complete tar ends with zero blocks
            if tar.fileobj.read(HEADER) != bytes(HEADER):
                raise tarfile.ReadError(f"no member and no end of the archive at byte {tar.offset:,}")
            labels = [_label(tar, path, key, members, num_classes) for key, members in samples.items()]
            found = [_image_member(path, key, members) for key, members in samples.items()]
            for key, member in zip(samples, found):
                tar.fileobj.seek(member.offset_data - HEADER)
                if not names_key(tar.fileobj.read(HEADER), encoded_key(key)):
                    raise FixresError(f"shard {path}, sample {key}: the tar header before its image does not name "
                                      "it (a tar dialect this reader does not know); write the shard with Python's "
                                      "tarfile, GNU tar or the webdataset library")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise FixresError(f"shard {path} cannot be read as a tar file ({type(exc).__name__}: {first_line(exc)}): "
                          "truncated or damaged; write it again (pack, or copy it whole)") from None
    return ShardIndex(list(samples), np.array([m.offset_data for m in found], np.int64),
                      np.array([m.size for m in found], np.int64), np.array(labels, np.int64))


def encoded_key(key: str) -> bytes:
    """A key as the index stores it (bytes)."""
    return key.encode(errors="surrogateescape")  # tarfile's decoding of a name that is not UTF-8


def names_key(header: bytes, key: bytes) -> bool:
    """Whether the tar header ``header`` (512 bytes) is of a member of sample ``key``: its name, with a
    USTAR prefix if any, starts with ``key`` and a dot; a long name (GNU, PAX) has its first 100 bytes
    there."""
    name = header[:NAME_FIELD].split(b"\0")[0]
    if header[257:263] == b"ustar\0" and header[345:346] not in (b"", b"\0"):  # POSIX, not GNU
        name = header[345:500].split(b"\0")[0] + b"/" + name
    expected = key + b"."
    return name.startswith(expected) or (len(name) == NAME_FIELD and expected.startswith(name))


def _add_member(path: Path, members: dict[str, tarfile.TarInfo], key: str, ext: str, member: tarfile.TarInfo) -> None:
    """Add ``member`` to its sample's ``members`` (by lower-case extension); :class:`FixresError` when the
    sample already has one of that extension (a key repeated in the shard)."""
    first = members.setdefault(ext, member)
    if first is not member:
        raise FixresError(f"shard {path}, sample {key}: the key is repeated: {first.name} (at byte {first.offset:,}) "
                          f"and {member.name} (at byte {member.offset:,}) are both its .{ext}, and one would be left "
                          "out; a key names one sample in a shard: write the shard again with unique keys")


def _image_member(path: Path, key: str, members: dict[str, tarfile.TarInfo]) -> tarfile.TarInfo:
    found = [member for ext, member in members.items() if f".{ext}" in IMG_EXTENSIONS]
    if len(found) != 1:
        raise FixresError(f"shard {path}, sample {key}: {len(found) or 'no'} image members "
                          f"({', '.join(sorted(members)) or 'none'}); a sample holds one image "
                          f"({', '.join(sorted(IMG_EXTENSIONS))}) and its .cls")
    return found[0]


def _label(tar: tarfile.TarFile, path: Path, key: str, members: dict[str, tarfile.TarInfo],
           num_classes: int | None) -> int:
    if "cls" not in members:
        raise FixresError(f"shard {path}, sample {key}: no label (no {key}.cls member)")
    text = tar.extractfile(members["cls"]).read().strip()
    limit = LABEL_LIMIT if num_classes is None else num_classes
    if not text.isdigit() or int(text) >= limit:
        within = f"(0 to {limit - 1})" if num_classes is None else f"of the class list (0 to {limit - 1})"
        raise FixresError(f"shard {path}, sample {key}: label {text.decode(errors='replace')!r} is not a class "
                          f"number {within}")
    return int(text)


class ShardSplit(Dataset):
    """One split of a packed data folder (module docstring) as a map-style dataset, ImageFolder's
    counterpart for :class:`~fixres_dist.data.pipeline.SeededDataset`.

    Item ``i``: ``(image, class number)``, the image a uint8 (3, H, W) RGB tensor for a JPEG, else an
    8-bit RGB PIL image (:func:`fixres_dist.data.images.decode_image`). ``classes``, ``class_to_idx``,
    ``targets`` and ``hidden`` (none) as torchvision's ImageFolder has them. Each process (rank,
    loader worker) opens the shards it reads, at most :data:`OPEN_SHARDS` at a time. Reading raises
    :class:`FixresError` (:meth:`read`) for a shard that is not the one packed or indexed (``made``:
    :func:`origin`).
    """

    def __init__(self, root: Path, split: str, classes: list[str], shard_names: list[str],
                 index: dict[str, np.ndarray], made: tuple[str, str] = PACKED):
        self.root, self.split, self.classes, self.made = root, split, classes, made
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
        return f"{self.shard_paths[self.shard[index]]}:{self.keys[index].decode(errors='replace')}"

    def read(self, index: int) -> bytes:
        """The image file's bytes of sample ``index``, read with the tar header before them, whose member
        name must be the sample's key (a shard replaced by another of the same size is found at its
        first read). Raises :class:`FixresError` naming the shard and key when it is not, or when the
        shard ends before the sample does."""
        shard, offset, size = int(self.shard[index]), int(self.offset[index]), int(self.size[index])
        data = os.pread(self._descriptor(shard), size + HEADER, offset - HEADER)
        made, again = self.made
        if len(data) != size + HEADER:
            raise FixresError(f"{self.item_name(index)}: the shard ends before this sample does (truncated since "
                              f"it was {made}); {again}")
        if not names_key(data[:HEADER], self.keys[index]):
            found = data[:NAME_FIELD].split(b"\0")[0].decode(errors="replace")
            raise FixresError(f"{self.item_name(index)}: the shard holds {found!r} there, not this sample (replaced "
                              f"since it was {made}); {again}, or run verify")
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
        # The longest shorter side (pixels) of the images (pack --max-side), None for images as they were.
        self.max_side: int | None = manifest.get("max_side")

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
        return ShardSplit(self.root, split, self.classes, names, self.indexes[split], origin(self.manifest))

    def save(self) -> None:
        """Nothing to save: the index is part of the packed data (DataIndex's interface)."""

    def describe(self) -> str:
        shards = sum(len(self.manifest["splits"][s]["shards"]) for s in SPLITS)
        resized = f", shorter sides at most {self.max_side} px" if self.max_side else ""
        return (f"data: {origin(self.manifest)[0]}: {self.images('train'):,} train and {self.images('val'):,} val "
                f"images in {len(self.classes):,} classes{resized}, {plural(shards, 'shard')} of {self.root} "
                f"({MANIFEST}), checked")

    def largest_test_size(self, crop_ratio: float) -> int:
        """The largest test resolution (pixels) whose resize, round(K / ``crop_ratio``), this pack's images
        serve without upsampling (:attr:`max_side`); 0 where there is no limit."""
        if self.max_side is None:
            return 0
        return max((k for k in range(1, self.max_side + 1) if pipeline.resize_size(k, crop_ratio) <= self.max_side),
                   default=1)

    def check_sizes(self, needs: dict[str, tuple[int, int]], where: str | None = None,
                    smaller: bool = True) -> None:
        """Refuse what needs larger images than a pack made with ``--max-side`` holds: ``needs`` maps what
        (``"test resolution 224 (224 / crop ratio 0.875)"``) to (the shorter side it needs, the largest
        resolution this pack serves it at), in pixels; ``where``: how the message names the pack (default
        ``--data-path ROOT``); ``smaller``: whether it may suggest that smaller resolution. Raises
        :class:`FixresError` naming the one that needs the most (packing again for it serves them all)."""
        if self.max_side is not None and needs:
            what, (side, fits) = max(needs.items(), key=lambda item: item[1][0])  # the first of the largest
            if side > self.max_side:
                raise FixresError(f"{where or f'--data-path {self.root}'}: the pack holds images with shorter sides "
                                  f"of at most {self.max_side} px (packed with --max-side {self.max_side}); {what} "
                                  f"needs {side} px: pack again with --max-side {side} or more"
                                  + (f", or use {fits} px or less" if smaller else ""))


def is_packed(root: str | Path) -> bool:
    """Whether ``root`` is a packed data folder (it holds :data:`MANIFEST`), or holds tar shards,
    compressed ones included, without it (then :func:`open_packed` says why it cannot be read)."""
    root = Path(root)
    return (root / MANIFEST).is_file() or (not (root / "train").is_dir() and (
        any(root.glob("*.tar")) or bool(compressed([p.name for p in root.glob("*")]))))


def compressed(names: list[str]) -> list[str]:
    """The compressed tar files among the file ``names`` (:data:`COMPRESSED`), in order."""
    return [name for name in names if name.lower().endswith(tuple(COMPRESSED))]


def refuse_compressed(folder: Path, names: list[str]) -> None:
    """Raise :class:`FixresError` in one line when the file ``names`` of ``folder`` hold compressed tar
    shards: which, that only uncompressed ``.tar`` shards are read (a sample is read at its byte
    offset), and how to get them (decompress them in place, or pack the images)."""
    found = compressed(names)
    if not found:
        return
    suffix = next(s for s in COMPRESSED if found[0].lower().endswith(s))
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    raise FixresError(f"{folder / found[0]}{more}: compressed shards ({suffix}) are not read, only uncompressed .tar "
                      f"shards (a sample is read at its byte offset); decompress them ({COMPRESSED[suffix]} "
                      f"{folder}/*{suffix}) and index them, or pack the images with python -m "
                      "fixres_dist.data.packing pack")


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
        raise FixresError(f"{root / MANIFEST}: class {empty[0]!r} has no training images; {origin(manifest)[1]}")
    if data.train_images < min_train_images:
        raise FixresError(f"{root} holds {data.train_images} training images, too few for the ranks "
                          f"(at least {min_train_images}: 2 per rank)")
    return data


def _require(condition, problem: str) -> None:
    """A manifest check that holds also under ``python -O`` (which drops ``assert``)."""
    if not condition:
        raise ValueError(problem)


def read_manifest(root: Path) -> dict:
    """``root/shards.json``, its fields checked. Raises :class:`FixresError` (see :func:`open_packed`;
    compressed shards without it: :func:`refuse_compressed`)."""
    path = root / MANIFEST
    if not path.is_file():
        if not any(root.glob("*.tar")):
            refuse_compressed(root, sorted(p.name for p in root.glob("*")))
        raise FixresError(f"{root} holds tar shards but no {MANIFEST}: a pack that did not finish (run the "
                          "pack command again: it continues) or shards written by another tool; index them with "
                          f"python -m fixres_dist.data.packing index {root}")
    try:
        manifest = json.loads(path.read_text())
        _require(manifest["format"] == FORMAT, f"format {manifest['format']!r}, not {FORMAT!r}")
        classes = manifest["classes"]
        _require(isinstance(classes, list) and classes and all(isinstance(c, str) and c for c in classes),
                 "the class list is not a list of names")
        _require(len(set(classes)) == len(classes), "a class name appears twice")
        names = [shard["name"] for split in SPLITS for shard in manifest["splits"][split]["shards"]]
        _require(len(set(names)) == len(names), "a shard is listed twice")
        for split in SPLITS:
            for shard in manifest["splits"][split]["shards"]:
                _require(is_shard_name(shard["name"]),
                         f"shard name {shard['name']!r} is not a file name ending in .tar")
                _require(all(isinstance(shard[k], int) and shard[k] >= 0 for k in ("images", "bytes")),
                         f"{shard['name']}: images or bytes is not a count")
                _require(isinstance(shard["sha256"], str), f"{shard['name']}: no SHA-256")
            _require(isinstance(manifest["splits"][split]["index_sha256"], str), f"no {split} index checksum")
        side = manifest.get("max_side")  # absent: packed before --max-side, images as they were
        _require(side is None or (isinstance(side, int) and not isinstance(side, bool) and side > 0),
                 f"max_side {side!r} is not a positive number of pixels")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FixresError(f"{path} is not a packed data manifest ({type(exc).__name__}: {first_line(exc)}); "
                          "pack the data again") from None
    return manifest


def is_shard_name(name) -> bool:
    """Whether ``name`` can be a shard's in ``shards.json``: a file name (no folder) ending in ``.tar``."""
    return isinstance(name, str) and name.endswith(".tar") and "/" not in name and "\0" not in name


def _checked_index(root: Path, split: str, manifest: dict) -> dict[str, np.ndarray]:
    entry = manifest["splits"][split]
    made, again = origin(manifest)
    for shard in entry["shards"]:
        path = root / shard["name"]
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise FixresError(f"shard {path} ({split}) is missing ({exc.strerror}): copy the {made} folder whole, "
                              f"or {again}") from None
        if size != shard["bytes"]:
            raise FixresError(f"shard {path} is {size:,} bytes, {MANIFEST} says {shard['bytes']:,}: truncated or "
                              f"replaced since it was {made}; {again}")
    path = root / index_name(split)
    try:
        digest = sha256(path)
    except OSError as exc:
        raise FixresError(f"index {path} is missing ({exc.strerror}): {again}") from None
    if digest != entry["index_sha256"]:
        raise FixresError(f"index {path} does not match {MANIFEST} (stale, or changed since it was {made}): "
                          f"{again}")
    with np.load(path) as arrays:
        index = {name: arrays[name] for name in ("shard", "offset", "size", "label", "key")}
    counts = np.bincount(index["shard"], minlength=len(entry["shards"]))
    expected = [shard["images"] for shard in entry["shards"]]
    if counts.tolist() != expected or (index["label"] >= len(manifest["classes"])).any():
        raise FixresError(f"index {path} does not match {MANIFEST} (samples per shard or class numbers differ); "
                          f"{again}")
    return index
