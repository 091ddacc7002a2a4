"""Data read as it is (issue 13, items 1 and 2): every image mode Pillow opens becomes 8-bit RGB with
its levels; hidden files and folders are no classes and no images. Real files written with Pillow."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets import ImageFolder

from conftest import make_subset, run_script
from fixres_dist.data import images, pipeline
from fixres_dist.data.samplers import SampleKey
from fixres_dist.errors import FixresError
from fixres_dist.training.checkpoint import CHECKPOINT_FILE, load_checkpoint

LEVELS = np.arange(180, dtype=np.uint8).reshape(12, 15)  # 180 grey levels, the image


def _rgb(path) -> np.ndarray:
    """The file as our loader gives it: (H, W, 3) uint8."""
    loaded = images.read_image(str(path))
    return loaded.permute(1, 2, 0).numpy() if isinstance(loaded, torch.Tensor) else np.asarray(loaded)


def _grey(values: np.ndarray) -> np.ndarray:
    return np.repeat(values[..., None], 3, axis=2)


# name -> (write the file into a folder and return its path, the 8-bit RGB levels expected)
def _png16(folder):
    path = folder / "grey16.png"
    Image.fromarray(LEVELS.astype(np.uint16) * 257).save(path)  # Pillow opens it as I;16
    return path, _grey(LEVELS)


def _tiff16_big_endian(folder):
    path = folder / "grey16be.tif"
    Image.fromarray((LEVELS.astype(np.uint16) * 257).astype(">u2")).save(path)
    return path, _grey(LEVELS)


def _pgm16(folder):
    path = folder / "grey16.pgm"  # maxval 4095: Pillow rescales to 0-65535 and opens it as I
    raw = np.round(LEVELS.astype(np.float64) * 4095 / 255).astype(">u2")
    path.write_bytes(b"P5\n15 12\n4095\n" + raw.tobytes())
    return path, _grey(LEVELS)


def _tiff_int32(folder):
    path = folder / "grey32.tif"  # BitsPerSample 32: the scale is 0 .. 2**31 - 1
    Image.fromarray(np.round(LEVELS.astype(np.float64) * (2 ** 31 - 1) / 255).astype(np.int32)).save(path)
    return path, _grey(LEVELS)


def _tiff_float(folder):
    path = folder / "greyf.tif"
    Image.fromarray(LEVELS.astype(np.float32) / 255).save(path)
    return path, _grey(LEVELS)


def _palette_transparent(folder):
    path = folder / "palette.png"
    image = Image.fromarray(LEVELS).convert("P")
    transparent = int(np.asarray(image)[0, 0])  # the palette entry of level 0
    image.save(path, transparency=transparent)
    return path, _grey(LEVELS)  # level 0 is transparent over black: black, as it was


def _la(folder):
    path = folder / "la.png"
    alpha = np.full_like(LEVELS, 255)
    alpha[0, :5] = 0  # transparent pixels hiding a colour: black over black
    Image.fromarray(np.stack([LEVELS, alpha], axis=2), "LA").save(path)
    expected = LEVELS.copy()
    expected[0, :5] = 0
    return path, _grey(expected)


def _rgba(folder):
    path = folder / "rgba.png"
    rgb = np.stack([LEVELS, 255 - LEVELS, np.full_like(LEVELS, 7)], axis=2)
    alpha = np.full_like(LEVELS, 255)
    alpha[1, 1] = 0
    alpha[2, 2] = 51  # 20 %: (32, 223, 7) over black is (6.4, 44.6, 1.4)
    Image.fromarray(np.concatenate([rgb, alpha[..., None]], axis=2), "RGBA").save(path)
    expected = rgb.copy()
    expected[1, 1] = 0
    expected[2, 2] = (6, 45, 1)
    return path, expected


def _cmyk(folder):
    path = folder / "cmyk.tif"
    image = Image.fromarray(np.stack([LEVELS, 255 - LEVELS, np.full_like(LEVELS, 7)], axis=2)).convert("CMYK")
    image.save(path)
    return path, np.asarray(image.convert("RGB"))  # Pillow's own conversion


def _bilevel(folder):
    path = folder / "bilevel.png"
    Image.fromarray(LEVELS >= 90).save(path)  # mode 1
    return path, _grey(np.where(LEVELS >= 90, 255, 0).astype(np.uint8))


MODES = {"I;16 png": (_png16, "I;16"), "I;16B tiff": (_tiff16_big_endian, "I;16B"), "I pgm maxval 4095": (_pgm16, "I"),
         "I 32-bit tiff": (_tiff_int32, "I"), "F tiff": (_tiff_float, "F"),
         "P + transparency": (_palette_transparent, "P"),
         "LA": (_la, "LA"), "RGBA": (_rgba, "RGBA"), "CMYK": (_cmyk, "CMYK"), "1": (_bilevel, "1")}


@pytest.mark.parametrize("case", list(MODES))
def test_every_mode_becomes_8bit_rgb_with_its_levels(tmp_path, case):
    write, mode = MODES[case]
    path, expected = write(tmp_path)
    assert Image.open(path).mode == mode  # the mode the case is about
    assert np.array_equal(_rgb(path), expected)


def test_16bit_grey_keeps_its_180_levels_through_the_data_pipeline(tmp_path):
    """The issue's case: before, Pillow's convert("RGB") clipped them to 0 and 255."""
    for split in ("train", "val"):
        (tmp_path / split / "grey").mkdir(parents=True)
        Image.fromarray(LEVELS.astype(np.uint16) * 257).save(tmp_path / split / "grey" / "a.png")
    assert len(np.unique(np.asarray(Image.open(tmp_path / "train" / "grey" / "a.png").convert("RGB")))) == 2
    folder = pipeline.image_folder(tmp_path, "train")
    assert np.array_equal(np.asarray(folder[0][0]), _grey(LEVELS))
    dataset = pipeline.SeededDataset(folder, pipeline.test_transform(12, crop_ratio=1.0, interpolation="nearest"),
                                     seed=0)
    image, _ = dataset[SampleKey(index=0, epoch=0)]
    assert image.dtype == torch.uint8 and len(torch.unique(image)) == 144  # the centre 12 x 12 of the levels
    assert torch.equal(image[0], torch.from_numpy(LEVELS[:, 2:14].copy()))  # CenterCrop: columns 2-13 of 15


@pytest.mark.parametrize("values, mode, reason", [
    (np.array([[0.0, 0.5, 2.0]], dtype=np.float32), "F", r"mode F image has values 0 to 2, outside its scale 0-1"),
    (np.array([[0.0, np.nan, 1.0]], dtype=np.float32), "F", r"mode F image holds non-finite values"),
    (np.array([[-5, 0, 100]], dtype=np.int32), "I", r"mode I image has values -5 to 100, outside its scale"),
])
def test_values_without_an_8bit_meaning_are_named_like_any_unreadable_image(tmp_path, values, mode, reason):
    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
    path = tmp_path / "train" / "a" / "odd.tif"
    Image.fromarray(values).save(path)
    assert Image.open(path).mode == mode
    with pytest.raises(images.ImageModeError, match=reason):
        images.read_image(str(path))
    base = pipeline.image_folder(tmp_path, "train")
    with pytest.raises(FixresError, match=rf"^unreadable image {path} \(ImageModeError: {reason}.*--skip-bad-images$"):
        pipeline.SeededDataset(base, pipeline.train_transform(8), seed=0)[SampleKey(0, 0)]
    skipping = pipeline.SeededDataset(base, pipeline.train_transform(8), seed=0, skip_bad_images=True)
    assert skipping[SampleKey(0, 0)] is None


def test_premultiplied_and_unconvertible_modes():
    rgba = Image.fromarray(np.array([[[200, 100, 50, 128]]], dtype=np.uint8), "RGBA")
    premultiplied = rgba.convert("RGBa")  # already "over black"
    assert np.array_equal(np.asarray(images.to_rgb8(premultiplied)), np.asarray(images.to_rgb8(rgba)))
    assert np.array_equal(np.asarray(images.to_rgb8(rgba))[0, 0], np.round(np.array([200, 100, 50]) * 128 / 255))


# ------------------------------------------------------------------------------------------ hidden
HIDDEN = {"train": [".ipynb_checkpoints/0_tshirt_top-checkpoint.png", ".snapshot/hourly.0/x.png",
                    "0_tshirt_top/.ipynb_checkpoints/a-checkpoint.png", "1_trouser/._macos.png", ".DS_Store/y.png",
                    ".DS_Store_file"],
          "val": [".ipynb_checkpoints/0_tshirt_top-checkpoint.png", ".DS_Store/y.png", "2_pullover/.hidden.png"]}


@pytest.fixture(scope="module")
def hidden_data(tmp_path_factory):
    """3 real classes; hidden folders holding an image in train/ and val/ (at the top, in classes)."""
    root = make_subset(tmp_path_factory.mktemp("hidden"), 4, 2, classes=3)
    some_image = next((root / "train" / "0_tshirt_top").iterdir())
    for split, paths in HIDDEN.items():
        for relative in paths:
            (root / split / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(some_image, root / split / relative)
    return root


def test_hidden_files_and_folders_are_neither_classes_nor_images(hidden_data):
    assert pipeline.check_image_folder(hidden_data) == ["0_tshirt_top", "1_trouser", "2_pullover"]
    train = pipeline.image_folder(hidden_data, "train")
    assert train.classes == ["0_tshirt_top", "1_trouser", "2_pullover"] and len(train) == 12
    assert not any("/." in path for path, _ in train.samples)
    # each hidden entry counted once: nothing under a hidden folder is walked
    assert sorted(os.path.relpath(p, hidden_data / "train") for p in train.hidden) == \
        [".DS_Store", ".DS_Store_file", ".ipynb_checkpoints", ".snapshot", "0_tshirt_top/.ipynb_checkpoints",
         "1_trouser/._macos.png"]
    assert len(pipeline.image_folder(hidden_data, "val").hidden) == 3
    # the order of the visible images is torchvision's ImageFolder's
    visible = make_subset(hidden_data.parent / "plain", 4, 2, classes=3)
    reference = ImageFolder(str(visible / "train"))
    assert [p.rsplit("/", 2)[1:] for p, _ in train.samples] == [p.rsplit("/", 2)[1:] for p, _ in reference.samples]


def test_a_run_trains_only_the_real_classes_and_says_what_it_skipped(hidden_data, tmp_path):
    """The issue's case: a hidden folder was trained as a 4th class (head [4, 512])."""
    proc = run_script("scratch", "--data-path", hidden_data, "--shared-folder-path", tmp_path, "--job-id", "h",
                      "--architecture", "resnet20", "--input-size", 16, "--batch", 4, "--epochs", 1, "--workers", 0,
                      "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data: skipped 9 hidden files and folders (train/.DS_Store, train/.DS_Store_file, " \
           "train/.ipynb_checkpoints, ...)" in proc.stdout
    state = load_checkpoint(tmp_path / "h" / CHECKPOINT_FILE)
    assert tuple(state["model"]["fc.weight"].shape) == (3, 64)
    evals = [json.loads(line) for line in (tmp_path / "h" / "metrics.jsonl").read_text().splitlines()]
    assert [e["images"] for e in evals if e["event"] == "eval"] == [6]


def test_nested_folders_keep_imagefolders_order(tmp_path):
    image = Image.fromarray(LEVELS)
    for relative in ["b/z.png", "b/sub/a.png", "b/sub/deeper/c.PNG", "b/a.png", "b/sub2/x.jpg", "a/q.png",
                     "a/.hidden/y.png", "b/not-an-image.txt"]:
        (tmp_path / "train" / relative).parent.mkdir(parents=True, exist_ok=True)
        image.save(tmp_path / "train" / relative, format="PNG" if not relative.endswith(".jpg") else "JPEG") \
            if relative.lower().endswith((".png", ".jpg")) else (tmp_path / "train" / relative).write_text("x")
    (tmp_path / "train" / "b" / "folder.png").mkdir()  # named like an image: not one
    ours = pipeline.image_folder(tmp_path, "train")
    reference = ImageFolder(str(tmp_path / "train"))
    assert ours.samples == [s for s in reference.samples if "/." not in s[0]]
    assert [os.path.relpath(p, tmp_path / "train") for p in ours.hidden] == ["a/.hidden"]
