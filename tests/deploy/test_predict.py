"""``python -m fixres_dist.deploy.predict``: the same file on 1, 2 and 3 ranks, a bad image skipped and
counted, the top k equal to the model's own softmax in every format, the three kinds of data alike, and
each bad input in one line with nothing left behind."""
from __future__ import annotations

import csv
import errno
import json
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pyarrow.parquet
import pytest
import torch
import torch.multiprocessing as mp
import torchvision
from safetensors.torch import load_file

import shown_commands as shown
from conftest import read_only_folder, tmpfs
from fixres_dist.data import images, packing, pipeline
from fixres_dist.deploy import predict

datasets = pytest.importorskip("datasets", reason="the hf extra (scripts/setup.sh installs it)")


@pytest.fixture(scope="module")
def flat_images(tiny_data, tmp_path_factory) -> Path:
    """tiny_data's 30 val images in one folder (the last class's in ``sub/``), a bad image ``bad.png`` and a
    hidden file ``.hidden.png`` (as bad, but never read)."""
    out = tmp_path_factory.mktemp("flat") / "images"
    (out / "sub").mkdir(parents=True)
    for path in sorted(tiny_data.glob("val/*/*.png")):
        klass = path.parent.name
        shutil.copy(path, out / ("sub" if klass.startswith("9") else ".") / f"{klass}-{path.name}")
    (out / "bad.png").write_bytes(b"not an image")
    (out / ".hidden.png").write_bytes(b"not an image")
    return out


def run(model, data, out, *flags) -> int:
    return predict.main([str(model), str(data), "--out", str(out), *map(str, flags)])


def rows(path: Path) -> list[dict]:
    """A predictions file's rows, whatever its format (probabilities as float32)."""
    if path.suffix == ".parquet":
        found = pyarrow.parquet.read_table(path).to_pylist()
    elif path.suffix == ".jsonl":
        found = [json.loads(line) for line in path.read_text().splitlines()]
    else:
        with open(path, newline="") as f:
            found = list(csv.DictReader(f))
    return [{k: np.float32(v) if k.startswith("probability") else str(v) for k, v in row.items()} for row in found]


def rank_by_flags(index: int, argv: list[str]) -> None:
    """One rank placed by ``--global-rank``: it meets the others at the file beside ``--out``."""
    raise SystemExit(predict.main([*argv, "--global-rank", str(index)]))


@pytest.mark.numeric
def test_the_file_is_the_same_on_1_2_and_3_ranks_with_a_bad_image_skipped(exported_by_hand, flat_images, tmp_path,
                                                                           capsys):
    shown_argv = shown.argv(shown.command("python -m fixres_dist.deploy.predict MODEL DATA"),  # on 3 ranks
                            MODEL=exported_by_hand, DATA=flat_images, **{"predictions.csv": tmp_path / "three.csv"})
    rest = shown_argv[5:]  # the flags but --out and --num-tasks
    flags = [a for i, a in enumerate(rest) if "--out" not in rest[max(i - 1, 0):i + 1]
             and "--num-tasks" not in rest[max(i - 1, 0):i + 1]]
    summary = f"30 images, 1 skipped: first: {flat_images / 'bad.png'}"
    assert run(exported_by_hand, flat_images, tmp_path / "one.csv", *flags) == 0  # this process, world size 1
    assert capsys.readouterr().out.strip() == f"{tmp_path / 'one.csv'}: {summary}"
    two = [str(exported_by_hand), str(flat_images), "--out", str(tmp_path / "two.csv"), *flags, "--num-tasks", "2"]
    mp.start_processes(rank_by_flags, args=(two,), nprocs=2, start_method="forkserver")  # 2 ranks started apart
    assert predict.main(shown_argv[3:]) == 0  # 3 ranks it spawns, forked from the session's forkserver
    failing = [a for a in flags if a not in ("--on-bad-image", "skip")]  # the bad image stops all 3 ranks: no file
    assert run(exported_by_hand, flat_images, tmp_path / "failed.csv", *failing, "--num-tasks", 3) == 1
    one = (tmp_path / "one.csv").read_bytes()
    assert one == (tmp_path / "two.csv").read_bytes() == (tmp_path / "three.csv").read_bytes()
    assert len(rows(tmp_path / "one.csv")) == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.csv", "three.csv", "two.csv"]  # no parts, no work folder


