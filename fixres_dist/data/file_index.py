"""The file index of a data root: the folders walked once per dataset version, for every rank and run.

Walking ``train/`` and ``val/`` (:func:`fixres_dist.data.pipeline.scan_split`) lists every folder and costs
minutes for ImageNet's 1.28 M files on a network file system, and every rank and every run did it
again. The index keeps the walk's result in the shared folder; the launcher (or rank 0) builds it
when it is missing or stale, and every rank and later run of any job loads it and checks it in a
fraction of a second.

**What it holds** (:class:`DataIndex`), per split: the class names, each class's image count, the
image files relative to the split folder in ImageFolder's order and the hidden entries skipped:
exactly what :func:`~fixres_dist.data.pipeline.scan_split` gives, so the datasets made from it are those of
a walk (same ``samples``, ``classes``, ``class_to_idx``, ``hidden``); and every folder walked
(each split, class and sub-folder, links followed) with its inode number and change time (ctime).

**Where**: ``<shared folder>/file_index/<20 hex digits of the SHA-256 of the resolved data
root>.npz`` (:func:`index_file`), in an owner-only folder, written atomically and owner-only
(:func:`fixres_dist.io.write_private`: temporary file, fsync, rename), so a reader sees a complete
old or new index, and builders racing on the same data (two jobs started together) are safe: the
last rename wins, with the same content. **Format**: a compressed numpy ``.npz`` without pickles
(read with ``allow_pickle=False``): names joined by NUL bytes (no file name holds one) as uint8
arrays of their file-system bytes (any name round-trips, also undecodable ones), counts int64,
inodes uint64, times int64 ns, and a JSON ``meta`` (format version, resolved root, when the folders
were listed). ImageNet's 1.33 M paths (with names like its own) take 4.8 MB and load in 0.3 s,
and a rank makes both datasets from them in 0.4 s more (2 cores; ``benchmarks/file_index.py``).

**Validity: the dataset version is the folders' stat.** Adding, removing or renaming an entry of a
folder changes that folder's change time (ctime, which unlike the modification time no ``touch
-d``, ``cp -a``, ``rsync -a`` or ``tar`` can set back), so the index is current as long as every
folder it walked still has the inode and the change time (ns) recorded (one ``stat`` per folder:
ImageNet has 2,002 folders beside its 1.28 M files), and nothing else needs checking. A folder
replaced by another (``mv``) has another inode. A folder changed within
:data:`RACY_MARGIN_NS` of the walk could have changed again in the same tick of a coarse clock
(1 s on some file systems) without a new time: such "racy" folders are listed again at each check
and compared with the index (as git does with racily clean files), and the launcher rewrites the
index once they have settled. Any difference, a folder gone, an unreadable, truncated, corrupt or
older-format index: the index is built again. Not noticed, by design: a file rewritten in place (the
index holds paths, not contents), and a file behind a symbolic link to a file that is deleted
(the link stays listed and the image is named as unreadable when read); on NFS a change made on
another machine shows once the client's attribute cache expires (``acdirmin``, 30 s by default).
On file systems whose inode numbers change between mounts (some FUSE file systems), every check
fails and each run walks the folders, as without an index.

**Who builds**: :func:`data_index` loads the index if it is valid, else walks the folders; only
:meth:`DataIndex.save` writes, which the launcher's preflight (:func:`fixres_dist.entry.launch.preflight`)
calls once the run's inputs are checked, and rank 0 in the Trainer; other ranks only load and check
(and walk for themselves if the data changed meanwhile). A cache folder that cannot be written is
no error: the run goes on with the walked index, and its log line carries a warning.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile
import zlib
from pathlib import Path

import attrs
import numpy as np

from fixres_dist import io
from fixres_dist.data import pipeline

FORMAT_VERSION = 2  # 2: folders' change times (ctime), no longer their modification times
SPLITS = ("train", "val")
INDEX_SUFFIX = ".npz"
# A folder modified less than this before its walk began may have changed again without a new
# change time (coarse clocks: 1 s on some file systems; NFS takes the server's clock, so
# this also bounds the client/server clock skew tolerated).
RACY_MARGIN_NS = 3_000_000_000
STALE_TEMPORARY_S = 3600  # a temporary index file older than this was left by a killed builder


def index_file(cache_folder: str | Path, root: str | Path) -> Path:
    """Where the index of data root ``root`` lives in ``cache_folder``: one file per resolved root
    (``./data``, ``data/`` and a link to it share one)."""
    digest = hashlib.sha256(os.fsencode(os.path.realpath(root))).hexdigest()[:20]
    return Path(cache_folder) / f"{digest}{INDEX_SUFFIX}"


def _pack(names: list[str]) -> np.ndarray:
    """Names -> one uint8 array of their file-system bytes joined by NUL."""
    return np.frombuffer(os.fsencode("\0".join(names)), dtype=np.uint8)


def _unpack(array: np.ndarray) -> list[str]:
    text = os.fsdecode(array.tobytes())
    return text.split("\0") if text else []


@attrs.frozen
class SplitIndex:
    """One split of a :class:`DataIndex`. ``classes``: class folder names, sorted; ``counts``: the
    number of images of each; ``files``: the image paths relative to the split folder
    (``<class>/[sub-folders/]<name>``), class after class in ImageFolder's order; ``hidden``: the
    hidden entries skipped, relative to the split folder, sorted."""

    classes: list[str]
    counts: list[int]
    files: list[str]
    hidden: list[str]


@attrs.define(eq=False)
class DataIndex:
    """The index of one data root (module docstring): what :func:`fixres_dist.data.pipeline.scan_split`
    gives for ``train/`` and ``val/``, the folders walked and their stat.

    ``root``: the data root as the caller gave it (the paths :meth:`scan` returns start with it);
    ``folders``: every folder walked, relative to ``root``; ``inodes`` (uint64) and ``ctimes``
    (int64, ns): their ``stat`` just before they were listed; ``listed_at_ns``: the wall clock (ns
    since the epoch) when the walk began. Then how this process got it: ``file`` the cache file
    (None: no cache folder), ``built`` (walked now; else loaded), ``reason`` why it was walked,
    ``seconds`` the time taken (walk, or load and check), ``unsaved`` (walked or refreshed and not
    written yet: :meth:`save`), ``warning`` (the cache could not be written).
    """

    root: Path
    splits: dict[str, SplitIndex]
    folders: list[str]
    inodes: np.ndarray
    ctimes: np.ndarray
    listed_at_ns: int
    file: Path | None = None
    built: bool = True
    reason: str = ""
    seconds: float = 0.0
    unsaved: bool = True
    warning: str = ""

    @property
    def file_count(self) -> int:
        """Images in both splits."""
        return sum(len(split.files) for split in self.splits.values())

    @property
    def train_images(self) -> int:
        """The images of ``train/``."""
        return sum(len(paths) for paths in self.scan("train").images.values())

    def identity(self) -> dict:
        """What a resumed run must see again (its checkpoint records it): the images of each split and a
        SHA-256 (hex) of their names, class by class, relative to the split folder."""
        digest = hashlib.sha256()
        for split in SPLITS:
            index = self.splits[split]
            digest.update(json.dumps([split, list(index.classes), list(map(int, index.counts))]).encode())
            digest.update("\0".join(index.files).encode())
        return {**{split: len(self.splits[split].files) for split in SPLITS}, "sha256": digest.hexdigest()}

    def dataset(self, split: str) -> pipeline.ImageFolder:
        """Split ``split`` (``train`` or ``val``) as a dataset, from this index (no walk)."""
        return pipeline.image_folder(self.root, split, self)

    def scan(self, split: str) -> pipeline.SplitScan:
        """What :func:`fixres_dist.data.pipeline.scan_split` gives for ``root/split``, without walking it:
        class name -> image paths (``str(Path(root) / split) + "/" + relative path``, as the walk
        writes them), and the hidden entries' paths. Raises ``KeyError`` for a split other than
        ``train`` and ``val``."""
        index = self.splits[split]
        prefix = os.path.join(str(self.root / split), "")
        paths = [prefix + name for name in index.files]
        images, start = {}, 0
        for name, count in zip(index.classes, index.counts):
            images[name] = paths[start:start + count]
            start += count
        return pipeline.SplitScan(images, [prefix + name for name in index.hidden])

    def racy_folders(self, listed_at_ns: int | None = None) -> list[int]:
        """Positions in ``folders`` of those modified within RACY_MARGIN_NS of ``listed_at_ns``
        (default the walk's): their time alone cannot prove that the index lists them as they are."""
        listed_at = self.listed_at_ns if listed_at_ns is None else listed_at_ns
        return np.flatnonzero(self.ctimes >= listed_at - RACY_MARGIN_NS).tolist()

    def describe(self) -> str:
        """The run's log line: walked (why, how many files, seconds) or reused, and where it is kept."""
        what = f"{self.file_count:,} files in {len(self.splits['train'].classes):,} classes of {self.root}"
        where = f" ({self.file})" if self.file is not None else ""
        if self.built:
            verb = f"rebuilt ({self.reason})" if self.reason else "built"
            line = f"data: file index {verb}: walked {what} in {self.seconds:.2f} s{where}"
        else:
            line = (f"data: file index reused: {what}, loaded and checked ({len(self.folders):,} folders unchanged) "
                    f"in {self.seconds:.2f} s{where}")
        return line + (f"; warning: {self.warning}" if self.warning else "")

    def save(self) -> None:
        """Write the index to its cache file if it was walked or refreshed (atomically, owner-only,
        in an owner-only ``file_index`` folder created if need be). Never raises for the cache: if it
        cannot be written, ``warning`` says so (:meth:`describe`) and the run goes on."""
        if not self.unsaved or self.file is None:
            return
        folder = self.file.parent
        try:
            io.private_folder(folder)  # an index is trusted only in a folder no one else can write to
            _remove_stale_temporaries(folder)
            io.write_private(self.file, lambda f: np.savez_compressed(f, **self._arrays()))
        except OSError as exc:
            self.warning = (f"cannot write the file index in {folder} ({exc.strerror or type(exc).__name__}): "
                            "not cached, the next run walks the folders again")
            return
        self.unsaved = False

    def _arrays(self) -> dict[str, np.ndarray]:
        meta = {"format": FORMAT_VERSION, "root": os.path.realpath(self.root), "listed_at_ns": self.listed_at_ns,
                "splits": list(self.splits)}
        arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), "folders": _pack(self.folders),
                  "inodes": self.inodes.astype(np.uint64), "ctimes": self.ctimes.astype(np.int64)}
        for name, split in self.splits.items():
            arrays.update({f"{name}_classes": _pack(split.classes),
                           f"{name}_counts": np.asarray(split.counts, np.int64),
                           f"{name}_files": _pack(split.files), f"{name}_hidden": _pack(split.hidden)})
        return arrays


