"""Two more inputs from the field (issue 26): an image above Pillow's decompression-bomb limit, and a
symbolic-link loop in the data folder. Real files: the large images are valid PNG and JPEG files
whose headers declare 200 M pixels (a few KB each); the links are real links."""
from __future__ import annotations

import io
import os
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from conftest import FAST, make_subset, run_main
from fixres_dist.data import file_index, images, pipeline
from fixres_dist.data.samplers import SampleKey
from fixres_dist.errors import FixresError, user_message

WIDTH, HEIGHT = 20_000, 10_000  # 200 M pixels: above twice Pillow's default limit (2 x 89,478,485)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _black_png(path, width: int, height: int) -> None:
    """A complete 1-bit black PNG of ``width`` x ``height`` (its rows compress to almost nothing)."""
    rows = bytes((width + 7) // 8 + 1) * height  # a filter byte and the packed bits of each row, all 0
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1 bit, grey, no interlace
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows))
                     + _chunk(b"IEND", b""))


def _jpeg_declaring(path, width: int, height: int) -> None:
    """A small real JPEG whose frame header (SOF0) declares ``width`` x ``height``."""
    buffer = io.BytesIO()
    Image.new("L", (16, 16)).save(buffer, "JPEG")
    encoded = bytearray(buffer.getvalue())
    sof = encoded.index(b"\xff\xc0")  # marker, length (2), precision (1), height (2), width (2)
    encoded[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    path.write_bytes(bytes(encoded))


def _one_class(root, files: dict) -> None:
    """``root/train/a`` and ``root/val/a`` holding ``files`` (name -> writer(path))."""
    for split in ("train", "val"):
        (root / split / "a").mkdir(parents=True)
        for name, write in files.items():
            write(root / split / "a" / name)


def _too_large(path, pixels: int) -> str:
    limit = 2 * Image.MAX_IMAGE_PIXELS
    return (f"image {path} is too large: {pixels:,} pixels, above Pillow's decompression-bomb limit of {limit:,} "
            "pixels (twice PIL.Image.MAX_IMAGE_PIXELS); downscale or remove it, or pass --skip-bad-images")


@pytest.mark.parametrize("name, write", [("big.png", _black_png), ("big.jpg", _jpeg_declaring)])
def test_an_image_above_the_limit_is_named_in_one_line_or_skipped(tmp_path, name, write):
    """Pillow's own limit, not patched; the JPEG is refused before torchvision's decoder sees it."""
    _one_class(tmp_path, {name: lambda path: write(path, WIDTH, HEIGHT)})
    path = tmp_path / "train" / "a" / name
    with pytest.raises(images.ImageTooLargeError):
        images.open_rgb(str(path))
    base = pipeline.image_folder(tmp_path, "train")
    dataset = pipeline.SeededDataset(base, pipeline.train_transform(8), seed=0)
    assert dataset.reads_files
    with pytest.raises(FixresError) as error:
        dataset[SampleKey(0, 0)]
    assert str(error.value) == _too_large(path, WIDTH * HEIGHT)
    skipping = pipeline.SeededDataset(base, pipeline.train_transform(8), seed=0, skip_bad_images=True)
    assert skipping[SampleKey(0, 0)] is None


@pytest.mark.parametrize("workers", [0, 1])
def test_limits_in_loader_workers(tmp_path, monkeypatch, workers):
    """With a limit of 600 pixels: a 28 x 28 image (784, between the limit and twice it) is decoded
    without a warning (made an error here, so that one would fail the worker too), a 40 x 40 one (1,600)
    is skipped and counted, or named in one line through the worker process."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 600)  # forked loader workers inherit it
    _one_class(tmp_path, {"28.png": lambda p: Image.fromarray(np.full((28, 28), 200, np.uint8)).save(p),
                          "40.png": lambda p: Image.new("L", (40, 40)).save(p)})
    folder = pipeline.image_folder(tmp_path, "train")
    options = dict(batch_size=2, world_size=1, rank=0, shuffle=False, seed=0, workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        skipping = pipeline.make_loader(folder, pipeline.test_transform(16), skip_bad_images=True, **options)
        try:
            [(batch, labels, skipped)] = list(skipping)
        finally:
            pipeline.close_loader(skipping)
        assert batch.shape == (1, 3, 16, 16) and int(batch.max()) == 200 and skipped == 1
        failing = pipeline.make_loader(folder, pipeline.test_transform(16), **options)
        try:
            with pytest.raises(FixresError) as error:
                list(failing)
        finally:
            pipeline.close_loader(failing)
    assert user_message(error.value) == _too_large(tmp_path / "train" / "a" / "40.png", 1600)


# ------------------------------------------------------------------------------------- link loops
def _loop_message(path, how: str) -> str:
    return (f"symbolic-link loop in the data: {path} {how}, so the walk of the folders would never end; "
            "remove that link or point it elsewhere")


def test_a_link_loop_is_refused_in_one_line_before_anything_starts(tmp_path, capsys):
    data = make_subset(tmp_path / "data", 2, 1, classes=3)
    for name in ("0_tshirt_top", "1_trouser"):  # two loops: each level of the walk doubles its paths
        (data / "train" / name / "loop").symlink_to("..")
    status, err = run_main(capsys, "scratch", "--data-path", data, "--shared-folder-path", tmp_path / "s", *FAST)
    how = f"leads back to {data / 'train'}, a folder that holds it"
    line = _loop_message(data / "train" / "0_tshirt_top" / "loop", how)
    assert (status, err) == (1, f"fixres_dist: rank 0: {line}\n")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("where, target, found, back_to", [
    ("train/a/self", ".", "train/a/self", "train/a"),
    ("train/a/sub/up", "../..", "train/a/sub/up", "train"),
    ("val/a/root", "../..", "val/a/root/val", "val"),  # the data folder: found at its val/
])
def test_loops_through_any_folder_above(tmp_path, where, target, found, back_to):
    _one_class(tmp_path, {"1.png": lambda p: p.write_bytes(b"")})
    (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / where).symlink_to(target)
    with pytest.raises(FixresError) as error:
        file_index.build(tmp_path)
    how = f"leads back to {tmp_path / back_to}, a folder that holds it"
    assert str(error.value) == _loop_message(tmp_path / found, how)


def test_a_chain_of_links_back_to_itself(tmp_path):
    _one_class(tmp_path, {"1.png": lambda p: p.write_bytes(b"")})
    (tmp_path / "train" / "a" / "x.png").symlink_to("y.png")
    (tmp_path / "train" / "a" / "y.png").symlink_to("x.png")
    with pytest.raises(FixresError) as error:
        pipeline.scan_split(tmp_path / "train")
    how = "is a chain of links that leads back to itself"
    assert str(error.value) in [_loop_message(tmp_path / "train" / "a" / name, how) for name in ("x.png", "y.png")]


def test_links_that_do_not_loop_are_followed(tmp_path):
    """A class folder that is a link (to a sibling class, or outside), and one folder behind two
    links: walked as torchvision walks them (the folder behind two links, twice)."""
    _one_class(tmp_path, {"1.png": lambda p: p.write_bytes(b"")})
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "o.png").write_bytes(b"")
    (tmp_path / "train" / "b").symlink_to("a")
    (tmp_path / "train" / "c").symlink_to(tmp_path / "outside")
    (tmp_path / "train" / "a" / "l1").symlink_to(tmp_path / "outside")
    (tmp_path / "train" / "a" / "l2").symlink_to(tmp_path / "outside")
    scan = file_index.build(tmp_path).scan("train")
    relative = {name: [os.path.relpath(p, tmp_path / "train") for p in paths] for name, paths in scan.images.items()}
    assert relative == {"a": ["a/1.png", "a/l1/o.png", "a/l2/o.png"], "b": ["b/1.png", "b/l1/o.png", "b/l2/o.png"],
                        "c": ["c/o.png"]}
