"""Datasets, transforms and loaders: ImageFolder roots with ``train/`` and ``val/``.

The embedded default is a Fashion-MNIST subset shipped in the package (``embedded_data/``, MIT
licence, see its LICENSE; built by ``scripts/make_embedded_dataset.py``). Grey images become RGB
(torchvision's PIL loader converts every image to RGB).

Preprocessing (FixRes, section 2; torchvision reference scripts):

* train (``scratch``): ``RandomResizedCrop(K_train)`` (scale 8-100 %, aspect 3/4-4/3) and a
  horizontal flip;
* test, and FixRes finetuning: ``Resize(round(K_test / 0.875))`` of the *shorter* side, then
  ``CenterCrop(K_test)`` (torchvision Resize semantics; FixRes' own height-only resize lost
  ~0.35 top-1 on portrait images, FixRes issue #4).

Workers return ``uint8`` tensors of shape (3, K, K); the float conversion and the ImageNet mean/std
normalisation happen on the training device (:func:`normalize`), which keeps worker-to-trainer
traffic four times smaller.
"""
from __future__ import annotations

import multiprocessing
import os
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate
from torchvision import datasets
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms import v2

from .errors import FixresError
from .samplers import ExactBatchSampler, SampleKey

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CROP_RATIO = 0.875  # test-time centre crop keeps 87.5 % of the resized shorter side


def embedded_data_path() -> Path:
    """The Fashion-MNIST subset inside the package (10 classes, 300 train + 100 val per class)."""
    return Path(str(resources.files("fixres_dist") / "embedded_data" / "fashion_mnist"))


def _class_folders(split: Path) -> dict[str, int]:
    """Class folder name -> number of image files in it (walked like ImageFolder: symlinks followed)."""
    classes = {}
    for folder in sorted(p for p in split.iterdir() if p.is_dir()):
        classes[folder.name] = sum(
            1 for root, _, files in os.walk(folder, followlinks=True) for name in files
            if name.lower().endswith(IMG_EXTENSIONS) and os.path.isfile(os.path.join(root, name)))
    return classes


def check_image_folder(root: str | Path, min_train_images: int = 1) -> list[str]:
    """Check that ``root`` holds ``train/`` and ``val/`` with the same non-empty class folders.

    Returns the sorted class names. Raises :class:`FixresError` naming the first problem found,
    also when ``train/`` holds fewer than ``min_train_images`` images.
    """
    root = Path(root)
    if not root.is_dir():
        raise FixresError(f"data path {root} does not exist or is not a folder")
    found = {}
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise FixresError(f"data path {root} has no {split}/ folder (expected ImageFolder layout "
                              f"{root}/train/<class>/*.png and {root}/val/<class>/*.png)")
        found[split] = _class_folders(root / split)
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


def train_transform(size: int) -> v2.Transform:
    """RandomResizedCrop(size) + horizontal flip, to a uint8 (3, size, size) tensor."""
    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()])


def test_transform(size: int) -> v2.Transform:
    """Resize the shorter side to round(size / 0.875), centre-crop size, to a uint8 tensor."""
    return v2.Compose([v2.Resize(round(size / CROP_RATIO), antialias=True), v2.CenterCrop(size), v2.PILToTensor()])


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W) on any device -> float32 normalised with the ImageNet mean and std."""
    mean = torch.tensor(IMAGENET_MEAN, device=images.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device=images.device).view(1, 3, 1, 1) * 255
    return (images.float() - mean) / std


class SeededDataset(Dataset):
    """Applies ``transform`` with randomness that depends only on (seed, epoch, index).

    Indexed by :class:`~fixres_dist.samplers.SampleKey`. The torch RNG is reseeded per sample from
    ``numpy.random.SeedSequence([seed, epoch, index])`` inside ``torch.random.fork_rng``, so the
    same image gets the same crop whatever the rank, the loader worker or the restart point.
    Returns ``(uint8 tensor (3, H, W), int label)``, or ``None`` for an unreadable image when
    ``skip_bad_images`` (else :class:`FixresError` naming the file).
    """

    def __init__(self, base: datasets.ImageFolder, transform: v2.Transform, seed: int, skip_bad_images: bool = False):
        self.base, self.transform, self.seed, self.skip_bad_images = base, transform, seed, skip_bad_images

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: SampleKey):
        try:
            image, label = self.base[key.index]
        except (OSError, ValueError, SyntaxError) as exc:  # PIL's UnidentifiedImageError is an OSError
            if self.skip_bad_images:
                return None
            raise FixresError(f"unreadable image {self.base.samples[key.index][0]} ({type(exc).__name__}); "
                              "fix or remove it, or pass --skip-bad-images") from None
        sample_seed = int(np.random.SeedSequence([self.seed, key.epoch, key.index]).generate_state(1)[0])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed)
            return self.transform(image), label


def collate_readable(samples: list) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Stack readable samples; returns ``(uint8 images (B, 3, H, W), int64 labels (B,), skipped)``."""
    good = [s for s in samples if s is not None]
    if not good:
        raise FixresError(f"all {len(samples)} images of a batch are unreadable")
    images, labels = default_collate(good)
    return images, labels, len(samples) - len(good)


def image_folder(root: str | Path, split: str) -> datasets.ImageFolder:
    """torchvision ImageFolder of ``root/split`` without a transform (PIL RGB images)."""
    return datasets.ImageFolder(str(Path(root) / split))


def make_loader(dataset: datasets.ImageFolder, transform: v2.Transform, *, batch_size: int,
                world_size: int, rank: int, shuffle: bool, seed: int, workers: int,
                pin_memory: bool = False, skip_bad_images: bool = False) -> DataLoader:
    """A DataLoader over ``dataset`` for one rank with an :class:`ExactBatchSampler`.

    Loader workers are seeded by torch from a generator seeded with ``seed + rank`` (distinct per
    worker); augmentation itself is seeded per sample by :class:`SeededDataset`.
    """
    sampler = ExactBatchSampler(len(dataset), world_size, rank, batch_size, shuffle=shuffle, seed=seed)
    # Ranks started by torch.multiprocessing's spawn inherit "spawn" as the default start method,
    # and spawned loader workers re-import torch (seconds each on a small CPU); fork them instead.
    context = "fork" if workers > 0 and "fork" in multiprocessing.get_all_start_methods() else None
    return DataLoader(SeededDataset(dataset, transform, seed, skip_bad_images), batch_sampler=sampler,
                      num_workers=workers, collate_fn=collate_readable,
                      pin_memory=pin_memory, persistent_workers=workers > 0, multiprocessing_context=context,
                      generator=torch.Generator().manual_seed(seed + rank))
