"""Datasets, transforms and loaders: ImageFolder roots with ``train/`` and ``val/``.

The embedded default is a Fashion-MNIST subset shipped in the package (``embedded_data/``, MIT
licence, see its LICENSE; built by ``scripts/make_embedded_dataset.py``). Every image becomes 8-bit
RGB with its levels preserved, whatever its mode (16-bit, float, transparency...:
:mod:`fixres_dist.data.images`).

Hidden files and folders (names starting with ``.``: ``.ipynb_checkpoints``, ``.DS_Store``,
``.snapshot``, macOS' ``._*`` files) are no part of the data: not classes, not images, and not walked
into (:func:`scan_split`); :class:`ImageFolder` counts what it skipped, and the run's log says so.
Runs take the walk's result from the data's file index (:mod:`fixres_dist.data.file_index`), walked
once per dataset version.

Preprocessing (FixRes, section 2; torchvision reference scripts):

* train (``scratch``): ``RandomResizedCrop(K_train)`` (scale 8-100 %, aspect 3/4-4/3) and a
  horizontal flip; optionally (:func:`train_transform`) an automatic augmentation policy
  (RandAugment, TrivialAugment, AugMix, AutoAugment) and random erasing, as torchvision's reference
  recipes (``references/classification/presets.py``);
* test, and FixRes finetuning: ``Resize(round(K_test / 0.875))`` of the *shorter* side, then
  ``CenterCrop(K_test)`` (torchvision Resize semantics; FixRes' own height-only resize lost
  ~0.35 top-1 on portrait images, FixRes issue #4).

Workers return ``uint8`` tensors of shape (3, K, K); the float conversion and the ImageNet mean/std
normalisation happen on the training device (:func:`normalize`), which keeps worker-to-trainer
traffic four times smaller.

Speed (``benchmarks/input_pipeline.py``): :class:`SeededDataset` hands the transforms JPEG files
undecoded, and their first step decodes only the kept window at the smallest DCT scale that still
covers the output (``jpeg_decode="scaled"``, the default: :mod:`fixres_dist.data.scaled_decode`, the same
crops as a full decode); with ``jpeg_decode="full"``, or where no scale applies, JPEGs are decoded with
``torchvision.io.decode_jpeg`` (libjpeg-turbo with PIL's settings: the same pixels as PIL's decoder)
straight into a uint8 tensor (:func:`fixres_dist.data.images.read_image`). The transforms then run on
uint8 tensors (torchvision's vectorised antialiased resize); other formats, and JPEGs that decoder
refuses, go through PIL. The transforms also take PIL images (then they compute exactly what they
did with PIL).
"""
from __future__ import annotations

import contextlib
import errno
import functools
import multiprocessing
import os
import re
import signal
from importlib import resources
from pathlib import Path
from typing import Callable

import attrs
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate
from torchvision import datasets
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from fixres_dist.config import AUTO_AUGMENT_POLICIES, CROP_RATIO, JPEG_DECODES
from fixres_dist.config import INTERPOLATIONS as INTERPOLATION_NAMES
from fixres_dist.data import images, scaled_decode
from fixres_dist.data.samplers import ExactBatchSampler, SampleKey
from fixres_dist.distributed import preemption
from fixres_dist.errors import FixresError, first_line

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# (mean, std) per RGB channel on the 0-1 scale: torchvision's ImageNet weights' normalisation.
IMAGENET_NORMALIZATION = (IMAGENET_MEAN, IMAGENET_STD)


EMBEDDED_DATASETS = ("fashion_mnist", "fashion_mnist_canvas")


def embedded_data_path(name: str = "fashion_mnist") -> Path:
    """An ImageFolder root shipped inside the package (``scripts/make_embedded_dataset.py``; MIT, Zalando SE).

    ``fashion_mnist``: 10 classes, 300 train + 100 val images per class, 28 x 28 grey PNG, garments
    filling the frame (the default ``--data-path``). ``fashion_mnist_canvas``: 1,000 train + 200 val
    other garments per class, each composed at a random scale (45-100 % of the side) and position on
    a black 48 x 48 canvas (:mod:`fixres_dist.data.canvas`), objects at varied scales as in photos (the
    demo's data). Raises ValueError for another name.
    """
    if name not in EMBEDDED_DATASETS:
        raise ValueError(f"no embedded dataset {name!r}; there are {', '.join(EMBEDDED_DATASETS)}")
    return Path(str(resources.files("fixres_dist") / "embedded_data" / name))


