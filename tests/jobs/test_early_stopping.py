"""The best checkpoint and early stopping in whole jobs: a job preempted mid-epoch, then during the
evaluation that stops it, and resumed each time, keeps the same best.pth (the same weights, bit for bit, and
the same metric) and stops at the same epoch as the job never interrupted; a rerun of a job that stopped
early trains no more. The rules themselves: tests/training/test_best_checkpoint.py."""
from __future__ import annotations

import pytest
import torch

from conftest import job_events, run_script
from fixres_dist.training.checkpoint import BEST_FILE, CHECKPOINT_FILE, load_checkpoint

# 2 ranks of 8 images on tiny_data's 80: 5 steps an epoch. The loss never improves by more than 10 nats, so
# the patience of 2 stops training after epoch 3 of 5, whatever the values; best.pth follows every strict
# improvement of the loss among those 3 epochs. One numbered checkpoint kept: best.pth outlives its own.
EARLY = ["--architecture", "resnet20", "--input-size", "32", "--batch", "8", "--epochs", "5", "--workers", "0",
         "--no-progress", "--best-metric", "loss", "--early-stopping-patience", "2", "--early-stopping-min-delta",
         "10", "--keep-checkpoints", "1"]
STOPPED_LINE = ("early stopping after epoch 3 of 5: loss did not improve by more than 10 for 2 evaluations in a row; "
                "training ends here (the best: loss ")


def train(folder, data, **env):
    return run_script("scratch", "--num-tasks", 2, "--job-id", "early", "--shared-folder-path", folder,
                      "--data-path", data, *EARLY, env=env or None)


def assert_same(a, b, where="") -> None:
    """``a`` and ``b`` (nested dicts and lists of tensors and plain values) are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{index}")
    else:
        assert a == b, where


def story(folder) -> list[dict]:
    """The job's events that the best checkpoint and early stopping depend on, without their times and speeds."""
    return [{k: v for k, v in e.items() if k not in ("time", "img_per_s")} for e in job_events(folder)
            if e["event"] in ("train", "eval", "best", "early_stop")]


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    """The job never interrupted: its folder."""
    folder = tmp_path_factory.mktemp("straight")
    run = train(folder, tiny_data)
    assert run.returncode == 0, run.stderr[-3000:]
    assert STOPPED_LINE in run.stdout, run.stdout[-3000:]
    return folder / "early"


def test_a_job_that_stops_early_keeps_its_best_and_ends_normally(straight):
    events = story(straight)
    assert [(e["event"], e["epoch"]) for e in events if e["event"] in ("train", "early_stop")] == \
        [("train", 1), ("train", 2), ("train", 3), ("early_stop", 3)]
    losses = {e["epoch"]: e["loss"] for e in events if e["event"] == "eval"}
    best_epoch = min(losses, key=lambda epoch: (losses[epoch], epoch))
    best = load_checkpoint(straight / BEST_FILE)
    assert best["best"]["epoch"] == best_epoch and best["best"]["value"] == losses[best_epoch]
    assert best["best"]["step"] == best["global_step"] == 5 * best_epoch and best["epoch"] == best_epoch
    assert [e for e in events if e["event"] == "best"][-1] == {"event": "best", "metric": "loss",
                                                              "value": losses[best_epoch], "epoch": best_epoch,
                                                              "step": 5 * best_epoch}
    last = load_checkpoint(straight / CHECKPOINT_FILE)
    assert (last["epoch"], last["global_step"], last["best"]["stopped_at"]) == (3, 15, 3)
    assert last["best"] == best["best"] | {"reference": losses[1], "without_improvement": 2, "stopped_at": 3}
    assert sorted(p.name for p in straight.glob("checkpoint-*.pth")) == ["checkpoint-00000015.pth"]


def test_stopped_and_resumed_it_keeps_the_same_best_and_stops_at_the_same_epoch(straight, tiny_data, tmp_path):
    """Preempted mid-epoch 2 (the best of epoch 1 and the count in its checkpoint), then during epoch 3's
    evaluation, which stops training: the resumed job writes the same best.pth and stops after epoch 3;
    run again, it trains no more."""
    mid = train(tmp_path, tiny_data, FIXRES_FAULT="signal:rank=1:step=7")
    assert mid.returncode == 3, mid.stderr[-3000:]
    assert load_checkpoint(tmp_path / "early" / CHECKPOINT_FILE)["best"]["epoch"] == 1
    evaluating = train(tmp_path, tiny_data, FIXRES_FAULT="eval-signal:rank=0:step=15")
    assert evaluating.returncode == 3 and "resumed from" in evaluating.stdout, evaluating.stderr[-3000:]
    assert STOPPED_LINE not in evaluating.stdout
    last = train(tmp_path, tiny_data)
    assert last.returncode == 0 and STOPPED_LINE in last.stdout, last.stderr[-3000:]
    job = tmp_path / "early"
    assert story(job) == story(straight)
    for name in (BEST_FILE, CHECKPOINT_FILE):  # the weights, the optimizer's state and the best's, bit for bit
        ours, theirs = (load_checkpoint(folder / name) for folder in (job, straight))
        for entry in ("model", "optimizer", "best", "global_step", "epoch"):
            assert_same(ours[entry], theirs[entry], f"{name}: {entry}")
    again = train(tmp_path, tiny_data)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "this job already stopped early after epoch 3; nothing to do" in again.stdout, again.stdout[-3000:]
    assert story(job) == story(straight)  # nothing trained or evaluated again
