"""Packed data (issue 26): the packer's shards and index, read back sample by sample as the ImageFolder
they came from; a run on them equal to the run on the folder; a killed pack continued; each bad input
one line naming the shard or sample."""
from __future__ import annotations

import gzip
import io
import json
import os
import re
import shutil
import tarfile
from pathlib import Path

import attrs
import numpy as np
import pytest

import shown_commands as shown
from conftest import (
    SCRATCH,
    assert_holds_the_folder,
    evaluation_matches_scratch_job,
    run_main,
    run_on_other_data_as_scratch_job,
    run_script,
)
from fixres_dist.config import TrainerConfig
from fixres_dist.data import file_index, packing, pipeline, shards
from fixres_dist.errors import FixresError
from fixres_dist.io import temporary_name
from fixres_dist.training import checkpoint
from fixres_dist.training.checkpoint import CHECKPOINT_FILE, load_checkpoint

SHARD_MIB = 0.008  # about 8 KB of images: tiny_data's 80 train images in 5 shards


@pytest.fixture(scope="module")
def packed(tiny_data, tmp_path_factory) -> Path:
    """:func:`conftest.tiny_data` packed (several train shards, 2 workers)."""
    out = tmp_path_factory.mktemp("packed") / "tiny"
    packing.pack(tiny_data, out, SHARD_MIB, workers=2, progress=False)
    return out


def copy_of(packed: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(packed, tmp_path / "copy"))


def test_the_shards_hold_the_folder_sample_by_sample(tiny_data, packed):
    """Every sample, in order: the same label and the same decoded pixels as the ImageFolder's file;
    several train shards; each is a WebDataset tar (key.png + key.cls); verify reads them all."""
    data = shards.open_packed(packed)
    assert data.classes == pipeline.check_image_folder(tiny_data)
    assert len(data.manifest["splits"]["train"]["shards"]) > 2
    assert_holds_the_folder(tiny_data, data.dataset)
    with tarfile.open(packed / "val-000000.tar") as tar:
        assert tar.getnames()[:2] == ["00000000.png", "00000000.cls"]
    count = sum(len(data.manifest["splits"][split]["shards"]) for split in shards.SPLITS)
    assert packing.verify(packed, progress=False) == f"{packed}: verified {count} shards, 110 images, 10 classes"


def test_a_killed_pack_continues_and_packs_the_same_bytes(tiny_data, packed, tmp_path):
    """Killed after some shards: no shards.json (the set is refused in one line), a temporary file; the
    pack run again removes it, keeps the finished shards and writes the same bytes as at once."""
    out = copy_of(packed, tmp_path)
    (out / shards.MANIFEST).unlink()
    (out / "train-000001.tar").rename(temporary_name(out / "train-000001.tar"))
    with pytest.raises(FixresError, match="holds tar shards but no shards.json: a pack that did not finish"):
        shards.open_packed(out)
    manifest = packing.pack(tiny_data, out, SHARD_MIB, workers=1, progress=False)
    shard_count = sum(len(manifest["splits"][s]["shards"]) for s in shards.SPLITS)
    assert manifest["kept"] == shard_count - 1 and not list(out.glob(".*.tmp"))
    assert json.loads((out / shards.MANIFEST).read_text()) == json.loads((packed / shards.MANIFEST).read_text())


def truncate(out: Path) -> str:
    shard = out / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:-2000])
    return f"shard {shard} is"


def remove_shard(out: Path) -> str:
    (out / "val-000000.tar").unlink()
    return f"shard {out / 'val-000000.tar'} (val) is missing"


def stale_index(out: Path) -> str:
    with np.load(out / "train.index.npz") as arrays:
        changed = dict(arrays)
    changed["offset"] = changed["offset"] + 512
    np.savez(out / "train.index.npz", **changed)
    return f"index {out / 'train.index.npz'} does not match shards.json (stale"


def remove_index(out: Path) -> str:
    (out / "val.index.npz").unlink()
    return f"index {out / 'val.index.npz'} is missing"


def damaged_manifest(out: Path) -> str:
    (out / shards.MANIFEST).write_text("{")
    return f"{out / shards.MANIFEST} is not a packed data manifest"