def is_hidden(name: str) -> bool:
    """Whether a file or folder name is hidden (starts with ``.``), hence no part of the data."""
    return name.startswith(".")


@attrs.frozen
class SplitScan:
    """What :func:`scan_split` found in one split folder (``train/`` or ``val/``).

    ``images``: class folder name -> paths (str) of its image files, in ImageFolder's order
    (sub-folders sorted by path, then files by name); ``hidden``: paths of the hidden files and
    folders skipped (each counted once: nothing under a hidden folder is walked).
    """

    images: dict[str, list[str]]
    hidden: list[str]


@attrs.frozen
class FolderListing:
    """One folder's entries as the walk sees them (:func:`list_folder`); paths are
    ``os.path.join(folder, name)``. ``folders``: sub-folders to walk (links to folders included),
    ``images``: image files sorted by name, ``hidden``: hidden entries (not walked); anything else
    (other files, broken links) is left out."""

    folders: list[str]
    images: list[str]
    hidden: list[str]


def _link_loop(path: str, how: str) -> FixresError:
    return FixresError(f"symbolic-link loop in the data: {path} {how}, so the walk of the folders would never "
                       "end; remove that link or point it elsewhere")


def list_folder(folder: str) -> FolderListing:
    """The entries of one folder, classified as :func:`scan_split` walks them. ``os.scandir`` knows
    most entries' types without a ``stat`` (only links need one), so this costs one listing.
    Raises ``OSError`` if ``folder`` cannot be listed, :class:`FixresError` naming an entry that is
    a chain of links leading back to itself (``x -> y -> x``: ELOOP)."""
    folders, files, hidden = [], [], []
    with os.scandir(folder) as entries:
        for entry in entries:
            if is_hidden(entry.name):
                hidden.append(entry.path)
                continue
            try:
                is_folder = entry.is_dir()  # follows links, as ImageFolder's os.walk(followlinks=True)
            except OSError as exc:  # a broken link is no folder (False); a looping one raises
                if exc.errno == errno.ELOOP:
                    raise _link_loop(entry.path, "is a chain of links that leads back to itself") from None
                raise
            if is_folder:
                folders.append(entry.path)
            elif entry.name.lower().endswith(IMG_EXTENSIONS) and entry.is_file():
                files.append(entry.path)
    return FolderListing(folders, sorted(files), hidden)


# A folder's identity whatever the path (links) it is reached by: (st_dev, st_ino) -> that path.
Ancestors = dict[tuple[int, int], str]
Visit = Callable[[str, os.stat_result], None]


def _enter(folder: str, ancestors: Ancestors, visit: Visit | None) -> Ancestors:
    """``ancestors`` (the folders above ``folder`` on the path walked to it) with ``folder`` added;
    ``visit(folder, its stat)`` is called first. Raises :class:`FixresError` naming ``folder`` if it
    is one of them: a link back up the tree, which torchvision's walk would follow forever (two such
    links in one folder double the paths at every turn)."""
    status = os.stat(folder)  # follows links, as the walk does
    key = (status.st_dev, status.st_ino)
    if key in ancestors:
        raise _link_loop(folder, f"leads back to {ancestors[key]}, a folder that holds it")
    if visit is not None:
        visit(folder, status)
    return {**ancestors, key: folder}


def _image_files(folder: str, hidden: list[str], ancestors: Ancestors, visit: Visit | None = None) -> list[str]:
    """Image files under ``folder`` in ImageFolder's order (sub-folders by path, files by name);
    hidden entries are appended to ``hidden`` and not walked into. ``ancestors``: the folders above
    ``folder`` (:func:`_enter`). ``visit(path, stat)`` is called for each folder just before it is
    listed. Raises as :func:`scan_split`."""
    found, stack = [], [(folder, ancestors)]
    while stack:
        root, above = stack.pop()
        above = _enter(root, above, visit)
        listing = list_folder(root)
        hidden.extend(listing.hidden)
        stack.extend((path, above) for path in listing.folders)
        found.append((root, listing.images))
    return [path for _, paths in sorted(found) for path in paths]


