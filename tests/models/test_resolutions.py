"""Models at the sizes FixRes needs (issue 13, item 6): timm models run at any size their family
supports; a size a model cannot run at is refused before anything is written, with the sizes it runs
at, measured by a forward pass of zeros on the meta device."""
from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import run_main, run_script
from fixres_dist.config import TrainerConfig
from fixres_dist.models import architectures, resolutions

HAS_TIMM = importlib.util.find_spec("timm") is not None
needs_timm = pytest.mark.skipif(not HAS_TIMM, reason="timm not installed (pip install -e .[timm])")
VIT = "timm/vit_tiny_patch16_224"
RUN = ["--batch", "8", "--epochs", "1", "--workers", "0", "--no-progress"]


def _evals(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["event"] == "eval"]


@pytest.mark.numeric
@pytest.mark.slow
@needs_timm
def test_timm_vit_trains_at_32_px_and_is_tested_up_to_224_px(few_data, tmp_path):
    """The issue's runs: before, both died with "Input height (32) doesn't match model (224)" after
    the job folder was made (here on 20 train and 10 val images)."""
    scratch = run_script("scratch", "--architecture", VIT, "--input-size", 32, "--test-sizes", "32,224",
                         "--data-path", few_data, "--shared-folder-path", tmp_path, "--job-id", "vit", *RUN)
    assert scratch.returncode == 0, scratch.stderr[-3000:]
    trained = {e["resolution"]: e["top1"] for e in _evals(tmp_path / "vit") if e.get("label") == "trained"}
    assert set(trained) == {32, 224}
    evaluated = run_script("finetune", "--architecture", VIT, "--weight-path", tmp_path / "vit" / "checkpoint.pth",
                           "--eval-only", "--test-sizes", "32,224", "--data-path", few_data,
                           "--shared-folder-path", tmp_path, "--job-id", "vit-eval", *RUN)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert {e["resolution"]: e["top1"] for e in _evals(tmp_path / "vit-eval")} == trained  # same weights, same numbers
    finetuned = run_script("finetune", "--architecture", VIT, "--weight-path", tmp_path / "vit" / "checkpoint.pth",
                           "--input-size", 48, "--data-path", few_data, "--shared-folder-path", tmp_path,
                           "--job-id", "vit-48", *RUN)
    assert finetuned.returncode == 0, finetuned.stderr[-3000:]
    assert "timm resampled pos_embed to this model's size" in finetuned.stdout


REFUSED = {
    "timm ViT, not a multiple of its patch": (
        ["--architecture", VIT, "--input-size", "40"],
        "timm/vit_tiny_patch16_224 cannot train on 40 px images with 2 per rank (AssertionError: Input height (40) "
        "should be divisible by patch size (16).); nearest sizes it runs at: 32 and 48 px"),
    "timm model of one size only": (
        ["--architecture", "timm/beit_base_patch16_224", "--input-size", "32", "--test-sizes", "32,64"],
        "timm/beit_base_patch16_224 cannot run on 64 px images (AssertionError: Input height (64) doesn't match "
        "model (32).); nearest size it runs at: 32 px"),
    "alexnet at 32 px": (
        ["--architecture", "alexnet", "--input-size", "32"],
        "alexnet cannot train on 32 px images with 2 per rank (RuntimeError: Given input size: (256x1x1). "
        "Calculated output size: (256x0x0). Output size is too small); the smallest size it runs at is 63 px"),
    "maxvit_t's windows": (
        ["--architecture", "maxvit_t", "--input-size", "224", "--test-sizes", "40,224"],
        "maxvit_t cannot run on 40 px images (RuntimeError: shape '[2, 64, 1, 7, 1, 7]' is invalid for input of "
        "size 12800); the smallest size it runs at is 221 px"),
    "one image per rank in training": (
        ["--architecture", "resnet18", "--input-size", "16", "--batch", "1"],
        "--batch must be >= 2 for training: a rank's BatchNorm cannot train on one image"),
    "auxiliary outputs in training": (
        ["--architecture", "inception_v3", "--input-size", "299"],
        "inception_v3 returns InceptionOutputs in training mode, not (batch, 10) logits: it cannot be trained here"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_sizes_a_model_cannot_run_at_are_refused_before_anything_is_written(case, tiny_data, tmp_path, capsys):
    """Refused by the launcher's preflight, in this process, before any rank starts (run_main)."""
    args, message = REFUSED[case]
    if "timm/" in " ".join(args) and not HAS_TIMM:
        pytest.skip("timm not installed (pip install -e .[timm])")
    status, err = run_main(capsys, "scratch", "--data-path", tiny_data, "--shared-folder-path", tmp_path / "shared",
                           "--epochs", "1", "--workers", "0", "--no-progress", *args)
    assert status == 1
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"fixres_dist: rank 0: {message}"), err
    assert not (tmp_path / "shared").exists()


def test_measured_sizes_of_torchvision_models(monkeypatch):
    """The smallest size each runs at in evaluation, measured on the meta device."""
    for name, size, expected in [("inception_v3", 32, "the smallest size it runs at is 75 px"),
                                 ("alexnet", 40, "the smallest size it runs at is 63 px"),
                                 ("vit_b_16", 40, "nearest sizes it runs at: 32 and 48 px")]:
        probe = resolutions.Probe(name, 10, 224 if name != "vit_b_16" else 32)
        assert probe.failure(size) is not None
        assert resolutions.supported_sizes_near(probe, size) == expected, name
    built, build_model = [], architectures.build_model

    def recorded(*args, **kwargs):
        model = build_model(*args, **kwargs)
        built.append({p.device.type for p in model.parameters()})
        return model

    monkeypatch.setattr(architectures, "build_model", recorded)
    probe = resolutions.Probe("resnet20", 10, 32)
    assert probe.failure(1) is None and probe.failure(4096) is None  # a CIFAR ResNet runs at any size
    assert built == [{"meta"}]  # one model, on the meta device: nothing was allocated


def test_the_sizes_a_run_uses():
    scratch = TrainerConfig(input_size=32, test_sizes=(24, 48))
    assert resolutions.run_sizes(scratch) == ([32], [24, 48, 32])
    finetune = TrainerConfig(mode="finetune", weight_path="w.pth", input_size="auto", test_sizes=(40, 56))
    assert resolutions.run_sizes(finetune, trained_at=28) == ([40, 56], [40, 56, 28])
    assert resolutions.build_size(finetune) == 40
    evaluate = TrainerConfig(mode="finetune", weight_path="w.pth", eval_only=True, input_size=48, test_sizes=(32, 224))
    assert resolutions.run_sizes(evaluate) == ([], [32, 224]) and resolutions.build_size(evaluate) == 32
    single = TrainerConfig(mode="finetune", weight_path="w.pth", eval_only=True, input_size=48, test_size=64)
    assert resolutions.run_sizes(single) == ([], [64]) and resolutions.build_size(single) == 64
