"""Hugging Face datasets as a run's data: a ``DatasetDict`` saved with ``save_to_disk``, or parquet
files (as the Hugging Face Hub stores datasets), read with the ``datasets`` library.

``--data-path ROOT`` is such a dataset when ``ROOT`` holds

* ``dataset_dict.json`` (``DatasetDict.save_to_disk``): read in place with ``datasets.load_from_disk``
  (memory-mapped Arrow files, nothing copied); or
* ``*.parquet`` files, in ``ROOT`` or a folder in it, each of the split its path names: a folder or a file
  name that is, or starts with, ``train``, ``val``, ``validation`` or ``test`` followed by ``-``,
  ``_`` or ``.`` (the Hub's ``data/train-00000-of-00004.parquet``, ``train/0000.parquet``). They are
  converted once to Arrow files by ``datasets.load_dataset("parquet")`` in the data cache
  ``<shared-folder-path>/file_index/hf_datasets`` (the random access that exact sampling needs is
  the Arrow files'; later runs reuse the conversion while the parquet files are unchanged).

The training split is ``train``; the evaluation split the first of ``val``, ``validation`` and
``test``. Each has one :class:`datasets.Image` column and one :class:`datasets.ClassLabel` column
(the class names, in label order, come from it); train and val must have the same class names.
Images are kept as their files' bytes (``Image(decode=False)``) and decoded as an image file of an
ImageFolder is (:func:`fixres_dist.data.images.decode_image`), so the same transforms, per-model
preprocessing and exact sampler (:mod:`fixres_dist.data.samplers`) apply: every validation image
evaluated once at any world size, a bit-identical resume mid-epoch.

``datasets`` is imported only when a run reads such data (it takes seconds); it runs offline here
(``HF_DATASETS_OFFLINE``, ``HF_HUB_OFFLINE``): nothing is downloaded at run time.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from fixres_dist.data import images
from fixres_dist.errors import FixresError, first_line

SPLITS = ("train", "val")
VAL_SPLITS = ("val", "validation", "test")  # the evaluation split: the first of these the dataset has
SAVED = "dataset_dict.json"
CACHE = "hf_datasets"  # the parquet files' Arrow conversion, in the data cache folder
FINGERPRINT_TAIL = 1 << 16  # bytes at the end of each data file hashed into the data's identity
PARQUET_SPLIT = re.compile(r"(train|val|validation|test)([-_.]|$)", re.IGNORECASE)


def is_hf_dataset(root: str | Path) -> bool:
    """Whether ``root`` is a Hugging Face dataset folder (module docstring): ``dataset_dict.json``, one
    split saved (``state.json`` beside ``dataset_info.json``, refused later with its reason), or parquet
    files, unless ``root/train`` holds class folders (an image folder with a stray parquet file is an
    image folder)."""
    root = Path(root)
    if (root / SAVED).is_file() or ((root / "state.json").is_file() and (root / "dataset_info.json").is_file()):
        return True
    train = root / "train"
    if train.is_dir() and any(entry.is_dir() for entry in train.iterdir()):
        return False
    return bool(_parquet_files(root))


def _parquet_files(root: Path) -> list[Path]:
    """The parquet files in ``root`` and its sub-folders, one level down (never a walk of an image
    folder: the class folders are listed, not entered)."""
    return sorted([*root.glob("*.parquet"), *root.glob("*/*.parquet")])


def library():
    """The ``datasets`` library, offline and quiet, or a one-line error saying how to install it."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except Exception as exc:  # not installed (ImportError), or an install that breaks as it imports
        raise FixresError(f"reading a Hugging Face dataset needs the datasets library, which cannot be imported "
                          f"({type(exc).__name__}: {first_line(exc)}): pip install -e '.[hf]' (scripts/setup.sh "
                          "installs it)") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(logging.CRITICAL)  # its errors reach the run as exceptions, named in one line
    return datasets


def parquet_splits(root: Path) -> tuple[dict[str, list[Path]], list[Path]]:
    """The parquet files below ``root`` by split name (module docstring; lower case), each list sorted,
    and those of no split a run reads (``unsupervised-00000-of-00001.parquet``: left out)."""
    found: dict[str, list[Path]] = {}
    left_out = []
    for path in _parquet_files(root):
        parts = path.relative_to(root).parts
        split = next((m.group(1).lower() for part in parts if (m := PARQUET_SPLIT.match(part))), None)
        if split is None:
            left_out.append(path)
        else:
            found.setdefault(split, []).append(path)
    return found, left_out