def image_files(folder: str | Path) -> tuple[list[str], list[str]]:
    """Every image file under ``folder``, at any depth, walked as :func:`scan_split` walks a class folder
    (links followed, hidden entries skipped and not walked into); returns ``(image paths, hidden paths)``.
    Raises as :func:`scan_split`."""
    hidden: list[str] = []
    found = _image_files(str(folder), hidden, {})
    return found, hidden


def scan_split(split: str | Path, visit: Visit | None = None) -> SplitScan:
    """The classes and image files of ``split``, walked as torchvision's ImageFolder walks them
    (symbolic links followed, extensions ``IMG_EXTENSIONS`` in any case, the same order), except
    that hidden files and folders are skipped and counted, names that are not files (a folder
    named ``x.png``, a broken link) are not images, and a symbolic-link loop is an error, found as
    soon as the walk comes back to a folder it is in (links that do not loop, to a class folder or
    below one, are followed; a folder reached through two links is walked twice, as torchvision
    does). ``visit(path, stat)``, if given, is called with every folder walked (``split`` itself,
    each class folder and every sub-folder) and its ``os.stat`` (links followed), just before it is
    listed (:mod:`fixres_dist.data.file_index` records them there). Raises ``OSError`` if a folder
    cannot be listed, :class:`FixresError` naming the looping path for a link loop.
    """
    split = str(split)
    above = _enter(split, {}, visit)
    listing = list_folder(split)
    hidden, images_by_class = list(listing.hidden), {}
    for path in sorted(listing.folders, key=os.path.basename):
        images_by_class[os.path.basename(path)] = _image_files(path, hidden, above, visit)
    return SplitScan(images_by_class, sorted(hidden))


def check_layout(root: str | Path) -> Path:
    """Check that ``root`` is a folder holding ``train/`` and ``val/`` folders; returns it as a Path.
    Raises :class:`FixresError` naming what is missing."""
    root = Path(root)
    if not root.is_dir():
        raise FixresError(f"data path {root} does not exist or is not a folder")
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise FixresError(f"data path {root} has no {split}/ folder (expected ImageFolder layout "
                              f"{root}/train/<class>/*.png and {root}/val/<class>/*.png)")
    return root


def check_image_folder(root: str | Path, min_train_images: int = 1, index=None) -> list[str]:
    """Check that ``root`` holds ``train/`` and ``val/`` with the same non-empty class folders.

    ``index``: a :class:`fixres_dist.data.file_index.DataIndex` of ``root`` to check instead of walking
    the folders (the same checks, the same messages). Returns the sorted class names. Raises
    :class:`FixresError` naming the first problem found, also when ``train/`` holds fewer than
    ``min_train_images`` images.
    """
    root = check_layout(root)
    found = {}
    for split in ("train", "val"):
        scan = index.scan(split) if index is not None else scan_split(root / split)
        found[split] = {name: len(paths) for name, paths in scan.images.items()}
        if not found[split]:
            raise FixresError(f"{root / split} has no class folders")
        empty = [name for name, count in found[split].items() if count == 0]
        if empty:
            raise FixresError(f"class folder {root / split / empty[0]} holds no images "
                              f"({', '.join(sorted(IMG_EXTENSIONS))})")
    if set(found["train"]) != set(found["val"]):
        only_train = sorted(set(found["train"]) - set(found["val"]))
        only_val = sorted(set(found["val"]) - set(found["train"]))
        raise FixresError(f"train and val class folders differ: only in train {only_train}, only in val {only_val}")
    if sum(found["train"].values()) < min_train_images:
        raise FixresError(f"{root / 'train'} holds {sum(found['train'].values())} images, too few for "
                          f"the ranks (at least {min_train_images}: 2 per rank)")
    return sorted(found["train"])


class ToUint8Tensor(v2.Transform):
    """A PIL image -> uint8 (C, H, W) tensor (as ``v2.PILToTensor``); a tensor (a decoded JPEG,
    already uint8) passes through unchanged. Every transform here has it, last or before steps that
    need a tensor (random erasing)."""

    def forward(self, image):
        return image if isinstance(image, torch.Tensor) else TF.pil_to_tensor(image)