def build(root: str | Path) -> DataIndex:
    """Walk ``root``'s ``train/`` and ``val/`` (:func:`fixres_dist.data.pipeline.scan_split`) and record every
    folder's stat just before it is listed. Raises :class:`~fixres_dist.errors.FixresError` if
    ``root`` lacks a split folder (:func:`fixres_dist.data.pipeline.check_layout`) or holds a symbolic-link
    loop (naming it), ``OSError`` if a folder cannot be listed."""
    root = pipeline.check_layout(root)
    start, listed_at = time.monotonic(), time.time_ns()
    folders, inodes, ctimes, splits = [], [], [], {}
    for name in SPLITS:
        split_folder = str(root / name)  # every path the walk gives starts with it

        def visit(path: str, stat: os.stat_result, name=name, cut=len(split_folder)) -> None:
            folders.append(name + path[cut:])
            inodes.append(stat.st_ino)
            ctimes.append(stat.st_ctime_ns)

        scan = pipeline.scan_split(split_folder, visit)
        cut = len(os.path.join(split_folder, ""))
        classes = list(scan.images)  # sorted by the walk
        splits[name] = SplitIndex(classes, [len(scan.images[c]) for c in classes],
                                  [path[cut:] for c in classes for path in scan.images[c]],
                                  [path[cut:] for path in scan.hidden])
    return DataIndex(root, splits, folders, np.array(inodes, dtype=np.uint64), np.array(ctimes, dtype=np.int64),
                     listed_at, seconds=time.monotonic() - start)


