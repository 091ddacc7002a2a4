"""Bad input: one clear line on stderr, no traceback, non-zero exit, nothing written."""
from __future__ import annotations

import argparse
import os
import pickle
import shutil

import pytest
import torch

from conftest import FAST, make_subset, run_interpreter
from fixres_dist.entry.launch import main
from fixres_dist.models import architectures


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    folder = tmp_path_factory.mktemp("weights")
    files = {"resnet18_10": architectures.build_model("resnet18", 10).state_dict(),
             "resnet18_headless": {k: v for k, v in architectures.build_model("resnet18", 10).state_dict().items()
                                   if not k.startswith("fc.")},
             "resnet34_10": architectures.build_model("resnet34", 10).state_dict(),
             "resnet18_low_stem": architectures.build_model("resnet18", 10, low_res_stem=True).state_dict()}
    nan = architectures.build_model("resnet18", 10).state_dict()
    nan["layer4.1.bn2.weight"][0] = float("nan")
    files.update({"timm_layout": {"epoch": 3, "arch": "resnet18", "state_dict": files["resnet18_10"],
                                  "args": argparse.Namespace(lr=0.1)},
                  "no_weights": {"epoch": 3, "optimizer": {"state": {}, "param_groups": []}},
                  "nan": {"model": nan}})
    for name, state in files.items():
        torch.save(state, folder / f"{name}.pth")
    (folder / "empty.pth").write_bytes(b"")
    (folder / "text.pth").write_text("hello, not a checkpoint")

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {folder / 'PWNED'}",))
    (folder / "evil.pth").write_bytes(pickle.dumps({"model": Evil()}))
    return folder


@pytest.fixture(scope="module")
def broken_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    no_val = make_subset(root / "no_val", 2, 1, classes=3)
    shutil.rmtree(no_val / "val")
    empty_class = make_subset(root / "empty_class", 2, 1, classes=3)
    for image in (empty_class / "train" / "1_trouser").iterdir():
        image.unlink()
    differ = make_subset(root / "differ", 2, 1, classes=3)
    (differ / "val" / "2_pullover").rename(differ / "val" / "2_jumper")
    make_subset(root / "three", 1, 1, classes=3)
    dir_image = make_subset(root / "dir_image", 2, 1, classes=1)
    for split in ("train", "val"):
        (dir_image / split / "b_class" / "fake.png").mkdir(parents=True)
    return root