@pytest.mark.parametrize("damage", [truncate, remove_shard, stale_index, remove_index, damaged_manifest])
def test_a_damaged_pack_is_refused_in_one_line_before_any_rank_starts(packed, tmp_path, capsys, damage):
    out = copy_of(packed, tmp_path)
    expected = damage(out)
    status, err = run_main(capsys, "scratch", "--data-path", out, "--shared-folder-path", tmp_path / "runs",
                           "--job-id", "j", *SCRATCH)
    assert status == 1 and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "runs").exists()


def test_compressed_shards_are_refused_saying_what_is_read_and_how_to_get_it(packed, tmp_path, capsys):
    """Shards gzipped as a download may hold them, without an index: the run and verify say that
    compressed shards are not read and how to decompress them, in one line, writing nothing."""
    out = tmp_path / "gz"
    out.mkdir()
    for shard in packed.glob("*.tar"):
        (out / f"{shard.name}.gz").write_bytes(gzip.compress(shard.read_bytes()))
    before = sorted(os.listdir(out))
    line = (f"{out}/train-000000.tar.gz and {len(before) - 1} more: compressed shards (.tar.gz) are not read, only "
            f"uncompressed .tar shards (a sample is read at its byte offset); decompress them (gunzip {out}/*.tar.gz) "
            "and index them, or pack the images with python -m fixres_dist.data.packing pack")
    status, err = run_main(capsys, "scratch", "--data-path", out, "--shared-folder-path", tmp_path / "runs",
                           "--job-id", "j", *SCRATCH)
    assert status == 1 and err == f"fixres_dist: rank 0: {line}\n", err
    assert packing.main(["verify", str(out), "--no-progress"]) == 1
    assert capsys.readouterr().err == f"fixres_dist: {line}\n"
    assert sorted(os.listdir(out)) == before and not (tmp_path / "runs").exists()


def test_verify_finds_a_changed_byte_that_keeps_the_size(packed, tmp_path):
    out = copy_of(packed, tmp_path)
    shard = out / "train-000000.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF  # inside the first image
    shard.write_bytes(bytes(data))
    shards.open_packed(out)  # sizes and the index still match: a start reads no shard whole
    with pytest.raises(FixresError, match=re.escape(f"shard {shard}: its SHA-256 is not the one in shards.json")):
        packing.verify(out, progress=False)


def test_a_shard_replaced_by_one_of_the_same_size_is_named_at_its_first_read(packed, tmp_path):
    """Same size, same index: a start cannot tell; the first read of a sample from it can (the tar
    header before the image names another key), and ends the run in one line."""
    out = copy_of(packed, tmp_path)
    first, second = out / "train-000000.tar", out / "train-000001.tar"
    size = second.stat().st_size
    second.write_bytes(first.read_bytes()[:size].ljust(size, b"\0"))
    split = shards.open_packed(out).dataset("train")
    number = int(np.argmax(split.shard == 1))
    with pytest.raises(FixresError, match=re.escape(f"{second}:{number:08d}: the shard holds '00000000.png' there")):
        split[number]


def write_tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("members, message", [
    ({"a.png": b"x"}, "sample a: no label (no a.cls member)"),
    ({"a.png": b"x", "a.cls": b"12"}, "sample a: label '12' is not a class number of the class list (0 to 9)"),
    ({"a.png": b"x", "a.cls": b"cat"}, "sample a: label 'cat' is not a class number"),
    ({"a.cls": b"1"}, "sample a: no image members (cls)"),
])
def test_a_foreign_shard_with_a_bad_sample_names_the_shard_and_the_key(tmp_path, members, message):
    shard = write_tar(tmp_path / "train-000000.tar", members)
    with pytest.raises(FixresError, match=re.escape(f"shard {shard}, {message}")):
        shards.index_shard(shard, 10)


def test_a_truncated_tar_is_named(packed, tmp_path):
    shard = tmp_path / "cut.tar"
    shard.write_bytes((packed / "train-000000.tar").read_bytes()[:1300])
    with pytest.raises(FixresError, match=re.escape(f"shard {shard} cannot be read as a tar file")):
        shards.index_shard(shard, 10)