def _writable_by_others(path: Path) -> bool:
    """Whether another user could have written ``path``: group or others may write it, or it is not
    this process's user's (raises OSError, FileNotFoundError included, if it cannot be read)."""
    status = path.stat()
    return bool(status.st_mode & 0o022) or status.st_uid != os.geteuid()


class StaleIndex(Exception):
    """The index file is not that of this data, or the data changed since (the message says how)."""


def load(file: str | Path, root: str | Path) -> DataIndex:
    """Read the index of ``root`` from ``file`` and check that it is current (module docstring).

    Returns a :class:`DataIndex` (``built`` False); one whose racy folders were listed again and had
    settled has ``unsaved`` True (the launcher rewrites it). Raises ``StaleIndex`` with the reason when it
    is missing, unreadable, corrupt, of another format or root, or the data changed.
    """
    root, file = Path(root), Path(file)
    checked_at = time.time_ns()
    try:
        if _writable_by_others(file) or _writable_by_others(file.parent):  # the file first: missing is a first build
            raise StaleIndex("it or its folder could be written by other users (the index is rewritten "
                             "owner-only)")
        with np.load(file, allow_pickle=False) as arrays:
            meta = json.loads(arrays["meta"].tobytes())
            if not isinstance(meta, dict):
                raise ValueError("meta is not an object")
            if meta.get("format") != FORMAT_VERSION or meta.get("root") != os.path.realpath(root):
                raise StaleIndex("it is of another format or data root")
            splits = {name: SplitIndex(_unpack(arrays[f"{name}_classes"]), arrays[f"{name}_counts"].tolist(),
                                       _unpack(arrays[f"{name}_files"]), _unpack(arrays[f"{name}_hidden"]))
                      for name in meta["splits"]}
            index = DataIndex(root, splits, _unpack(arrays["folders"]), arrays["inodes"], arrays["ctimes"],
                              int(meta["listed_at_ns"]), file=file, built=False, unsaved=False)
    except FileNotFoundError:
        raise StaleIndex("") from None  # none yet: a first build, not a rebuild
    except OSError as exc:
        raise StaleIndex(f"its file was unreadable: {exc.strerror or type(exc).__name__}") from None
    except (ValueError, KeyError, TypeError, AttributeError, EOFError, zipfile.BadZipFile, zlib.error):
        raise StaleIndex("its file was corrupt") from None
    if (tuple(index.splits) != SPLITS or not len(index.inodes) == len(index.folders) == len(index.ctimes)
            or any(sum(s.counts) != len(s.files) or len(s.counts) != len(s.classes) for s in index.splits.values())):
        raise StaleIndex("its file was corrupt")
    _check_folders(index)
    racy = index.racy_folders()
    if racy:
        _check_listings(index, [index.folders[i] for i in racy])
        index.unsaved = len(index.racy_folders(checked_at)) < len(racy)  # settled: rewrite with the new time
        if index.unsaved:
            index.listed_at_ns = checked_at
    return index