def _split_names(available, root: Path, left_out: list[Path] = ()) -> dict[str, str]:
    """Our split (``train``, ``val``) -> the dataset's split name."""
    val = next((name for name in VAL_SPLITS if name in available), None)
    if "train" not in available or val is None:
        other = (f" (and parquet files of no split it reads: {', '.join(p.name for p in left_out[:3])}"
                 f"{', ...' if len(left_out) > 3 else ''}; a split is named by the folder or the start of the file "
                 "name, as data/train-00000-of-00001.parquet)") if left_out else ""
        splits = ", ".join(sorted(available)) or "none"
        raise FixresError(f"Hugging Face dataset {root} has the splits {splits}{other}: a run needs train and one of "
                          f"{', '.join(VAL_SPLITS)}")
    return {"train": "train", "val": val}


class HFSplit(Dataset):
    """One split of a Hugging Face dataset as a map-style dataset, ImageFolder's counterpart for
    :class:`~fixres_dist.data.pipeline.SeededDataset`.

    Item ``i``: ``(image, class number)``, the image a uint8 (3, H, W) RGB tensor for a JPEG, else an
    8-bit RGB PIL image (:func:`fixres_dist.data.images.decode_image`); an image stored as a path
    rather than bytes is read from that path. ``classes``, ``class_to_idx``, ``targets`` and ``hidden``
    (none) as torchvision's ImageFolder has them; ``lengths``: each row's image length in bytes
    (int64, -1 where the image is kept as a path).
    """

    def __init__(self, table, image_column: str, name: str, classes: list[str], targets: list[int],
                 lengths: np.ndarray):
        self.table, self.image_column, self.name = table, image_column, name
        self.classes, self.targets, self.lengths = classes, targets, lengths
        self.class_to_idx = {c: number for number, c in enumerate(classes)}
        self.hidden: list[str] = []

    def __len__(self) -> int:
        return len(self.targets)

    def item_name(self, index: int) -> str:
        """``<root> [<split>] row <index>``: what a message about row ``index`` names."""
        return f"{self.name} row {index}"

    def read(self, index: int) -> bytes:
        """The image file's bytes of row ``index``."""
        image = self.table[index][self.image_column]
        if image.get("bytes") is not None:
            return image["bytes"]
        if not image.get("path"):
            raise ValueError("the row holds no image (neither bytes nor a path)")
        with open(image["path"], "rb") as f:
            return f.read()

    def __getitem__(self, index: int):
        return images.decode_image(self.read(index)), self.targets[index]


class HFData:
    """A Hugging Face dataset folder ``root``, read and checked (:func:`open_hf_dataset`); the
    counterpart of :class:`~fixres_dist.data.file_index.DataIndex` for a run. ``classes``: the class
    names in label order; ``form``: ``saved`` or ``parquet``."""

    built = False  # nothing to save: the dataset is its own index

    def __init__(self, root: Path, form: str, splits: dict[str, HFSplit], split_names: dict[str, str],
                 files: dict[str, list[Path]], left_out: list[Path]):
        self.root, self.form, self.splits, self.split_names, self.files = root, form, splits, split_names, files
        self.left_out = left_out
        self.classes = splits["train"].classes

    def images(self, split: str) -> int:
        return len(self.splits[split])

    @property
    def train_images(self) -> int:
        return self.images("train")

    def identity(self) -> dict:
        """What a resumed run must see again (its checkpoint records it): the images of each split and a
        SHA-256 (hex) of the class list, every row's label and image length in bytes, and each data
        file's name, size and last 64 KiB. A fingerprint, read in milliseconds rather than the files
        whole at every start: a row added, removed or relabelled, an image of another length, a file
        that grew or shrank is other data; images swapped or edited in place at equal lengths are not
        seen (an image folder's identity likewise holds its file names, not their bytes)."""
        digest = hashlib.sha256(json.dumps([self.classes, self.split_names]).encode())
        for split in SPLITS:
            digest.update(np.asarray(self.splits[split].targets, np.int64).tobytes())
            digest.update(self.splits[split].lengths.tobytes())
            for path in self.files[split]:
                size = path.stat().st_size
                digest.update(f"{split}\0{path.name}\0{size}\0".encode())
                with open(path, "rb") as f:
                    f.seek(max(0, size - FINGERPRINT_TAIL))
                    digest.update(f.read())
        return {**{split: self.images(split) for split in SPLITS}, "sha256": digest.hexdigest()}

    def dataset(self, split: str) -> HFSplit:
        """Split ``split`` (``train`` or ``val``) as a dataset."""
        return self.splits[split]

    def save(self) -> None:
        """Nothing to save (DataIndex's interface)."""

    def describe(self) -> str:
        val = self.split_names["val"]
        left_out = (f" (left out: {len(self.left_out)} parquet files of other splits, "
                    f"{', '.join(p.name for p in self.left_out[:3])}{', ...' if len(self.left_out) > 3 else ''})"
                    if self.left_out else "")
        return (f"data: Hugging Face dataset ({self.form}): {self.images('train'):,} train and {self.images('val'):,} "
                f"{val} images in {len(self.classes):,} classes, {self.root}, checked{left_out}")


