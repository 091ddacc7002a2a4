"""``packing pack --max-side N [--quality Q]`` (issue 44, item 2): images stored at most N pixels on their shorter
side, the same bytes every time, recorded in shards.json; a run needing more pixels refused in one line."""
from __future__ import annotations

import io
import tarfile
import types
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fixres_dist.config import TrainerConfig
from fixres_dist.data import packing, shards
from fixres_dist.errors import FixresError
from fixres_dist.training import inputs

SIZES = {"wide.jpg": (200, 150), "tall.png": (90, 120), "small.png": (40, 30), "rgba.png": (130, 100)}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """Two classes, each split: a 200 x 150 JPEG, a 90 x 120 PNG, a 40 x 30 PNG, a 130 x 100 RGBA PNG."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in ("a", "b"):
            folder = root / split / name
            folder.mkdir(parents=True)
            for file, (width, height) in SIZES.items():
                mode = "RGBA" if file.startswith("rgba") else "RGB"
                pixels = rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
                Image.fromarray(pixels, mode).save(folder / file)
    return root


def members(out: Path, shard: str = "train-000000.tar") -> dict[str, bytes]:
    with tarfile.open(out / shard) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_images_are_stored_at_most_n_pixels_on_their_shorter_side(source, tmp_path):
    """Larger images become JPEGs whose shorter side is N (the longer one rounded); the smaller one keeps
    its bytes and format; shards.json records the side and quality; a second pack writes the same bytes."""
    manifest = packing.pack(source, tmp_path / "p64", workers=2, progress=False, max_side=64)
    assert (manifest["max_side"], manifest["quality"]) == (64, packing.QUALITY)
    stored = members(tmp_path / "p64")
    found = {name: Image.open(io.BytesIO(data)) for name, data in stored.items() if not name.endswith(".cls")}
    order = sorted(SIZES)  # the class folder's files in ImageFolder's order: by name
    for number, file in enumerate(order):
        image = found[f"{number:08d}.{'png' if file == 'small.png' else 'jpg'}"]
        width, height = SIZES[file]
        if file == "small.png":
            assert image.format == "PNG" and image.size == (40, 30)
            assert stored[f"{number:08d}.png"] == (source / "train" / "a" / file).read_bytes()
        else:
            scale = 64 / min(width, height)
            assert image.format == "JPEG" and image.mode == "RGB"
            assert image.size == (round(width * scale), round(height * scale))
            assert min(image.size) == 64
    data = shards.open_packed(tmp_path / "p64")
    assert data.max_side == 64 and "shorter sides at most 64 px" in data.describe()
    again = packing.pack(source, tmp_path / "again", workers=1, progress=False, max_side=64)
    assert again["splits"] == manifest["splits"]  # the same SHA-256 of every shard and index


def test_a_pack_continued_with_another_max_side_is_rewritten(source, tmp_path):
    """The same source packed into the same folder with another --max-side or --quality: every shard is
    written again, and the pack equals a fresh one with the new settings."""
    out = tmp_path / "out"
    packing.pack(source, out, progress=False, max_side=64)
    changed = packing.pack(source, out, progress=False, max_side=48, quality=80)
    fresh = packing.pack(source, tmp_path / "fresh", progress=False, max_side=48, quality=80)
    assert changed["kept"] == 0 and changed["splits"] == fresh["splits"] and changed["max_side"] == 48
    assert packing.pack(source, out, progress=False, max_side=48, quality=80)["kept"] == len(
        fresh["splits"]["train"]["shards"]) + len(fresh["splits"]["val"]["shards"])


@pytest.mark.parametrize("argv, status, message", [
    (["--max-side", "0"], 2, "argument --max-side: must be a positive whole number, got 0"),
    (["--max-side", "abc"], 2, "argument --max-side: 'abc' is not a whole number"),
    (["--max-side", "64", "--quality", "0"], 2, "argument --quality: must be a positive whole number, got 0"),
    (["--max-side", "64", "--quality", "96"], 2, "argument --quality: must be 1 to 95 (above 95 the files only grow)"),
    (["--quality", "80"], 2, "--quality is the JPEG quality of the images --max-side resizes: give --max-side too"),
])
def test_bad_values_are_one_line_and_write_nothing(source, tmp_path, capsys, argv, status, message):
    out = tmp_path / "out"
    try:
        code = packing.main(["pack", str(source), str(out), "--no-progress", *argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == status and message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_the_function_refuses_what_the_command_line_refuses(source, tmp_path):
    with pytest.raises(FixresError, match="--quality must be 1 to 95"):
        packing.pack(source, tmp_path / "out", progress=False, max_side=64, quality=101)
    with pytest.raises(FixresError, match="give --max-side too"):
        packing.pack(source, tmp_path / "out", progress=False, quality=80)
    assert not (tmp_path / "out").exists()


def test_an_unreadable_image_is_named_in_one_line(source, tmp_path):
    broken = tmp_path / "broken"
    for split in ("train", "val"):
        (broken / split / "a").mkdir(parents=True)
        Image.new("RGB", (100, 80)).save(broken / split / "a" / "good.jpg")
    (broken / "train" / "a" / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    with pytest.raises(FixresError, match=r"^cannot pack .*bad\.jpg: OSError: .*; replace or remove it, then run the "
                                          r"command again \(finished shards are kept\)$"):
        packing.pack(broken, tmp_path / "out", progress=False, max_side=64)


def run_inputs(pack: Path):
    """What the preflight's check reads of a run's inputs: the packed data, no weight file."""
    return types.SimpleNamespace(index=shards.open_packed(pack), weights=None)


@pytest.fixture(scope="module")
def pack64(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pack64") / "p"
    packing.pack(source, out, progress=False, max_side=64)
    return out


@pytest.mark.parametrize("fields, message", [
    ({"input_size": 72, "test_size": 40},
     "training at 72 px (RandomResizedCrop's largest box is the whole image) needs 72 px: pack again with --max-side "
     "72 or more, or use 64 px or less"),
    ({"input_size": 56, "test_size": 64}, "test resolution 64 px (64 / crop ratio 0.875) needs 73 px: pack again "
                                          "with --max-side 73 or more, or use 56 px or less"),
    ({"input_size": 32, "test_sizes": (32, 48, 60)}, "test resolution 60 px (60 / crop ratio 0.875) needs 69 px"),
    ({"mode": "finetune", "input_size": 64, "train_size": 32, "weight_path": "w.pth"},
     "the finetune at 64 px (64 / crop ratio 0.875) needs 73 px"),
    ({"input_size": 72, "test_size": 64}, "test resolution 64 px (64 / crop ratio 0.875) needs 73 px"),  # the most
    ({"input_size": 64, "test_size": 64, "crop_ratio": 1.0}, None),
    ({"input_size": 64, "test_size": 56}, None),
])
def test_a_run_needing_more_pixels_than_the_pack_holds_is_refused(pack64, fields, message):
    """The preflight's check (before any rank starts): scratch training at K needs K, a test resolution
    or a finetune at K needs round(K / crop ratio); the one needing the most is named; within the pack's
    side it passes."""
    config = TrainerConfig(data_path=str(pack64), architecture="resnet20", **fields)
    if message is None:
        inputs.check_pack_sizes(config, run_inputs(pack64))
        return
    with pytest.raises(FixresError) as refused:
        inputs.check_pack_sizes(config, run_inputs(pack64))
    assert str(refused.value).startswith(f"--data-path {pack64}: the pack holds images with shorter sides of at most "
                                         "64 px (packed with --max-side 64); ")
    assert message in str(refused.value)