def _check_folders(index: DataIndex) -> None:
    """Every folder walked still has the inode and change time recorded; else ``StaleIndex``."""
    for relative, inode, ctime in zip(index.folders, index.inodes.tolist(), index.ctimes.tolist()):
        try:
            stat = os.stat(index.root / relative)
        except OSError:
            raise StaleIndex(f"{relative} is gone") from None
        if stat.st_ino != inode or stat.st_ctime_ns != ctime:
            raise StaleIndex(f"{relative} changed")


def _check_listings(index: DataIndex, racy: list[str]) -> None:
    """List the racy folders again and compare their entries with the index's; else ``StaleIndex``."""
    expected = {folder: (set(), [], []) for folder in racy}  # sub-folders, images, hidden
    for folder in index.folders:
        parent = os.path.dirname(folder)
        if parent in expected:
            expected[parent][0].add(folder)
    for name, split in index.splits.items():
        if not any(folder == name or folder.startswith(name + os.sep) for folder in racy):
            continue
        for position, entries in ((1, split.files), (2, split.hidden)):
            for entry in entries:
                parent = os.path.join(name, os.path.dirname(entry)) if os.sep in entry else name
                if parent in expected:
                    expected[parent][position].append(os.path.join(name, entry))
    for folder, (folders, images, hidden) in expected.items():
        try:
            listing = pipeline.list_folder(index.root / folder)
        except OSError:
            raise StaleIndex(f"{folder} is gone") from None

        def relative(paths: list[str]) -> list[str]:
            return [os.path.join(folder, os.path.basename(path)) for path in paths]

        found_images = relative(listing.images)
        if folder in SPLITS:  # a split's own files are not images of any class
            found_images = images = []
        if (set(relative(listing.folders)) != folders or found_images != images
                or set(relative(listing.hidden)) != set(hidden)):
            raise StaleIndex(f"{folder} changed")


def data_index(root: str | Path, cache_folder: str | Path | None) -> DataIndex:
    """The index of data root ``root``: loaded from ``cache_folder`` (:func:`index_file`) if it is
    current, else walked (``built``, not yet written: call :meth:`DataIndex.save`). ``cache_folder``
    None: always walk. Raises :class:`~fixres_dist.errors.FixresError` if ``root`` is not a folder
    holding ``train/`` and ``val/`` (:func:`fixres_dist.data.pipeline.check_layout`) or holds a
    symbolic-link loop, ``OSError`` if a folder cannot be listed; a missing, unreadable or corrupt
    cache file is no error (it is walked again).
    """
    root = pipeline.check_layout(root)
    start = time.monotonic()
    file = index_file(cache_folder, root) if cache_folder is not None else None
    reason = ""
    if file is not None:
        try:
            index = load(file, root)
            index.seconds = time.monotonic() - start
            return index
        except StaleIndex as stale:
            reason = str(stale)
    index = build(root)
    index.file, index.reason = file, reason
    return index


def _remove_stale_temporaries(folder: Path) -> None:
    """Delete temporary index files that a killed builder left (older than STALE_TEMPORARY_S; a live
    builder's is newer: it writes its file in seconds)."""
    for path in folder.glob(f".*{INDEX_SUFFIX}.*{io.TEMP_SUFFIX}"):
        try:
            if time.time() - path.stat().st_mtime > STALE_TEMPORARY_S:
                path.unlink()
        except OSError:  # another builder removed it first
            pass
