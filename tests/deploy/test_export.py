"""The export folder (``python -m fixres_dist.deploy.export``) of a finished FixRes finetune and of a sharded
checkpoint: its JSON as the checkpoint says, its ONNX (the real onnxruntime), ``torch.export`` program and
safetensors weights (torchvision's and timm's own models, loaded without this package's code) giving the
checkpoint's logits on 20 real photographs at the test resolution, and its bad input."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import timm
import torch
import torchvision
from PIL import Image
from safetensors.torch import load_file

import shown_commands as shown
from conftest import once_per_run, read_only_folder, tmpfs
from fixres_dist.config import TrainerConfig
from fixres_dist.data import pipeline
from fixres_dist.deploy import export
from fixres_dist.entry import launch
from fixres_dist.training.checkpoint import CHECKPOINT_FILE, rank_buffers
from numeric import assert_near_reference
from split_models import full

_FOOLBOX = importlib.util.find_spec("foolbox")  # installed --no-deps: only its data folder is used
FOOLBOX_DATA = Path(_FOOLBOX.origin).parent / "data" if _FOOLBOX else Path("/nonexistent")
PHOTOS = sorted(FOOLBOX_DATA.glob("imagenet_*.jpg"))  # 20 real ImageNet photographs of various sizes
needs_photos = pytest.mark.skipif(len(PHOTOS) != 20, reason="foolbox's 20 ImageNet photos absent "
                                                            "(pip install --no-deps foolbox==3.3.4)")


@pytest.fixture(scope="module")
def run_export(finetune_job, tmp_path_factory) -> tuple[Path, str]:
    """The export folder of :func:`jobs_fixtures.finetune_job` (resnet18 trained at 32 px, FixRes-finetuned at
    48 px on 2 ranks), written by what ``--export`` runs once the ranks ended (``launch.export_run``: in this
    process, off the path of the finetune every test shares; tests/jobs/test_using.py runs the flag itself),
    and the line it printed."""
    def make(_: Path) -> tuple[Path, str]:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            launch.export_run(TrainerConfig(shared_folder_path=str(finetune_job.folder.parent), job_id="f",
                                            export=True))
        return finetune_job.folder / export.RUN_FOLDER, printed.getvalue()
    return once_per_run(tmp_path_factory, "finetune_export", make)


@pytest.fixture(scope="module")
def exported(run_export) -> Path:
    return run_export[0]


def photos(described: dict) -> torch.Tensor:
    """foolbox's 20 ImageNet photos (various sizes) through the test transform model.json describes, built
    from the project's own functions: (20, 3, input_size, input_size) float32, normalised."""
    transform = pipeline.test_transform(described["input_size"], described["crop_ratio"], described["interpolation"])
    assert transform.transforms[0].resize == described["resize_size"]  # the shorter side, as model.json says
    images = torch.stack([transform(Image.open(p).convert("RGB")) for p in PHOTOS])
    return pipeline.normalize(images, (described["mean"], described["std"]))


