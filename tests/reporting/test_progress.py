"""What rank 0 shows while it works: bars for epochs, evaluations and sweeps, the job's remaining
time, the latest loss at each redraw, and nothing with --no-progress."""
from __future__ import annotations

import io
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, clean_env, run_script
from fixres_dist import TrainerConfig
from fixres_dist.reporting import progress
from fixres_dist.training import plan
from fixres_dist.training.trainer import Trainer

# resnet20 at 16 px on few_data (20 train, 10 val images), a sweep of 16 and 24 px after training
RUN = ["--architecture", "resnet20", "--input-size", "16", "--batch", "8", "--epochs", "1", "--workers", "0",
       "--test-sizes", "16,24"]


class Ticks:
    """A clock that moves only when the test says so (seconds)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_loss_shown_is_the_latest_steps_at_each_redraw():
    clock, out = Ticks(), io.StringIO()
    bar = progress.Bar(100, "epoch 1/1", enabled=True, interval=0.5, clock=clock, file=out)
    for step, loss in enumerate((1.0, 2.0, 3.0)):  # 4 images a step, summed losses
        bar.advance(4, torch.tensor(4 * loss), 4)
    assert bar.shown_loss is None and bar.done == 12  # not due yet: counted, nothing read or drawn
    clock.now = 0.6
    bar.advance(4, torch.tensor(4 * 5.0), 4)  # the step during which the bar became due
    assert bar.shown_loss == 5.0 and "loss=5.000" in out.getvalue() and "16.0/100" in out.getvalue()
    bar.advance(4, torch.tensor(4 * 6.0), 4)
    bar.advance(4, torch.tensor(4 * 7.0), 4)
    assert bar.shown_loss == 5.0  # between redraws the loss tensors stay unread
    clock.now = 1.2
    bar.advance(4, torch.tensor(4 * 8.0), 4)
    assert bar.shown_loss == 8.0 and out.getvalue().rstrip("\r\n ").endswith("loss=8.000]")
    bar.close()


def test_a_disabled_bar_writes_nothing():
    out = io.StringIO()
    bar = progress.Bar(10, "eval 32 px", enabled=False, interval=0.0, file=out)
    bar.advance(5, torch.tensor(1.0), 5)
    bar.refresh()
    bar.close()
    assert out.getvalue() == "" and bar.shown_loss is None


def test_job_clock_counts_the_remaining_epochs_and_evaluations():
    clock = progress.JobClock()
    assert clock.remaining(100, 32, [(30, 32)]) is None  # nothing measured yet
    assert clock.remaining(0, 32, []) == 0.0
    clock.add_training(images=80, seconds=8.0)  # 0.1 s per image
    # before any evaluation: an evaluated image costs a third of a trained one of the same area
    assert clock.remaining(160, 32, [(30, 32)]) == pytest.approx(16 + 1.0)
    clock.add_evaluation(images=30, size=32, seconds=6.0)  # 0.2 s per 32 px image
    assert clock.remaining(160, 32, [(30, 32), (30, 64)]) == pytest.approx(16 + 6 + 24)
    assert clock.remaining(40, 32, [], live=(80, 24.0)) == pytest.approx(40 * 32 / 160)  # the epoch running counts
    assert progress.format_seconds(3725) == "1:02:05" and progress.format_seconds(None) == "?"


def test_evaluations_and_sweeps_show_progress_on_stderr_and_a_log_file_gets_none(few_data, tmp_path):
    shown = run_script("scratch", "--job-id", "shown", "--shared-folder-path", tmp_path, "--data-path", few_data, *RUN,
                       "--progress")
    assert shown.returncode == 0, shown.stderr[-3000:]
    err = shown.stderr
    assert "epoch 1/1" in err and "eval 16 px (epoch 1/1)" in err
    assert "eval 16 px (1/2 of the sweep after training)" in err
    assert "eval 24 px (2/2 of the sweep after training)" in err
    assert "/10" in err  # images done of the 10 validation images
    assert "eval 16 px" not in shown.stdout and "img/s]" not in shown.stdout  # bars stay on stderr
    # log lines stay whole: each starts a line of its own
    lines = [line for line in shown.stdout.splitlines() if line]
    expected = ("job ", "data:", "input ", "sgd lr ", "epoch 1/1: train loss", "  step times (", "eval", "|", "top-1",
                "best", "network", "train resolution", "plot", "warning: ")
    assert lines and all(line.startswith(expected) for line in lines)
    quiet = run_script("scratch", "--job-id", "quiet", "--shared-folder-path", tmp_path, "--data-path", few_data,
                       *RUN)  # stderr is a file here, as a log file under SLURM: no bars by default
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "eval 16 px" not in quiet.stderr and "epoch 1/1" not in quiet.stderr and "img/s" not in quiet.stderr
    assert "eval trained @24px" in quiet.stdout  # the run itself did the same work


def test_the_job_clock_counts_what_the_job_has_left(few_data, tmp_path):
    """In one process: the remaining work counts the epochs left, their evaluations and the final sweep,
    and the epoch bar's postfix turns it into a time once a rate was measured."""
    config = TrainerConfig(data_path=str(few_data), shared_folder_path=str(tmp_path), job_id="left",
                           architecture="resnet20", input_size=16, batch=8, epochs=2, workers=0, test_sizes=(16, 24),
                           progress=False)
    trainer = Trainer(config)
    try:
        trainer.build()
        assert trainer.plan.evaluations() == [16, 16, 16, 24]  # 2 epochs' evaluations, then the sweep
        bar = progress.Bar(20, "epoch 1/2", enabled=True, file=io.StringIO())
        assert trainer.remaining.postfix(bar) == "job ? left"  # nothing measured yet
        steps = iter(trainer.plan)
        assert next(steps) == plan.TrainEpoch(0)
        trainer.train_epoch()
        assert next(steps) == plan.Evaluate(16, 1, what="epoch 1/2")  # now in progress: the plan holds the rest
        assert trainer.plan.evaluations() == [16, 16, 24]
        assert trainer.clock.train_images == 20 and trainer.clock.train_seconds > 0
        assert re.fullmatch(r"job \d\d:\d\d left", trainer.remaining.postfix(bar))
        bar.close()
    finally:
        trainer.close()


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux's script for a terminal")
def test_a_terminal_gets_bars_by_default_even_one_that_reports_no_size(few_data, tmp_path):
    """``script`` run from a pipe gives the run a pseudo-terminal of 0 x 0 characters, where tqdm alone
    draws nothing (a real ``python main_scratch.py`` in that terminal)."""
    command = " ".join(shlex.quote(str(a)) for a in [sys.executable, ROOT / "main_scratch.py", "--job-id", "tty",
                                                     "--shared-folder-path", tmp_path, "--data-path", few_data, *RUN])
    result = subprocess.run(["script", "-qec", command, "/dev/null"], capture_output=True, text=True, timeout=300,
                            env=clean_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "eval 16 px (epoch 1/1)" in result.stdout and "/10" in result.stdout  # the terminal's output
