"""The FixRes finetune: exactly the intended parameters train, only the last BatchNorm's statistics move."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import FAST, run_script
from fixres_dist import Trainer, TrainerConfig, fixres, models, reports
from fixres_dist.checkpoint import load_checkpoint


@pytest.mark.parametrize("architecture, head, norm", [
    ("resnet18", "fc", "layer4.1.bn2"),
    ("resnet50", "fc", "layer4.2.bn3"),
    ("mobilenet_v3_small", "classifier.3", "features.12.1"),
    ("convnext_tiny", "classifier.2", "classifier.0"),
])
def test_head_and_last_norm_are_found_from_the_graph(architecture, head, norm):
    model = models.build_model(architecture, 10)
    assert fixres.find_head_and_last_norm(model, 64) == (head, norm)


def test_finetune_trains_exactly_head_and_last_bn(tiny_data, tmp_path):
    start = models.build_model("resnet18", 10)
    weight_file = tmp_path / "start.pth"
    torch.save({f"module.{k}": v for k, v in start.state_dict().items()}, weight_file)  # DDP-style keys
    config = TrainerConfig(mode="finetune", weight_path=str(weight_file), data_path=str(tiny_data),
                           shared_folder_path=str(tmp_path), job_id="ft", input_size=48, batch=8, epochs=1,
                           workers=0, progress=False, learning_rate=0.5)
    trainer = Trainer(config)
    result = trainer()
    assert result.images == 30 and result.resolution == 48
    after = trainer.model.state_dict()
    changed = {k for k, v in start.state_dict().items() if not torch.equal(v, after[k])}
    assert changed == {"fc.weight", "fc.bias", "layer4.1.bn2.weight", "layer4.1.bn2.bias",
                       "layer4.1.bn2.running_mean", "layer4.1.bn2.running_var",
                       "layer4.1.bn2.num_batches_tracked"}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable == {"fc.weight", "fc.bias", "layer4.1.bn2.weight", "layer4.1.bn2.bias"}
    fixres.set_train_mode(trainer.model)
    assert not trainer.model.layer4[1].bn1.training and trainer.model.layer4[1].bn2.training


def test_scratch_then_finetune_end_to_end_with_two_ranks(tiny_data, tmp_path):
    shared = tmp_path / "shared"
    scratch = run_script("scratch", "--num-tasks", 2, "--job-id", "s", "--shared-folder-path", shared,
                         "--data-path", tiny_data, *FAST)
    assert scratch.returncode == 0, scratch.stderr[-3000:]
    checkpoint = load_checkpoint(shared / "s" / "checkpoint.pth")
    assert checkpoint["epoch"] == 1 and checkpoint["config"]["num_tasks"] == 2
    assert not any(k.startswith("module.") for k in checkpoint["model"])
    assert TrainerConfig.from_json((shared / "s" / "config.json").read_text()).num_tasks == 2

    finetune = run_script("finetune", "--num-tasks", 2, "--job-id", "f", "--shared-folder-path", shared,
                          "--data-path", tiny_data, "--weight-path", shared / "s" / "checkpoint.pth",
                          "--input-size", 48, "--batch", 8, "--epochs", 1, "--workers", 1,
                          "--no-progress")
    assert finetune.returncode == 0, finetune.stderr[-3000:]
    assert "train resolution, no finetuning" in finetune.stdout and "FixRes finetuned" in finetune.stdout
    assert "finetuning at the test resolution bought" in finetune.stdout
    events = [json.loads(line) for line in (shared / "f" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert [(e["epoch"], e["resolution"]) for e in evals] == [(0, 32), (0, 48), (1, 48)]
    assert all(e["images"] == 30 and 0 <= e["top1"] <= 100 and e["top1"] <= e["top5"] for e in evals)
    train = [e for e in events if e["event"] == "train"]
    assert len(train) == 1 and {"epoch", "loss", "lr", "img_per_s"} <= set(train[0])


def test_a_finetune_at_the_train_resolution_is_reported_as_a_control():
    history = [{"event": "eval", "label": "train-resolution", "resolution": 24, "top1": 80.0, "top5": 99.0, "images": 9},
               {"event": "eval", "label": "before", "resolution": 24, "top1": 80.0, "top5": 99.0, "images": 9},
               {"event": "eval", "resolution": 24, "top1": 81.0, "top5": 99.0, "images": 9}]
    table = reports.finetune_table(history, "resnet20", 2, 24, 24)
    assert "test resolution" not in table  # 24 px is the train resolution here, not a test resolution
    assert table.count("no finetuning") == 1 and "train resolution, finetuned (control)" in table
    assert "finetuning at the train resolution (a control: no change of resolution, so no FixRes effect) bought " \
           "+1.00 top-1 points over the train resolution (24 px)" in table


def test_a_finetune_with_a_new_head_says_its_gain_is_the_heads_training(tiny_data, tmp_path):
    """Weights of a 7-class network on the 10 classes: the table must not credit FixRes."""
    weight_file = tmp_path / "seven.pth"
    torch.save(models.build_model("resnet18", 7).state_dict(), weight_file)
    config = TrainerConfig(mode="finetune", weight_path=str(weight_file), data_path=str(tiny_data),
                           shared_folder_path=str(tmp_path), job_id="new-head", input_size=32, batch=8, epochs=1,
                           workers=0, progress=False)
    lines = []
    Trainer(config, log=lines.append)()
    table = "\n".join(lines)
    assert "new 10-class head fc (weights had 7 classes)" in table
    assert "new head: the weights had 7 classes, the model has 10; the rows without finetuning evaluate an " \
           "untrained head, so these points are the head's training, not a FixRes gain" in table


def test_a_finetune_of_finetuned_weights_says_they_were_finetuned_before():
    history = [{"event": "eval", "label": "train-resolution", "resolution": 24, "top1": 80.0, "top5": 99.0, "images": 9},
               {"event": "eval", "label": "before", "resolution": 40, "top1": 81.0, "top5": 99.0, "images": 9},
               {"event": "eval", "resolution": 40, "top1": 82.0, "top5": 99.0, "images": 9}]
    table = reports.finetune_table(history, "resnet20", 1, 40, 40, finetuned_before=32)
    assert 'the weights were already finetuned at 32 px before this run: "no finetuning" above means before ' \
           'this finetune' in table