class Uint8Pipeline(v2.Compose):
    """A transform of this module: takes an 8-bit RGB PIL image or a uint8 (3, H, W) tensor and
    returns a uint8 (3, K, K) tensor, the same image from either up to resampling rounding (the mark
    by which :class:`SeededDataset` knows it may hand it decoded JPEG tensors)."""


# --interpolation's names (fixres_dist.config.INTERPOLATIONS) -> torchvision's modes.
INTERPOLATIONS = dict(zip(INTERPOLATION_NAMES, (v2.InterpolationMode.BILINEAR, v2.InterpolationMode.BICUBIC,
                                                v2.InterpolationMode.NEAREST_EXACT), strict=True))


def _interpolation(name: str) -> v2.InterpolationMode:
    if name not in INTERPOLATIONS:
        raise FixresError(f"unknown interpolation {name!r}; use one of {', '.join(INTERPOLATIONS)}")
    return INTERPOLATIONS[name]


def resize_size(size: int, crop_ratio: float) -> int:
    """The shorter side (pixels) the test transform resizes to before its centre crop of ``size``
    pixels: ``round(size / crop_ratio)``. Raises :class:`FixresError` for a ratio outside (0, 1]."""
    if not 0 < crop_ratio <= 1:
        raise FixresError(f"crop ratio must be in (0, 1], got {crop_ratio!r}")
    return round(size / crop_ratio)


def _resize_for_crop(size: int, crop_ratio: float, interpolation: str, crop: int | None = None):
    """Resize of the shorter side to :func:`resize_size` (antialiased), then a centre crop of ``crop``
    pixels (default ``size``); a JPEG's window decoded at a DCT scale (:mod:`fixres_dist.data.scaled_decode`)."""
    return scaled_decode.WindowedResizeCenterCrop(resize_size(size, crop_ratio), size if crop is None else crop,
                                                  _interpolation(interpolation))


# --auto-augment's names (fixres_dist.config.AUTO_AUGMENT_POLICIES) -> torchvision v2 policies, made
# with ``interpolation=`` as torchvision's references/classification/presets.py make them.
AUTO_AUGMENTS = dict(zip(AUTO_AUGMENT_POLICIES, (
    v2.RandAugment,  # Cubuk et al. 2020, arXiv 1909.13719: 2 random ops of magnitude 9 of 31
    v2.TrivialAugmentWide,  # Mueller & Hutter 2021, arXiv 2103.10158: 1 op, random magnitude
    v2.AugMix,  # Hendrycks et al. 2020, arXiv 1912.02781: a Dirichlet mix of 3 op chains
    functools.partial(v2.AutoAugment, v2.AutoAugmentPolicy.IMAGENET),  # Cubuk et al. 2019, arXiv 1805.09501
), strict=True))


def _erase_colour(fill) -> list[float]:
    """The normalisation mean ``fill`` (3 floats on the 0-1 scale) on the uint8 scale: round(255 mean)."""
    if (not isinstance(fill, (tuple, list)) or len(fill) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1 for v in fill)):
        raise FixresError(f"random erasing fill must be 3 numbers in [0, 1] (the normalisation mean), got {fill!r}")
    return [float(round(255 * v)) for v in fill]


