"""WebDataset shards written by another tool (here Python's tarfile by hand, with names of their own),
indexed in place by ``python -m fixres_dist.data.packing index``: read back sample by sample as they
were written, the shards untouched; each bad input one line, nothing written; a corrupt image in a
shard named ``shard:key`` by a run's dataset, or skipped and counted. In-process: no run is started."""
from __future__ import annotations

import errno
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import shown_commands as shown
from conftest import as_tensor
from fixres_dist.data import images, packing, pipeline, shards
from fixres_dist.data.samplers import SampleKey
from fixres_dist.errors import FixresError

CLASSES = ["cat", "dog", "bird"]
WRITTEN = {"shards.json", "train.index.npz", "val.index.npz"}


def image_bytes(value: int, kind: str = "PNG") -> bytes:
    pixels = np.random.default_rng(value).integers(0, 256, (5, 6, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, kind)
    return buffer.getvalue()


def write_shard(path: Path, samples: list[tuple[str, str, bytes, bytes]], tar_format=tarfile.PAX_FORMAT,
                extra: tuple[tuple[str, bytes], ...] = ()) -> None:
    """A WebDataset shard as another tool writes it: per sample ``(key, image extension, image bytes,
    .cls bytes)``, the image member then the label member; then the ``extra`` members ``(name, bytes)``."""
    members = [m for key, ext, data, label in samples for m in ((f"{key}.{ext}", data), (f"{key}.cls", label))]
    with tarfile.open(path, "w", format=tar_format) as tar:
        for name, content in members + list(extra):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(content), 1700000000
            tar.addfile(info, io.BytesIO(content))


def foreign_shards(folder: Path, classes: int = 3) -> dict[str, list[tuple[str, bytes, int]]]:
    """Shards named as another tool names them, in ``folder``: ``mydata-train-{2,10,0}.tar`` (natural
    order 0, 2, 10), ``mydata-validation-0.tar``, an ignored ``mydata-test-0.tar`` and a classes.txt;
    keys with a ``./`` folder prefix or dots in a folder, PNG (``.png``, ``.PNG``) and JPEG images, a
    member of another kind and a hidden file (macOS's ``._`` files: no sample). Returns each split's
    samples ``(key, image bytes, label)`` in the order a reader gives them."""
    folder.mkdir(parents=True, exist_ok=True)
    expected: dict[str, list[tuple[str, bytes, int]]] = {"train": [], "val": []}
    for number in (0, 2, 10):
        samples = [(f"./s{number:02d}_{i}", "png" if i % 2 else "PNG", image_bytes(number * 10 + i),
                    str(i % classes).encode()) for i in range(classes + 1)]
        write_shard(folder / f"mydata-train-{number}.tar", samples)
        expected["train"] += [(key, data, int(label)) for key, _, data, label in samples]
    samples = [(f"v1.0/img{i}", "jpeg", image_bytes(100 + i, "JPEG"), f"{i % classes}\n".encode()) for i in range(3)]
    write_shard(folder / "mydata-validation-0.tar", samples, extra=(("v1.0/img0.json", b"{}"),  # not an image
                                                                    ("v1.0/._img1.jpeg", b"macOS")))  # hidden
    expected["val"] = [(key, data, int(label.strip())) for key, _, data, label in samples]
    write_shard(folder / "mydata-test-0.tar", [("t", "png", image_bytes(0), b"0")])
    (folder / "classes.txt").write_text("\n".join(CLASSES[:classes]) + "\n")
    return expected


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def index_command(capsys, folder: Path, *options: str) -> tuple[int, str, str]:
    status = packing.main(["index", str(folder), "--no-progress", "--workers", "2", *options])
    out, err = capsys.readouterr()
    return status, out, err


def test_shards_written_by_hand_are_indexed_in_place_and_read_back_sample_by_sample(tiny_data, tmp_path, capsys):
    """Train shards in natural order, val from ``validation``, the test shard left out; the shards
    unchanged, only the index files and shards.json added; every sample's bytes, image and class as
    written; verify passes; indexing again gives the same files; pack never writes there."""
    folder = tmp_path / "foreign"
    expected = foreign_shards(folder)
    before = digests(folder)
    status, out, err = index_command(capsys, folder, "--classes", str(folder / "classes.txt"))
    assert status == 0 and err == "", err
    assert out == (f"{folder}: indexed 12 train images in 3 shards, 3 val images in 1 shard, 3 classes (1 other .tar "
                   "file left out: mydata-test-0.tar); use it as --data-path\n")
    after = digests(folder)
    assert {name: after[name] for name in before} == before and set(after) - set(before) == WRITTEN
    data = shards.open_packed(folder)
    assert data.classes == CLASSES and [s["name"] for s in data.manifest["splits"]["train"]["shards"]] == [
        "mydata-train-0.tar", "mydata-train-2.tar", "mydata-train-10.tar"]
    assert data.describe().startswith("data: indexed: 12 train and 3 val images in 3 classes, 4 shards of")
    for split in shards.SPLITS:
        ours = data.dataset(split)
        assert len(ours) == len(expected[split]) and ours.targets == [label for _, _, label in expected[split]]
        for number, (key, raw, label) in enumerate(expected[split]):
            assert ours.read(number) == raw and ours.item_name(number).endswith(f".tar:{key}")
            image, our_label = ours[number]
            assert our_label == label
            assert torch.equal(as_tensor(image), as_tensor(images.decode_image(raw))), key
    assert packing.main(["verify", str(folder), "--no-progress"]) == 0
    assert capsys.readouterr().out == f"{folder}: verified 4 shards, 15 images, 3 classes\n"
    identity = data.identity()
    assert index_command(capsys, folder, "--classes", str(folder / "classes.txt"))[0] == 0
    assert digests(folder) == after and shards.open_packed(folder).identity() == identity
    assert packing.main(["pack", str(tiny_data), str(folder), "--no-progress"]) == 1
    assert capsys.readouterr().err.startswith(f"fixres_dist: {folder} holds files that are not a pack's")
    assert digests(folder) == after


def test_without_classes_the_labels_numbers_name_the_classes_and_globs_choose_the_shards(tiny_data, tmp_path,
                                                                                         capsys):
    """No --classes: classes "0", "1", "2", with a one-line note; --train/--val pick shards by pattern
    (here the test shard as val); shards named as ShardWriter's default (train-000000.tar) and indexed
    are still never packed over."""
    folder = tmp_path / "foreign"
    foreign_shards(folder)
    status, out, err = index_command(capsys, folder, "--train", "mydata-train-1*.tar", "--val", "*-test-*")
    assert status == 0 and err == ("fixres_dist: note: no --classes: the classes are named by their numbers, 0 to 2, "
                                   "and a checkpoint knows them by number only; give their names with --classes "
                                   "FILE\n")
    assert out.startswith(f"{folder}: indexed 4 train images in 1 shard, 1 val images in 1 shard, 3 classes (3 other")
    data = shards.open_packed(folder)
    assert data.classes == ["0", "1", "2"] and data.dataset("val").item_name(0) == f"{folder}/mydata-test-0.tar:t"
    named = tmp_path / "named"
    named.mkdir()
    write_shard(named / "train-000000.tar", [("a", "png", image_bytes(1), b"0")])
    write_shard(named / "val-000000.tar", [("b", "png", image_bytes(2), b"0")])
    assert index_command(capsys, named)[0] == 0 and len(shards.open_packed(named).dataset("train")) == 1
    assert packing.main(["pack", str(tiny_data), str(named), "--no-progress"]) == 1
    assert capsys.readouterr().err == (f"fixres_dist: {named} holds shards that this command did not write (no "
                                       ".pack.json): pack into a new or empty folder\n")


@pytest.mark.parametrize("tar_format", [tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT])
def test_long_keys_of_every_tar_format_are_read_back(tmp_path, capsys, tar_format):
    """Keys of over 100 bytes (a GNU long name, a USTAR prefix, a PAX header): the header before each
    image is checked at every read, and holds for all three."""
    folder = tmp_path / "long"
    folder.mkdir()
    key = "a" * 60 + "/" + "b" * 70
    write_shard(folder / "x-train.tar", [(key, "png", image_bytes(1), b"0")], tar_format)
    write_shard(folder / "x-val.tar", [("short", "png", image_bytes(2), b"0")], tar_format)
    assert index_command(capsys, folder)[0] == 0
    assert shards.open_packed(folder).dataset("train").read(0) == image_bytes(1)


def truncated(folder: Path) -> str:
    shard = folder / "mydata-train-2.tar"
    shard.write_bytes(shard.read_bytes()[:1500])
    return f"shard {shard} cannot be read as a tar file"


def unlabelled(folder: Path) -> str:
    write_shard(folder / "mydata-train-2.tar", [("a", "png", image_bytes(1), b"0")])
    with tarfile.open(folder / "mydata-train-2.tar", "a") as tar:
        info = tarfile.TarInfo("lonely.png")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"png"))
    return f"shard {folder / 'mydata-train-2.tar'}, sample lonely: no label (no lonely.cls member)"


