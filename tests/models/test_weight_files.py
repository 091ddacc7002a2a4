"""Weights from elsewhere (issue 13, items 4 and 5): the layouts of torchvision's references, timm,
DeiT, Lightning, FixRes and plain state_dicts; what torch's strict load accepts from older versions;
--weight-key; a message listing the top-level keys when nothing fits. Real objects saved with torch."""
from __future__ import annotations

import argparse
import builtins
import copy
import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from conftest import run_script
from fixres_dist.errors import FixresError
from fixres_dist.models import architectures, weights

HAS_TIMM = importlib.util.find_spec("timm") is not None
needs_timm = pytest.mark.skipif(not HAS_TIMM, reason="timm not installed (pip install -e .[timm])")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return architectures.build_model("resnet20", 10)


@pytest.fixture(scope="module")
def trained():
    """A resnet20, its optimizer and an EMA of it (torchvision's AveragedModel) that differs from it."""
    model = _model(1)
    ema = AveragedModel(model)
    ema.update_parameters(model)  # the first update copies
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    ema.update_parameters(model)  # the EMA now averages the two: not the model's weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, ema, optimizer


def _layouts(model, ema, optimizer) -> dict:
    state = model.state_dict()
    shifted = {k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}
    args = argparse.Namespace(model="resnet20", lr=0.1)
    return {
        # torchvision's references/classification/train.py
        "torchvision": ({"model": state, "model_ema": ema.state_dict(), "optimizer": optimizer.state_dict(),
                         "lr_scheduler": {"last_epoch": 3}, "epoch": 3, "args": args}, "model", ["model_ema"]),
        # timm's train.py (CheckpointSaver)
        "timm": ({"epoch": 3, "arch": "resnet20", "state_dict": state, "state_dict_ema": shifted,
                  "optimizer": optimizer.state_dict(), "version": 2, "args": args, "metric": np.float64(71.5)},
                 "state_dict", ["state_dict_ema"]),
        # DeiT's main.py
        "deit": ({"model": state, "optimizer": optimizer.state_dict(), "lr_scheduler": {"last_epoch": 3},
                  "epoch": 3, "scaler": {"scale": 65536.0}, "args": args}, "model", []),
        # Lightning: the LightningModule's state_dict, the network under its attribute name
        "lightning": ({"epoch": 3, "global_step": 120, "pytorch-lightning_version": "2.4.0",
                       "state_dict": {**{f"model.{k}": v for k, v in state.items()},
                                      "criterion.weight": torch.ones(10)},
                       "optimizer_states": [optimizer.state_dict()], "lr_schedulers": [],
                       "hyper_parameters": {"lr": 0.1, "args": args}}, "state_dict", []),
        # FixRes' own: the DDP module's state_dict
        "fixres": ({"model": {f"module.{k}": v for k, v in state.items()}, "optimizer": optimizer.state_dict(),
                    "epoch": 3}, "model", []),
        "plain": (state, None, []),
        "torch.compile": (torch.compile(model).state_dict(), None, []),  # _orig_mod. prefixes, not compiled yet
        "DataParallel": (nn.DataParallel(model).state_dict(), None, []),  # module. prefixes
        "tutorial": ({"epoch": 3, "model_state_dict": state, "optimizer_state_dict": optimizer.state_dict(),
                      "loss": 0.4}, "model_state_dict", []),
    }


@pytest.mark.parametrize("layout", ["torchvision", "timm", "deit", "lightning", "fixres", "plain", "torch.compile",
                                    "DataParallel", "tutorial"])
def test_layouts_of_other_trainers_load(trained, tmp_path, layout):
    model, ema, optimizer = trained
    payload, key, others = _layouts(model, ema, optimizer)[layout]
    torch.save(payload, tmp_path / "w.pth")
    found = weights.read_weight_file(tmp_path / "w.pth")
    assert (found.key, list(found.others)) == (key, others)
    target = _model(2)
    weights.load_weights(target, found)
    for name, tensor in model.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name