def open_hf_dataset(root: str | Path, cache_folder: str | Path | None = None, min_train_images: int = 1) -> HFData:
    """Read and check the Hugging Face dataset at ``root`` (module docstring); ``cache_folder``: where
    parquet files are converted to Arrow (``<cache_folder>/hf_datasets``; None: the library's cache).

    Raises :class:`FixresError` in one line for a dataset that cannot be read, a missing train or
    evaluation split, a split without one image and one class-label column, train and val with
    different class names, a label outside the class list, a class without training images, or
    fewer than ``min_train_images`` training images. A parquet dataset refused leaves nothing behind:
    the conversion this call made is removed (:func:`_conversion`).
    """
    root = Path(root)
    datasets = library()
    if (root / SAVED).is_file() or (root / "state.json").is_file():
        with _unreadable(root):
            loaded = datasets.load_from_disk(str(root))
        if not isinstance(loaded, datasets.DatasetDict):
            raise FixresError(f"{root} holds one saved split ({len(loaded):,} rows), not a DatasetDict: save "
                              "DatasetDict({'train': ..., 'validation': ...}) with save_to_disk")
        names = _split_names(loaded.keys(), root)
        tables = {split: loaded[name] for split, name in names.items()}
        files = {split: [Path(f["filename"]) for f in tables[split].cache_files] for split in SPLITS}
        return _checked(datasets, root, "saved", tables, names, files, [], min_train_images)
    found, left_out = parquet_splits(root)
    names = _split_names(found.keys(), root, left_out)
    files = {split: found[name] for split, name in names.items()}
    left_out += [path for name, paths in found.items() if name not in names.values() for path in paths]
    with _conversion(root, files, cache_folder) as cache_dir:
        with _unreadable(root):
            loaded = datasets.load_dataset("parquet", data_files={name: [str(p) for p in files[split]]
                                                                  for split, name in names.items()},
                                           cache_dir=cache_dir)
        tables = {split: loaded[name] for split, name in names.items()}
        return _checked(datasets, root, "parquet", tables, names, files, left_out, min_train_images)


def _checked(datasets, root: Path, form: str, tables: dict, names: dict[str, str], files: dict[str, list[Path]],
             left_out: list[Path], min_train_images: int) -> HFData:
    """The dataset's splits (``tables``, by our split name) checked (:func:`open_hf_dataset`'s errors)."""
    splits = {split: _split(datasets, table, root, names[split], files[split]) for split, table in tables.items()}
    train, val = splits["train"], splits["val"]
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))[:3]
        only_val = sorted(set(val.classes) - set(train.classes))[:3]
        raise FixresError(f"Hugging Face dataset {root}: the class names of train and {names['val']} differ (only in "
                          f"train {only_train}, only in {names['val']} {only_val}"
                          f"{', or their order' if not only_train and not only_val else ''})")
    counts = np.bincount(train.targets, minlength=len(train.classes))
    if (counts == 0).any():
        raise FixresError(f"Hugging Face dataset {root}: class {train.classes[int(np.argmin(counts))]!r} has no "
                          "training images")
    if len(train) < min_train_images:
        raise FixresError(f"{root} holds {len(train)} training images, too few for the ranks "
                          f"(at least {min_train_images}: 2 per rank)")
    return HFData(root, form, splits, names, files, left_out)