def test_the_export_of_a_run_says_what_its_checkpoint_says(run_export, finetune_job):
    """``--export``: the folder written once the finetune's 2 ranks ended, named on stdout; its JSON says what
    the checkpoint says (sizes, preprocessing, class names, lineage, source) and the SHA-256 of each file; its
    weights are the checkpoint's, BatchNorm statistics averaged over the ranks."""
    out, line = run_export
    assert line.startswith(f"--export: {out}: resnet18 at 48 px, 10 classes, model weights of ")
    assert line.rstrip().endswith("(model.safetensors, model.onnx, model.pt2, model.json)")
    assert sorted(os.listdir(out)) == ["model.json", "model.onnx", "model.pt2", "model.safetensors"]
    assert not [p.name for p in out.parent.iterdir() if export.PARTIAL in p.name]  # no partial folder left
    described = json.loads((out / export.DESCRIPTION_FILE).read_text(encoding="utf-8"))
    state = full(finetune_job.folder / CHECKPOINT_FILE)
    assert {k: v for k, v in described.items() if k not in ("files", "source")} == {
        "format": "fixres_dist.export", "version": 1, "architecture": "resnet18", "num_classes": 10,
        "build": {"name": "resnet18", "num_classes": 10, "image_size": 48, "low_res_stem": False},
        "class_names": state["classes"], "input_size": 48, "resize_size": 55, "crop_ratio": 0.875,
        "interpolation": "bilinear", "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
        "lineage": {"train_size": 32, "finetuned_at": 48}, "weights": "model"}
    assert described["source"] == {"checkpoint": str((finetune_job.folder / CHECKPOINT_FILE).resolve()),
                                   "job_id": "f", "epoch": state["epoch"]}
    assert described["files"] == {name: export.sha256(out / name) for name in ("model.safetensors", "model.onnx",
                                                                                "model.pt2")}
    assert len(set(described["files"].values())) == 3
    # the weights: the checkpoint's, BatchNorm statistics averaged over its 2 ranks, every key of the model
    weights = load_file(out / export.WEIGHTS_FILE)
    expected = {**state["model"], **rank_buffers(state["ranks"], None)}
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)
    assert {t.dtype for t in weights.values()} == {torch.float32, torch.int64}  # num_batches_tracked


def test_a_rerun_keeps_the_export_it_finds(exported, finetune_job, capsys):
    """``--export`` at a rerun of the finished job (the same configuration, so the same last checkpoint) keeps the
    folder, untouched, in one line."""
    folder = finetune_job.folder / export.RUN_FOLDER
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    launch.export_run(TrainerConfig(shared_folder_path=str(finetune_job.folder.parent), job_id="f", export=True))
    assert capsys.readouterr().out == f"--export: {folder} kept (an earlier run of this job wrote it)\n"
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


@pytest.mark.parametrize("found", ["file", "junk-json"])
def test_a_rerun_refuses_an_export_that_is_not_one(tmp_path, capsys, found):
    """``--export`` finding something else named ``export`` in the job folder (a file, a folder whose model.json is
    not an export's): one line naming it, exit status 1, left as it was."""
    folder = tmp_path / "j" / export.RUN_FOLDER
    if found == "file":
        folder.parent.mkdir()
        folder.write_text("notes")
    else:
        folder.mkdir(parents=True)
        (folder / export.DESCRIPTION_FILE).write_text('{"format": "mine"}')
    with pytest.raises(SystemExit) as exit_status:
        launch.export_run(TrainerConfig(shared_folder_path=str(tmp_path), job_id="j", export=True))
    assert exit_status.value.code == 1
    captured = capsys.readouterr()
    assert not captured.out and len(captured.err.splitlines()) == 1, captured
    assert f"--export: {folder} exists and is not an export folder (" in captured.err
    assert captured.err.endswith("; remove it and run again to export\n")
    assert folder.is_file() if found == "file" else sorted(os.listdir(folder)) == [export.DESCRIPTION_FILE]


@needs_photos
@pytest.mark.numeric
def test_onnx_and_torch_export_give_the_checkpoints_logits_on_real_photos(exported):
    """torchvision's own resnet18 (strict load of the safetensors, no fixres_dist code) is the float32
    baseline, the same in float64 the reference; onnxruntime's logits (a batch of 20, then of 7 and 13: the
    batch axis is dynamic) and the ``torch.export`` program's (20, then 1) are within 10 x the baseline's
    rounding of the reference (:func:`numeric.assert_near_reference`)."""
    out = exported
    described = json.loads((out / export.DESCRIPTION_FILE).read_text())
    images = photos(described)
    model = torchvision.models.get_model("resnet18", num_classes=len(described["class_names"]))
    model.load_state_dict(load_file(out / export.WEIGHTS_FILE))  # strict
    with torch.no_grad():
        baseline = model.eval()(images)
        reference = model.double()(images.double())
    session = onnxruntime.InferenceSession(out / export.ONNX_FILE, providers=["CPUExecutionProvider"])
    (given,), (produced,) = session.get_inputs(), session.get_outputs()
    assert (given.name, given.shape, given.type) == ("images", ["batch", 3, 48, 48], "tensor(float)")
    assert (produced.name, produced.shape) == ("logits", ["batch", 10])
    whole = session.run(None, {"images": images.numpy()})[0]
    parts = np.concatenate([session.run(None, {"images": images[i:j].numpy()})[0] for i, j in ((0, 7), (7, 20))])
    program = torch.export.load(out / export.PROGRAM_FILE).module()
    with torch.no_grad():
        exported_whole, exported_one = program(images), program(images[:1])
    assert exported_one.shape == (1, 10)
    candidates = {"onnxruntime, batch 20": whole, "onnxruntime, batches 7 and 13": parts,
                  "torch.export, batch 20": exported_whole}
    for what, logits in candidates.items():
        assert_near_reference({"logits": torch.as_tensor(logits)}, {"logits": baseline}, {"logits": reference}, what)
    assert_near_reference({"logits": exported_one}, {"logits": baseline[:1]}, {"logits": reference[:1]},
                          "torch.export, batch 1")
    assert (baseline - reference).abs().max() > 0  # float32 rounds: the tolerance is measured, not zero


