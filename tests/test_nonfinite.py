"""Numbers that stay numbers (issue 13, item 3): a diverged loss stops every rank at the same step
with one line naming epoch and step, the last good checkpoint is kept, nothing non-finite is ever
written, and metrics.jsonl is strict JSON (RFC 8259)."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from conftest import run_script
from fixres_dist import finite
from fixres_dist.distributed import checkpoint_shards
from fixres_dist.errors import FixresError
from fixres_dist.finite import NonFiniteWeights
from fixres_dist.models import architectures, weights
from fixres_dist.reporting.metrics import MetricsLog
from fixres_dist.training.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint

DIVERGE = ["--learning-rate", "1e6", "--warmup-epochs", "0", "--architecture", "resnet20", "--input-size", "16",
           "--batch", "8", "--epochs", "2", "--workers", "0", "--no-progress"]
# Which goes non-finite first, the loss of step S or the weights its update wrote, depends on the float
# rounding of the CPU's kernels (with AVX-512 and AVX2 the loss, with SSE4.1 the weights): either way,
# every rank stops at step S, keeps the checkpoint of step S - 1 and writes nothing non-finite.
LINE = re.compile(r"^fixres_dist: rank (\d): (non-finite loss \(NaN or infinity\) at|non-finite weights after) "
                  r"epoch 1, step (\d+)(?: \(\d+ of \d+ tensors hold NaN or infinity \(e\.g\. [^)]*\)\))?: training "
                  r"stopped on all ranks; (.*); lower --learning-rate \(or raise --warmup-epochs\) and use a new "
                  r"--job-id$")
REASONS = {"non-finite loss (NaN or infinity) at": "non-finite loss", "non-finite weights after": "non-finite weights"}


def strict_events(path):
    """Every line of metrics.jsonl parsed by a parser that refuses NaN and Infinity (RFC 8259)."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def rank_lines(stderr: str) -> dict[int, re.Match]:
    return {int(m.group(1)): m for m in map(LINE.match, stderr.splitlines()) if m}


@pytest.mark.numeric
def test_divergence_stops_all_ranks_at_one_step_and_keeps_the_last_good_checkpoint(tiny_data, tmp_path):
    """The issue's run: --learning-rate 1e6 --warmup-epochs 0; before, it went on, exited 0, wrote a
    checkpoint with 102 of 122 tensors non-finite and a bare NaN in metrics.jsonl. Whether the loss of
    step S or the weights after it go non-finite first depends on the CPU's kernels (:data:`LINE`): both
    ranks name the same cause and step, and the checkpoint of step S - 1 is the one kept."""
    proc = run_script("scratch", "--num-tasks", 2, "--data-path", tiny_data, "--shared-folder-path", tmp_path,
                      "--job-id", "nan", "--ckpt-every", 1, *DIVERGE)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = rank_lines(proc.stderr)
    assert set(lines) == {0, 1}, proc.stderr
    causes = {(m.group(2), int(m.group(3))) for m in lines.values()}
    assert len(causes) == 1  # both ranks name the same cause and step
    cause, step = causes.pop()
    assert step > 1
    assert {m.group(4) for m in lines.values()} == \
        {f"the last good checkpoint (step {step - 1}) is kept in {tmp_path / 'nan'}"}
    folder = tmp_path / "nan"
    state = load_checkpoint(folder / CHECKPOINT_FILE)  # refuses non-finite weights
    assert state["global_step"] == step - 1
    assert finite.non_finite_tensors(state["model"])[0] == [] and finite.non_finite_tensors(state["optimizer"])[0] == []
    assert sorted(p.name for p in folder.glob("checkpoint-*.pth")) == \
        [f"checkpoint-{s:08d}.pth" for s in range(max(1, step - 2), step)]
    events = strict_events(folder / "metrics.jsonl")
    assert events[-1]["event"] == "diverged" and (events[-1]["epoch"], events[-1]["step"]) == (1, step)
    assert events[-1]["reason"] == REASONS[cause]
    assert all(e["event"] != "eval" for e in events)  # no evaluation of diverged weights, no "top-1 33.33 %"


@pytest.mark.numeric
def test_divergence_before_any_checkpoint_writes_none(tiny_data, tmp_path):
    proc = run_script("scratch", "--data-path", tiny_data, "--shared-folder-path", tmp_path, "--job-id", "nan",
                      *DIVERGE)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = rank_lines(proc.stderr)
    assert set(lines) == {0} and lines[0].group(4) == "no checkpoint was written"
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not list((tmp_path / "nan").glob("checkpoint*.pth"))
    assert strict_events(tmp_path / "nan" / "metrics.jsonl")[-1]["event"] == "diverged"


