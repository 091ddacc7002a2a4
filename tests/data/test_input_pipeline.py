"""The fast input path of fixres_dist.data.pipeline (JPEGs decoded to uint8 tensors give what the PIL path gave)
and its training augmentation recipes (auto-augment policies, random erasing, repeated-augmentation copies).

``SeededDataset`` reads JPEG files with ``torchvision.io.decode_jpeg`` and runs the transforms on
uint8 tensors (benchmarks/input_pipeline.py: 1.8-2.6x the torchvision reference per core with
``--jpeg-decode full``); other formats, and JPEGs that decoder refuses, still go through PIL. The scaled
decode (the default) is tests/data/test_scaled_decode.py's.
"""
from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from fixres_dist import FixresError
from fixres_dist.data import images, pipeline
from fixres_dist.data.samplers import SampleKey


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
    make = {"train": lambda: pipeline.train_transform(48), "test": lambda: pipeline.test_transform(48),
            "fixres": lambda: pipeline.finetune_transform(48, "fixres")}[transform]
    base = pipeline.image_folder(jpeg_folder, "train")
    fast = pipeline.SeededDataset(base, make(), seed=7)
    pil_base = copy.copy(base)
    pil_base.loader = lambda path: images.open_rgb(path)  # another loader: the ImageFolder's PIL images, as before
    slow = pipeline.SeededDataset(pil_base, make(), seed=7)
    assert fast.reads_files and not slow.reads_files
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
    dataset = pipeline.SeededDataset(pipeline.image_folder(jpeg_folder, "train"), pipeline.train_transform(32), seed=3)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = dataset[SampleKey(index=0, epoch=1)][0]
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(first, dataset[SampleKey(index=0, epoch=1)][0])
    others = [dataset[SampleKey(index=0, epoch=e)][0] for e in range(2, 6)]
    assert any(not torch.equal(first, o) for o in others)  # another epoch, another crop


def test_other_transforms_get_pil_images(jpeg_folder):
    seen = []
    dataset = pipeline.SeededDataset(pipeline.image_folder(jpeg_folder, "val"), lambda image: seen.append(image) or 0,
                                     seed=0)
    assert not dataset.reads_files
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
    base = pipeline.image_folder(tmp_path, "train")
    with pytest.raises(FixresError, match=f"unreadable image {bad}"):
        pipeline.SeededDataset(base, pipeline.train_transform(32), seed=0)[SampleKey(index=0, epoch=0)]
    skipping = pipeline.SeededDataset(base, pipeline.train_transform(32), seed=0, skip_bad_images=True)
    assert skipping[SampleKey(0, 0)] is None