def repeated_key(folder: Path) -> str:
    """A key written twice in one shard, apart: indexed by key, one of its images would be silently left
    out."""
    shard = folder / "mydata-train-2.tar"
    write_shard(shard, [("a", "png", image_bytes(1), b"0"), ("b", "png", image_bytes(2), b"1"),
                        ("a", "png", image_bytes(3), b"2")])
    return (f"shard {shard}, sample a: the key is repeated: a.png (at byte 0) and a.png (at byte 4,096) are both its "
            ".png, and one would be left out; a key names one sample in a shard: write the shard again with unique "
            "keys")


def compressed_shard(folder: Path) -> str:
    """A shard gzipped as some tools write them: not read, and not to be silently left out either."""
    shard = folder / "mydata-train-2.tar"
    (folder / "mydata-train-2.tar.gz").write_bytes(gzip.compress(shard.read_bytes()))
    shard.unlink()
    return (f"{folder}/mydata-train-2.tar.gz: compressed shards (.tar.gz) are not read, only uncompressed .tar shards "
            f"(a sample is read at its byte offset); decompress them (gunzip {folder}/*.tar.gz) and index them, or "
            "pack the images with python -m fixres_dist.data.packing pack")


def val_label_no_training_class(folder: Path) -> str:
    write_shard(folder / "mydata-validation-0.tar", [("v", "png", image_bytes(1), b"7")])
    return f"shard {folder / 'mydata-validation-0.tar'}, sample v: label 7 is not a class of the train shards (0 to 2)"