def test_the_pack_command_refuses_what_it_would_overwrite(tiny_data, packed, tmp_path, capsys):
    """A folder of other files, a file, a finished pack of other data: one line each, nothing changed;
    verify of a folder that is no pack says so."""
    (tmp_path / "notes.txt").write_text("mine")
    other_source = Path(shutil.copytree(tiny_data, tmp_path / "elsewhere"))
    finished = copy_of(packed, tmp_path)
    manifest = (finished / shards.MANIFEST).read_text()
    for out, message in ((tmp_path, f"{tmp_path} holds files that are not a pack's (copy, elsewhere, notes.txt)"),
                         (tmp_path / "notes.txt", f"cannot pack into {tmp_path / 'notes.txt'}: File exists"),
                         (finished, f"{finished} holds a pack of {tiny_data.resolve()}, not of {other_source}: packing "
                          "would replace that data")):
        assert packing.main(["pack", str(other_source), str(out), "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"fixres_dist: {message}") and err.count("\n") == 1, err
    assert (tmp_path / "notes.txt").read_text() == "mine" and (finished / shards.MANIFEST).read_text() == manifest
    assert packing.main(["verify", str(tiny_data), "--no-progress"]) == 1
    assert capsys.readouterr().err == (f"fixres_dist: {tiny_data} is not a packed data folder (no shards.json, no "
                                       "tar shards)\n")


@pytest.mark.numeric
@pytest.mark.slow
def test_a_run_on_the_shards_stopped_mid_epoch_resumes_bit_identically(scratch_job, packed, tmp_path):
    """The session's 2-rank scratch job (loader workers, 2 epochs) on the packed data, stopped mid-epoch
    and resumed: equal to the uninterrupted run on the folder, bit for bit."""
    run_on_other_data_as_scratch_job(scratch_job, packed, tmp_path, "data: packed: 80 train and 30 val images in 10 "
                                     "classes")


@pytest.mark.numeric
@pytest.mark.slow
def test_evaluation_on_the_shards_is_exact_on_1_2_and_3_ranks(scratch_job, packed, tmp_path):
    """30 validation images on 1, 2 and 3 ranks (3 does not divide 30 into equal batches of 4): every
    image once, the same top-1 and loss as the folder's evaluation of the same weights."""
    evaluation_matches_scratch_job(scratch_job, packed, tmp_path, (1, 2, 3))


@pytest.mark.slow
def test_the_commands_shown(tiny_data, tmp_path, capsys):
    """docs/data_at_scale.md's commands on tiny_data: pack, verify, train on the shards."""
    pack, verify, train = (shown.argv(c, DATA=tiny_data, **{"/tmp/packed": tmp_path / "packed"})
                           for c in shown.block("python -m fixres_dist.data.packing pack DATA"))
    assert packing.main(pack[3:]) == 0 and packing.main(verify[3:]) == 0
    assert f"{tmp_path / 'packed'}: verified 2 shards, 110 images, 10 classes" in capsys.readouterr().out
    result = run_script("scratch", *train[2:], "--shared-folder-path", tmp_path / "runs")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data: packed: 80 train and 30 val images in 10 classes" in result.stdout


def test_shards_that_the_pack_did_not_write_and_a_pack_inside_its_source_are_refused(tiny_data, tmp_path, capsys):
    """A folder of another tool's shards (or one backup.tar) is never packed over; nor is the data
    folder itself packed into."""
    for name in ("backup.tar", "train-000000.tar"):
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_bytes(b"theirs")
        assert packing.main(["pack", str(tiny_data), str(folder), "--no-progress"]) == 1
        assert (folder / name).read_bytes() == b"theirs"
    err = capsys.readouterr().err.splitlines()
    assert err == [f"fixres_dist: {tmp_path / 'backup_tar'} holds files that are not a pack's (backup.tar): pack into "
                   "a new or empty folder",
                   f"fixres_dist: {tmp_path / 'train-000000_tar'} holds shards that this command did not write (no "
                   ".pack.json): pack into a new or empty folder"]
    assert packing.main(["pack", str(tiny_data), str(tiny_data / "packed"), "--no-progress"]) == 1
    assert "it is inside the data folder" in capsys.readouterr().err and not (tiny_data / "packed").exists()


def test_a_pack_continued_after_its_source_changed_rewrites_the_changed_shards(tiny_data, tmp_path):
    """Two class folders swapped their names (a labelling fix): the shards holding them are written
    again, the others kept, and the pack holds the new labels."""
    source = Path(shutil.copytree(tiny_data, tmp_path / "data"))
    out = tmp_path / "packed"
    packing.pack(source, out, SHARD_MIB, progress=False)
    for split in shards.SPLITS:
        first, second = sorted((source / split).iterdir())[:2]
        first.rename(source / split / "swap")
        second.rename(first)
        (source / split / "swap").rename(second)
    again = packing.pack(source, out, SHARD_MIB, progress=False)
    total = sum(len(again["splits"][split]["shards"]) for split in shards.SPLITS)
    assert 0 < again["kept"] < total
    ours = shards.open_packed(out).dataset("train")
    assert ours.targets == pipeline.image_folder(source, "train").targets
    assert packing.verify(out, progress=False).startswith(f"{out}: verified")


def test_a_hand_edited_manifest_is_refused(packed, tmp_path):
    out = copy_of(packed, tmp_path)
    manifest = json.loads((out / shards.MANIFEST).read_text())
    for change, message in ((lambda m: m["classes"].__setitem__(1, m["classes"][0]), "a class name appears twice"),
                            (lambda m: m["splits"]["val"]["shards"][0].__setitem__("name", "../x.tar"),
                             "shard name '../x.tar' is not a file name ending in .tar"),
                            (lambda m: m["classes"].append("extra"), "class 'extra' has no training images")):
        edited = json.loads(json.dumps(manifest))
        change(edited)
        (out / shards.MANIFEST).write_text(json.dumps(edited))
        with pytest.raises(FixresError, match=re.escape(message)):
            shards.open_packed(out)


def test_a_resume_on_other_images_is_refused(scratch_job, tiny_data, packed, tmp_path):
    """Checkpoints record their data's identity (images per split, a SHA-256 of their names, or of the
    packed shards): the session's job records its folder's; one image fewer, or the images packed,
    is other data for a resume (one line); the same images packed again are the same."""
    saved = load_checkpoint(scratch_job / CHECKPOINT_FILE)["data"]
    copy = Path(shutil.copytree(tiny_data, tmp_path / "data"))
    assert file_index.data_index(copy, None).identity() == saved
    next((copy / "train").rglob("*.png")).unlink()
    fewer = file_index.data_index(copy, None).identity()
    with pytest.raises(FixresError, match=re.escape(f"ckpt.pth was trained on other images than {copy} holds now "
                                                    "(train 80 images then, 79 now, val 30 images then, 30 now;")):
        checkpoint.check_same_data(saved, fewer, "ckpt.pth", copy)
    again = packing.pack(tiny_data, tmp_path / "again", SHARD_MIB, progress=False)
    assert shards.open_packed(tmp_path / "again").identity() == shards.open_packed(packed).identity() != saved
    assert again["kept"] == 0


def test_a_job_continues_on_its_data_copied_elsewhere(tiny_data, packed, tmp_path):
    """--data-path may change on a resume (data staged to node-local disk, moved by an admin): the
    checkpoint's data identity is checked instead, and a copy is the same data; the same command on
    data elsewhere still derives another job id; an older checkpoint, without an identity, continues
    only from its own path."""
    config = TrainerConfig(data_path=str(packed))
    moved = attrs.evolve(config, data_path=str(copy_of(packed, tmp_path)))
    assert moved.changed_since(config.to_dict()) == [] and moved.derived_job_id() != config.derived_job_id()
    identity = shards.open_packed(packed).identity()
    checkpoint.check_same_data(identity, shards.open_packed(moved.data_path).identity(), "ckpt.pth", moved.data_path)
    checkpoint.check_same_data(None, identity, "ckpt.pth", packed, str(packed))
    with pytest.raises(FixresError, match=f"^ckpt.pth was written by an older fixres_dist, which did not record its "
                                          f"data's identity: it continues only on its own --data-path {packed}$"):
        checkpoint.check_same_data(None, identity, "ckpt.pth", moved.data_path, str(packed))
