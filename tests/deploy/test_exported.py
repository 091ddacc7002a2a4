"""fixres_dist.deploy.exported: an export folder (written by hand per the specification: jobs_fixtures'
``exported_by_hand``) and the checkpoint it came from read as the same model, with evaluation's test
transform; each bad folder or file refused in one line."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import torchvision
from safetensors.torch import load_file, save_file

from fixres_dist.data import images, pipeline
from fixres_dist.deploy import exported
from fixres_dist.errors import FixresError


def real_batch(folder: Path, transform) -> torch.Tensor:
    """The few_data val images (one per class) through ``transform``: uint8 (10, 3, 48, 48)."""
    return torch.stack([transform(images.read_image(str(p))) for p in sorted(folder.glob("val/*/*.png"))])


@pytest.mark.numeric
def test_an_export_folder_and_its_checkpoint_are_the_same_model(exported_by_hand, finetune_job, few_data):
    folder = exported.read_export(exported_by_hand)
    from_checkpoint = exported.open_model(finetune_job.folder / "checkpoint.pth")
    assert exported.open_model(exported_by_hand) == folder
    assert {**from_checkpoint.metadata(), "files": None} == {**folder.metadata(), "files": None}
    assert folder.metadata()["files"] == json.loads((exported_by_hand / "model.json").read_text())["files"]
    assert (folder.input_size, folder.resize_size, folder.lineage) == (48, 55, {"train_size": 32, "finetuned_at": 48})
    # the transform is evaluation's at 48 px with the weights' crop and interpolation
    batch = real_batch(few_data, folder.transform())
    assert torch.equal(batch, real_batch(few_data, pipeline.test_transform(48, 0.875, "bilinear")))
    net, other = folder.build(), from_checkpoint.build()
    assert not net.training
    x = pipeline.normalize(batch, folder.normalization)
    with torch.no_grad():  # the same weights, bit for bit, also in torchvision's own model (no fixres_dist)
        plain = torchvision.models.get_model("resnet18", num_classes=10)
        plain.load_state_dict(load_file(exported_by_hand / "model.safetensors"), strict=True)
        logits = net(x)
        assert torch.equal(logits, other(x)) and torch.equal(logits, plain.eval()(x))


# model.json's values edited to ones that would give NaN probabilities, a ZeroDivisionError or no image
EDITS = {"std-zero": {"std": [0, 0, 0]}, "std-nan": {"std": [float("nan"), 0.2, 0.2]}, "mean-two": {"mean": [0.5, 0.5]},
         "crop-zero": {"crop_ratio": 0}, "crop-above-1": {"crop_ratio": 1.5, "resize_size": 32},
         "size-zero": {"input_size": 0, "resize_size": 0}, "interpolation": {"interpolation": "lanczos"}}


def damaged(source: Path, dest: Path, problem: str) -> Path:
    """A copy of the export folder ``source`` at ``dest`` with ``problem``."""
    shutil.copytree(source, dest)
    meta_path = dest / "model.json"
    meta = json.loads(meta_path.read_text())
    weights = dest / "model.safetensors"
    if problem == "no-weights":
        weights.unlink()
    elif problem == "listed-file-missing":
        meta["files"]["model.onnx"] = "0" * 64
    elif problem == "hash":
        state = load_file(weights)
        state["fc.bias"] = state["fc.bias"] + 1
        save_file(state, str(weights))
    elif problem == "keys":
        state = load_file(weights)
        del state["fc.bias"]
        save_file(state, str(weights))
        meta["files"]["model.safetensors"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    elif problem == "format":
        meta["format"] = "timm"
    elif problem == "version":
        meta["version"] = 2
    elif problem == "no-json":
        meta_path.unlink()
    elif problem == "field":
        meta["input_size"] = "48"
    elif problem in EDITS:
        meta.update(EDITS[problem])
    if meta_path.exists():
        meta_path.write_text(json.dumps(meta))
    return dest


@pytest.mark.parametrize("problem,message", [
    ("no-weights", r"is missing model\.safetensors \(listed in model\.json\); export the checkpoint again$"),
    ("listed-file-missing", r"is missing model\.onnx \(listed in model\.json\)"),
    ("hash", r"model\.safetensors has SHA-256 \w+\.\.\., not the \w+\.\.\. model\.json records: changed or damaged"),
    ("keys", r": the weights do not fit resnet18 \(missing fc\.bias\)$"),
    ("format", r"model\.json is not a fixres_dist\.export file \(format 'timm'\)$"),
    ("version", r"has fixres_dist\.export version 2; this fixres_dist reads version 1"),
    ("no-json", r"is not an export folder: it has no model\.json$"),
    ("field", r"model\.json: input_size is '48', not a JSON int$"),
    ("std-zero", r"bad: std is \[0, 0, 0\]: each must be above 0 \(images are divided by it\)$"),
    ("std-nan", r"bad: std is \[nan, 0\.2, 0\.2\], not 3 finite numbers \(one per RGB channel\)$"),
    ("mean-two", r"bad: mean is \[0\.5, 0\.5\], not 3 finite numbers"),
    ("crop-zero", r"bad: crop_ratio is 0, not in \(0, 1\]$"),
    ("crop-above-1", r"bad: crop_ratio is 1\.5, not in \(0, 1\]$"),
    ("size-zero", r"bad: input_size is 0, not a size in pixels \(at least 1\)$"),
    ("interpolation", r"bad: interpolation 'lanczos' is none of bilinear, bicubic, nearest$"),
])
def test_a_bad_export_folder_is_refused_in_one_line(exported_by_hand, tmp_path, problem, message):
    with pytest.raises(FixresError, match=message) as error:
        exported.open_model(damaged(exported_by_hand, tmp_path / "bad", problem))
    assert "\n" not in str(error.value)


def test_a_file_that_is_no_checkpoint_of_this_project_is_refused_in_one_line(exported_by_hand, tmp_path):
    plain = tmp_path / "resnet18.pth"  # another tool's file: a bare state_dict
    torch.save(load_file(exported_by_hand / "model.safetensors"), plain)
    for path, message in ((plain, r"is not a fixres_dist checkpoint \(no integer format_version\)$"),
                          (exported_by_hand / "model.safetensors", r"safetensors is not a fixres_dist checkpoint"),
                          (tmp_path / "nothing", r"model .*nothing does not exist \(give an export folder or a")):
        with pytest.raises(FixresError, match=message) as error:
            exported.open_model(path)
        assert "\n" not in str(error.value)