def number_without_training_images(folder: Path) -> str:
    write_shard(folder / "mydata-train-2.tar", [("a", "png", image_bytes(1), b"9")])
    return "no training sample has label 3, yet the train shards' labels go up to 9"


def no_val_shard(folder: Path) -> str:
    (folder / "mydata-validation-0.tar").unlink()
    return f"no val shards in {folder} (no *.tar file named *val*); choose them with --val GLOB"


def written_by_pack(folder: Path) -> str:
    (folder / packing.STATE).write_text("{}")
    return (f"{folder} was written by the pack command (.pack.json) and has its index: check it with python -m "
            f"fixres_dist.data.packing verify {folder}")


def another_tools_manifest(folder: Path) -> str:
    (folder / "shards.json").write_text('{"shards": ["mydata-train-0.tar"]}')
    return f"{folder / 'shards.json'} was not written by this index command: indexing would replace it"


def refused_in_one_line(capsys, folder: Path, expected: str, *options: str) -> None:
    """``index`` of ``folder`` fails with the one line that starts with ``expected``, and writes nothing."""
    before = digests(folder)
    status, out, err = index_command(capsys, folder, *options)
    assert status == 1 and out == "" and err.startswith(f"fixres_dist: {expected}") and err.count("\n") == 1, err
    assert digests(folder) == before