WRITTEN_IN_ORDER = (export.WEIGHTS_FILE, export.PROGRAM_FILE, export.ONNX_FILE)


def small_disk(tmp_path: Path, exported: Path, full_at: str):
    """A folder on a disk with room for the export's files written before ``full_at`` and half of that one."""
    sizes = {name: (exported / name).stat().st_size for name in os.listdir(exported)}
    before = WRITTEN_IN_ORDER[:WRITTEN_IN_ORDER.index(full_at)]
    room = sum(sizes[name] for name in before) + sizes[full_at] // 2
    folder = tmp_path / "small"
    folder.mkdir()
    yield from tmpfs(folder, f"size={room}", "a small disk that fills up")


@pytest.fixture()
def no_room(tmp_path, exported):
    """A folder on a disk with room for the export's safetensors and torch.export files but not its ONNX file."""
    yield from small_disk(tmp_path, exported, export.ONNX_FILE)


@pytest.fixture(params=[export.WEIGHTS_FILE, export.PROGRAM_FILE])
def full_early(request, tmp_path, exported):
    """A folder on a disk that fills up in the middle of the safetensors file, or of the torch.export program."""
    yield from small_disk(tmp_path, exported, request.param)


@pytest.mark.slow  # an export per file that fills the disk: about 25 s of CPU, over the test command's budget
def test_a_disk_full_in_any_file_is_one_line(finetune_job, full_early, capsys):
    """Each file is serialised in memory and written by the package's writer: a full disk in the safetensors
    or torch.export file is the same one line as in the ONNX file (not safetensors' error nor an abort from
    torch's zip writer), nothing left."""
    assert export.main([str(finetune_job.folder / CHECKPOINT_FILE), str(full_early / "e")]) == 1
    err = capsys.readouterr().err
    assert err == f"fixres_dist: cannot write {full_early / 'e'}: No space left on device; nothing written\n"
    assert list(full_early.iterdir()) == []


def test_bad_input_is_one_line_and_writes_nothing(exported, finetune_job, tmp_path, capsys, no_room):
    """Each refused in one line, exit status 1, nothing left behind: not a checkpoint (a plain state_dict, a
    safetensors file, an ONNX file, a torch.export program), no model_ema in a run without --model-ema, an empty
    OUT, an OUT that exists (kept as it was), a missing folder, and a disk that fills up in the middle of the
    ONNX file."""
    out = exported
    source = finetune_job.folder / CHECKPOINT_FILE
    torch.save(load_file(out / export.WEIGHTS_FILE), tmp_path / "state_dict.pth")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    other = "is not a fixres_dist checkpoint: another format"
    cases = [([tmp_path / "state_dict.pth", tmp_path / "a"], "not a fixres_dist checkpoint (no integer format_"),
             ([out / export.WEIGHTS_FILE, tmp_path / "b"], f"model.safetensors {other}"),
             ([out / export.ONNX_FILE, tmp_path / "b"], f"model.onnx {other}"),
             ([out / export.PROGRAM_FILE, tmp_path / "b"], "model.pt2 is a torch.export program (an export's "
                                                           "model.pt2), not a fixres_dist checkpoint"),
             ([source, ""], "the export folder is empty: give a path to write"),
             ([source, tmp_path / "c", "--weight-key", "model_ema"], "has no model_ema weights (a run without"),
             ([source, out], "export exists; export writes a new folder"),
             ([source, tmp_path / "no" / "d"], "its folder"),
             ([source, no_room / "e"], "e: No space left on device; nothing written")]
    capsys.readouterr()
    for argv, message in cases:
        assert export.main([str(a) for a in argv]) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("fixres_dist: ") and message in err and len(err.splitlines()) == 1, (argv, err)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small", "state_dict.pth"]
    assert list(no_room.iterdir()) == []  # the partial folder removed: its safetensors and program written