def test_weight_key_picks_the_ema_weights(trained, tmp_path):
    model, ema, optimizer = trained
    layouts = _layouts(model, ema, optimizer)
    torch.save(layouts["torchvision"][0], tmp_path / "tv.pth")
    found = weights.read_weight_file(tmp_path / "tv.pth", "model_ema")
    assert found.key == "model_ema" and found.others == ("model",)
    target = _model(2)
    # torchvision's EMA is an AveragedModel: module. prefixes and an n_averaged counter
    assert weights.load_weights(target, found).note == "weights under 'module.'; ignored 1 other entry: n_averaged"
    assert torch.equal(target.conv1.weight, ema.module.conv1.weight)
    assert not torch.equal(target.conv1.weight, model.conv1.weight)
    torch.save(layouts["timm"][0], tmp_path / "timm.pth")
    target = _model(2)
    weights.load_weights(target, weights.read_weight_file(tmp_path / "timm.pth", "state_dict_ema"))
    assert torch.equal(target.conv1.weight, model.conv1.weight + 0.01)
    assert weights.read_weight_file(tmp_path / "timm.pth").describe() == (
        f"weights: {len(model.state_dict())} tensors from entry 'state_dict' of {tmp_path / 'timm.pth'} "
        "(also there: state_dict_ema; --weight-key picks one)")


@pytest.mark.parametrize("payload, key, message", [
    ({"epoch": 3, "arch": "resnet20", "args": argparse.Namespace(lr=0.1)}, None,
     r"holds no state_dict \(a dict of tensors\); its top-level keys: epoch, arch, args; read as inert "
     r"placeholders: argparse.Namespace; if one of them holds the weights, name it with --weight-key$"),
    ({"net": "STATE", "net_ema": "STATE", "epoch": 3}, None,
     r"holds several state_dicts \(net, net_ema\); pick one with --weight-key$"),
    ({"model": "STATE", "epoch": 3}, "model_ema",
     r"^--weight-key model_ema: weight file .* has no entry 'model_ema'; its top-level keys: model, epoch$"),
    ({"model": "STATE", "epoch": 3}, "epoch",
     r"^--weight-key epoch: entry 'epoch' of weight file .* is not a state_dict \(a dict of tensors\) but a int$"),
    ("STATE", "model", r"is a plain state_dict, with no entries to pick from; leave --weight-key out$"),
    ([1, 2], None, r"holds no state_dict \(a dict of tensors\); its top-level keys: none: it holds a list"),
])
def test_when_nothing_fits_the_message_lists_what_the_file_holds(tmp_path, payload, key, message):
    state = _model().state_dict()
    def fill(v):
        return state if v == "STATE" else v

    payload = {k: fill(v) for k, v in payload.items()} if isinstance(payload, dict) else fill(payload)
    torch.save(payload, tmp_path / "w.pth")
    with pytest.raises(FixresError, match=message) as info:
        weights.read_weight_file(tmp_path / "w.pth", key)
    assert "\n" not in str(info.value)


