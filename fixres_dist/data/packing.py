"""Pack a data folder into WebDataset tar shards with an index, index shards another tool wrote, and
verify either.

    python -m fixres_dist.data.packing pack SOURCE OUT [--shard-size 256] [--max-side PX [--quality 90]] [--workers N]
    python -m fixres_dist.data.packing index FOLDER [--train GLOB] [--val GLOB] [--classes FILE] [--workers N]
    python -m fixres_dist.data.packing verify OUT

``pack`` reads ``SOURCE/train`` and ``SOURCE/val`` as a run reads them (ImageFolder: hidden files
skipped, the same class folders in both, symbolic-link loops refused; :mod:`fixres_dist.data.pipeline`)
and writes into ``OUT`` what :mod:`fixres_dist.data.shards` reads: shards of about ``--shard-size``
MiB each (``train-000000.tar``, ...: every image file's bytes as they are, not decoded or
re-encoded, and its class number), the index of each split and ``shards.json``. Shards are written
by ``--workers`` processes at once, each into a hidden temporary file renamed when complete
(fsynced), so a killed pack leaves no half-written shard under a shard's name; ``shards.json`` comes
last. Run it again to continue: the temporary files are removed, and a shard already written with the
planned samples (same keys and image sizes) is kept; a finished pack of another source is never
packed over. Worker processes end with the command, however it ends. The shards are the same bytes whoever packs
them (members in order, mode 0444, time 0, no owner), so their SHA-256 identifies the data.

``index`` reads WebDataset shards that another tool wrote into ``FOLDER`` (the webdataset library's
ShardWriter, ``tar`` by hand: each sample a ``<key>.<ext>`` image and its ``<key>.cls`` class number)
where they are, without changing them: it writes only the two index files and, last, ``shards.json``
beside them (each atomically; an interrupted index leaves none of them), so that ``--data-path
FOLDER`` reads them as a pack. The train and val shards are the ``*.tar`` files whose names contain
``train`` and ``val`` (``--train``/``--val``: file name patterns), in natural order (``x-2.tar``
before ``x-10.tar``); the class names come from ``--classes FILE`` (one a line, in label order), or
are the labels' numbers. Indexing again replaces the index; a folder written by ``pack`` is refused.

``verify`` reads every shard: its size and SHA-256 against ``shards.json``, and each shard indexed
again against the split's index. Each problem ends any command in one line naming the file, exit 1;
Ctrl-C or SIGTERM ends it with exit 130.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fnmatch
import hashlib
import io
import json
import math
import os
import re
import signal
import sys
import tarfile
from pathlib import Path

import attrs
import numpy as np
from PIL import Image
from tqdm import tqdm

from fixres_dist import locks, startup
from fixres_dist.arguments import OneLineParser, positive_int
from fixres_dist.data import images, pipeline, shards
from fixres_dist.errors import FixresError, first_line, plural, say
from fixres_dist.io import remove_stale_temporaries, temporary_name, write_private

SHARED = 0o644  # packed data is read by others (less the umask), unlike a run's own files
STATE = ".pack.json"  # the source, and each finished shard's plan digest and entry: what a continued pack keeps
LOCK = ".pack.lock"
# What a pack folder may hold: shards, indexes, the manifest, the state, the lock and temporary files.
OURS = re.compile(r"(train|val)-\d{6}\.tar|(train|val)\.index\.npz|shards\.json|\.pack\.(json|lock)|\..+\.tmp")
INDEX_ARRAYS = {"shard", "offset", "size", "label", "key"}
QUALITY = 90  # pack --max-side's JPEG quality by default (FFCV's; ImageNet's files are about as fine)


@attrs.frozen
class ShardPlan:
    """One shard to write: its file name, the split's number of its first sample (keys count from
    it), its samples as ``(image file, class number)``, and with ``max_side`` (pixels) the images
    whose shorter side is longer stored resized to it, as JPEGs of ``quality`` (:func:`stored_image`)."""

    name: str
    first: int
    samples: tuple[tuple[str, int], ...]
    max_side: int | None = None
    quality: int | None = None

    def keys(self) -> list[str]:
        return [f"{self.first + number:08d}" for number in range(len(self.samples))]

    def digest(self) -> str:
        """SHA-256 of what the shard is made of: each sample's file (path, size, modification time)
        and class number. A finished shard is kept by a continued pack only if this is unchanged."""
        stats = [(path, (st := os.stat(path)).st_size, st.st_mtime_ns, label) for path, label in self.samples]
        resized = [self.max_side, self.quality] if self.max_side else []  # a pack before --max-side: unchanged
        return hashlib.sha256(json.dumps([self.name, self.first, stats, *resized]).encode()).hexdigest()


def plan(source: Path, shard_bytes: int, max_side: int | None = None,
         quality: int | None = None) -> tuple[list[str], dict[str, list[ShardPlan]]]:
    """The class names of ``source`` and, for each split, its shards: consecutive samples in the
    ImageFolder's order, a new shard once one holds ``shard_bytes`` of image files (source files: with
    ``max_side`` the shards come out smaller); ``max_side``, ``quality``: :class:`ShardPlan`'s. Raises
    :class:`FixresError` as a run does for a bad data folder."""
    classes = pipeline.check_image_folder(source)
    planned = {}
    for split in shards.SPLITS:
        samples = pipeline.image_folder(source, split).samples
        split_shards, current, size = [], [], 0
        for path, label in samples:
            current.append((path, label))
            size += os.stat(path).st_size
            if size >= shard_bytes:
                split_shards.append(current)
                current, size = [], 0
        if current:
            split_shards.append(current)
        first = np.cumsum([0] + [len(s) for s in split_shards])
        planned[split] = [ShardPlan(f"{split}-{number:06d}.tar", int(first[number]), tuple(s), max_side, quality)
                          for number, s in enumerate(split_shards)]
    return classes, planned


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o444, 0
    return info


def write_shard(shard: ShardPlan, out: Path, num_classes: int) -> tuple[dict, shards.ShardIndex]:
    """Write ``shard`` into ``out`` (atomically: :func:`fixres_dist.io.write_private`, a hidden temporary
    file, fsynced, renamed); returns its ``shards.json`` entry and its index."""
    def write(file):
        with tarfile.open(fileobj=file, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for key, (path, label) in zip(shard.keys(), shard.samples):
                resized = stored_image(path, shard.max_side, shard.quality) if shard.max_side else None
                if resized is not None:
                    tar.addfile(_member(f"{key}.jpg", len(resized)), io.BytesIO(resized))
                else:
                    with open(path, "rb") as image:  # streamed: a large file is never held whole
                        tar.addfile(_member(f"{key}{Path(path).suffix.lower()}", os.fstat(image.fileno()).st_size),
                                    image)
                text = str(label).encode()
                tar.addfile(_member(f"{key}.cls", len(text)), io.BytesIO(text))
    final = write_private(out / shard.name, write, SHARED)
    found = shards.index_shard(final, num_classes)
    return _entry(final, found), found


def stored_image(path: str, max_side: int, quality: int) -> bytes | None:
    """What ``pack --max-side`` stores for the image file ``path``: ``None`` (its bytes as they are) when its
    shorter side is at most ``max_side`` pixels (read from its header), else the image decoded as a run
    decodes it (:func:`fixres_dist.data.images.open_rgb`: 8-bit RGB, levels preserved), resized with
    Pillow's antialiased bicubic filter so that its shorter side is ``max_side`` (the longer one
    rounded), as a baseline JPEG of ``quality`` with 4:2:0 chroma (the same bytes every time). Raises
    :class:`FixresError` naming a file that cannot be read or converted."""
    try:
        with images.pillow_limits(), Image.open(path) as header:
            width, height = header.size
        if min(width, height) <= max_side:
            return None
        image = images.open_rgb(path)
    except (OSError, ValueError, SyntaxError) as exc:
        raise FixresError(f"cannot pack {path}: {type(exc).__name__}: {first_line(exc)}; replace or remove it, then "
                          "run the command again (finished shards are kept)") from None
    scale = max_side / min(width, height)
    size = (max_side, round(height * scale)) if width <= height else (round(width * scale), max_side)
    out = io.BytesIO()
    image.resize(size, Image.Resampling.BICUBIC).save(out, "JPEG", quality=quality, subsampling=2)
    return out.getvalue()


def kept_shard(shard: ShardPlan, out: Path, num_classes: int, entry: dict) -> tuple[dict, shards.ShardIndex]:
    """A shard this pack finished before (``entry``: its ``shards.json`` entry then), indexed again."""
    return entry, shards.index_shard(out / shard.name, num_classes)


def _entry(path: Path, found: shards.ShardIndex) -> dict:
    return {"name": path.name, "images": len(found.keys), "bytes": path.stat().st_size, "sha256": shards.sha256(path)}


def pack(source: str | Path, out: str | Path, shard_mib: float = 256, workers: int = 1,
         progress: bool = True, max_side: int | None = None, quality: int | None = None) -> dict:
    """Pack ``source`` into ``out`` (module docstring); returns ``shards.json``'s content (with
    ``kept``: the shards a continued pack kept). ``max_side`` (pixels): images with a longer shorter
    side stored resized to it, as JPEGs of ``quality`` (1-95, default 90; :func:`stored_image`). Raises
    :class:`FixresError` for a bad data folder or value, an ``out`` it must not write into
    (:func:`_check_destination`), another pack into ``out`` running, or a file it cannot read or write."""
    source, out = Path(source), Path(out)
    if not math.isfinite(shard_mib) or shard_mib <= 0:
        raise FixresError(f"--shard-size must be a positive number of MiB; got {shard_mib}")
    if quality is not None and max_side is None:
        raise FixresError("--quality is the JPEG quality of the images --max-side resizes: give --max-side too")
    if max_side is not None and not 1 <= (quality := QUALITY if quality is None else quality) <= 95:
        raise FixresError(f"--quality must be 1 to 95 (Pillow's JPEG qualities; above 95 only grows the files); "
                          f"got {quality}")
    classes, planned = plan(source, int(shard_mib * 2 ** 20), max_side, quality)
    state = _check_destination(source, out)
    with _locked(out):
        try:
            return _pack(source, out, classes, planned, state, workers, progress)
        except OSError as exc:
            raise FixresError(f"cannot pack into {out}: {exc.strerror or exc}"
                              f"{f' ({exc.filename})' if exc.filename else ''}; run the command again to "
                              "continue") from None


def _pack(source: Path, out: Path, classes: list[str], planned: dict[str, list[ShardPlan]], state: dict,
          workers: int, progress: bool) -> dict:
    remove_stale_temporaries(out)  # of a killed pack
    (out / shards.MANIFEST).unlink(missing_ok=True)  # incomplete from here until the new one is written
    state = {"source": str(source.resolve()), "shards": state.get("shards", {})}
    jobs = [(split, shard, shard.digest()) for split in shards.SPLITS for shard in planned[split]]
    results, kept = {}, 0
    with _workers(workers) as pool:
        futures = {}
        for split, shard, digest in jobs:
            done = state["shards"].get(shard.name, {})
            if done.get("digest") == digest and _size(out / shard.name) == done["entry"]["bytes"]:
                futures[pool.submit(kept_shard, shard, out, len(classes), done["entry"])] = (shard.name, digest, True)
            else:
                futures[pool.submit(write_shard, shard, out, len(classes))] = (shard.name, digest, False)
        for (name, digest, was_kept), (entry, found) in _finished(futures, "packing", progress):
            results[name], kept = (entry, found), kept + was_kept
            state["shards"][name] = {"digest": digest, "entry": entry}
            write_private(out / STATE, json.dumps(state), SHARED)
    first = next(shard for split in shards.SPLITS for shard in planned[split])
    manifest = _write_indexes(out, {"format": shards.FORMAT, "source": state["source"], "classes": classes,
                                    "max_side": first.max_side, "quality": first.quality},
                              {split: [results[shard.name] for shard in planned[split]] for split in shards.SPLITS})
    named = {shard.name for _, shard, _ in jobs}
    for old in out.glob("*.tar"):
        if old.name not in named:  # of an earlier pack of this source with another shard size
            old.unlink()
    return {**manifest, "kept": kept}


@contextlib.contextmanager
def _workers(count: int):
    """A pool of ``count`` worker processes that end with this one, however it ends; leaving the block
    waits for them, and a failure (the first problem ends a command) cancels the jobs not started."""
    pool = concurrent.futures.ProcessPoolExecutor(max(1, count), initializer=startup.die_with_parent)
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _finished(futures: dict, desc: str, progress: bool, in_order: bool = False):
    """``(futures[future], its result)`` for each future of ``futures`` as it finishes (``in_order``: in
    their order, so that a failure named is the first shard's), with a progress bar of shards; the
    first failure is raised."""
    for future in tqdm(futures if in_order else concurrent.futures.as_completed(futures), total=len(futures),
                       desc=desc, unit="shard", disable=not progress):
        yield futures[future], future.result()


def _write_indexes(out: Path, manifest: dict, entries: dict[str, list[tuple[dict, shards.ShardIndex]]]) -> dict:
    """Write each split's index (``entries``: its shards' ``shards.json`` entries and indexes, in
    order), then ``shards.json``: ``manifest`` with the splits, returned. Each file atomically
    (:func:`fixres_dist.io.write_private`); raises OSError."""
    manifest = {**manifest, "splits": {}}
    for split in shards.SPLITS:
        index_path = out / shards.index_name(split)
        write_private(index_path, lambda f, e=entries[split]: np.savez(f, **_index_arrays(e)), SHARED)
        manifest["splits"][split] = {"shards": [entry for entry, _ in entries[split]],
                                     "index_sha256": shards.sha256(index_path)}
    write_private(out / shards.MANIFEST, json.dumps(manifest, indent=1), SHARED)
    return manifest


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


@contextlib.contextmanager
def _locked(out: Path):
    """One pack into ``out`` at a time (``flock`` on ``out/.pack.lock``, released when the process ends)."""
    descriptor = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not locks.try_lock(descriptor, out / LOCK, "a second pack into it at once would not be refused"):
            raise FixresError(f"another pack into {out} is running; wait for it to end")
        yield
    finally:
        os.close(descriptor)


def _check_destination(source: Path, out: Path) -> dict:
    """``out`` made if need be; returns what an earlier pack of ``source`` into it recorded (:data:`STATE`;
    empty for a new folder). Raises :class:`FixresError` for ``out`` inside ``source``, a file, a
    folder holding other files or shards this command did not write, or a pack of another source."""
    if out.resolve().is_relative_to(source.resolve()):
        raise FixresError(f"cannot pack into {out}: it is inside the data folder {source} (it would become part of "
                          "the data); pack into a folder outside it")
    try:
        out.mkdir(parents=True, exist_ok=True)
        names = [p.name for p in out.iterdir()]
    except OSError as exc:
        raise FixresError(f"cannot pack into {out}: {exc.strerror or exc}") from None
    foreign = [name for name in names if not OURS.fullmatch(name)]
    if foreign:
        raise FixresError(f"{out} holds files that are not a pack's ({', '.join(sorted(foreign)[:3])}): pack into a "
                          "new or empty folder")
    try:
        state = json.loads((out / STATE).read_text())
        earlier = state["source"]
    except FileNotFoundError:
        if any(name.endswith((".tar", ".npz", ".json")) for name in names):
            raise FixresError(f"{out} holds shards that this command did not write (no {STATE}): pack into a new or "
                              "empty folder") from None
        return {}
    except (OSError, ValueError, KeyError, TypeError):
        raise FixresError(f"{out / STATE} is damaged: pack into a new or empty folder") from None
    if earlier != str(source.resolve()):
        raise FixresError(f"{out} holds a pack of {earlier}, not of {source}: packing would replace that data (and a "
                          "job resuming on it would refuse it); pack into a new folder, or remove this one first")
    return state


def _index_arrays(entries: list[tuple[dict, shards.ShardIndex]]) -> dict[str, np.ndarray]:
    found = [index for _, index in entries]
    return {"shard": np.concatenate([np.full(len(f.keys), n, np.int32) for n, f in enumerate(found)]),
            "offset": np.concatenate([f.offsets for f in found]), "size": np.concatenate([f.sizes for f in found]),
            "label": np.concatenate([f.labels for f in found]),
            "key": np.array([shards.encoded_key(key) for f in found for key in f.keys], dtype=bytes)}


def verify(out: str | Path, workers: int = 1, progress: bool = True) -> str:
    """Read every shard of the packed folder ``out`` (module docstring); returns a one-line summary.
    Raises :class:`FixresError` naming the first shard or index that does not match."""
    out = Path(out)
    if not shards.is_packed(out):
        raise FixresError(f"{out} is not a packed data folder (no {shards.MANIFEST}, no tar shards)")
    data = shards.open_packed(out)
    made = shards.origin(data.manifest)
    jobs = [(split, number, entry) for split in shards.SPLITS
            for number, entry in enumerate(data.manifest["splits"][split]["shards"])]
    try:
        with _workers(workers) as pool:  # the first problem ends it: no queued shard is read
            futures = [pool.submit(_check_shard, out / entry["name"], entry["sha256"], len(data.classes), made)
                       for _, _, entry in jobs]
            for (split, number, entry), future in tqdm(zip(jobs, futures), total=len(jobs), desc="verifying",
                                                       unit="shard", disable=not progress):
                found = future.result()
                index = data.indexes[split]
                mine = index["shard"] == number
                if (list(index["key"][mine]) != [shards.encoded_key(key) for key in found.keys]
                        or not np.array_equal(index["offset"][mine], found.offsets)
                        or not np.array_equal(index["size"][mine], found.sizes)
                        or not np.array_equal(index["label"][mine], found.labels)):
                    raise FixresError(f"shard {out / entry['name']} does not match the index "
                                      f"{shards.index_name(split)}: {made[1]}")
    except OSError as exc:
        raise FixresError(f"cannot read {exc.filename or out}: {exc.strerror or exc}") from None
    images = sum(data.images(split) for split in shards.SPLITS)
    return f"{out}: verified {plural(len(jobs), 'shard')}, {images:,} images, {len(data.classes)} classes"


def _check_shard(path: Path, digest: str, num_classes: int, made: tuple[str, str]) -> shards.ShardIndex:
    if shards.sha256(path) != digest:
        raise FixresError(f"shard {path}: its SHA-256 is not the one in {shards.MANIFEST} (changed or damaged since "
                          f"it was {made[0]}): {made[1]}")
    return shards.index_shard(path, num_classes)


def index(folder: str | Path, train: str | None = None, val: str | None = None, classes: str | Path | None = None,
          workers: int = 1, progress: bool = True) -> dict:
    """Index the WebDataset shards another tool wrote into ``folder``, in place (module docstring):
    ``train``/``val``, patterns of their file names (default: :func:`shard_names`); ``classes``, a
    file of class names (:func:`read_classes`; default: the labels' numbers). Returns ``shards.json``'s
    content, with ``ignored``: the other ``.tar`` files. Raises :class:`FixresError`, having written
    nothing, for a missing folder, no train or no val shards, a folder ``pack`` wrote or files there
    this command did not write, a folder it cannot write, a bad class list, a bad shard (a damaged tar,
    a sample without image or label: :func:`fixres_dist.data.shards.index_shard`), a class without
    training images, a val label that is no training class."""
    folder = Path(folder)
    names = shard_names(folder, {"train": train, "val": val})
    _check_indexable(folder)
    class_list = read_classes(Path(classes)) if classes is not None else None
    try:
        found = _index_shards(folder, names, None if class_list is None else len(class_list), workers, progress)
        class_list = _checked_classes(folder, found, class_list, classes)
        manifest = _write_index(folder, class_list, found)
    except OSError as exc:
        raise FixresError(f"cannot index {folder}: {exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}"
                          "; run the command again") from None
    taken = set(names["train"] + names["val"])
    return {**manifest, "ignored": sorted(n for n in names["all"] if n.endswith(".tar") and n not in taken)}


def shard_names(folder: Path, patterns: dict[str, str | None]) -> dict[str, list[str]]:
    """The shards of each split in ``folder``, by file name in natural order (numbers by value): those
    matching the split's pattern (:mod:`fnmatch`), by default the ``*.tar`` files whose name contains the
    split's (``val`` also in ``validation``; case aside); ``"all"``: every file name there, hidden
    files aside. Raises :class:`FixresError` for a missing folder, a split without shards, compressed
    shards (:func:`fixres_dist.data.shards.refuse_compressed`: not read, and by default they would be
    left out), a pattern with a ``/`` or matching a file that is not ``.tar``, a shard taken for both
    splits."""
    if not folder.is_dir():
        raise FixresError(f"{folder} is {'not a folder' if folder.exists() else 'missing'}: give the folder that "
                          "holds the shards")
    try:
        files = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and p.is_file())
    except OSError as exc:
        raise FixresError(f"cannot read the folder {folder}: {exc.strerror or exc}") from None
    found = {"all": files}
    for split, pattern in patterns.items():
        if pattern is not None and "/" in pattern:
            raise FixresError(f"--{split} {pattern!r}: a pattern of file names in {folder}, without a '/'")
        found[split] = sorted((n for n in files if fnmatch.fnmatchcase(n, pattern)) if pattern is not None else
                              (n for n in files if n.endswith(".tar") and split in n.lower()), key=_natural)
        if pattern is None:  # compressed shards of the split would be left out
            shards.refuse_compressed(folder, [n for n in files if split in n.lower()])
        looked = f"no file matching {pattern!r}" if pattern is not None else f"no *.tar file named *{split}*"
        if not found[split]:
            raise FixresError(f"no {split} shards in {folder} ({looked}); choose them with --{split} GLOB")
        shards.refuse_compressed(folder, found[split])
        odd = [n for n in found[split] if not shards.is_shard_name(n)]
        if odd:
            raise FixresError(f"--{split} {pattern!r} matches {folder / odd[0]}, which is not a .tar shard")
    both = sorted(set(found["train"]) & set(found["val"]))
    if both:
        raise FixresError(f"shard {folder / both[0]} would be both a train and a val shard; choose them with --train "
                          "and --val")
    return found


def _natural(name: str) -> list:
    return [int(part) if number % 2 else part for number, part in enumerate(re.split(r"([0-9]+)", name))]


def read_classes(path: Path) -> list[str]:
    """The class names of a ``--classes`` file: one a line (spaces around it dropped), line 1 for
    label 0; UTF-8. Raises :class:`FixresError` naming the file and line for an unreadable file, no
    names, an empty line among them, a name given twice."""
    try:
        names = [line.strip() for line in path.read_text(encoding="utf-8-sig").splitlines()]
    except (OSError, UnicodeError) as exc:
        raise FixresError(f"cannot read the class list {path} ({getattr(exc, 'strerror', None) or first_line(exc)}): "
                          "give a UTF-8 text file with one class name per line") from None
    while names and not names[-1]:
        names.pop()
    if not names:
        raise FixresError(f"the class list {path} holds no class names: give one per line, in label order")
    seen: dict[str, int] = {}
    for line, name in enumerate(names, 1):
        if not name:
            raise FixresError(f"{path}, line {line}: empty; one class name per line, line 1 for label 0")
        if name in seen:
            raise FixresError(f"{path}, line {line}: class {name!r} again (line {seen[name]}); class names are unique")
        seen[name] = line
    return names


def _check_indexable(folder: Path) -> None:
    """Raises :class:`FixresError` for a folder ``pack`` wrote, a ``shards.json`` or index file there
    that no earlier ``index`` wrote (never replaced), or a folder this process cannot write into."""
    if (folder / STATE).exists():
        raise FixresError(f"{folder} was written by the pack command ({STATE}) and has its index: check it with "
                          f"python -m fixres_dist.data.packing verify {folder}")
    for name in (shards.MANIFEST, *map(shards.index_name, shards.SPLITS)):
        if not _replaceable(folder / name):
            raise FixresError(f"{folder / name} was not written by this index command: indexing would replace it; "
                              f"{_elsewhere(folder)}")
    probe = temporary_name(folder / shards.MANIFEST)
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        probe.unlink()
    except OSError as exc:
        raise FixresError(f"cannot write the index into {folder} ({exc.strerror or exc}; a shared dataset's "
                          f"read-only copy?): {_elsewhere(folder)}") from None


def _elsewhere(folder: Path) -> str:
    return (f"index a copy of the shards, or a folder of links to them (mkdir NEW && ln -s {folder.resolve()}/*.tar "
            "NEW/), instead")


def _replaceable(path: Path) -> bool:
    """Whether ``path`` (``shards.json`` or an index) is absent or an earlier index's (of a killed one)."""
    try:
        if path.name == shards.MANIFEST:
            return json.loads(path.read_text()).get("indexed") is True
        with np.load(path) as arrays:
            return set(arrays.files) == INDEX_ARRAYS
    except FileNotFoundError:
        return True
    except Exception:  # whatever cannot be read as ours (numpy and json raise many types) is not ours
        return False


def indexed_shard(path: Path, num_classes: int | None) -> tuple[dict, shards.ShardIndex]:
    """The shard at ``path`` indexed (:func:`fixres_dist.data.shards.index_shard`) and its
    ``shards.json`` entry (its SHA-256 read)."""
    found = shards.index_shard(path, num_classes)
    return _entry(path, found), found


def _index_shards(folder: Path, names: dict[str, list[str]], num_classes: int | None, workers: int,
                  progress: bool) -> dict[str, list[tuple[dict, shards.ShardIndex]]]:
    places = [(split, number, name) for split in shards.SPLITS for number, name in enumerate(names[split])]
    results = {}
    with _workers(min(workers, len(places))) as pool:
        futures = {pool.submit(indexed_shard, folder / name, num_classes): (split, number)
                   for split, number, name in places}
        for place, result in _finished(futures, "indexing", progress, in_order=True):
            results[place] = result
    return {split: [results[split, number] for number in range(len(names[split]))] for split in shards.SPLITS}


def _checked_classes(folder: Path, found: dict[str, list[tuple[dict, shards.ShardIndex]]],
                     class_list: list[str] | None, classes_file) -> list[str]:
    """``class_list``, or the numbers up to the largest train label; raises :class:`FixresError` for a
    split without samples, a class without training images, a val label that is no training class."""
    for split in shards.SPLITS:
        if not sum(len(index.keys) for _, index in found[split]):
            raise FixresError(f"the {split} shards of {folder} hold no samples ({found[split][0][0]['name']}, ...)")
    present = np.unique(np.concatenate([index.labels for _, index in found["train"]]))
    count = int(present[-1]) + 1 if class_list is None else len(class_list)
    gaps = np.flatnonzero(present != np.arange(len(present)))
    missing = int(gaps[0]) if gaps.size else len(present) if len(present) < count else None
    if missing is not None and class_list is not None:
        raise FixresError(f"class {class_list[missing]!r} (line {missing + 1} of {classes_file}) has no training "
                          f"images in the train shards of {folder}: every class needs some")
    if missing is not None:
        raise FixresError(f"no training sample has label {missing}, yet the train shards' labels go up to "
                          f"{count - 1} (the classes are the numbers 0 to {count - 1}): every class needs training "
                          "images")
    for entry, index in found["val"]:
        beyond = np.flatnonzero(index.labels >= count)
        if beyond.size:
            raise FixresError(f"shard {folder / entry['name']}, sample {index.keys[beyond[0]]}: label "
                              f"{index.labels[beyond[0]]} is not a class of the train shards (0 to {count - 1})")
    return class_list if class_list is not None else [str(number) for number in range(count)]


def _write_index(folder: Path, classes: list[str], found: dict[str, list[tuple[dict, shards.ShardIndex]]]) -> dict:
    """The index files and ``shards.json`` written into ``folder``; any failure, Ctrl-C included, leaves
    none of them (the folder is not indexed then, and the command is run again)."""
    written = [shards.MANIFEST, *map(shards.index_name, shards.SPLITS)]
    for name in written:
        remove_stale_temporaries(folder, f"{name}.*")  # of a killed index
    (folder / shards.MANIFEST).unlink(missing_ok=True)  # not indexed from here until the new one is written
    try:
        return _write_indexes(folder, {"format": shards.FORMAT, "indexed": True, "classes": classes}, found)
    except BaseException:
        for name in written:
            (folder / name).unlink(missing_ok=True)
        raise


def _interrupted(signum, frame):
    """SIGTERM ends the command as Ctrl-C does: one line (the workers end with it)."""
    raise KeyboardInterrupt


def _quality(text: str) -> int:
    """``--quality``: a whole number from 1 to 95 (above 95 Pillow's JPEGs only grow)."""
    value = positive_int(text)
    if value > 95:
        raise argparse.ArgumentTypeError(f"must be 1 to 95 (above 95 the files only grow), got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m fixres_dist.data.packing",
                                     description="pack a data folder into WebDataset tar shards, index the shards "
                                                 "another tool wrote, or verify either")
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="pack SOURCE (train/ and val/ class folders) into OUT")
    packing.add_argument("source", help="the data folder (train/ and val/ with one folder per class)")
    packing.add_argument("out", help="the folder to write the shards into (new, or a pack to continue)")
    packing.add_argument("--shard-size", type=float, default=256,
                         help="MiB of image files per shard (default 256; a tar adds 1 KiB per image)")
    packing.add_argument("--max-side", type=positive_int, metavar="PX",
                         help="store each image whose shorter side is longer resized to PX pixels on that side (a "
                              "JPEG; the others as they are): cheaper to read and decode, enough for test "
                              "resolutions up to PX x crop ratio (docs/data_at_scale.md)")
    packing.add_argument("--quality", type=_quality, metavar="Q",
                         help=f"JPEG quality of the images --max-side resizes, 1-95 (default {QUALITY})")
    indexing = commands.add_parser("index", help="index the WebDataset shards another tool wrote into FOLDER, "
                                                 "in place (writes only the index files and shards.json there)")
    indexing.add_argument("folder", help="the folder of the shards (samples <key>.jpg or .png... and <key>.cls)")
    for split in shards.SPLITS:
        indexing.add_argument(f"--{split}", metavar="GLOB", help=f"the {split} shards: file names in FOLDER "
                              f"matching GLOB (default: the *.tar files whose name contains {split!r})")
    indexing.add_argument("--classes", metavar="FILE", help="the class names, one per line, line 1 for label 0 "
                          "(default: the labels' numbers name the classes)")
    checking = commands.add_parser("verify", help="read every shard of OUT and check it")
    checking.add_argument("out", help="a packed or indexed folder")
    for sub in (packing, indexing, checking):
        sub.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                         help="processes that pack or read shards at once (default: the CPUs, at most 8)")
        sub.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _counts(manifest: dict) -> str:
    """``3,000 train images in 2 shards, 1,000 val images in 1 shard``, of ``shards.json``'s content."""
    written = {split: manifest["splits"][split]["shards"] for split in shards.SPLITS}
    return ", ".join(f"{sum(s['images'] for s in written[split]):,} {split} images in "
                     f"{plural(len(written[split]), 'shard')}" for split in shards.SPLITS)