CASES = {
    "rank >= num tasks": (["--num-tasks", "2", "--global-rank", "2", "--job-id", "x"],
                          "--global-rank 2 must be < --num-tasks 2"),
    "negative rank": (["--num-tasks", "2", "--global-rank", "-1", "--job-id", "x"], "--global-rank must be >= 0"),
    "local rank >= num tasks": (["--num-tasks", "2", "--global-rank", "0", "--local-rank", "5", "--job-id", "x"],
                                "--local-rank 5"),
    "zero tasks": (["--num-tasks", "0"], "--num-tasks must be >= 1"),
    "missing data": (["--data-path", "{tmp}/nowhere"], "does not exist"),
    "no val folder": (["--data-path", "{broken}/no_val"], "has no val/ folder"),
    "empty class folder": (["--data-path", "{broken}/empty_class"], "1_trouser holds no images"),
    "class folders differ": (["--data-path", "{broken}/differ"], "train and val class folders differ"),
    "unknown architecture": (["--architecture", "resnet81"], "did you mean resnet18"),
    "unsafe job id": (["--job-id", "../up"], "not safe as a folder name"),
    "bad dist url": (["--dist-url", "http://host:1"], "file://, tcp:// or env://"),
    "missing weights": (["--weight-path", "{tmp}/none.pth"], "does not exist"),
    "empty weight file": (["--weight-path", "{weights}/empty.pth"], "is empty (0 bytes)"),
    "text weight file": (["--weight-path", "{weights}/text.pth"], "not a complete PyTorch file"),
    "weight path is a folder": (["--weight-path", "{weights}"], "is not a file"),
    "code in weight file": (["--weight-path", "{weights}/evil.pth"], "nothing in it was executed"),
    "nan learning rate": (["--learning-rate", "nan"], "--learning-rate must be a finite number"),
    "inf momentum": (["--momentum", "inf"], "--momentum must be a finite number"),
    "port out of range": (["--num-tasks", "2", "--dist-url", "tcp://localhost:99999"], "Port out of range"),
    "relative file url": (["--num-tasks", "2", "--dist-url", "file://x.json"], "three slashes"),
    "huge seed": (["--seed", "99999999999999999999999"], "--seed must be in [0, 2**63)"),
    "too few train images": (["--num-tasks", "2", "--data-path", "{broken}/three"], "too few for the ranks"),
    "folder named like an image": (["--data-path", "{broken}/dir_image"], "b_class holds no images"),
    "shared folder is a file": (["--shared-folder-path", "{weights}/empty.pth"], "is not a writable folder"),
    "resume a plain state_dict": (["--resume", "{weights}/resnet18_10.pth"], "not a fixres_dist checkpoint"),
    "other architecture": (["--weight-path", "{weights}/resnet34_10.pth"], "unexpected keys e.g. layer1.2"),
    "weights without a head": (["--weight-path", "{weights}/resnet18_headless.pth"],
                               "has no classifier head (missing fc.weight, fc.bias)"),
    "low-res stem of a ViT": (["--architecture", "vit_b_16", "--low-res-stem"],
                              "--low-res-stem: vit_b_16 has no ResNet stem to replace; it applies to torchvision "
                              "ResNets (resnet18, "),
    "low-res stem of a CIFAR ResNet": (["--architecture", "resnet20", "--low-res-stem"],
                                       "resnet20 already has a low-resolution stem"),
    "low-res stem weights without the flag": (["--weight-path", "{weights}/resnet18_low_stem.pth"],
                                              "conv1.weight (64, 3, 3, 3) vs model (64, 3, 7, 7)"),
    "last norm that is no norm": (["--weight-path", "{weights}/resnet18_10.pth", "--last-norm", "layer4.1.conv2"],
                                  "is a Conv2d, not a normalisation layer of ResNet; closest normalisation layers: "
                                  "layer4.1.bn2"),
    "last norm on a shortcut": (["--weight-path", "{weights}/resnet18_10.pth", "--last-norm", "layer4.0.downsample.1"],
                                "is off the main path of ResNet (a shortcut, a shorter parallel branch, or not between "
                                "the input and the classifier fc); the main-path last norm is layer4.1.bn2"),
    "weight key the file lacks": (["--weight-path", "{weights}/timm_layout.pth", "--weight-key", "model_ema"],
                                  "has no entry 'model_ema'; its top-level keys: state_dict, epoch, arch, args"),
    "weight file without weights": (["--weight-path", "{weights}/no_weights.pth"],
                                    "holds no state_dict (a dict of tensors); its top-level keys: epoch, optimizer; "
                                    "if one of them holds the weights, name it with --weight-key"),
    "weights that diverged": (["--weight-path", "{weights}/nan.pth"],
                              "entry 'model': 1 of 102 tensors hold NaN or infinity (e.g. layer4.1.bn2.weight)"),
    "size the model cannot run at": (["--architecture", "alexnet", "--input-size", "32"],
                                     "the smallest size it runs at is 63 px"),
    "unknown best metric": (["--best-metric", "top-1"], "is not one of top1, top5, loss, ema_top1, ema_top5, "
                                                         "ema_loss; the nearest: top1"),
    "early stopping a one-epoch run": (["--best-metric", "loss", "--early-stopping-patience", "1"],
                                       "--early-stopping-patience 1 can never end this 1-epoch run early"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_cleanly(case, tmp_path, weights, broken_data, capsys):
    args, message = CASES[case]
    args = [a.format(tmp=tmp_path, weights=weights, broken=broken_data) for a in args]
    shared = tmp_path / "shared"
    mode = "finetune" if "--weight-path" in args else "scratch"
    with pytest.raises(SystemExit) as exit_info:
        main(mode, ["--shared-folder-path", str(shared), *FAST, *args])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("fixres_dist: rank ") and message in err, err
    assert not shared.exists() or "shared folder" in case  # refused before anything started
    assert not (weights / "PWNED").exists()


def test_finetune_without_weights_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main("finetune", ["--shared-folder-path", str(tmp_path / "s"), *FAST])
    assert exit_info.value.code == 1
    assert "needs --weight-path" in capsys.readouterr().err


def test_argparse_rejects_non_positive_sizes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main("scratch", ["--input-size", "0"])
    assert exit_info.value.code == 2
    assert "must be a positive whole number" in capsys.readouterr().err


def test_real_process_exit_status_and_single_line(tmp_path):
    """``python main_scratch.py`` itself: its exit status, and nothing on stderr but the one line
    (no warning as the interpreter imports torch)."""
    proc = run_interpreter("scratch", "--num-tasks", "3", "--global-rank", "3", "--job-id", "x",
                           "--shared-folder-path", tmp_path / "shared")
    assert proc.returncode == 1
    assert proc.stderr.strip() == "fixres_dist: rank 3: --global-rank 3 must be < --num-tasks 3"
    assert not (tmp_path / "shared").exists()