def expected_top(exported_by_hand: Path, paths: list[Path], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision's resnet18 with the exported weights on ``paths`` in one batch, evaluation's transform
    at 48 px and normalisation: its softmax's top ``k`` (probabilities, classes)."""
    model = torchvision.models.get_model("resnet18", num_classes=10)
    model.load_state_dict(load_file(exported_by_hand / "model.safetensors"))
    transform = pipeline.test_transform(48, 0.875, "bilinear")
    batch = torch.stack([transform(images.read_image(str(p))) for p in paths])
    with torch.no_grad():
        return torch.softmax(model.eval()(pipeline.normalize(batch)), dim=1).topk(k, dim=1)


@pytest.mark.numeric
def test_the_top_k_are_the_models_own_softmax_in_every_format(exported_by_hand, finetune_job, flat_images, tmp_path):
    for name in ("p.csv", "p.jsonl", "p.parquet"):
        assert run(exported_by_hand, flat_images, tmp_path / name, "--topk", 3, "--on-bad-image", "skip") == 0
    assert run(finetune_job.folder / "checkpoint.pth", flat_images, tmp_path / "c.jsonl", "--topk", 3,
               "--on-bad-image", "skip", "--workers", 1) == 0
    assert (tmp_path / "c.jsonl").read_bytes() == (tmp_path / "p.jsonl").read_bytes()
    found = rows(tmp_path / "p.csv")
    assert found == rows(tmp_path / "p.jsonl") == rows(tmp_path / "p.parquet")
    ids = sorted(p.relative_to(flat_images).as_posix() for p in flat_images.rglob("*.png")
                 if p.name not in ("bad.png", ".hidden.png"))
    assert [row["id"] for row in found] == ids and ids[-1].startswith("sub/")
    probabilities, classes = expected_top(exported_by_hand, [flat_images / i for i in ids], 3)
    names = json.loads((exported_by_hand / "model.json").read_text())["class_names"]
    expected = [[names[c] for c in r] for r in classes.tolist()]
    assert [[row[f"class_{r}"] for r in (1, 2, 3)] for row in found] == expected
    assert np.array_equal([[row[f"probability_{r}"] for r in (1, 2, 3)] for row in found], probabilities.numpy())
    assert list(pyarrow.parquet.read_schema(tmp_path / "p.parquet").names)[:3] == ["id", "class_1", "probability_1"]
    assert str(pyarrow.parquet.read_schema(tmp_path / "p.parquet").field("probability_1").type) == "float"


def as_parquet(root: Path, out: Path) -> Path:
    """The ImageFolder ``root`` as a Hugging Face parquet dataset (Image and ClassLabel columns, in
    ImageFolder's order), as the Hub stores it."""
    for split in ("train", "val"):
        folder = pipeline.image_folder(root, split)
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=folder.classes)})
        datasets.Dataset.from_dict({"image": [p for p, _ in folder.samples], "label": folder.targets},
                                   features=features).to_parquet(str(out / "data" / f"{split}-00000-of-00001.parquet"))
    return out