def _run_pack(args) -> str:
    manifest = pack(args.source, args.out, args.shard_size, args.workers, not args.no_progress, args.max_side,
                    args.quality)
    kept = f" ({manifest['kept']} already written, kept)" if manifest["kept"] else ""
    return f"{args.out}: {_counts(manifest)}{kept}, {len(manifest['classes'])} classes; use it as --data-path"


def _run_index(args) -> str:
    manifest = index(args.folder, args.train, args.val, args.classes, args.workers, not args.no_progress)
    count = len(manifest["classes"])
    if args.classes is None:
        say(f"fixres_dist: note: no --classes: the classes are named by their numbers, 0 to {count - 1}, and a "
            "checkpoint knows them by number only; give their names with --classes FILE")
    ignored = manifest["ignored"]
    others = (f" ({plural(len(ignored), 'other .tar file')} left out: {', '.join(ignored[:3])}"
              f"{', ...' if len(ignored) > 3 else ''})") if ignored else ""
    return f"{args.folder}: indexed {_counts(manifest)}, {count} classes{others}; use it as --data-path"


def _run_verify(args) -> str:
    return verify(args.out, args.workers, not args.no_progress)


RUN = {"pack": _run_pack, "index": _run_index, "verify": _run_verify}
AFTER_INTERRUPT = {"pack": "; run the same command again to continue (finished shards are kept)",
                   "index": "; the shards are untouched and no new index was written: run the same command again"}


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status: 0, 1 after a one-line error, 130
    after Ctrl-C or SIGTERM."""
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "quality", None) is not None and args.max_side is None:
        parser.error("--quality is the JPEG quality of the images --max-side resizes: give --max-side too")
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        print(RUN[args.command](args))
    except FixresError as exc:
        say(f"fixres_dist: {exc}")
        return 1
    except KeyboardInterrupt:
        say(f"fixres_dist: {args.command} interrupted{AFTER_INTERRUPT.get(args.command, '')}")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