@pytest.fixture()
def read_only(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    yield from read_only_folder(folder)


def test_an_unwritable_folder_is_one_line(finetune_job, read_only, capsys):
    assert export.main([str(finetune_job.folder / CHECKPOINT_FILE), str(read_only / "out")]) == 1
    err = capsys.readouterr().err
    assert "cannot write" in err and "out" in err and len(err.splitlines()) == 1, err
    assert not any(read_only.iterdir())


def test_ctrl_c_is_one_line_and_writes_nothing(finetune_job, tmp_path, capsys, monkeypatch):
    """SIGINT (KeyboardInterrupt) once the safetensors file is written, while tracing: one line, exit status 130
    (what ``python -m fixres_dist.deploy.export`` exits with), the partial folder removed."""
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "program", interrupted)
    assert export.main([str(finetune_job.folder / CHECKPOINT_FILE), str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err == "fixres_dist: export stopped by SIGINT; nothing written\n"
    assert list(tmp_path.iterdir()) == []


def test_a_killed_exports_partial_folder_is_removed_by_the_next(tmp_path, capsys):
    """An export killed by SIGKILL leaves its partial folder; the next export to the same OUT removes those of
    this host whose process is gone, and keeps a live process's, another host's and another OUT's."""
    out = tmp_path / "out"
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it
    host = socket.gethostname()
    names = {"dead": f".out.{host}.{gone}.partial", "alive": f".out.{host}.1.partial",  # pid 1: init, alive
             "other host": f".out.elsewhere.{gone}.partial", "other out": f".out2.{host}.{gone}.partial"}
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / export.WEIGHTS_FILE).write_bytes(b"half")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    assert export.main([str(tmp_path / "junk.pth"), str(out)]) == 1  # refused, after the clean-up
    assert "another format" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["junk.pth", *(names[k] for k in names
                                                                              if k != "dead")])


