"""Preprocessing per model (issue 13, item 7): timm's pretrained config (mean/std, crop ratio,
interpolation), EfficientNet-Lite's 127/128, ImageNet's as the default, explicit overrides, the
weights' own run's values, and the log line at start."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from conftest import FAST, run_main, run_script
from fixres_dist.config import TrainerConfig
from fixres_dist.data import pipeline
from fixres_dist.errors import FixresError
from fixres_dist.models import preprocessing

HAS_TIMM = importlib.util.find_spec("timm") is not None
HAS_LITE = importlib.util.find_spec("efficientnet_lite_pytorch") is not None

# resnet20 at 16 px, 1 epoch (on few_data: 20 train, 10 val images): what is checked is the log, not the training
SMALL = ["--architecture", "resnet20", "--input-size", "16", "--batch", "8", "--epochs", "1", "--workers", "0",
         "--no-progress"]


@pytest.mark.parametrize("name, mean, std, crop, interpolation", [
    ("resnet50", pipeline.IMAGENET_MEAN, pipeline.IMAGENET_STD, 0.875, "bilinear"),
    ("resnet20", pipeline.IMAGENET_MEAN, pipeline.IMAGENET_STD, 0.875, "bilinear"),
    pytest.param("efficientnet_lite0", (127 / 255,) * 3, (128 / 255,) * 3, 0.875, "bilinear",
                 marks=pytest.mark.skipif(not HAS_LITE, reason="efficientnet-lite-pytorch not installed")),
    pytest.param("timm/vit_tiny_patch16_224", (0.5,) * 3, (0.5,) * 3, 0.9, "bicubic",
                 marks=pytest.mark.skipif(not HAS_TIMM, reason="timm not installed")),
    pytest.param("timm/resnet18", pipeline.IMAGENET_MEAN, pipeline.IMAGENET_STD, 0.95, "bicubic",
                 marks=pytest.mark.skipif(not HAS_TIMM, reason="timm not installed")),
])
def test_each_architecture_gets_the_preprocessing_of_its_weights(name, mean, std, crop, interpolation):
    prep = preprocessing.architecture_preprocessing(name)
    assert prep.mean == pytest.approx(mean) and prep.std == pytest.approx(std)
    assert (prep.crop_ratio, prep.interpolation) == (crop, interpolation)


def test_explicit_values_win_then_the_weights_run_then_the_architecture():
    default = preprocessing.resolve(TrainerConfig(architecture="resnet18"))
    assert default == preprocessing.architecture_preprocessing("resnet18")
    mine = preprocessing.resolve(TrainerConfig(architecture="resnet18", mean=0.5, std=(0.2, 0.25, 0.3), crop_ratio=1.0),
                                 weight_config={"mean": [0.1, 0.1, 0.1], "std": [0.9] * 3, "interpolation": "bicubic"})
    assert (mine.mean, mine.std, mine.crop_ratio, mine.interpolation) == ((0.5,) * 3, (0.2, 0.25, 0.3), 1.0, "bicubic")
    assert mine.describe() == ("input preprocessing: mean 0.5,0.5,0.5, std 0.2,0.25,0.3, test crop 1, bicubic "
                               "(--mean, --std, --crop-ratio, interpolation of the weights' run; otherwise "
                               "ImageNet's default)")


def test_test_transform_uses_the_crop_ratio_and_interpolation():
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (90, 70, 3), dtype=np.uint8))
    ours = pipeline.test_transform(48, crop_ratio=0.9, interpolation="bicubic")(image)
    reference = v2.Compose([v2.Resize(53, interpolation=v2.InterpolationMode.BICUBIC, antialias=True),
                            v2.CenterCrop(48), v2.PILToTensor()])(image)
    assert torch.equal(ours, reference)
    assert not torch.equal(ours, pipeline.test_transform(48)(image))
    with pytest.raises(FixresError, match="unknown interpolation 'lanczos'"):
        pipeline.test_transform(48, interpolation="lanczos")


@pytest.mark.parametrize("args, message", [
    (["--mean", "0.5"], "--mean and --std go together"),
    (["--mean", "0.5", "--std", "0,0.2,0.2"], "--std must be > 0 for every channel, got [0.0, 0.2, 0.2]"),
    (["--mean", "nan", "--std", "0.2"], "--mean must be 3 finite numbers"),
    (["--crop-ratio", "1.5"], "--crop-ratio must be in (0, 1]"),
    (["--weight-key", "model_ema"], "--weight-key needs --weight-path"),
])
def test_bad_preprocessing_values_are_refused(args, message, tmp_path, capsys):
    status, err = run_main(capsys, "scratch", "--shared-folder-path", tmp_path / "s", *FAST, *args)
    assert status == 1 and err.strip().startswith("fixres_dist: rank 0: ") and message in err, err
    assert not (tmp_path / "s").exists()


def test_the_run_logs_its_preprocessing_and_a_finetune_keeps_the_weights_own(few_data, tmp_path):
    scratch = run_script("scratch", "--mean", "0.5", "--std", "0.25", "--data-path", few_data,
                         "--shared-folder-path", tmp_path, "--job-id", "s", *SMALL)
    assert scratch.returncode == 0, scratch.stderr[-3000:]
    assert "input preprocessing: mean 0.5,0.5,0.5, std 0.25,0.25,0.25, test crop 0.875, bilinear (--mean, --std; " \
           "otherwise ImageNet's default)" in scratch.stdout
    finetune = run_script("finetune", "--weight-path", tmp_path / "s" / "checkpoint.pth", "--eval-only",
                          "--data-path", few_data, "--shared-folder-path", tmp_path, "--job-id", "f", *SMALL)
    assert finetune.returncode == 0, finetune.stderr[-3000:]
    assert "input preprocessing: mean 0.5,0.5,0.5, std 0.25,0.25,0.25, test crop 0.875, bilinear (mean of the " \
           "weights' run, std of the weights' run; otherwise ImageNet's default)" in finetune.stdout