def train_transform(size: int, interpolation: str = "bilinear", auto_augment: str | None = None,
                    random_erase: float = 0.0, fill=None) -> v2.Transform:
    """RandomResizedCrop(size) + horizontal flip [+ auto-augment] [+ random erasing], to a uint8
    (3, size, size) tensor.

    Takes a PIL RGB image or a uint8 (3, H, W) tensor (what :class:`SeededDataset` gives for JPEGs).
    ``interpolation``: ``bilinear`` (default), ``bicubic`` or ``nearest`` (:data:`INTERPOLATIONS`)
    for the crop's resize; the policy's rotations, shears and shifts use ``nearest`` for
    ``nearest`` and ``bilinear`` otherwise (the two modes torchvision warps tensors with).
    ``auto_augment``: ``None`` (default) or a policy of :data:`AUTO_AUGMENTS` after the flip:
    ``ra`` RandAugment, ``ta_wide`` TrivialAugmentWide, ``augmix`` AugMix, ``imagenet`` AutoAugment's
    ImageNet policy (torchvision defaults; pixels uncovered by a rotation or shift are black).
    ``random_erase``: probability in [0, 1] of ``v2.RandomErasing`` (Zhong et al. 2020, arXiv
    1708.04896; area 2-33 %, aspect 0.3-3.3), applied last as torchvision's references do, on the
    uint8 tensor. The box is filled with ``fill``, the normalisation mean (3 floats on the 0-1 scale;
    default ImageNet's, :data:`IMAGENET_MEAN`) as uint8 levels ``round(255 mean)``, so that after
    :func:`normalize` it is 0 (within half a level), as the references' ``RandomErasing(value=0)``
    on normalised images. With the defaults the output is bit for bit that of the crop and flip
    alone. Raises :class:`FixresError` for values outside those.
    """
    mode = _interpolation(interpolation)
    steps = [scaled_decode.WindowedRandomResizedCrop(size, mode), v2.RandomHorizontalFlip()]
    if auto_augment is not None:
        if auto_augment not in AUTO_AUGMENTS:
            raise FixresError(f"unknown auto-augment policy {auto_augment!r}; use one of {', '.join(AUTO_AUGMENTS)}")
        warp = v2.InterpolationMode.NEAREST if interpolation == "nearest" else v2.InterpolationMode.BILINEAR
        steps.append(AUTO_AUGMENTS[auto_augment](interpolation=warp))
    steps.append(ToUint8Tensor())
    if isinstance(random_erase, bool) or not isinstance(random_erase, (int, float)) or not 0 <= random_erase <= 1:
        raise FixresError(f"random erasing probability must be in [0, 1], got {random_erase!r}")
    colour = _erase_colour(IMAGENET_MEAN if fill is None else fill)
    if random_erase > 0:
        steps.append(v2.RandomErasing(p=random_erase, value=colour))
    return Uint8Pipeline(steps)


def test_transform(size: int, crop_ratio: float = CROP_RATIO, interpolation: str = "bilinear") -> v2.Transform:
    """Resize the shorter side to round(size / crop_ratio), centre-crop size, to a uint8 tensor.

    Takes a PIL RGB image or a uint8 (3, H, W) tensor. ``crop_ratio`` in (0, 1] (default 0.875, the
    ImageNet convention: 224 of 256 px; the model's own, :mod:`fixres_dist.models.preprocessing`);
    ``interpolation`` as :func:`train_transform`. Raises :class:`FixresError` for values outside those.
    """
    return Uint8Pipeline([_resize_for_crop(size, crop_ratio, interpolation), ToUint8Tensor()])


def finetune_transform(size: int, augmentation: str = "test", crop_ratio: float = CROP_RATIO,
                       interpolation: str = "bilinear") -> v2.Transform:
    """Preprocessing for the FixRes finetune at test resolution ``size`` (pixels), to a uint8 tensor.

    ``"test"``: exactly :func:`test_transform` (FixRes' default: the finetune sees test-time images).
    ``"fixres"``: FixRes' lighter augmentation (its "v2" finetuning): the same resize, then a
    centre crop shifted by up to 4 % of ``size`` in each direction (centre crop of ``size + 2d``
    then a random ``size`` crop, ``d = max(1, round(0.04 size))``), a horizontal flip, and a mild
    colour jitter (brightness, contrast, saturation x [0.9, 1.1]). The amounts are ours; FixRes
    describes them only as light. ``crop_ratio`` and ``interpolation`` as :func:`test_transform`.
    """
    if augmentation == "test":
        return test_transform(size, crop_ratio, interpolation)
    if augmentation != "fixres":
        raise FixresError(f"unknown finetune augmentation {augmentation!r}; use test or fixres")
    shift = max(1, round(0.04 * size))
    return Uint8Pipeline([_resize_for_crop(size, crop_ratio, interpolation, size + 2 * shift), v2.RandomCrop(size),
                          v2.RandomHorizontalFlip(), v2.ColorJitter(brightness=0.1, contrast=0.1, saturation=0.1),
                          ToUint8Tensor()])