@pytest.mark.numeric
@pytest.mark.slow  # an export of a sharded job's checkpoint: about 10 s of CPU, over the test command's budget
def test_a_sharded_checkpoints_average_loads_into_timm(vit_jobs, tmp_path, capsys):
    """docs/models.md's command on a ``--sharding full`` checkpoint's EMA (its tensors in the shards folder): the
    weights load strictly into ``timm.create_model`` at the build size, whose logits the ``torch.export`` program
    and onnxruntime give within rounding, and the JSON names the average; a copy with a shard missing is refused
    in one line, nothing written."""
    source = vit_jobs / "full" / CHECKPOINT_FILE
    saved = full(source)
    argv = shown.argv(shown.command("python -m fixres_dist.deploy.export /tmp/runs/my-job"),
                      **{"/tmp/runs/my-job": source.parent, "/tmp/runs": tmp_path})
    assert export.main(argv[3:]) == 0
    out = tmp_path / "my-job-export"
    assert capsys.readouterr().out == f"{out}: timm/test_vit at 32 px, 10 classes, model_ema weights of {source} " \
                                      "(model.safetensors, model.onnx, model.pt2, model.json)\n"
    described = json.loads((out / export.DESCRIPTION_FILE).read_text())
    assert (described["weights"], described["build"], described["input_size"], described["lineage"]) == (
        "model_ema", {"name": "timm/test_vit", "num_classes": 10, "image_size": 32, "low_res_stem": False}, 32,
        {"train_size": 32, "finetuned_at": None})
    assert (described["mean"], described["crop_ratio"], described["resize_size"]) == ([0.5] * 3, 0.95, 34)  # timm's
    weights = load_file(out / export.WEIGHTS_FILE)
    assert all(torch.equal(weights[k], saved["model_ema"][k]) for k in saved["model_ema"])
    model = timm.create_model("test_vit", num_classes=10, img_size=described["build"]["image_size"])
    model.load_state_dict(weights)  # strict
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    program = torch.export.load(out / export.PROGRAM_FILE).module()
    session = onnxruntime.InferenceSession(out / export.ONNX_FILE, providers=["CPUExecutionProvider"])
    with torch.no_grad():
        baseline, reference = model.eval()(images), model.double()(images.double())
        ours = {"torch.export": program(images),
                "onnxruntime": torch.as_tensor(session.run(None, {"images": images.numpy()})[0])}
    for what, logits in ours.items():
        assert_near_reference({"logits": logits}, {"logits": baseline}, {"logits": reference}, f"test_vit, {what}")
    shutil.copytree(vit_jobs / "full", tmp_path / "cut")
    (tmp_path / "cut" / saved["shards"] / "__1_0.distcp").unlink()
    capsys.readouterr()
    assert export.main([str(tmp_path / "cut" / CHECKPOINT_FILE), str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "is missing the shard __1_0.distcp" in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut", "my-job-export"]


def test_split_checkpoints_hold_the_whole_network(split_jobs):
    """Tensor-parallel and pipeline runs write the whole model's tensors (gathered): each checkpoint loads
    strictly into the network its model.json would describe, the same description as the job's under DDP."""
    def described(job: str) -> tuple[dict, list[str]]:
        exportable = export.read_exportable(split_jobs / job / CHECKPOINT_FILE)  # a strict load_state_dict
        return ({k: v for k, v in exportable.description.items() if k != "source"},
                list(exportable.model.state_dict()))
    ddp = described("ddp")
    assert ddp[0]["build"] == {"name": "timm/test_vit", "num_classes": 10, "image_size": 32, "low_res_stem": False}
    assert described("tp") == ddp and described("pp") == ddp


def test_the_preprocessing_a_finetune_inherited(finetune_job, tmp_path):
    """A finetune without its own ``--mean``/``--std``/``--crop-ratio``/``--interpolation`` used those of the run
    its ``--weight-path`` checkpoint came from (:func:`fixres_dist.models.preprocessing.resolve`), and so does its
    export; where that checkpoint is gone, the architecture's, with one warning naming it."""
    state = dict(full(finetune_job.folder / CHECKPOINT_FILE))
    weights_run = {**state["config"], "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25], "crop_ratio": 0.9,
                   "interpolation": "bicubic"}
    torch.save({"format_version": 1, "config": weights_run}, tmp_path / "weights.pth")
    for name, source in (("inherits.pth", tmp_path / "weights.pth"), ("orphan.pth", tmp_path / "gone.pth")):
        torch.save({**state, "config": {**state["config"], "weight_path": str(source)}}, tmp_path / name)
    warned = []
    inherited = export.read_exportable(tmp_path / "inherits.pth", warn=warned.append).description
    assert [inherited[k] for k in ("mean", "std", "crop_ratio", "interpolation", "resize_size")] == [
        [0.5] * 3, [0.25] * 3, 0.9, "bicubic", 53] and not warned
    orphan = export.read_exportable(tmp_path / "orphan.pth", warn=warned.append).description
    assert (orphan["mean"], orphan["crop_ratio"]) == ([0.485, 0.456, 0.406], 0.875)
    assert warned == [f"mean, std, crop_ratio, interpolation: the architecture's, as the run's --weight-path "
                      f"{tmp_path / 'gone.pth'}, whose overrides it would have inherited, cannot be read (weight file "
                      f"{tmp_path / 'gone.pth'} does not exist)"]
