"""The input pipeline's CPU cost per image at a resolution, measured on real image files: what the
FixRes trade costs on the data side (``python -m fixres_dist.bench --input-images DIR``).

A run's own preprocessing (:class:`~fixres_dist.data.pipeline.SeededDataset` reading the files, the
train transform ``RandomResizedCrop(K)`` + flip and the test transform ``Resize(K / 0.875)`` +
``CenterCrop(K)``, JPEGs decoded at the DCT scale their crop allows: :mod:`fixres_dist.data.scaled_decode`),
on one thread, in CPU milliseconds per image (``time.thread_time``, the best of ``repeats`` passes):
the cost one loader core pays, whatever else runs on the machine. A loader worker process runs this
per image; the batches' collation and normalisation (on the training device) are not included.
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import attrs
import torch
from torch.utils.data import Dataset

from fixres_dist.data import images, pipeline
from fixres_dist.data.samplers import SampleKey
from fixres_dist.errors import FixresError, first_line


@attrs.frozen
class InputCost:
    """CPU milliseconds per image on one core at ``size`` pixels: ``train`` (the train transform) and
    ``test`` (the test transform), over ``images`` files."""

    size: int
    train: float
    test: float
    images: int


class ImageFiles(Dataset):
    """Image files as :class:`~fixres_dist.data.pipeline.SeededDataset` reads an ImageFolder's (its
    ``samples``, ``targets`` and loader), every one of class 0."""

    loader = staticmethod(images.open_rgb)
    transform = target_transform = None

    def __init__(self, paths: list[str]):
        self.samples = [(str(path), 0) for path in paths]
        self.targets = [0] * len(paths)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        return images.open_rgb(self.samples[index][0]), 0


def found_images(folder: str | Path | None) -> list[str]:
    """The image files under ``folder`` (walked as a class folder is), each decoded once to check it, or,
    without one, foolbox's 20 ImageNet photos where foolbox is installed (``pip install --no-deps
    foolbox==3.3.4``), else none. Raises :class:`FixresError` for a folder without images, or naming an
    image that cannot be read (before anything is measured)."""
    if folder is None:
        spec = importlib.util.find_spec("foolbox")
        if spec is None or not spec.submodule_search_locations:
            return []
        return sorted(str(p) for p in Path(spec.submodule_search_locations[0], "data").glob("imagenet_*_*.jpg"))
    if not Path(folder).is_dir():
        raise FixresError(f"--input-images {folder}: not a folder")
    paths, _ = pipeline.image_files(folder)
    if not paths:
        raise FixresError(f"--input-images {folder}: no image files in it")
    for path in paths:
        try:
            images.read_image(path)
        except (OSError, ValueError, SyntaxError) as exc:
            raise FixresError(f"--input-images {folder}: unreadable image {path} ({type(exc).__name__}: "
                              f"{first_line(exc)}); remove it from the folder") from None
    return paths


def _ms_per_image(dataset: pipeline.SeededDataset, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for index in range(len(dataset)):
            dataset[SampleKey(index, 1)]
        best = min(best, time.thread_time() - start)
    return 1000 * best / len(dataset)


def measure(paths: list[str], size: int, repeats: int = 3) -> InputCost:
    """The train and test transforms' CPU cost per image at ``size`` pixels over ``paths`` (module
    docstring), on one intra-op thread. Raises :class:`FixresError` naming an unreadable image."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        costs = [_ms_per_image(pipeline.SeededDataset(ImageFiles(paths), transform, 0), repeats)
                 for transform in (pipeline.train_transform(size), pipeline.test_transform(size))]
    finally:
        torch.set_num_threads(threads)
    return InputCost(size, *costs, len(paths))
