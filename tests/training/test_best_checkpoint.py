"""The best checkpoint and early stopping (fixres_dist/training/best_checkpoint.py), in this process: the
improvement rules, the min delta, the patience, the state's round trip through a checkpoint, best.pth on
disk (rotation, shards, a link mended), and the configurations refused. Whole jobs stopped and resumed:
tests/jobs/test_early_stopping.py."""
from __future__ import annotations

import io
import os

import pytest
import torch

from fixres_dist import FixresError, TrainerConfig
from fixres_dist.distributed import checkpoint_shards
from fixres_dist.entry.cli import build_parser
from fixres_dist.training import checkpoint
from fixres_dist.training.best_checkpoint import BestCheckpoint, epochs_to_train, improves
from fixres_dist.training.engine import EvalResult
from fixres_dist.training.plan import Evaluate


class Record:
    """What a :class:`~fixres_dist.reporting.run_log.RunLog` is told: events and lines."""

    def __init__(self):
        self.history, self.lines = [], []

    def record(self, event, **fields):
        self.history.append({"event": event, **fields})

    def log(self, line):
        self.lines.append(line)


def watch(**options) -> BestCheckpoint:
    return BestCheckpoint(TrainerConfig(**{"epochs": 10, **options}), Record())


def result(loss=1.0, top1=50.0, top5=90.0) -> EvalResult:
    return EvalResult(top1, top5, loss, 30)


def run(best: BestCheckpoint, values: list[float], first_epoch: int = 1, field: str = "loss") -> list[bool]:
    """Epoch evaluations of ``values`` (of ``field``) from ``first_epoch``, 5 steps an epoch: each decision."""
    return [best.evaluated(Evaluate(32, epoch), result(**{field: value}), 5 * epoch)
            for epoch, value in enumerate(values, first_epoch)]


def test_improvement_is_strict_and_beyond_the_min_delta():
    assert improves("higher", 50.0, None) and improves("lower", 9.0, None)
    assert improves("higher", 51.0, 50.0) and not improves("higher", 50.0, 50.0)
    assert improves("lower", 0.9, 1.0) and not improves("lower", 1.0, 1.0) and not improves("lower", 1.1, 1.0)
    assert not improves("higher", 50.5, 50.0, by=0.5) and improves("higher", 50.75, 50.0, by=0.5)
    assert not improves("lower", 0.9, 1.0, by=0.1) and improves("lower", 0.875, 1.0, by=0.1)


def test_the_best_follows_every_strict_improvement_and_is_recorded():
    best = watch(best_metric="top1")
    assert run(best, [40.0, 55.0, 55.0, 50.0, 60.0], field="top1") == [False] * 5
    assert (best.value, best.epoch, best.step) == (60.0, 5, 25)
    assert [(e["value"], e["epoch"], e["step"]) for e in best.run_log.history] == \
        [(40.0, 1, 5), (55.0, 2, 10), (60.0, 5, 25)]
    assert best.run_log.history[0] == {"event": "best", "metric": "top1", "value": 40.0, "epoch": 1, "step": 5}
    assert best.run_log.lines[-1] == \
        "best top1 so far: 60.00 % at epoch 5 (step 25); its checkpoint is kept as best.pth"
    loss = watch(best_metric="loss")
    run(loss, [2.0, 1.5, 1.75, 1.5])
    assert (loss.value, loss.epoch) == (1.5, 2)  # lower is better; an equal value is no improvement


def test_patience_counts_evaluations_without_an_improvement_beyond_the_min_delta():
    best = watch(best_metric="loss", early_stopping_patience=2, early_stopping_min_delta=0.1)
    # 1.95 beats 2.0 (best.pth follows) but not by more than 0.1: the count goes on; 1.8 resets it
    assert run(best, [2.0, 1.95, 1.8, 1.79, 1.75]) == [False, False, False, False, True]
    assert (best.value, best.epoch, best.step, best.stopped_at) == (1.75, 5, 25, 5)
    assert (best.reference, best.without_improvement) == (1.8, 2)
    stop = best.run_log.history[-1]
    assert stop == {"event": "early_stop", "epoch": 5, "metric": "loss", "patience": 2, "min_delta": 0.1,
                    "best_value": 1.75, "best_epoch": 5, "best_step": 25}
    assert best.run_log.lines[-1] == ("early stopping after epoch 5 of 10: loss did not improve by more than 0.1 for "
                                      "2 evaluations in a row; training ends here (the best: loss 1.7500 at epoch 5 "
                                      "(step 25), best.pth)")
    assert ("early stopping: loss not improved by more than 0.1 for 1 of 2 evaluations (the best: loss 1.9500 at "
            "epoch 2 (step 10))") in best.run_log.lines
    assert epochs_to_train(best.config, best.run_log.history) == 5
    assert epochs_to_train(best.config, []) == 10