@contextlib.contextmanager
def _conversion(root: Path, files: dict[str, list[Path]], cache_folder: str | Path | None):
    """Where the parquet files of ``root`` are converted (the ``cache_dir`` of ``load_dataset``, None
    without ``cache_folder``): ``<cache_folder>/hf_datasets/<root>/<version>``, the version a digest of
    each file's path, size, modification and change times and inode, so a file rewritten (its change
    time moves even when its modification time is kept) is converted again. When the block ends, the
    conversions of earlier versions of ``root`` are removed; when it raises (the dataset refused,
    Ctrl-C), what it made is removed instead (the version folder and the folders above it that it
    made): a refused dataset leaves nothing behind. Raises :class:`FixresError` when the folder cannot
    be made."""
    if cache_folder is None:
        yield None
        return
    stats = [(str(p), (st := p.stat()).st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
             for split in SPLITS for p in files[split]]
    place = Path(cache_folder) / CACHE / hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    folder = place / hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FixresError(f"cannot make {folder} ({exc.strerror}): the parquet files of {root} are converted there "
                          "(--shared-folder-path holds the data cache); give a writable --shared-folder-path") from None
    if not any(folder.iterdir()):  # said before the minutes it can take at ImageNet's size
        print(f"data: converting the parquet files of {root} once, into {folder}", flush=True)
    try:
        yield str(folder)
    except BaseException:
        if made:
            shutil.rmtree(folder, ignore_errors=True)
        for parent in made[1:]:
            with contextlib.suppress(OSError):  # not empty: another run's meanwhile
                parent.rmdir()
        raise
    for earlier in place.iterdir():
        if earlier != folder:
            shutil.rmtree(earlier, ignore_errors=True)


@contextlib.contextmanager
def _unreadable(root: Path):
    try:
        yield
    except FixresError:
        raise
    except Exception as exc:  # the library raises many types (pyarrow's, FileNotFoundError, ValueError, ...)
        raise FixresError(f"Hugging Face dataset {root} cannot be read ({type(exc).__name__}: {first_line(exc)})") \
            from None


def _split(datasets, table, root: Path, name: str, files: list[Path]) -> HFSplit:
    """Split ``name`` of the dataset as an :class:`HFSplit`: its image and class-label columns found
    and checked, its labels read (one column read)."""
    where = f"Hugging Face dataset {root} [{name}]"
    features = table.features
    image_columns = [c for c, f in features.items() if isinstance(f, datasets.Image)]
    label_columns = [c for c, f in features.items() if isinstance(f, datasets.ClassLabel)]
    columns = ", ".join(f"{c} ({type(f).__name__})" for c, f in features.items())
    if len(image_columns) != 1 or len(label_columns) != 1:
        raise FixresError(f"{where}: a run needs exactly one Image column and one ClassLabel column (which holds the "
                          f"class names), and it has {columns}; cast them with Dataset.cast_column")
    image_column, label_column = image_columns[0], label_columns[0]
    classes = list(features[label_column].names)
    labels = np.asarray(table.with_format("numpy")[label_column])
    bad = np.flatnonzero((labels < 0) | (labels >= len(classes)))
    if bad.size:
        raise FixresError(f"{where}: row {int(bad[0])} has label {int(labels[bad[0]])}, not a class number of its "
                          f"{len(classes)} classes ({bad.size:,} rows so; an unlabelled split cannot train or "
                          "evaluate)")
    if not len(table):
        raise FixresError(f"{where}: the split holds no rows")
    lengths = _image_lengths(table, image_column, where)
    table = table.select_columns([image_column]).cast_column(image_column, datasets.Image(decode=False))
    return HFSplit(table, image_column, f"{root} [{name}]", classes, labels.astype(np.int64).tolist(), lengths)


def _image_lengths(table, image_column: str, where: str) -> np.ndarray:
    """Each row's image length in bytes (int64; -1 for an image kept as a path), read from the Arrow
    column's offsets without reading the images. Raises :class:`FixresError` naming the first row
    whose image is neither in the dataset nor at its path (a dataset that refers to files moved since)."""
    import pyarrow.compute as pc
    column = table.data.column(image_column)
    lengths = pc.binary_length(pc.struct_field(column, "bytes")).fill_null(-1).to_numpy().astype(np.int64)
    by_path = np.flatnonzero(lengths < 0)
    if by_path.size:
        paths = pc.struct_field(column, "path").to_pylist()
        missing = next((int(row) for row in by_path if not paths[row] or not os.path.isfile(paths[row])), None)
        if missing is not None:
            raise FixresError(f"{where}: row {missing} keeps its image as a path, and {paths[missing]!r} is no file "
                              f"(moved or deleted since the dataset was made); restore the image files, or save the "
                              "dataset with its images embedded (datasets' save_to_disk does)")
    return lengths