@pytest.mark.numeric
def test_normalize_in_place_is_exact_and_keeps_channels_last():
    images = torch.randint(0, 256, (2, 3, 9, 7), dtype=torch.uint8)
    mean = torch.tensor(pipeline.IMAGENET_MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(pipeline.IMAGENET_STD).view(1, 3, 1, 1) * 255
    assert torch.equal(pipeline.normalize(images), (images.float() - mean) / std)
    channels_last = pipeline.normalize(images.contiguous(memory_format=torch.channels_last))
    assert channels_last.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(channels_last, (images.float() - mean) / std)


# ----------------------------------------------------------------- training augmentation recipes


def _inputs():
    """The same picture as a uint8 tensor (a decoded JPEG) and as a PIL image (other formats)."""
    picture = _photo(6, (80, 60))
    return {"tensor": torch.from_numpy(np.array(picture)).permute(2, 0, 1).contiguous(), "pil": picture}


@pytest.mark.parametrize("interpolation", pipeline.INTERPOLATIONS)
@pytest.mark.parametrize("policy", pipeline.AUTO_AUGMENT_POLICIES)
def test_each_policy_gives_uint8_crops_from_tensors_and_pil_images(policy, interpolation):
    transform = pipeline.train_transform(40, interpolation, auto_augment=policy, random_erase=0.5)
    for kind, image in _inputs().items():
        for seed in range(4):
            torch.manual_seed(seed)
            out = transform(image)
            assert isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and out.shape == (3, 40, 40), kind


@pytest.mark.parametrize("interpolation", pipeline.INTERPOLATIONS)
def test_default_train_transform_is_the_crop_and_flip_bit_for_bit(interpolation):
    mode = pipeline.INTERPOLATIONS[interpolation]
    before = v2.Compose([v2.RandomResizedCrop(24, interpolation=mode, antialias=True), v2.RandomHorizontalFlip(),
                         pipeline.ToUint8Tensor()])
    for transform in (pipeline.train_transform(24, interpolation),
                      pipeline.train_transform(24, interpolation, auto_augment=None, random_erase=0.0,
                                               fill=(0.5,) * 3)):
        for kind, image in _inputs().items():
            for seed in range(6):
                torch.manual_seed(seed)
                expected = before(image)
                torch.manual_seed(seed)
                assert torch.equal(transform(image), expected), (kind, seed)


@pytest.mark.parametrize("fill", [None, (0.2, 0.6, 1.0)])
def test_erasing_fills_a_box_with_the_mean_colour_that_normalises_to_zero(fill):
    mean = pipeline.IMAGENET_MEAN if fill is None else fill
    colour = torch.tensor([round(255 * m) for m in mean], dtype=torch.uint8).view(3, 1, 1)
    image = torch.full((3, 64, 64), 7, dtype=torch.uint8)  # far from any mean colour
    transform = pipeline.train_transform(64, random_erase=1.0, fill=fill)
    for seed in range(8):
        torch.manual_seed(seed)
        out = transform(image)
        erased = (out == colour).all(0)
        assert (out[:, ~erased] == 7).all(), "only the box changes"
        rows, cols = erased.any(1).nonzero().flatten(), erased.any(0).nonzero().flatten()
        box = erased[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
        assert box.all() and 0.02 * 64 * 64 - 64 <= box.numel() <= 0.33 * 64 * 64 + 64, "one box of 2-33 %"
        normalised = pipeline.normalize(out[None], (mean, pipeline.IMAGENET_STD))[0][:, erased]
        assert normalised.abs().max() <= 0.5 / 255 / min(pipeline.IMAGENET_STD)


def test_augmented_samples_are_seeded_and_each_copy_draws_its_own(jpeg_folder):
    transform = pipeline.train_transform(32, auto_augment="ta_wide", random_erase=0.5)
    dataset = pipeline.SeededDataset(pipeline.image_folder(jpeg_folder, "train"), transform, seed=3)
    assert dataset.reads_files, "JPEGs still reach our transforms decoded"
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = dataset[SampleKey(index=0, epoch=1)][0]
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first, dataset[SampleKey(0, 1, 0)][0]) and torch.equal(first, dataset[SampleKey(0, 1)][0])
    copies = [dataset[SampleKey(0, 1, copy)][0] for copy in range(4)]
    assert all(not torch.equal(a, b) for i, a in enumerate(copies) for b in copies[i + 1:]), "copies differ"
    assert torch.equal(copies[2], dataset[SampleKey(0, 1, 2)][0])


def test_copy_zero_is_seeded_as_before(jpeg_folder):
    transform = pipeline.train_transform(32)
    dataset = pipeline.SeededDataset(pipeline.image_folder(jpeg_folder, "train"), transform, seed=9)
    assert dataset.reads_files
    image = images.read_image(dataset.base.samples[2][0])  # what the transform gets: the decoded file
    torch.manual_seed(int(np.random.SeedSequence([9, 4, 2]).generate_state(1)[0]))
    assert torch.equal(dataset[SampleKey(index=2, epoch=4, copy=0)][0], transform(image))


def test_bad_recipe_values_are_one_line_errors():
    for kwargs, match in [({"auto_augment": "rand-m9"}, "unknown auto-augment policy 'rand-m9'; use one of ra, "),
                          ({"random_erase": 1.5}, "random erasing probability"),
                          ({"random_erase": -0.1}, "random erasing probability"),
                          ({"fill": (0.5, 0.5)}, "fill must be 3 numbers"),
                          ({"fill": (0.5, 0.5, 128)}, "fill must be 3 numbers")]:
        with pytest.raises(FixresError, match=match):
            pipeline.train_transform(32, **kwargs)


def test_loader_passes_repeated_augmentation_to_its_sampler(jpeg_folder):
    base = pipeline.image_folder(jpeg_folder, "train")
    loader = pipeline.make_loader(base, pipeline.train_transform(16), batch_size=2, world_size=1, rank=0, shuffle=True,
                              seed=0, workers=0, training=True, reps=2)
    assert loader.batch_sampler.reps == 2
    assert sum(len(labels) for _, labels, _ in loader) == len(base)