def test_no_stop_after_the_last_epoch_nor_without_patience():
    last = watch(best_metric="top1", early_stopping_patience=1, epochs=3)
    assert run(last, [50.0, 50.0], field="top1") == [False, True] and last.stopped_at == 2
    at_end = watch(best_metric="top1", early_stopping_patience=2, epochs=4)
    assert run(at_end, [50.0, 60.0, 55.0, 55.0], field="top1") == [False] * 4  # 2 without at epoch 4, the last
    assert at_end.stopped_at is None and epochs_to_train(at_end.config, at_end.run_log.history) == 4
    plain = watch(best_metric="loss")
    assert run(plain, [1.0] * 9) == [False] * 9 and plain.without_improvement == 0


def test_only_the_epoch_evaluations_of_the_watched_model_count():
    best = watch(best_metric="loss", model_ema=True)
    assert not best.evaluated(Evaluate(48, 0, "before"), result(loss=0.1), 0)  # a finetune's sweep before training
    assert not best.evaluated(Evaluate(32, 1, ema=True), result(loss=0.2), 5)  # the average's
    assert not best.evaluated(Evaluate(32, 10, "trained"), result(loss=0.3), 50)  # the final sweep
    assert best.value is None and not best.run_log.history
    best.evaluated(Evaluate(32, 1), result(loss=0.4), 5)
    assert best.value == 0.4
    ema = watch(best_metric="ema_top1", model_ema=True)
    ema.evaluated(Evaluate(32, 1), result(top1=90.0), 5)
    ema.evaluated(Evaluate(32, 1, ema=True), result(top1=70.0), 5)
    assert (ema.value, ema.epoch) == (70.0, 1)
    off = watch()
    assert not off.evaluated(Evaluate(32, 1), result(), 5) and off.state_dict() is None


def roundtrip(state):
    """``state`` written into a checkpoint and read back as a resume reads it (``weights_only``)."""
    buffer = io.BytesIO()
    torch.save({"best": state}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)["best"]


VALUES = [2.0, 1.9, 1.95, 1.7, 1.72, 1.71, 1.8]


@pytest.mark.parametrize("stop_after", range(len(VALUES)))
def test_a_resumed_watch_decides_as_one_never_interrupted(stop_after):
    options = {"best_metric": "loss", "early_stopping_patience": 3, "early_stopping_min_delta": 0.05}
    straight = watch(**options)
    decisions = run(straight, VALUES)
    assert decisions.index(True) == 6  # 1.7 at epoch 4, then 3 without beating it by more than 0.05
    first = watch(**options)
    before = run(first, VALUES[:stop_after])
    resumed = watch(**options)
    resumed.load_state_dict(roundtrip(first.state_dict()))
    after = run(resumed, VALUES[stop_after:], first_epoch=stop_after + 1)
    assert before + after == decisions
    assert resumed.state_dict() == straight.state_dict()
    assert set(straight.state_dict()) == {"metric", "value", "epoch", "step", "reference", "without_improvement",
                                          "stopped_at"}


def test_a_checkpoint_of_another_metric_is_refused_and_one_without_starts_afresh():
    best = watch(best_metric="top1")
    with pytest.raises(FixresError, match="the checkpoint watched --best-metric loss, this run top1"):
        best.load_state_dict(watch(best_metric="loss").state_dict())
    best.load_state_dict(None)
    assert best.value is None and best.without_improvement == 0


# ------------------------------------------------------------------ best.pth on disk
def contents(step: int, shards: str | None = None) -> dict:
    return {"model": {"w": torch.full((2,), float(step))}, "optimizer": {}, "epoch": step, "images_in_epoch": 0,
            "global_step": step, "ranks": [], "config": {}, "metrics": [], **({"shards": shards} if shards else {})}