def normalize(images: torch.Tensor, normalization=IMAGENET_NORMALIZATION) -> torch.Tensor:
    """uint8 (B, 3, H, W) on any device -> float32 ``(x / 255 - mean) / std`` per channel.

    ``normalization`` is ``(mean, std)``, three floats each on the 0-1 scale: the architecture's own
    (:mod:`fixres_dist.models.preprocessing`; default ImageNet's). Computed in place on the
    one float copy (the same values as out of place, 2.5x faster on a CPU); the memory format (e.g.
    channels_last) is kept.
    """
    mean, std = normalization
    mean = torch.tensor(mean, device=images.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(std, device=images.device).view(1, 3, 1, 1) * 255
    return images.float().sub_(mean).div_(std)


def to_device(images: torch.Tensor, device: torch.device, channels_last: bool = False,
              normalization=IMAGENET_NORMALIZATION) -> torch.Tensor:
    """A uint8 (B, 3, H, W) batch -> float32 on ``device`` normalised with ``normalization`` ((mean,
    std), see :func:`normalize`); non-blocking copy from pinned memory, channels-last if asked."""
    images = normalize(images.to(device, non_blocking=True), normalization)
    return images.contiguous(memory_format=torch.channels_last) if channels_last else images


@contextlib.contextmanager
def seeded_cpu_generator(entropy):
    """Within the block, torch's default CPU generator is seeded from
    ``numpy.random.SeedSequence(entropy)`` (``entropy``: non-negative ints); its state is restored
    afterwards. What ``torch.random.fork_rng(devices=[])`` + ``torch.manual_seed`` do for the CPU
    generator alone, without their cost (0.4 ms a call) or reseeding CUDA's: torchvision's random
    transforms draw their parameters from this generator whatever the data's device."""
    generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(int(np.random.SeedSequence(entropy).generate_state(1)[0]))
    try:
        yield
    finally:
        generator.set_state(state)


class SeededDataset(Dataset):
    """Applies ``transform`` with randomness that depends only on (seed, epoch, index, copy).

    Indexed by :class:`~fixres_dist.data.samplers.SampleKey`. The CPU torch generator is reseeded per
    sample from ``numpy.random.SeedSequence([seed, epoch, index])`` for copy 0 (every sample without
    repeated augmentation), ``[seed, epoch, index, copy]`` for the other copies of a repeated
    augmentation (each its own draw), and restored afterwards, so the same image gets the same crop
    whatever the rank, the loader worker or the restart point.
    Returns ``(uint8 tensor (3, H, W), int label)``, or ``None`` for a bad image when
    ``skip_bad_images`` (else :class:`FixresError` naming the file, in one line): one that cannot be
    read or converted, or one above Pillow's decompression-bomb limit (twice
    ``PIL.Image.MAX_IMAGE_PIXELS``; :mod:`fixres_dist.data.images`).

    For an :class:`ImageFolder` as made by :func:`image_folder` (loader
    :func:`fixres_dist.data.images.open_rgb`, no transforms of its own) and a transform of this module
    (a :class:`Uint8Pipeline`: :func:`train_transform`, :func:`test_transform`, :func:`finetune_transform`),
    JPEG files reach ``transform`` as decoded uint8 tensors (:func:`fixres_dist.data.images.read_image`), other
    formats as 8-bit RGB PIL images; otherwise the dataset's own items (PIL images). With ``jpeg_decode``
    ``"scaled"`` (the default) and a transform whose first step decodes windows
    (:func:`fixres_dist.data.scaled_decode.takes_encoded`: every transform of this module), JPEGs read from
    files or from packed shards (a base with ``read(index)``: :class:`fixres_dist.data.shards.ShardSplit`)
    reach it undecoded (:class:`~fixres_dist.data.scaled_decode.EncodedJpeg`); ``"full"`` decodes them
    whole. Raises :class:`FixresError` for another ``jpeg_decode``.
    """

    skip_flag = "--skip-bad-images"  # what the bad image's message says skips it

    def __init__(self, base: datasets.ImageFolder, transform: v2.Transform, seed: int, skip_bad_images: bool = False,
                 jpeg_decode: str = "scaled"):
        if jpeg_decode not in JPEG_DECODES:
            raise FixresError(f"unknown JPEG decode {jpeg_decode!r}; use one of {', '.join(JPEG_DECODES)}")
        self.base, self.transform, self.seed, self.skip_bad_images = base, transform, seed, skip_bad_images
        # Decode files here only where that changes nothing but the speed: our PIL loader, no
        # ImageFolder transforms, and one of this module's transforms (they take tensors).
        self._read_files = (getattr(base, "loader", None) is images.open_rgb
                            and base.transform is None and base.target_transform is None
                            and isinstance(transform, Uint8Pipeline))
        # Hand JPEGs over undecoded where the transform decodes their window (scaled_decode), from files
        # or from packed shards (ShardSplit.read: a sample's bytes).
        self._windows = jpeg_decode == "scaled" and scaled_decode.takes_encoded(transform) and (
            self._read_files or callable(getattr(base, "read", None)))

    @property
    def reads_files(self) -> bool:
        """Whether JPEG files reach ``transform`` decoded here (uint8 tensors, other formats as RGB PIL
        images) rather than as the dataset's own items: see the class docstring for when."""
        return self._read_files

    @property
    def decodes_windows(self) -> bool:
        """Whether JPEGs reach ``transform`` undecoded (:class:`~fixres_dist.data.scaled_decode.EncodedJpeg`),
        so that it decodes only their window at a DCT scale (``jpeg_decode="scaled"``)."""
        return self._windows

    def __len__(self) -> int:
        return len(self.base)

    def _load(self, index: int):
        if self._windows:
            if self._read_files:
                path, label = self.base.samples[index]
                with open(path, "rb") as f:
                    encoded = f.read()
            else:
                encoded, label = self.base.read(index), self.base.targets[index]
            jpeg = scaled_decode.EncodedJpeg.of(encoded)
            return jpeg if jpeg is not None else images.decode_image(encoded), label
        if self._read_files:
            path, label = self.base.samples[index]
            return images.read_image(path), label
        return self.base[index]

    def item_name(self, index: int) -> str:
        """What a message names for item ``index``: its file, or its shard and key (packed data)."""
        name = getattr(self.base, "item_name", None)
        return name(index) if name is not None else self.base.samples[index][0]

    def __getitem__(self, key: SampleKey):
        image = None
        try:
            image, label = self._load(key.index)
            with seeded_cpu_generator([self.seed, key.epoch, key.index] + ([key.copy] if key.copy else [])):
                return self.transform(image), label
        except (OSError, ValueError, SyntaxError, scaled_decode.DeferredDecodeError) as exc:
            # (PIL's UnidentifiedImageError is an OSError)
            if isinstance(exc, scaled_decode.DeferredDecodeError):  # the window's decode: the image's error
                exc = exc.__cause__
            elif image is not None:
                raise  # a transform's own error, not the image's
            if self.skip_bad_images:
                return None
            raise FixresError(bad_image_message(self.item_name(key.index), exc, self.skip_flag)) from None


def bad_image_message(path: str, exc: Exception, skip_flag: str = "--skip-bad-images") -> str:
    """The one line that names the bad image ``path`` and says what ``exc``, raised reading it, means
    (``skip_flag``: the flag that skips such images instead)."""
    if isinstance(exc, images.ImageTooLargeError):
        problem, fix = f"image {path} is too large: {exc}", "downscale"
    else:
        said = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", first_line(exc))  # Pillow names its buffer
        problem, fix = f"unreadable image {path} ({type(exc).__name__}: {said})", "fix"
    return f"{problem}; {fix} or remove it, or pass {skip_flag}"


def collate_readable(samples: list) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Stack readable samples; returns ``(uint8 images (B, 3, H, W), int64 labels (B,), skipped)``."""
    good = [s for s in samples if s is not None]
    if not good:
        raise FixresError(f"all {len(samples)} images of a batch are unreadable")
    images, labels = default_collate(good)
    return images, labels, len(samples) - len(good)


class ImageFolder(datasets.ImageFolder):
    """torchvision's ImageFolder of one split without hidden files and folders (:func:`scan_split`).

    Items are ``(8-bit RGB PIL image, class index)`` (loader :func:`fixres_dist.data.images.open_rgb`,
    levels preserved for every mode). ``hidden``: the paths of the hidden files and folders skipped.
    ``scan``: what :func:`scan_split` gives for ``root``, e.g. from the data's file index
    (:meth:`fixres_dist.data.file_index.DataIndex.scan`), instead of walking ``root`` again; the dataset
    is the same (``samples``, ``classes``, ``class_to_idx``, ``hidden``). Raises
    ``FileNotFoundError`` (as torchvision's) when ``root`` holds no class folder.
    """

    def __init__(self, root: str | Path, scan: SplitScan | None = None):
        self._scan = scan if scan is not None else scan_split(root)
        self.hidden = self._scan.hidden
        super().__init__(str(root), loader=images.open_rgb)
        del self._scan  # its paths now live in self.samples

    def find_classes(self, directory) -> tuple[list[str], dict[str, int]]:
        classes = sorted(self._scan.images)
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
        return classes, {name: index for index, name in enumerate(classes)}

    def make_dataset(self, directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        return [(path, class_to_idx[name]) for name in sorted(class_to_idx) for path in self._scan.images[name]]


def image_folder(root: str | Path, split: str, index=None) -> ImageFolder:
    """The :class:`ImageFolder` of ``root/split`` without a transform (8-bit RGB PIL images);
    ``index``: a :class:`fixres_dist.data.file_index.DataIndex` of ``root`` to take the files from
    instead of walking the folder."""
    return ImageFolder(Path(root) / split, index.scan(split) if index is not None else None)


def close_loader(loader) -> None:
    """Stop ``loader``'s persistent worker processes now (a no-op without workers or before its first
    iteration). Needed because the workers ignore SIGTERM (:func:`make_loader`): left for the
    interpreter's exit, multiprocessing would SIGTERM them and wait for them forever.
    """
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def make_loader(dataset: ImageFolder, transform: v2.Transform, *, batch_size: int,
                world_size: int, rank: int, shuffle: bool, seed: int, workers: int,
                pin_memory: bool = False, skip_bad_images: bool = False, training: bool = False,
                reps: int = 1, ignored_signals: tuple[signal.Signals, ...] = (), global_batch: int | None = None,
                accumulation: int = 1, tail_ranks: int | None = None, jpeg_decode: str = "scaled") -> DataLoader:
    """A DataLoader over ``dataset`` for one rank with an :class:`ExactBatchSampler` (``training``:
    its training semantics; ``reps``: repeated augmentation, K copies of each image per cycle of K
    epochs, training only; ``global_batch``, ``accumulation``, ``tail_ranks``: a step's images over all
    ranks, its micro-batches, the ranks whose last-batch rule is kept; see :mod:`fixres_dist.data.samplers`).

    Loader workers ignore ``ignored_signals`` (the job's stop signals): SLURM, ``timeout``, ``kill
    -- -PGID`` and Ctrl-C signal every process of a job, and a worker that died of it would take
    the rank's step down with it; the rank alone decides to checkpoint and stop, and shuts its
    workers down as it exits.

    Loader workers are seeded by torch from a generator seeded with ``seed + rank`` (distinct per
    worker); augmentation itself is seeded per sample by :class:`SeededDataset` (``jpeg_decode``: its
    ``scaled`` or ``full`` JPEG decode).
    """
    sampler = ExactBatchSampler(len(dataset), world_size, rank, batch_size, shuffle=shuffle, seed=seed,
                                training=training, reps=reps, global_batch=global_batch, accumulation=accumulation,
                                tail_ranks=tail_ranks)
    # Ranks started by torch.multiprocessing's spawn inherit "spawn" as the default start method,
    # and spawned loader workers re-import torch (seconds each on a small CPU); fork them instead,
    # with the stop signals blocked from the fork until the worker ignores them.
    context = None
    if workers > 0 and "fork" in multiprocessing.get_all_start_methods():
        context = preemption.shielded_fork_context(ignored_signals) if ignored_signals else "fork"
    return DataLoader(SeededDataset(dataset, transform, seed, skip_bad_images, jpeg_decode), batch_sampler=sampler,
                      num_workers=workers, collate_fn=collate_readable,
                      pin_memory=pin_memory, persistent_workers=workers > 0, multiprocessing_context=context,
                      worker_init_fn=functools.partial(preemption.loader_worker_init, ignored_signals, os.getpid())
                      if workers else None,
                      generator=torch.Generator().manual_seed(seed + rank))