@pytest.mark.parametrize("damage", [truncated, unlabelled, repeated_key, compressed_shard, val_label_no_training_class,
                                    number_without_training_images, no_val_shard, written_by_pack,
                                    another_tools_manifest])
def test_each_bad_input_is_one_line_and_nothing_is_written(tmp_path, capsys, damage):
    folder = tmp_path / "foreign"
    foreign_shards(folder)
    refused_in_one_line(capsys, folder, damage(folder))


@pytest.mark.parametrize("names, message", [
    ("cat\ndog\n", "shard {folder}/mydata-train-0.tar, sample ./s00_2: label '2' is not a class number of the class "
                   "list (0 to 1)"),
    ("cat\ndog\nbird\nfish\n", "class 'fish' (line 4 of {folder}/classes.txt) has no training images in the train "
                               "shards of {folder}"),
    ("cat\ndog\ncat\n", "{folder}/classes.txt, line 3: class 'cat' again (line 1); class names are unique"),
    ("cat\n\ndog\n", "{folder}/classes.txt, line 2: empty; one class name per line, line 1 for label 0"),
])
def test_a_bad_class_list_is_one_line_and_nothing_is_written(tmp_path, capsys, names, message):
    """A label beyond the list, a class without training images, a name twice, an empty line."""
    folder = tmp_path / "foreign"
    foreign_shards(folder)
    (folder / "classes.txt").write_text(names)
    refused_in_one_line(capsys, folder, message.format(folder=folder), "--classes", str(folder / "classes.txt"))


def test_a_missing_folder_a_file_and_a_folder_without_shards_are_named(tmp_path, capsys):
    (tmp_path / "file.tar").write_bytes(b"")
    for folder, message in ((tmp_path / "none", f"{tmp_path / 'none'} is missing: give the folder that holds the "
                                                "shards"),
                            (tmp_path / "file.tar", f"{tmp_path / 'file.tar'} is not a folder: give the folder"),
                            (tmp_path, f"no train shards in {tmp_path} (no *.tar file named *train*); choose them "
                                       "with --train GLOB")):
        status, out, err = index_command(capsys, folder)
        assert status == 1 and err.startswith(f"fixres_dist: {message}") and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == ["file.tar"]
    (tmp_path / "file.tar").rename(tmp_path / "file-train.tar.bz2")  # chosen by a glob: still compressed
    status, out, err = index_command(capsys, tmp_path, "--train", "*train*")
    assert status == 1 and err.startswith(f"fixres_dist: {tmp_path}/file-train.tar.bz2: compressed shards (.tar.bz2) "
                                          f"are not read") and f"(bunzip2 {tmp_path}/*.tar.bz2)" in err, err


def test_a_read_only_folder_is_refused_and_a_folder_of_links_to_it_indexed(tmp_path, capsys, monkeypatch):
    """A shared dataset's read-only folder (EROFS, as root sees it too): one line saying what to do,
    nothing written; the folder of links it suggests is indexed and read."""
    folder = tmp_path / "shared"
    expected = foreign_shards(folder)
    real_open = os.open

    def read_only(path, flags, *args):
        if Path(path).parent == folder and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)
    monkeypatch.setattr(os, "open", read_only)
    status, _, err = index_command(capsys, folder)
    assert status == 1 and err == (f"fixres_dist: cannot write the index into {folder} (Read-only file system; a "
                                   "shared dataset's read-only copy?): index a copy of the shards, or a folder of "
                                   f"links to them (mkdir NEW && ln -s {folder}/*.tar NEW/), instead\n")
    assert not set(os.listdir(folder)) & WRITTEN
    links = tmp_path / "links"
    links.mkdir()
    for shard in folder.glob("*.tar"):
        (links / shard.name).symlink_to(shard)
    assert index_command(capsys, links)[0] == 0
    assert shards.open_packed(links).dataset("val").read(2) == expected["val"][2][1]


