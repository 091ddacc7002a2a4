"""Hugging Face datasets as a run's data (issue 26): a DatasetDict saved with save_to_disk and the same
as parquet, read back sample by sample as the ImageFolder they came from; a run on them equal to the
run on the folder; each bad input one line naming the dataset, split and row."""
from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

import shown_commands as shown
from conftest import (
    assert_holds_the_folder,
    evaluation_matches_scratch_job,
    run_main,
    run_on_other_data_as_scratch_job,
    run_script,
)
from fixres_dist.data import file_index, hf_datasets, pipeline
from fixres_dist.errors import FixresError
from fixres_dist.training import checkpoint

datasets = pytest.importorskip("datasets", reason="the hf extra (scripts/setup.sh installs it)")
hf_datasets.library()  # offline and quiet, as a run has it
import pyarrow.parquet  # noqa: E402  (installed with datasets)


def as_dataset_dict(root: Path, val_name: str = "validation") -> "datasets.DatasetDict":
    """The ImageFolder ``root`` as a DatasetDict (Image and ClassLabel columns), in ImageFolder's order."""
    def split(name):
        folder = pipeline.image_folder(root, name)
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=folder.classes)})
        return datasets.Dataset.from_dict({"image": [p for p, _ in folder.samples], "label": folder.targets},
                                          features=features)
    return datasets.DatasetDict({"train": split("train"), val_name: split("val")})