def test_state_dicts_from_older_torch_versions_load_as_torch_loads_them(tmp_path):
    """The issue's case: BatchNorm buffers without num_batches_tracked (before torch 0.4.1) were refused
    with "20 missing keys", though load_state_dict(strict=True) accepts them."""
    source = architectures.build_model("resnet18", 10)
    old = {k: v for k, v in source.state_dict().items() if not k.endswith("num_batches_tracked")}
    assert len(source.state_dict()) - len(old) == 20
    reference = architectures.build_model("resnet18", 10)
    reference.load_state_dict(old, strict=True)  # torch accepts it
    torch.save(old, tmp_path / "old.pth")
    target = architectures.build_model("resnet18", 10)
    assert weights.load_weights(target, weights.read_weight_file(tmp_path / "old.pth")).note is None
    for name, tensor in reference.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
    # a neighbour: torchvision's ViT MLP keys before torchvision 0.13 (linear_1/linear_2), upgraded by its module
    vit = architectures.build_model("vit_b_32", 10, image_size=64)
    renamed = {k.replace("mlp.0.", "mlp.linear_1.").replace("mlp.3.", "mlp.linear_2."): v
               for k, v in vit.state_dict().items()}
    assert any("linear_1" in k for k in renamed)
    fresh = copy.deepcopy(vit)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()  # unlike vit's: only a load makes them equal (a copy is cheaper than a second vit_b_32)
    assert weights.load_weights(fresh, renamed, "vit-0.12.pth").note is None
    assert torch.equal(fresh.encoder.layers[0].mlp[0].weight, vit.encoder.layers[0].mlp[0].weight)
    # what torch refuses stays refused, and a refused load leaves the model as it was
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    broken = {k: v for k, v in renamed.items() if "mlp.linear_2.bias" not in k}
    broken["encoder.layers.encoder_layer_0.mlp.linear_1.weight"] = torch.zeros(5, 5)
    with pytest.raises(FixresError, match=r"do not fit this model: .*size mismatch"):
        weights.load_weights(fresh, broken, "broken.pth")
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())


def test_foreign_python_objects_are_placeholders_and_never_run(tmp_path):
    marker = tmp_path / "EXECUTED"

    class RunsCode:
        def __reduce__(self):
            return (builtins.exec, (f"open({str(marker)!r}, 'w').close()",))

    state = _model().state_dict()
    torch.save({"model": state, "args": argparse.Namespace(lr=0.1), "trap": RunsCode()}, tmp_path / "w.pth")
    found = weights.read_weight_file(tmp_path / "w.pth")
    assert found.key == "model" and set(found.placeholders) == {"argparse.Namespace", "builtins.exec"}
    assert not marker.exists()

    class Shell:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"model": state, "trap": Shell()}, tmp_path / "os.pth")  # torch blocks the os module outright
    with pytest.raises(FixresError, match="nothing in it was executed"):
        weights.read_weight_file(tmp_path / "os.pth")
    assert not marker.exists()


@needs_timm
def test_timm_weights_for_another_size_are_resampled_by_timm():
    source = architectures.build_model("timm/vit_tiny_patch16_224", 10, image_size=224)
    target = architectures.build_model("timm/vit_tiny_patch16_224", 10, image_size=32)
    note = weights.load_weights(target, source.state_dict(), "vit224.pth").note
    assert note == "timm resampled pos_embed to this model's size"
    assert target.pos_embed.shape == (1, 5, 192)
    assert torch.equal(target.cls_token, source.cls_token)


def test_finetune_from_files_of_other_trainers(trained, few_data, tmp_path):
    """End to end: an older torch's state_dict, and a timm train.py checkpoint's EMA entry."""
    model, ema, optimizer = trained
    layouts = _layouts(model, ema, optimizer)
    torch.save({k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")},
               tmp_path / "old.pth")
    torch.save(layouts["timm"][0], tmp_path / "timm.pth")
    common = ["--architecture", "resnet20", "--data-path", few_data, "--shared-folder-path", tmp_path,
              "--eval-only", "--test-size", 16, "--workers", 0, "--no-progress"]
    old = run_script("finetune", *common, "--weight-path", tmp_path / "old.pth", "--job-id", "old")
    assert old.returncode == 0, old.stderr[-3000:]
    ema_run = run_script("finetune", *common, "--weight-path", tmp_path / "timm.pth", "--weight-key", "state_dict_ema",
                         "--job-id", "ema")
    assert ema_run.returncode == 0, ema_run.stderr[-3000:]
    assert "from entry 'state_dict_ema' of" in ema_run.stdout
    evals = [json.loads(line) for line in (tmp_path / "ema" / "metrics.jsonl").read_text().splitlines()]
    assert [e["images"] for e in evals if e["event"] == "eval"] == [10]
