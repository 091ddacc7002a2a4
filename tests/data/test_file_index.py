"""The data's file index (issue 14): walked once per dataset version, shared with every rank and later
runs, walked again when the folders change. Real folders and files on disk."""
from __future__ import annotations

import multiprocessing
import os
import shutil
import stat
import time

import attrs
import numpy as np
import pytest

from conftest import FAST, make_subset, read_only_folder, run_script, wait_for
from fixres_dist.config import FILE_INDEX_FOLDER, TrainerConfig
from fixres_dist.data import file_index, pipeline
from fixres_dist.errors import FixresError
from fixres_dist.training.checkpoint import CHECKPOINT_FILE, load_checkpoint

RACY_MARGIN_NS = file_index.RACY_MARGIN_NS  # the product's, which the ranks forked for real runs keep
SMALL = [*FAST, "--architecture", "resnet20"]  # the real runs' model plays no part


def _touch(path, text=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture(autouse=True)
def settled_folders(monkeypatch):
    """The folders a test just made count as settled, not racy (a folder changed within
    file_index.RACY_MARGIN_NS of the walk is listed again at each check): their change time, unlike
    a modification time, cannot be dated back. The racy-folder test restores the margin."""
    monkeypatch.setattr(file_index, "RACY_MARGIN_NS", 0)


@pytest.fixture
def tree(tmp_path):
    """An ImageFolder root with everything the walk handles: nested sub-folders, hidden files and
    folders, files that are not images, a folder named like an image, links to a folder, to a file
    and a broken one, a class folder that is a link, a name with a newline and one that is not UTF-8.
    Files are empty: the walk never opens them."""
    root = tmp_path / "data"
    outside = tmp_path / "outside"
    _touch(outside / "linked" / "l1.png")
    _touch(outside / "linked" / "sub" / "l2.jpg")
    _touch(outside / "target.png")
    _touch(outside / "whole_class" / "w.png")
    for split in ("train", "val"):
        s = root / split
        for relative in ["a/1.png", "a/2.JPG", "a/sub/3.png", "a/sub/deeper/4.jpeg", "a/sub2/5.png", "a/notes.txt",
                         "a/.hidden.png", "a/.ipynb_checkpoints/x.png", "b/z.png", "b/line\nbreak.png",
                         ".DS_Store", ".snapshot/y.png", "README.txt"]:
            _touch(s / relative)
        (s / "b" / "folder.png").mkdir()
        (s / "b" / os.fsdecode(b"caf\xe9.png")).write_text("")  # Latin-1 name: not valid UTF-8
        (s / "a" / "link_dir").symlink_to(outside / "linked")
        (s / "b" / "link_file.png").symlink_to(outside / "target.png")
        (s / "b" / "broken.png").symlink_to(outside / "nowhere.png")
        (s / "c").symlink_to(outside / "whole_class")
    return root


def _same_datasets(root, index):
    for split in ("train", "val"):
        walked, indexed = pipeline.image_folder(root, split), pipeline.image_folder(root, split, index)
        assert indexed.samples == walked.samples
        assert indexed.targets == walked.targets
        assert indexed.classes == walked.classes and indexed.class_to_idx == walked.class_to_idx
        assert indexed.hidden == walked.hidden


def test_the_index_gives_the_datasets_of_a_walk(tree, tmp_path):
    built = file_index.data_index(tree, tmp_path / "cache")
    assert built.built and not built.reason and built.unsaved
    _same_datasets(tree, built)
    train = pipeline.image_folder(tree, "train", built)
    relative = [os.path.relpath(p, tree / "train") for p, _ in train.samples]
    assert relative == ["a/1.png", "a/2.JPG", "a/link_dir/l1.png", "a/link_dir/sub/l2.jpg", "a/sub/3.png",
                        "a/sub/deeper/4.jpeg", "a/sub2/5.png", os.fsdecode(b"b/caf\xe9.png"),
                        "b/line\nbreak.png", "b/link_file.png", "b/z.png", "c/w.png"]
    assert train.classes == ["a", "b", "c"]
    built.save()
    assert built.file.exists() and built.file.parent == tmp_path / "cache"
    assert built.file.stat().st_mode & 0o777 == 0o600 and built.file.parent.stat().st_mode & 0o777 == 0o700
    loaded = file_index.data_index(tree, tmp_path / "cache")
    assert not loaded.built
    _same_datasets(tree, loaded)
    assert pipeline.check_image_folder(tree, index=loaded) == pipeline.check_image_folder(tree) == ["a", "b", "c"]


def test_one_index_per_resolved_root(tree, tmp_path, monkeypatch):
    (tmp_path / "alias").symlink_to(tree)
    monkeypatch.chdir(tmp_path)
    files = {file_index.index_file("c", root) for root in (tree, "data", "data/", "./data", "alias", tree / "train/..")}
    assert len(files) == 1
    assert file_index.index_file("c", tmp_path / "outside") not in files


def test_a_second_run_reuses_the_index_without_listing_a_folder(tree, tmp_path, monkeypatch):
    first = file_index.data_index(tree, tmp_path / "cache")
    first.save()
    before = first.file.stat()
    listed = []
    monkeypatch.setattr(pipeline, "list_folder", lambda folder: listed.append(folder))
    again = file_index.data_index(tree, tmp_path / "cache")
    assert not again.built and not again.unsaved and listed == []
    again.save()  # nothing to write
    after = first.file.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    line = again.describe()
    assert line.startswith(f"data: file index reused: 24 files in 3 classes of {tree}, loaded and checked "
                           f"({len(first.folders)} folders unchanged) in ") and line.endswith(f" s ({first.file})")
    assert first.describe().startswith(f"data: file index built: walked 24 files in 3 classes of {tree} in ")


def _add_file(root):
    _touch(root / "train" / "a" / "new.png")


def _remove_file(root):
    (root / "val" / "b" / "z.png").unlink()


def _rename_file(root):
    (root / "train" / "a" / "1.png").rename(root / "train" / "a" / "0.png")


def _add_class(root):
    for split in ("train", "val"):
        _touch(root / split / "d" / "new.png")


def _rename_class(root):
    for split in ("train", "val"):
        (root / split / "a").rename(root / split / "aa")


def _nested_file(root):
    _touch(root / "train" / "a" / "sub" / "deeper" / "new.png")


def _behind_a_link(root):
    _touch(root.parent / "outside" / "linked" / "sub" / "new.png")  # seen through train/a/link_dir


def _hidden_file(root):
    _touch(root / "val" / "a" / ".new.png")


def _replace_split(root):
    shutil.copytree(root / "val", root / "val2", symlinks=True)
    _touch(root / "val2" / "a" / "new.png")
    shutil.rmtree(root / "val")
    (root / "val2").rename(root / "val")


def _remove_sub_folder(root):
    shutil.rmtree(root / "train" / "a" / "sub2")


CHANGES = {"add a file": (_add_file, "train/a changed"), "remove a file": (_remove_file, "val/b changed"),
           "rename a file": (_rename_file, "train/a changed"), "add a class": (_add_class, "train changed"),
           "rename a class": (_rename_class, "train changed"), "file in a sub-folder": (_nested_file, "changed"),
           "file behind a link to a folder": (_behind_a_link, "train/a/link_dir/sub changed"),
           "hidden file": (_hidden_file, "val/a changed"), "split folder replaced": (_replace_split, "val changed"),
           "sub-folder removed": (_remove_sub_folder, "train/a")}


@pytest.mark.parametrize("case", list(CHANGES))
def test_a_change_of_the_folders_rebuilds_the_index(tree, tmp_path, case):
    change, reason = CHANGES[case]
    old = file_index.data_index(tree, tmp_path / "cache")
    old.save()
    change(tree)
    new = file_index.data_index(tree, tmp_path / "cache")
    assert new.built and reason in new.reason, new.reason
    assert new.describe().startswith(f"data: file index rebuilt ({new.reason}): walked ")
    _same_datasets(tree, new)
    new.save()
    assert not file_index.data_index(tree, tmp_path / "cache").built


def test_a_change_in_the_same_clock_tick_is_found_by_listing_racy_folders(tree, tmp_path, monkeypatch):
    """A folder changed again within its time's resolution keeps its time: folders changed shortly
    before the walk are listed again at each check, until they have settled."""
    monkeypatch.setattr(file_index, "RACY_MARGIN_NS", 3_000_000_000)
    now = time.time_ns()
    for folder, _, _ in os.walk(tree, followlinks=True):
        os.utime(folder, ns=(now, now))
    index = file_index.data_index(tree, tmp_path / "cache")
    assert len(index.racy_folders()) == len(index.folders)
    index.save()
    folder = tree / "train" / "b"
    recorded = folder.stat().st_mtime_ns
    _touch(folder / "same_tick.png")
    os.utime(folder, ns=(recorded, recorded))  # a coarse clock: the same time as before
    rebuilt = file_index.data_index(tree, tmp_path / "cache")
    assert rebuilt.built and rebuilt.reason == "train/b changed"
    _same_datasets(tree, rebuilt)
    rebuilt.save()
    # Unchanged racy folders pass once listed; once they settle, the launcher's save drops them.
    monkeypatch.setattr(file_index, "RACY_MARGIN_NS", 10 ** 8)  # 0.1 s instead of 3 s
    time.sleep(0.2)
    settled = file_index.data_index(tree, tmp_path / "cache")
    assert not settled.built and settled.unsaved and settled.racy_folders() == []
    settled.save()
    assert file_index.data_index(tree, tmp_path / "cache").racy_folders() == []


def _truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _flip_bytes(file):
    content = bytearray(file.read_bytes())
    content[len(content) // 2: len(content) // 2 + 64] = bytes(64)
    file.write_bytes(bytes(content))


def _other_format(file):
    with np.load(file) as arrays:
        saved = dict(arrays)
    saved["meta"] = np.frombuffer(b'{"format": 999}', dtype=np.uint8)
    with open(file, "wb") as f:
        np.savez(f, **saved)


def _pickled(file):
    with open(file, "wb") as f:
        np.savez(f, meta=np.array([{"format": 1}], dtype=object))


def _inconsistent(file):
    with np.load(file) as arrays:
        saved = dict(arrays)
    saved["train_counts"] = saved["train_counts"] + 1
    with open(file, "wb") as f:
        np.savez(f, **saved)


CORRUPT = {"empty": lambda f: f.write_bytes(b""), "garbage": lambda f: f.write_bytes(os.urandom(3000)),
           "truncated": _truncate, "damaged": _flip_bytes, "a folder": lambda f: (f.unlink(), f.mkdir()),
           "other format": _other_format, "pickle inside": _pickled, "counts that do not add up": _inconsistent}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_a_corrupt_index_is_rebuilt(tree, tmp_path, case):
    index = file_index.data_index(tree, tmp_path / "cache")
    index.save()
    CORRUPT[case](index.file)
    rebuilt = file_index.data_index(tree, tmp_path / "cache")
    assert rebuilt.built and rebuilt.reason, rebuilt.reason
    _same_datasets(tree, rebuilt)
    if case == "a folder":
        index.file.rmdir()
    rebuilt.save()
    assert not rebuilt.warning and not file_index.data_index(tree, tmp_path / "cache").built


@pytest.fixture
def read_only_index_folder(tmp_path):
    """``shared/file_index``, a folder this process cannot write to (a read-only mount for root,
    mode 0500 otherwise)."""
    folder = tmp_path / "shared" / FILE_INDEX_FOLDER
    folder.mkdir(parents=True)
    yield from read_only_folder(folder)


def test_a_cache_folder_that_cannot_be_written_warns_and_walks(tree, tmp_path, read_only_index_folder):
    for cache in (read_only_index_folder, read_only_index_folder / "below", tmp_path / "a_file"):
        (tmp_path / "a_file").write_text("")
        index = file_index.data_index(tree, cache)
        index.save()
        assert index.built and index.unsaved
        assert "; warning: cannot write the file index in " in index.describe()
        assert index.describe().endswith("not cached, the next run walks the folders again")
        _same_datasets(tree, index)


def test_no_cache_folder_walks(tree):
    index = file_index.data_index(tree, None)
    index.save()
    assert index.built and index.file is None and not index.warning
    _same_datasets(tree, index)


def _build_and_save(root, cache, start, rounds):
    while time.time() < start:
        time.sleep(0.001)
    for _ in range(rounds):
        index = file_index.build(root)
        index.file = file_index.index_file(cache, root)
        index.save()


def test_concurrent_builders_leave_one_complete_index(tree, tmp_path):
    context = multiprocessing.get_context("fork")
    start = time.time() + 0.5
    builders = [context.Process(target=_build_and_save, args=(tree, tmp_path / "cache", start, 5)) for _ in range(4)]
    for process in builders:
        process.start()
    for process in builders:
        process.join(60)
    assert [p.exitcode for p in builders] == [0] * 4
    index = file_index.data_index(tree, tmp_path / "cache")
    assert not index.built
    _same_datasets(tree, index)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [index.file.name]  # no temporary left


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    make_subset(root / "no_classes", 1, 1, classes=0)
    (root / "no_classes" / "train").mkdir(parents=True)
    (root / "no_classes" / "val").mkdir(parents=True)
    empty = make_subset(root / "empty_class", 2, 1, classes=3)
    for image in (empty / "val" / "1_trouser").iterdir():
        image.unlink()
    differ = make_subset(root / "differ", 2, 1, classes=3)
    (differ / "val" / "2_pullover").rename(differ / "val" / "2_jumper")
    make_subset(root / "three", 1, 1, classes=3)
    return root


@pytest.mark.parametrize("case, min_images", [("no_classes", 1), ("empty_class", 1), ("differ", 1), ("three", 4)])
def test_checks_from_the_index_say_what_the_walk_says(broken, tmp_path, case, min_images):
    with pytest.raises(FixresError) as walked:
        pipeline.check_image_folder(broken / case, min_images)
    with pytest.raises(FixresError) as indexed:
        pipeline.check_image_folder(broken / case, min_images, file_index.data_index(broken / case, tmp_path))
    assert str(indexed.value) == str(walked.value)


def test_no_job_may_be_named_like_the_index_folder():
    with pytest.raises(FixresError, match="--job-id file_index is reserved"):
        TrainerConfig(job_id=FILE_INDEX_FOLDER)


# ------------------------------------------------------------------------------ real runs
def _settled(index):
    """``index`` if none of its folders is racy any more (a load of a settled index dates it anew)."""
    return index if not index.racy_folders() else None


def test_two_rank_runs_build_the_index_once_then_every_rank_uses_it(tiny_data, tmp_path, monkeypatch):
    """A first 2-rank run builds the index once (the launcher: one log line); a second one's launcher
    and every rank use it as it is, neither walking the folders nor rewriting it. Both run with the
    product's racy margin, as their ranks do (the launcher runs in this process, whose margin
    :func:`settled_folders` changes)."""
    monkeypatch.setattr(file_index, "RACY_MARGIN_NS", RACY_MARGIN_NS)
    data_path = tmp_path / "data"
    shutil.copytree(tiny_data, data_path)
    common = ["--num-tasks", 2, "--data-path", data_path, "--shared-folder-path", tmp_path / "shared", *SMALL]
    first = run_script("scratch", *common, "--job-id", "first")
    assert first.returncode == 0, first.stderr[-3000:]
    file = file_index.index_file(tmp_path / "shared" / FILE_INDEX_FOLDER, data_path)
    assert f"data: file index built: walked 110 files in 10 classes of {data_path} in " in first.stdout
    assert f" s ({file})" in first.stdout
    assert first.stdout.count("data: file index") == 1
    # The index (still valid: the folders did not change) gets an 11th class made of class 0's
    # files, which no walk would find: every rank must build an 11-class head from it (a rank that
    # walked the folders would build a 10-class one, and DDP would refuse the mismatch). The folders,
    # just copied, must first have settled: a racy folder is listed again at each check, which
    # would find the extra class missing from it and rebuild the index.
    index = wait_for(lambda: _settled(file_index.load(file, data_path)), RACY_MARGIN_NS / 1e9 + 60,
                     "the copied folders to settle")
    for name, split in index.splits.items():
        extra = split.files[:split.counts[0]]
        index.splits[name] = attrs.evolve(split, classes=[*split.classes, "z_extra"],
                                          counts=[*split.counts, len(extra)], files=[*split.files, *extra])
    index.unsaved = True
    index.save()
    written = file.stat()
    assert not file_index.load(file, data_path).racy_folders()
    again = run_script("scratch", *common, "--job-id", "again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"data: file index reused: 121 files in 11 classes of {data_path}, loaded and checked " in again.stdout
    assert (file.stat().st_ino, file.stat().st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    state = load_checkpoint(tmp_path / "shared" / "again" / CHECKPOINT_FILE)
    assert tuple(state["model"]["fc.weight"].shape) == (11, 64)


def test_a_run_with_a_read_only_index_folder_warns_and_trains(tiny_data, read_only_index_folder):
    proc = run_script("scratch", "--data-path", tiny_data, "--shared-folder-path", read_only_index_folder.parent,
                      "--job-id", "ro", *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"data: file index built: walked 110 files in 10 classes of {tiny_data} in ") in proc.stdout
    assert (f"; warning: cannot write the file index in {read_only_index_folder} (Read-only file system): not cached, "
            "the next run walks the folders again") in proc.stdout or os.geteuid() != 0
    assert not any(read_only_index_folder.iterdir())


@pytest.mark.parametrize("loose", ["the file", "its folder"])
def test_an_index_others_could_write_is_not_trusted_but_rebuilt_owner_only(tree, tmp_path, loose):
    index = file_index.data_index(tree, tmp_path / "cache")
    index.save()
    os.chmod(index.file if loose == "the file" else index.file.parent, 0o666 if loose == "the file" else 0o777)
    rebuilt = file_index.data_index(tree, tmp_path / "cache")
    assert rebuilt.built and "could be written by other users" in rebuilt.reason
    _same_datasets(tree, rebuilt)
    rebuilt.save()
    assert stat.S_IMODE(index.file.stat().st_mode) == 0o600 and stat.S_IMODE(index.file.parent.stat().st_mode) == 0o700
    assert not file_index.data_index(tree, tmp_path / "cache").built