def test_best_pth_links_the_best_step_and_survives_the_rotation(tmp_path):
    for step in (5, 10, 15, 20):
        checkpoint.save_checkpoint(tmp_path, contents(step), step, keep=1, best_step=10 if step >= 10 else 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pth", "checkpoint-00000020.pth", "checkpoint.pth"]
    assert checkpoint.load_checkpoint(tmp_path / checkpoint.BEST_FILE)["global_step"] == 10
    assert (tmp_path / "best.pth").stat().st_mode & 0o777 == 0o600
    checkpoint.save_checkpoint(tmp_path, contents(25), 25, keep=1, best_step=25)  # a new best
    assert os.path.samefile(tmp_path / "best.pth", tmp_path / "checkpoint-00000025.pth")
    assert not (tmp_path / "checkpoint-00000020.pth").exists()


def test_a_sharded_best_keeps_its_shards_folder(tmp_path):
    for step in (5, 10, 15):
        (tmp_path / checkpoint_shards.folder_name(step)).mkdir()
        checkpoint.save_checkpoint(tmp_path, contents(step, checkpoint_shards.folder_name(step)), step, keep=1,
                                   best_step=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pth", "checkpoint-00000005.shards",
                                                          "checkpoint-00000015.pth", "checkpoint-00000015.shards",
                                                          "checkpoint.pth"]


def test_a_link_a_kill_left_stale_is_mended(tmp_path):
    checkpoint.save_checkpoint(tmp_path, contents(5), 5, keep=2, best_step=5)
    checkpoint.save_checkpoint(tmp_path, contents(10), 10, keep=2)  # killed before best.pth was linked to step 10
    checkpoint.keep_best(tmp_path, 10)  # the resume
    assert checkpoint.load_checkpoint(tmp_path / "best.pth")["global_step"] == 10
    checkpoint.keep_best(tmp_path, 99)  # a step whose file is gone: nothing to link
    checkpoint.keep_best(tmp_path, None)
    assert checkpoint.load_checkpoint(tmp_path / "best.pth")["global_step"] == 10


# ------------------------------------------------------------------ refused before anything starts
@pytest.mark.parametrize("options, message", [
    ({"best_metric": "top-1"}, "--best-metric 'top-1' is not one of top1, top5, loss, ema_top1, ema_top5, ema_loss; "
                               "the nearest: top1"),
    ({"best_metric": "ema_loss"}, "--best-metric ema_loss watches the --model-ema average's evaluation: add "
                                  "--model-ema, or watch the model's own with --best-metric loss"),
    ({"best_metric": "loss", "early_stopping_patience": 0}, "--early-stopping-patience must be a whole number >= 1"),
    ({"best_metric": "loss", "early_stopping_patience": 2, "early_stopping_min_delta": -0.1},
     "--early-stopping-min-delta must be >= 0"),
    ({"best_metric": "loss", "early_stopping_patience": 2, "early_stopping_min_delta": float("nan")},
     "--early-stopping-min-delta must be a finite number"),
    ({"early_stopping_patience": 2}, "--early-stopping-patience needs --best-metric (one of top1"),
    ({"best_metric": "loss", "early_stopping_min_delta": 0.1}, "--early-stopping-min-delta applies to early stopping"),
    ({"best_metric": "loss", "early_stopping_patience": 2, "epochs": 3},
     "--early-stopping-patience 2 can never end this 3-epoch run early: the first epoch's evaluation sets the best, "
     "so the earliest stop follows epoch 3, and a stop after the last epoch stops nothing; give a patience of at "
     "most 1"),
    ({"best_metric": "loss", "early_stopping_patience": 1, "epochs": 1}, "give at least 3 --epochs"),
    ({"best_metric": "top1", "eval_only": True, "weight_path": "w.pth"},
     "--best-metric watches the evaluations of training's epochs, and --eval-only trains none"),
    ({"best_metric": "top1", "early_stopping_patience": 1, "mode": "finetune", "weight_path": "w.pth"},
     "--early-stopping-patience does not apply to main_finetune.py"),
])
def test_what_cannot_work_is_refused_in_one_line(options, message):
    with pytest.raises(FixresError) as refused:
        TrainerConfig(**{"epochs": 10, **options})
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("spelt, meant", [("top-1", "top1"), ("acc1", "top1"), ("accuracy", "top1"), ("Top5", "top5"),
                                          ("val_loss", "loss"), ("ema_acc", "ema_top1"), ("lss", "loss")])
def test_a_metric_spelt_otherwise_is_answered_with_ours(spelt, meant):
    with pytest.raises(FixresError, match=f"; the nearest: {meant}$"):
        TrainerConfig(best_metric=spelt)


def test_the_flags_reach_the_configuration_and_early_stopping_is_main_scratch_s(capsys):
    args = build_parser("scratch").parse_args(["--best-metric", "loss", "--early-stopping-patience", "3",
                                                "--early-stopping-min-delta", "0.01"])
    assert (args.best_metric, args.early_stopping_patience, args.early_stopping_min_delta) == ("loss", 3, 0.01)
    assert build_parser("finetune").parse_args(["--best-metric", "top1"]).best_metric == "top1"
    with pytest.raises(SystemExit) as exit_info:
        build_parser("finetune").parse_args(["--early-stopping-patience", "3"])
    assert exit_info.value.code == 2
    assert "--early-stopping-patience only applies to main_scratch.py" in capsys.readouterr().err
    # the fields are the job's: at their defaults, an older job's derived id is unchanged
    assert TrainerConfig(best_metric="loss").derived_job_id() != TrainerConfig().derived_job_id()
    assert "best_metric" not in TrainerConfig.resumable_fields()
