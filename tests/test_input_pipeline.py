"""The fast input path of fixres_dist.data: JPEGs decoded to uint8 tensors give what the PIL path gave.

``SeededDataset`` reads JPEG files with ``torchvision.io.decode_jpeg`` and runs the transforms on
uint8 tensors (benchmarks/input_pipeline.py: 1.6-1.7x the torchvision reference per core); other
formats, and JPEGs that decoder refuses, still go through PIL.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from fixres_dist import FixresError, data
from fixres_dist.samplers import SampleKey


def _photo(seed: int, size=(96, 72)) -> Image.Image:
    """A smooth RGB picture (JPEG-friendly) with some texture."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size[1], 0:size[0]]
    channels = [np.sin(x / (5 + 3 * c) + rng.uniform(0, 6)) * np.cos(y / (7 + c)) * 100 + 128 for c in range(3)]
    pixels = np.stack(channels, -1) + rng.normal(0, 8, (size[1], size[0], 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory):
    """train/a: RGB, grey and CMYK JPEGs, a progressive JPEG, a PNG; val/a: one JPEG."""
    root = tmp_path_factory.mktemp("jpegs")
    for split in ("train", "val"):
        (root / split / "a").mkdir(parents=True)
    _photo(0).save(root / "train" / "a" / "0_rgb.jpg", quality=90)
    _photo(1).convert("L").save(root / "train" / "a" / "1_grey.jpg", quality=90)
    _photo(2).convert("CMYK").save(root / "train" / "a" / "2_cmyk.jpg", quality=90)
    _photo(3).save(root / "train" / "a" / "3_progressive.jpg", quality=85, progressive=True)
    _photo(4).save(root / "train" / "a" / "4_png.png")
    _photo(5, (40, 60)).save(root / "val" / "a" / "5.jpg")
    return root


@pytest.mark.parametrize("transform", ["train", "test", "fixres"])
def test_jpeg_tensor_path_matches_the_pil_path(jpeg_folder, transform):
    make = {"train": lambda: data.train_transform(48), "test": lambda: data.test_transform(48),
            "fixres": lambda: data.finetune_transform(48, "fixres")}[transform]
    base = data.image_folder(jpeg_folder, "train")
    fast = data.SeededDataset(base, make(), seed=7)
    slow = data.SeededDataset(base, make(), seed=7)
    slow._read_files = False  # the ImageFolder's PIL images, as before
    assert fast._read_files
    for index, (path, _) in enumerate(base.samples):
        a, label_a = fast[SampleKey(index=index, epoch=2)]
        b, label_b = slow[SampleKey(index=index, epoch=2)]
        assert a.shape == b.shape == (3, 48, 48) and a.dtype == b.dtype == torch.uint8 and label_a == label_b
        difference = (a.int() - b.int()).abs()
        if path.endswith(".png"):
            assert difference.max() == 0, path  # PIL path: unchanged
        elif transform == "fixres":  # + colour jitter: torchvision truncates on tensors where PIL rounds
            assert difference.max() <= 3 and difference.float().mean() < 1.5, (path, difference.max())
        else:  # same decoded pixels, same crop; tensor and PIL resampling round differently
            assert difference.max() <= 2 and difference.float().mean() < 0.5, (path, difference.max())


def test_seeded_and_leaves_the_global_generator_alone(jpeg_folder):
    dataset = data.SeededDataset(data.image_folder(jpeg_folder, "train"), data.train_transform(32), seed=3)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = dataset[SampleKey(index=0, epoch=1)][0]
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(first, dataset[SampleKey(index=0, epoch=1)][0])
    others = [dataset[SampleKey(index=0, epoch=e)][0] for e in range(2, 6)]
    assert any(not torch.equal(first, o) for o in others)  # another epoch, another crop


def test_other_transforms_get_pil_images(jpeg_folder):
    seen = []
    dataset = data.SeededDataset(data.image_folder(jpeg_folder, "val"), lambda image: seen.append(image) or 0, seed=0)
    assert not dataset._read_files
    dataset[SampleKey(index=0, epoch=0)]
    assert isinstance(seen[0], Image.Image) and seen[0].mode == "RGB"


@pytest.mark.parametrize("content", ["truncated", "header only"])
def test_broken_jpeg_is_unreadable_or_skipped(tmp_path, content):
    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
    buffer = io.BytesIO()
    _photo(0).save(buffer, "JPEG", quality=90)
    encoded = buffer.getvalue()
    bad = tmp_path / "train" / "a" / "bad.jpg"
    bad.write_bytes(encoded[: len(encoded) // 2] if content == "truncated" else encoded[:20])
    base = data.image_folder(tmp_path, "train")
    with pytest.raises(FixresError, match=f"unreadable image {bad}"):
        data.SeededDataset(base, data.train_transform(32), seed=0)[SampleKey(index=0, epoch=0)]
    assert data.SeededDataset(base, data.train_transform(32), seed=0, skip_bad_images=True)[SampleKey(0, 0)] is None


def test_normalize_in_place_is_exact_and_keeps_channels_last():
    images = torch.randint(0, 256, (2, 3, 9, 7), dtype=torch.uint8)
    mean = torch.tensor(data.IMAGENET_MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(data.IMAGENET_STD).view(1, 3, 1, 1) * 255
    assert torch.equal(data.normalize(images), (images.float() - mean) / std)
    channels_last = data.normalize(images.contiguous(memory_format=torch.channels_last))
    assert channels_last.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(channels_last, (images.float() - mean) / std)