def test_ctrl_c_leaves_no_index_files(tmp_path, capsys, monkeypatch):
    """Interrupted while indexing again: the earlier index is kept as it was; interrupted while writing
    (the index files written, not shards.json): none of the three files is left, nor a temporary one."""
    folder = tmp_path / "foreign"
    foreign_shards(folder)
    assert index_command(capsys, folder)[0] == 0
    indexed = digests(folder)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    with monkeypatch.context() as patch:
        patch.setattr(packing, "tqdm", interrupted)  # Ctrl-C while the command waits for the workers
        status, _, err = index_command(capsys, folder)
    assert status == 130 and err == ("fixres_dist: index interrupted; the shards are untouched and no new index was "
                                     "written: run the same command again\n")
    assert digests(folder) == indexed
    written = packing.write_private

    def interrupted_at_the_manifest(path, *args):
        if Path(path).name == shards.MANIFEST:
            raise KeyboardInterrupt
        return written(path, *args)
    monkeypatch.setattr(packing, "write_private", interrupted_at_the_manifest)
    assert index_command(capsys, folder)[0] == 130
    assert sorted(os.listdir(folder)) == sorted(set(indexed) - WRITTEN)


def test_a_corrupt_image_in_a_shard_is_named_by_shard_and_key_or_skipped_and_counted(tmp_path, capsys):
    """A sample whose image bytes are garbage is indexed (the index reads no image); a run's dataset
    names it ``<shard path>:<key>`` in one line, or with skip_bad_images skips it and the loader counts
    it."""
    folder = tmp_path / "foreign"
    folder.mkdir()
    write_shard(folder / "mine-train.tar", [("good", "png", image_bytes(1), b"0"),
                                            ("bad", "jpg", b"garbage, not a JPEG", b"1"),
                                            ("fine", "png", image_bytes(2), b"1")])
    write_shard(folder / "mine-val.tar", [("v", "png", image_bytes(3), b"0")])
    assert index_command(capsys, folder)[0] == 0
    train = shards.open_packed(folder).dataset("train")
    strict = pipeline.SeededDataset(train, pipeline.train_transform(8), seed=0)
    with pytest.raises(FixresError, match=re.escape(f"unreadable image {folder / 'mine-train.tar'}:bad (")):
        strict[SampleKey(index=1, epoch=0)]
    assert strict[SampleKey(index=0, epoch=0)][1] == 0
    skipping = pipeline.SeededDataset(train, pipeline.train_transform(8), seed=0, skip_bad_images=True)
    assert skipping[SampleKey(index=1, epoch=0)] is None
    loader = pipeline.make_loader(train, pipeline.test_transform(8), batch_size=3, world_size=1, rank=0,
                                  shuffle=False, seed=0, workers=0, skip_bad_images=True)
    batches = list(loader)
    assert [(len(labels), skipped) for _, labels, skipped in batches] == [(2, 1)]
    assert batches[0][1].tolist() == [0, 1]


def test_the_commands_shown_for_shards_of_other_tools(tmp_path, capsys):
    """docs/data_at_scale.md's commands for shards of another tool, on shards written here."""
    folder = tmp_path / "foreign"
    foreign_shards(folder)
    index, verify = (shown.argv(c, **{"/tmp/foreign": folder})
                     for c in shown.block("python -m fixres_dist.data.packing index /tmp/foreign"))
    assert packing.main(index[3:] + ["--no-progress"]) == 0 and packing.main(verify[3:] + ["--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"{folder}: indexed 12 train images in 3 shards" in out and f"{folder}: verified 4 shards" in out
    assert json.loads((folder / "shards.json").read_text())["classes"] == CLASSES