def test_loss_watch_and_the_agreement_name_the_earliest_bad_step():
    watch = finite.LossWatch()
    watch.observe(1, torch.tensor(3.0))
    assert watch.first_bad is None
    watch.observe(2, torch.tensor(float("inf")))
    watch.observe(3, torch.tensor(float("nan")))
    assert watch.flush() == 2
    # per-rank codes reduced by MAX give the earliest bad step of any rank
    codes = [finite.agreement_code(None), finite.agreement_code(7), finite.agreement_code(5)]
    assert finite.agreed_bad_step(max(codes)) == 5
    assert finite.agreed_bad_step(finite.agreement_code(None)) is None


def test_checkpoint_writer_refuses_non_finite_state_and_keeps_the_previous(tmp_path):
    model = architectures.build_model("resnet20", 3)
    good = {"model": model.state_dict(), "optimizer": {}, "epoch": 0, "images_in_epoch": 0, "global_step": 1,
            "ranks": [], "config": {}, "metrics": []}
    save_checkpoint(tmp_path, good, 1)
    bad_state = {k: v.clone() for k, v in model.state_dict().items()}
    bad_state["fc.weight"][0, 0] = float("nan")
    bad_state["conv1.weight"][0, 0, 0, 0] = float("inf")
    with pytest.raises(FixresError, match=r"^checkpoint of step 2 not written: 2 of \d+ tensors hold NaN or "
                                          r"infinity \(e.g. model/conv1.weight, model/fc.weight\) "
                                          r"\(training diverged\); "
                                          r"the previous checkpoint is kept$"):
        save_checkpoint(tmp_path, {**good, "model": bad_state, "global_step": 2}, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-00000001.pth", "checkpoint.pth"]
    assert load_checkpoint(tmp_path / CHECKPOINT_FILE)["global_step"] == 1
    # a checkpoint with NaN weights from an older version is not resumed
    torch.save({"format_version": 1, **good, "model": bad_state}, tmp_path / "old.pth")
    with pytest.raises(FixresError, match=r"old.pth cannot be resumed: 2 of .* --resume, or use a new --job-id$"):
        load_checkpoint(tmp_path / "old.pth")


def test_weight_files_with_non_finite_values_are_refused(tmp_path):
    state = architectures.build_model("resnet20", 3).state_dict()
    state["layer1.0.bn1.running_var"][0] = float("nan")
    torch.save({"model": state}, tmp_path / "nan.pth")
    with pytest.raises(FixresError, match=r"nan.pth entry 'model': 1 of \d+ tensors hold NaN or infinity "
                                          r"\(e.g. layer1.0.bn1.running_var\); these weights diverged"):
        weights.read_weight_file(tmp_path / "nan.pth")


def test_metrics_are_strict_json_even_for_non_finite_numbers(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", True)
    log.write("eval", loss=float("nan"), top1=float("inf"), nested={"x": [1.5, float("-inf")]})
    (written,) = strict_events(tmp_path / "metrics.jsonl")
    assert (written["loss"], written["top1"], written["nested"]) == (None, None, {"x": [1.5, None]})
    log.rewrite([{"event": "train", "loss": float("nan")}, {"event": "eval", "loss": 0.25}])
    log.write("train", loss=math.pi)
    events = strict_events(tmp_path / "metrics.jsonl")
    assert events[0] == {"event": "train", "loss": None} and events[1]["loss"] == 0.25
    assert events[2]["loss"] == pytest.approx(math.pi)


def test_the_shard_writer_refuses_non_finite_weights_as_the_one_file_writer_does(tmp_path):
    """Both raise NonFiniteWeights (which the Checkpointer turns into a divergence naming the kept
    checkpoint), and write nothing."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteWeights, match=r"^checkpoint of step 3 not written: a rank's weights or optimizer "
                                                 r"state hold NaN or infinity \(model/weight\); the previous "
                                                 r"checkpoint is kept$") as raised:
        checkpoint_shards.write(tmp_path, 3, model, optimizer, None, 0)
    assert raised.value.detail == "a rank's weights or optimizer state hold NaN or infinity (model/weight)"
    assert list(tmp_path.iterdir()) == []