@pytest.mark.numeric
def test_shards_and_a_hugging_face_dataset_give_the_folders_predictions(exported_by_hand, tiny_data, tmp_path):
    packing.pack(tiny_data, tmp_path / "packed", progress=False)
    sources = {"folder": tiny_data / "val", "shards": tmp_path / "packed",
               "parquet": as_parquet(tiny_data, tmp_path / "hf")}
    found = {}
    for kind, data in sources.items():
        assert run(exported_by_hand, data, tmp_path / f"{kind}.csv") == 0
        found[kind] = rows(tmp_path / f"{kind}.csv")
    assert found["folder"][0]["id"] == "0_tshirt_top/00019.png" and len(found["folder"]) == 30
    assert [row["id"] for row in found["parquet"]] == [str(i) for i in range(30)]
    assert found["shards"][0]["id"].startswith("val-000000.tar:")
    predictions = [[{k: v for k, v in row.items() if k != "id"} for row in found[kind]] for kind in sources]
    assert predictions[0] == predictions[1] == predictions[2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.csv", "hf", "packed", "parquet.csv", "shards.csv"]


@pytest.fixture
def read_only(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    yield from read_only_folder(folder)


def test_bad_input_is_refused_in_one_line_leaving_nothing(exported_by_hand, flat_images, tiny_data, tmp_path, read_only,
                                                          capsys):
    (tmp_path / "empty" / ".hidden").mkdir(parents=True)
    packing.pack(tiny_data, tmp_path / "p32", progress=False, max_side=32)
    (tmp_path / "exists.csv").write_text("kept\n")
    (tmp_path / "notes.txt").write_text("no model\n")
    out = tmp_path / "p.csv"
    cases = [
        ((exported_by_hand, flat_images, out), rf"unreadable image {flat_images / 'bad.png'} \(UnidentifiedImageError: "
                                               r".*\); fix or remove it, or pass --on-bad-image skip$"),
        ((exported_by_hand, tmp_path / "empty", out), r"data .*empty holds no images \(.*, hidden files skipped\)$"),
        ((exported_by_hand, flat_images, tmp_path / "none" / "p.csv"), r"--out .*: its folder .*none does not exist$"),
        ((exported_by_hand, flat_images, read_only / "p.csv"), r"--out .*: its folder .*read-only is not writable$"),
        ((exported_by_hand, flat_images, tmp_path / "exists.csv"), r"exists; pass --overwrite to replace it"),
        ((exported_by_hand, flat_images, out, "--topk", 11), r"--topk 11 is more than the model's 10 classes$"),
        ((exported_by_hand, flat_images, tmp_path / "p.txt"), r"cannot tell the format of .*p\.txt from its suffix"),
        ((tmp_path / "notes.txt", flat_images, out), r"notes\.txt is not a fixres_dist checkpoint: another format"),
        ((tmp_path, flat_images, out), r"is not an export folder: it has no model\.json$"),
        ((exported_by_hand, tmp_path / "p32", out),
         r"fixres_dist: data .*p32: the pack holds images with shorter sides of at most 32 px \(packed with "
         r"--max-side 32\); the model's test resolution 48 px \(resized to 55 on the shorter side\) needs 55 px: pack "
         r"again with --max-side 55 or more$"),
    ]
    for args, message in cases:
        assert run(*args) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("fixres_dist: ")
        assert re.search(message, err), (message, err)
        assert not out.exists() and not list(tmp_path.glob(".*predict*"))
    assert (tmp_path / "exists.csv").read_text() == "kept\n"
    assert run(exported_by_hand, flat_images, tmp_path / "exists.csv", "--on-bad-image", "skip", "--overwrite") == 0
    assert len(rows(tmp_path / "exists.csv")) == 30
    for flags, message in ((("--topk", 0), "argument --topk: must be a positive whole number, got 0"),
                           (("--format", "xml"), "argument --format: invalid choice: 'xml'"),
                           (("--workers", -1), "argument --workers: must be 0 or more, got -1")):
        with pytest.raises(SystemExit) as exit_info:
            run(exported_by_hand, flat_images, out, *flags)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


START_PROCESSES = mp.start_processes


def spawned_then(monkeypatch, act):
    """predict's spawn with ``act(processes)`` run as soon as its ranks started."""
    def started(*args, **kwargs):
        context = START_PROCESSES(*args, **kwargs)
        act(context.processes)
        return context
    monkeypatch.setattr(mp, "start_processes", started)


@pytest.mark.slow  # ranks started and killed: over the test command's budget
def test_a_killed_rank_and_ctrl_c_end_the_run_in_one_line_leaving_nothing(exported_by_hand, tiny_data, tmp_path,
                                                                           monkeypatch, capsys):
    out = tmp_path / "p.csv"
    spawned_then(monkeypatch, lambda processes: os.kill(processes[1].pid, signal.SIGKILL))
    assert run(exported_by_hand, tiny_data / "val", out, "--num-tasks", 2, "--batch", 8) == 1
    err = capsys.readouterr().err.strip()
    assert err == "fixres_dist: rank 1 ended by SIGKILL; stopped the other ranks, nothing written"
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no file, no work folder
    spawned_then(monkeypatch, lambda _: os.kill(os.getpid(), signal.SIGINT))  # Ctrl-C as the ranks start
    assert run(exported_by_hand, tiny_data / "val", out, "--num-tasks", 2, "--batch", 8) == 130
    assert capsys.readouterr().err.strip() == "fixres_dist: predict stopped by SIGINT; nothing written"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_second_predict_of_the_same_out_is_refused_while_the_first_writes(exported_by_hand, tiny_data, tmp_path,
                                                                           capsys):
    out = tmp_path / "p.csv"
    request = predict.Request(str(exported_by_hand), str(tiny_data / "val"), out, "csv")
    lock = predict.lock_work_folder(request)  # the first predict, writing
    try:
        for ranks in (1, 2):
            assert run(exported_by_hand, tiny_data / "val", out, "--num-tasks", ranks) == 1
            assert capsys.readouterr().err.strip() == (
                f"fixres_dist: {'rank 0: ' if ranks == 1 else ''}--out {out} is being written by another predict "
                f"(pid {os.getpid()} on host {os.uname().nodename}); wait for it to end, or give another --out")
            assert not out.exists() and (request.work_folder / predict.LOCK_FILE).exists()  # the first's, kept
    finally:
        predict.remove_work_folder(request, lock)
    assert run(exported_by_hand, tiny_data / "val", out) == 0  # once it ended


@pytest.fixture
def full_disk(tmp_path):
    """A small disk with one page free: room for the lock file, none for a part."""
    folder = tmp_path / "small"
    folder.mkdir()
    for mounted in tmpfs(folder, "size=64k", "a small disk that fills up"):
        (mounted / "page").write_bytes(b"x" * 4096)
        with open(mounted / "filler", "wb", buffering=0) as f, pytest.raises(OSError) as full:
            while True:
                f.write(b"x" * 4096)
        assert full.value.errno == errno.ENOSPC
        (mounted / "page").unlink()
        yield mounted


@pytest.mark.slow  # a run on a disk that fills: about 25 s on 2 cores, over the test command's budget
def test_a_full_disk_is_one_line_and_leaves_nothing(exported_by_hand, tiny_data, full_disk, capsys):
    assert run(exported_by_hand, tiny_data / "val", full_disk / "p.csv") == 1
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"fixres_dist: cannot write .*part-0\.npz: No space left on device", err), err
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]
