"""Session fixtures several test files share (loaded by ``pytest_plugins`` in conftest.py): a small
data set for jobs whose data are not what they test, and a finished FixRes finetune job."""
from __future__ import annotations

from pathlib import Path

import attrs
import pytest

import shown_commands as shown
from conftest import make_subset, once_per_run, run_main, run_script
from split_models import events


@pytest.fixture(scope="session")
def few_data(tmp_path_factory) -> Path:
    """:func:`conftest.tiny_data`'s 10 classes with 2 train and 1 val image each (20 train, 10 val):
    for jobs where what is checked does not depend on how much they train or evaluate (a
    :func:`conftest.scratch_job` checkpoint fits it)."""
    return once_per_run(tmp_path_factory, "few", lambda folder: make_subset(folder, 2, 1))


@attrs.frozen
class FinishedJob:
    """A job run to its end: its folder and what it wrote to stdout."""

    folder: Path
    stdout: str


def finetune_of(scratch_job, few_data, shared: Path, *extra) -> FinishedJob:
    """The finetune of :func:`finetune_job` in ``shared``, with ``extra`` options."""
    result = run_script("finetune", "--num-tasks", 2, "--job-id", "f", "--shared-folder-path", shared,
                        "--data-path", few_data, "--weight-path", scratch_job / "checkpoint.pth",
                        "--input-size", 48, "--batch", 8, "--epochs", 1, "--workers", 1, "--no-progress", *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return FinishedJob(shared / "f", result.stdout)


@pytest.fixture(scope="session")
def finetune_job(scratch_job, few_data, tmp_path_factory) -> FinishedJob:
    """A finished 2-rank FixRes finetune (job id ``f``) of :func:`conftest.scratch_job`'s checkpoint
    (resnet18 trained at 32 px) at 48 px on :func:`few_data`: 1 epoch, loader workers, the default
    scope (head+last-norm), no sweep. Read it; copy it to change it (but ``export/``, which
    ``tests/deploy/test_export.py``'s ``exported`` writes as ``--export`` does)."""
    return once_per_run(tmp_path_factory, "finetune_job",
                        lambda shared: finetune_of(scratch_job, few_data, shared))


@pytest.fixture(scope="session")
def finetune_job_other(scratch_job, few_data, tmp_path_factory) -> FinishedJob:
    """:func:`finetune_job` again with the other memory format (``--channels-last``): the same computation
    in another summation order (:func:`split_models.assert_same_run`)."""
    return once_per_run(tmp_path_factory, "finetune_job_other",
                        lambda shared: finetune_of(scratch_job, few_data, shared, "--channels-last"))


# The split jobs (tensor parallelism, pipeline stages) and the DDP job they equal: a LayerNorm ViT, clipped,
# 2 data-parallel ranks of 8 images, whether each is one rank (DDP), a tensor group or a pipeline of 2 ranks
SPLIT_JOB = ["--architecture", "timm/test_vit", "--input-size", "32", "--batch", "8", "--epochs", "2",
             "--warmup-epochs", "0", "--workers", "0", "--no-progress", "--clip-grad-norm", "0.5"]


def job(folder, data, name, *extra, world=2, fault=None, script="scratch"):
    """:data:`SPLIT_JOB` (then ``extra``) as job ``name`` on ``world`` ranks, ``fault``: FIXRES_FAULT."""
    return run_script(script, "--num-tasks", world, "--job-id", name, "--shared-folder-path", folder,
                      "--data-path", data, *SPLIT_JOB, *extra, env={"FIXRES_FAULT": fault} if fault else None)


@pytest.fixture(scope="session")
def split_jobs(tiny_data, tmp_path_factory) -> Path:
    """The same job under DDP on 2 ranks (``ddp``), again with the other memory format (``ddp-other``: the
    same computation in another summation order, :func:`split_models.assert_same_run`), on 2 tensor groups
    of 2 ranks (``tp``) and on 2 pipelines of 2 stages (``pp``); each job's stdout in ``<name>.out``."""
    def make(folder: Path) -> Path:
        for name, extra, world in (("ddp", (), 2), ("ddp-other", ("--channels-last",), 2),
                                   ("tp", ("--tensor-parallel", 2), 4),
                                   ("pp", ("--pipeline-stages", 2), 4)):
            result = job(folder, tiny_data, name, *extra, world=world)
            assert result.returncode == 0, result.stderr[-3000:]
            (folder / f"{name}.out").write_text(result.stdout)
        return folder
    return once_per_run(tmp_path_factory, "split_jobs", make)


def assert_refused_before_start(capsys, data, folder, args, message) -> None:
    """main_scratch.py with ``args`` on ``data`` (a timm test ViT at 32 px by default) ends in the one line
    ``message`` (exit 1) before any rank starts: nothing written in ``folder``."""
    status, err = run_main(capsys, "scratch", "--shared-folder-path", folder, "--data-path", data,
                           "--architecture", "timm/test_vit", "--input-size", 32, *args)
    assert status == 1 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (folder / "local").exists()


def run_shown_split_command(command: str, job_id: str, folder) -> str:
    """docs/sharding.md's ``command`` (``shown.command(...)``, called in the test: that call claims it; job
    ``job_id``, its /tmp/runs as ``folder``): it ends 0 with each of the embedded data's 1,000 validation
    images counted once; its stdout."""
    argv = shown.argv(command, **{"/tmp/runs": folder})
    result = run_script("scratch", *argv[2:])
    assert result.returncode == 0, result.stderr[-3000:]
    assert events(folder / job_id, "eval")[-1]["images"] == 1000
    return result.stdout


# The sharding tests' ViT (timm's 6-block test model, 0.3 M parameters): no BatchNorm, so the gradient of a
# global batch is the same however the ranks split it, and runs on other world sizes compare too.
VIT = ["--architecture", "timm/test_vit", "--input-size", "32", "--batch", "8", "--epochs", "1",
       "--warmup-epochs", "0", "--workers", "0", "--no-progress", "--model-ema", "--model-ema-steps", "1",
       "--model-ema-decay", "0.5"]


def vit_run(folder, data, name, *extra, world=2, fault=None):
    """main_scratch.py with :data:`VIT` (then ``extra``) as job ``name`` on ``world`` ranks, ``fault``: FIXRES_FAULT."""
    return run_script("scratch", "--num-tasks", world, "--job-id", name, "--shared-folder-path", folder,
                      "--data-path", data, *VIT, *extra, env={"FIXRES_FAULT": fault} if fault else None)


@pytest.fixture(scope="session")
def vit_jobs(tiny_data, tmp_path_factory) -> Path:
    """The same 2-rank ViT job (:data:`VIT`, with its EMA) under DDP (job ``ddp``), again with the other memory
    format (``ddp-other``: the same computation in another summation order, :func:`split_models.assert_same_run`)
    and fully sharded (``full``: a ``--sharding full`` checkpoint, its ``.pth`` and shards folder)."""
    def make(folder: Path) -> Path:
        for name, sharding, extra in (("ddp", "ddp", ()), ("ddp-other", "ddp", ("--channels-last",)),
                                      ("full", "full", ())):
            result = vit_run(folder, tiny_data, name, "--sharding", sharding, *extra)
            assert result.returncode == 0, result.stderr[-3000:]
        return folder
    return once_per_run(tmp_path_factory, "vit_jobs", make)


@pytest.fixture(scope="session")
def exported_by_hand(finetune_job, tmp_path_factory) -> Path:
    """:func:`finetune_job`'s checkpoint as an export folder written here by hand, exactly per the export
    folder's specification (``model.safetensors`` and ``model.json``; docs/models.md), without the
    exporter: what the readers of export folders are tested on. Read it; copy it to change it."""
    import hashlib
    import json

    from safetensors.torch import save_file

    from fixres_dist.deploy.export import read_exportable

    out = tmp_path_factory.mktemp("exported") / "resnet18-48"
    out.mkdir()
    found = read_exportable(finetune_job.folder / "checkpoint.pth")  # the weights as a checkpoint holds them
    save_file({name: tensor.contiguous() for name, tensor in found.model.state_dict().items()},
              str(out / "model.safetensors"))
    classes = list(found.description["class_names"])
    meta = {"format": "fixres_dist.export", "version": 1, "architecture": "resnet18", "num_classes": len(classes),
            "build": {"name": "resnet18", "num_classes": len(classes), "image_size": 48, "low_res_stem": False},
            "class_names": classes, "input_size": 48, "resize_size": 55, "crop_ratio": 0.875,
            "interpolation": "bilinear", "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
            "lineage": {"train_size": 32, "finetuned_at": 48}, "weights": "model",
            "source": {"checkpoint": str(finetune_job.folder / "checkpoint.pth"), "job_id": "f", "epoch": 1},
            "files": {"model.safetensors": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()}}
    (out / "model.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return out