@pytest.fixture(scope="module")
def hf_saved(tiny_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "saved"
    as_dataset_dict(tiny_data).save_to_disk(str(out))
    return out


@pytest.fixture(scope="module")
def hf_parquet(hf_saved, tmp_path_factory) -> Path:
    """The saved dataset as the Hub stores it: data/<split>-00000-of-00001.parquet."""
    out = tmp_path_factory.mktemp("hf") / "parquet"
    for name, split in datasets.load_from_disk(str(hf_saved)).items():
        split.to_parquet(str(out / "data" / f"{name}-00000-of-00001.parquet"))
    return out


@pytest.mark.parametrize("form", ["saved", "parquet"])
def test_the_dataset_holds_the_folder_sample_by_sample(tiny_data, hf_saved, hf_parquet, tmp_path, form):
    root = {"saved": hf_saved, "parquet": hf_parquet}[form]
    assert hf_datasets.is_hf_dataset(root) and not hf_datasets.is_hf_dataset(tiny_data)
    data = hf_datasets.open_hf_dataset(root, tmp_path)
    assert data.classes == pipeline.check_image_folder(tiny_data)
    assert data.describe() == (f"data: Hugging Face dataset ({form}): 80 train and 30 validation images in 10 classes, "
                               f"{root}, checked")
    assert_holds_the_folder(tiny_data, data.dataset)
    if form == "parquet":  # converted once, in the data cache folder, and reused
        assert list((tmp_path / hf_datasets.CACHE).iterdir())


def test_the_identity_follows_the_images_not_the_folder(tiny_data, hf_saved, tmp_path):
    """A copy of the dataset is the same data (a resume continues); a changed image is other data, and so
    is the folder the dataset came from (checkpoint.check_same_data refuses, naming the counts)."""
    identity = hf_datasets.open_hf_dataset(hf_saved).identity()
    assert identity["train"] == 80 and identity["val"] == 30
    copy = Path(shutil.copytree(hf_saved, tmp_path / "copy"))
    assert hf_datasets.open_hf_dataset(copy).identity() == identity
    changed = as_dataset_dict(tiny_data)
    changed["train"] = changed["train"].map(lambda row, i: {"label": (row["label"] + 1) % 10 if i == 79 else
                                                            row["label"]}, with_indices=True)
    changed.save_to_disk(str(tmp_path / "changed"))
    other = hf_datasets.open_hf_dataset(tmp_path / "changed").identity()
    assert other != identity
    with pytest.raises(FixresError, match="was trained on other images than"):
        checkpoint.check_same_data(identity, other, "ckpt.pth", tmp_path / "changed")
    assert file_index.data_index(tiny_data, None).identity() != identity


def test_a_bad_image_is_named_by_split_and_row_or_skipped(hf_saved, tmp_path):
    rows = datasets.load_from_disk(str(hf_saved))
    broken = rows["train"].cast_column("image", datasets.Image(decode=False)).map(
        lambda row, i: {"image": {"bytes": b"not an image" if i == 5 else row["image"]["bytes"], "path": None}},
        with_indices=True).cast_column("image", datasets.Image())
    datasets.DatasetDict({"train": broken, "val": rows["validation"]}).save_to_disk(str(tmp_path / "broken"))
    data = hf_datasets.open_hf_dataset(tmp_path / "broken")
    assert data.split_names == {"train": "train", "val": "val"}
    seeded = pipeline.SeededDataset(data.dataset("train"), pipeline.test_transform(16), seed=0)
    with pytest.raises(FixresError, match=rf"^unreadable image {tmp_path / 'broken'} \[train\] row 5 \(Unidentified"):
        seeded[pipeline.SampleKey(5, 0)]
    loader = pipeline.make_loader(data.dataset("train"), pipeline.test_transform(16), batch_size=8, world_size=1,
                                  rank=0, shuffle=False, seed=0, workers=0, skip_bad_images=True)
    assert sum(skipped for _, _, skipped in loader) == 1


def save(splits: dict, root: Path) -> Path:
    datasets.DatasetDict(splits).save_to_disk(str(root))
    return root


def relabelled(split, classes: list[str], labels=None):
    features = datasets.Features({**split.features, "label": datasets.ClassLabel(names=classes)})
    table = split if labels is None else split.remove_columns("label").add_column("label", labels)
    return table.cast(features)


@pytest.mark.parametrize("problem, message", [
    ("no-label-column", r"\[train\]: a run needs exactly one Image column and one ClassLabel column .*, and it has "
                        r"image \(Image\), label \(Value\); cast them with Dataset.cast_column$"),
    ("unlabelled-rows", r"\[validation\]: row 0 has label -1, not a class number of its 10 classes \(30 rows so"),
    ("other-classes", r"the class names of train and validation differ \(only in train \['0_tshirt_top'\], only in "
                      r"validation \['tops'\]\)$"),
    ("reordered-classes", r"the class names of train and validation differ \(only in train \[\], only in validation "
                          r"\[\], or their order\)$"),
    ("no-val-split", r"has the splits train: a run needs train and one of val, validation, test$"),
    ("one-split-saved", r"holds one saved split \(80 rows\), not a DatasetDict"),
    ("empty-class", r"class '9_ankle_boot' has no training images$"),
    ("parquet-without-split", r"has the splits none \(and parquet files of no split it reads: images.parquet; a split "
                              r"is named by the folder or the start of the file name"),
    ("images-moved", r"\[train\]: row 0 keeps its image as a path, and '.*/moved/.*\.png' is no file \(moved or"),
    ("unwritable-cache", r"cannot make .*/hf_datasets/.* \(Not a directory\): the parquet files of .* are converted"),
    ("damaged-parquet", r"cannot be read \(ArrowInvalid: .*\)$"),
])
def test_bad_input_is_refused_in_one_line_before_any_rank_starts(tiny_data, hf_saved, hf_parquet, tmp_path, capsys,
                                                                 problem, message):
    rows = datasets.load_from_disk(str(hf_saved))
    train, val = rows["train"], rows["validation"]
    root = tmp_path / problem
    if problem == "no-label-column":
        save({"train": train.cast_column("label", datasets.Value("int64")), "validation": val}, root)
    elif problem == "unlabelled-rows":  # the Hub's test splits are often so: label -1
        save({"train": train, "validation": val.cast_column("label", datasets.Value("int64")).map(
            lambda row: {"label": -1}).cast_column("label", train.features["label"])}, root)
    elif problem in ("other-classes", "reordered-classes"):
        names = train.features["label"].names
        names = ["tops", *names[1:]] if problem == "other-classes" else names[::-1]
        save({"train": train, "validation": relabelled(val, names, val["label"][:])}, root)
    elif problem == "no-val-split":
        save({"train": train}, root)
    elif problem == "one-split-saved":
        train.save_to_disk(str(root))
    elif problem == "empty-class":
        keep = [i for i, label in enumerate(train["label"]) if label != 9]
        save({"train": train.select(keep), "validation": val}, root)
    elif problem == "parquet-without-split":
        train.to_parquet(str(root / "images.parquet"))
    elif problem == "images-moved":  # the images kept as paths (no bytes), then moved away
        shutil.copytree(tiny_data, tmp_path / "moved")
        for name, split in as_dataset_dict(tmp_path / "moved").items():  # as made: paths, no bytes yet
            (root / "data").mkdir(parents=True, exist_ok=True)
            pyarrow.parquet.write_table(split.data.table, root / "data" / f"{name}-00000-of-00001.parquet")
        shutil.rmtree(tmp_path / "moved")
    elif problem == "unwritable-cache":  # the data cache folder is under --shared-folder-path
        shutil.copytree(hf_parquet, root)
        (tmp_path / "runs").mkdir()
        (tmp_path / "runs" / "file_index").write_text("a file where the cache folder goes")
    else:
        (root / "data").mkdir(parents=True)
        (root / "data" / "train-00000-of-00001.parquet").write_bytes(b"PAR1 not a parquet file")
        val.to_parquet(str(root / "data" / "validation-00000-of-00001.parquet"))
    status, err = run_main(capsys, "scratch", "--data-path", root, "--shared-folder-path", tmp_path / "runs",
                           "--job-id", "j", "--epochs", 1)
    assert status == 1 and err.count("\n") == 1, err
    assert re.search(message, err.strip()), err
    assert not (tmp_path / "runs" / "j").exists()


def test_a_parquet_file_rewritten_with_its_old_modification_time_is_converted_again(hf_parquet, tmp_path):
    """The conversion is of the files as they are now: a file replaced (cp -p, rsync -a, tar keep the
    modification time) is converted again, its old conversion removed, and the identity changes."""
    root = Path(shutil.copytree(hf_parquet, tmp_path / "parquet"))
    before = hf_datasets.open_hf_dataset(root, tmp_path / "cache")
    path = root / "data" / "train-00000-of-00001.parquet"
    kept = path.stat()
    relabelled_rows = datasets.load_dataset("parquet", data_files=str(path), split="train",
                                            cache_dir=str(tmp_path / "elsewhere"))
    relabelled_rows.map(lambda row: {"label": (row["label"] + 1) % 10}).to_parquet(str(tmp_path / "new.parquet"))
    shutil.move(tmp_path / "new.parquet", path)
    os.utime(path, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    after = hf_datasets.open_hf_dataset(root, tmp_path / "cache")
    assert after.dataset("train").targets == [(label + 1) % 10 for label in before.dataset("train").targets]
    assert after.identity() != before.identity()
    assert len(list((tmp_path / "cache" / hf_datasets.CACHE).glob("*/*"))) == 1


def test_a_stray_parquet_file_leaves_an_image_folder_one_and_other_splits_are_left_out(tiny_data, hf_saved, tmp_path):
    folder = Path(shutil.copytree(tiny_data, tmp_path / "folder"))
    rows = datasets.load_from_disk(str(hf_saved))
    rows["train"].to_parquet(str(folder / "stats.parquet"))
    assert not hf_datasets.is_hf_dataset(folder)
    root = tmp_path / "hub"
    for name, split in (("Train", rows["train"]), ("Validation", rows["validation"]), ("unsupervised", rows["train"])):
        split.to_parquet(str(root / "data" / f"{name}-00000-of-00001.parquet"))
    data = hf_datasets.open_hf_dataset(root, tmp_path / "cache")
    assert data.split_names == {"train": "train", "val": "validation"}
    assert data.describe().endswith("checked (left out: 1 parquet files of other splits, "
                                    "unsupervised-00000-of-00001.parquet)")


def test_without_the_library_the_error_says_how_to_install_it(hf_saved, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(FixresError, match=r"needs the datasets library, which cannot be imported "
                                          r"\(ModuleNotFoundError: .*\): pip install -e '\.\[hf\]'"):
        hf_datasets.open_hf_dataset(hf_saved)


@pytest.mark.numeric
@pytest.mark.slow
def test_a_run_on_the_dataset_stopped_mid_epoch_resumes_bit_identically(scratch_job, hf_saved, tmp_path):
    """The session's 2-rank scratch job on the saved dataset, stopped mid-epoch and resumed: equal to the
    uninterrupted run on the folder, bit for bit (its last evaluation on 2 ranks included)."""
    run_on_other_data_as_scratch_job(scratch_job, hf_saved, tmp_path, "data: Hugging Face dataset (saved): 80 "
                                     "train and 30 validation images in 10 classes")


@pytest.mark.numeric
@pytest.mark.slow
def test_evaluation_on_parquet_is_exact_on_1_and_3_ranks(scratch_job, hf_parquet, tmp_path):
    """The parquet form's 30 validation images on 1 and 3 ranks (2: the resume above): the folder's
    top-1 and loss."""
    evaluation_matches_scratch_job(scratch_job, hf_parquet, tmp_path, (1, 3))


@pytest.mark.slow
def test_the_commands_shown(tiny_data, tmp_path):
    """docs/data_at_scale.md's commands on tiny_data: the folder saved as a Hugging Face dataset, a
    run on it."""
    save_it, train = shown.block('python -c "import datasets')
    fill = {"DATA": tiny_data, "/tmp/hf_data": tmp_path / "hf_data", "/tmp/hf_cache": tmp_path / "cache"}
    exec(shown.argv(save_it, **fill)[2])  # the python -c program, in this process (no interpreter to start)
    result = run_script("scratch", *shown.argv(train, **fill)[2:], "--shared-folder-path", tmp_path / "runs")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data: Hugging Face dataset (saved): 80 train and 30 validation images in 10 classes" in result.stdout



def test_a_refused_parquet_dataset_leaves_the_files_on_disk_as_they_were(hf_saved, tmp_path, capsys, monkeypatch):
    """Refused after its conversion (a class without training images): the conversion is removed, with
    the folders made for it (the whole shared folder of a first run), an earlier conversion of the same
    dataset is kept, and the library's own caches are not written."""
    for name in ("HF_DATASETS_CACHE", "HF_MODULES_CACHE", "DOWNLOADED_DATASETS_PATH", "EXTRACTED_DATASETS_PATH"):
        monkeypatch.setattr(datasets.config, name, tmp_path / "library" / name.lower())
    rows = datasets.load_from_disk(str(hf_saved))
    root = tmp_path / "parquet"

    def write(train):
        for name, split in (("train", train), ("validation", rows["validation"])):
            split.to_parquet(str(root / "data" / f"{name}-00000-of-00001.parquet"))

    def files():
        return {str(p.relative_to(tmp_path)): p.is_dir() or (p.stat().st_size, p.stat().st_mtime_ns)
                for p in tmp_path.rglob("*")}

    write(rows["train"])
    hf_datasets.open_hf_dataset(root, tmp_path / "runs" / "file_index")  # an earlier run's conversion
    write(rows["train"].filter(lambda row: row["label"] != 9, keep_in_memory=True))
    before = files()
    for shared in ("runs", "fresh"):
        status, err = run_main(capsys, "scratch", "--data-path", root, "--shared-folder-path", tmp_path / shared,
                               "--job-id", "j", "--epochs", 1)
        assert status == 1 and err == (f"fixres_dist: rank 0: Hugging Face dataset {root}: class '9_ankle_boot' has "
                                       "no training images\n"), err
        assert files() == before
