"""Reports that tell the truth: an evaluation calls itself one and names the resolution its network
was trained from scratch at (followed through a finetune checkpoint), the finetune's resolution, the
estimate derived from the train resolution, "unknown" when nothing says; the plot shows every marker."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_script
from fixres_dist.fixres import finetuning
from fixres_dist.models import architectures, lineage, weights
from fixres_dist.models.lineage import Lineage
from fixres_dist.reporting import reports
from fixres_dist.training.checkpoint import load_checkpoint


def _events(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finetuned(scratch_job, finetune_job):
    """(scratch checkpoint trained at 32 px, its FixRes finetune at 48 px), both real runs (the session's)."""
    return scratch_job / "checkpoint.pth", finetune_job.folder / "checkpoint.pth"


def test_checkpoints_record_their_lineage(finetuned):
    scratch, finetune = finetuned
    assert load_checkpoint(scratch)["lineage"] == {"train_size": 32, "finetuned_at": None}
    state = load_checkpoint(finetune)
    assert state["lineage"] == {"train_size": 32, "finetuned_at": 48}
    assert state["config"]["mode"] == "finetune" and state["config"]["input_size"] == 48  # what misled before


@pytest.mark.parametrize("script", ["finetune", "scratch"])
def test_eval_only_of_a_finetuned_checkpoint_reports_an_evaluation_of_the_scratch_resolution(
        script, finetuned, few_data, tmp_path):
    _, finetune = finetuned
    result = run_script(script, "--job-id", "e", "--eval-only", "--weight-path", finetune, "--test-sizes", "32,40,48",
                        "--shared-folder-path", tmp_path, "--data-path", few_data, "--workers", 0, "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    out, folder = result.stdout, tmp_path / "e"
    assert out.startswith("job e: evaluation resnet18,") and "finetune resnet18" not in out
    assert "evaluating weights: trained from scratch at 32 px, FixRes-finetuned at 48 px" in out
    estimate = finetuning.apparent_size_test_resolution(32)
    report = [e for e in _events(folder) if e["event"] == "sweep"][0]
    assert report["run"] == "evaluation" and report["train_resolution"] == 32 and report["finetuned_at"] == 48
    assert report["apparent_size_estimate"] == pytest.approx(estimate)
    table = (folder / "resolution_sweep.md").read_text()
    assert table.startswith("top-1 against test resolution: resnet18, evaluation")
    assert "network: trained from scratch at 32 px, FixRes-finetuned at 48 px" in table
    assert "train resolution: 32 px; from it, FixRes' apparent-object-size estimate" in table
    assert f"{estimate:.0f} px" in table
    assert "48 px" not in table.split("train resolution:")[1].split(";")[0]


def test_checkpoints_without_a_record_follow_their_weight_path(finetuned, tmp_path):
    """A finetune checkpoint from before the record: its config's weight_path names the scratch
    checkpoint, whose config says 32 px; without that file the train resolution is unknown."""
    scratch, finetune = finetuned
    state = load_checkpoint(finetune)
    del state["lineage"]
    torch.save(state, tmp_path / "old.pth")
    assert lineage.of_weights(weights.read_weight_file(tmp_path / "old.pth")) == Lineage(32, 48)
    state["config"]["weight_path"] = str(tmp_path / "gone.pth")
    torch.save(state, tmp_path / "orphan.pth")
    assert lineage.of_weights(weights.read_weight_file(tmp_path / "orphan.pth")) == Lineage(None, 48)
    state["config"]["train_size"] = 24  # --train-size given at finetune time
    torch.save(state, tmp_path / "told.pth")
    assert lineage.of_weights(weights.read_weight_file(tmp_path / "told.pth")) == Lineage(24, 48)
    torch.save(architectures.build_model("resnet18", 10).state_dict(), tmp_path / "plain.pth")
    assert lineage.of_weights(weights.read_weight_file(tmp_path / "plain.pth")) == Lineage()


def _stages(sizes, top1=50.0):
    return {"sweep": {s: {"resolution": s, "top1": top1 + i, "top5": 90.0, "images": 30} for i, s in enumerate(sizes)}}


def test_an_unknown_train_resolution_is_said_to_be_unknown():
    text = reports.table(_stages([64, 96]), 96, Lineage(), None, "title")
    assert "train resolution unknown" in text and "no apparent-object-size estimate" in text
    assert "train resolution: " not in text


@pytest.mark.parametrize("sizes, network", [
    ([48, 64, 96], Lineage(32, None)),  # train resolution and estimate (44 px) left of the swept range
    ([24, 32], Lineage(32, 160)),  # a marker at the edge, the finetune resolution far right
    ([128], Lineage(128, 128)),  # one point, every marker on it
])
def test_the_plot_shows_every_marker_inside_its_x_range(sizes, network, tmp_path):
    estimate = finetuning.apparent_size_test_resolution(network.train_size)
    fig = reports.plot(tmp_path / "sweep.png", _stages(sizes), sizes[0], network, estimate, "title")
    (ax,) = fig.axes
    low, high = ax.get_xlim()
    xs = [x for line in ax.get_lines() for x in line.get_xdata()]
    assert {*sizes, network.train_size, estimate} <= set(map(float, xs))  # every marker is drawn
    span = max(xs) - min(xs)
    margin = max(reports.MARGIN * span, 1.0)
    assert low <= min(xs) - margin + 1e-9 and high >= max(xs) + margin - 1e-9
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
