"""The FixRes finetune: exactly the intended parameters train, only the last BatchNorm's statistics move."""
from __future__ import annotations

import json

import torch

from fixres_dist import Trainer, TrainerConfig
from fixres_dist.fixres import finetuning
from fixres_dist.models import architectures
from fixres_dist.reporting import reports
from fixres_dist.training.checkpoint import load_checkpoint


def _finetune(weight_file, data, folder, job_id, **fields):
    """A 1-epoch resnet20 finetune at 16 px run in this process, as a rank runs it: ``(the Trainer after
    the run, its RunResult, what it logged)``."""
    config = TrainerConfig(mode="finetune", weight_path=str(weight_file), data_path=str(data), architecture="resnet20",
                           shared_folder_path=str(folder), job_id=job_id, input_size=16, batch=4, epochs=1,
                           workers=0, progress=False, **fields)
    lines = []
    trainer = Trainer(config, log=lines.append)
    result = trainer()
    return trainer, result, "\n".join(lines)


def test_finetune_trains_exactly_head_and_last_bn(few_data, tmp_path):
    start = architectures.build_model("resnet20", 10)
    weight_file = tmp_path / "start.pth"
    torch.save({f"module.{k}": v for k, v in start.state_dict().items()}, weight_file)  # DDP-style keys
    trainer, result, _ = _finetune(weight_file, few_data, tmp_path, "ft", learning_rate=0.5)
    assert result.images == 10 and result.resolution == 16
    after = trainer.model.state_dict()
    changed = {k for k, v in start.state_dict().items() if not torch.equal(v, after[k])}
    assert changed == {"fc.weight", "fc.bias", "layer3.2.bn2.weight", "layer3.2.bn2.bias",
                       "layer3.2.bn2.running_mean", "layer3.2.bn2.running_var",
                       "layer3.2.bn2.num_batches_tracked"}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable == {"fc.weight", "fc.bias", "layer3.2.bn2.weight", "layer3.2.bn2.bias"}
    finetuning.set_train_mode(trainer.model)
    assert not trainer.model.layer3[2].bn1.training and trainer.model.layer3[2].bn2.training


def test_scratch_then_finetune_end_to_end_with_two_ranks(scratch_job, finetune_job):
    """main_scratch.py, then main_finetune.py of its checkpoint, both on 2 ranks (the session's jobs)."""
    checkpoint = load_checkpoint(scratch_job / "checkpoint.pth")
    assert checkpoint["epoch"] == 2 and checkpoint["config"]["num_tasks"] == 2  # its 2 epochs, done
    assert not any(k.startswith("module.") for k in checkpoint["model"])
    assert TrainerConfig.from_json((scratch_job / "config.json").read_text()).num_tasks == 2

    out = finetune_job.stdout
    assert "train resolution, no finetuning" in out and "FixRes finetuned" in out
    assert "finetuning at the test resolution bought" in out
    events = [json.loads(line) for line in (finetune_job.folder / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert [(e["epoch"], e["resolution"]) for e in evals] == [(0, 32), (0, 48), (1, 48)]
    assert all(e["images"] == 10 and 0 <= e["top1"] <= 100 and e["top1"] <= e["top5"] for e in evals)
    train = [e for e in events if e["event"] == "train"]
    assert len(train) == 1 and {"epoch", "loss", "lr", "img_per_s"} <= set(train[0])


def test_a_finetune_at_the_train_resolution_is_reported_as_a_control():
    history = [{"event": "eval", "label": "train-resolution", "resolution": 24, "top1": 80.0, "top5": 99.0,
                "images": 9},
               {"event": "eval", "label": "before", "resolution": 24, "top1": 80.0, "top5": 99.0, "images": 9},
               {"event": "eval", "resolution": 24, "top1": 81.0, "top5": 99.0, "images": 9}]
    table = reports.finetune_table(history, "resnet20", 2, 24, 24)
    assert "test resolution" not in table  # 24 px is the train resolution here, not a test resolution
    assert table.count("no finetuning") == 1 and "train resolution, finetuned (control)" in table
    assert "finetuning at the train resolution (a control: no change of resolution, so no FixRes effect) bought " \
           "+1.00 top-1 points over the train resolution (24 px)" in table


def test_a_finetune_with_a_new_head_says_its_gain_is_the_heads_training(few_data, tmp_path):
    """Weights of a 7-class network on the 10 classes: the table must not credit FixRes."""
    weight_file = tmp_path / "seven.pth"
    torch.save(architectures.build_model("resnet20", 7).state_dict(), weight_file)
    *_, table = _finetune(weight_file, few_data, tmp_path, "new-head")
    assert "new 10-class head fc (weights had 7 classes)" in table
    assert "new head: the weights had 7 classes, the model has 10; the rows without finetuning evaluate an " \
           "untrained head, so these points are the head's training, not a FixRes gain" in table


def test_a_finetune_of_finetuned_weights_says_they_were_finetuned_before():
    history = [{"event": "eval", "label": "train-resolution", "resolution": 24, "top1": 80.0, "top5": 99.0,
                "images": 9},
               {"event": "eval", "label": "before", "resolution": 40, "top1": 81.0, "top5": 99.0, "images": 9},
               {"event": "eval", "resolution": 40, "top1": 82.0, "top5": 99.0, "images": 9}]
    table = reports.finetune_table(history, "resnet20", 1, 40, 40, finetuned_before=32)
    assert 'the weights were already finetuned at 32 px before this run: "no finetuning" above means before ' \
           'this finetune' in table
