"""Where a step's time goes (issue 27): every rank's step breakdown per epoch in metrics.jsonl and
TensorBoard scalars, a slowed rank named as the straggler, a slowed loader named as the bottleneck
with the workers that would keep up, a loader-bound job; --no-step-times turns it off."""
from __future__ import annotations

import time

import pytest
import torch

from conftest import job_events
from fixres_dist import FixresError, TrainerConfig
from fixres_dist.entry.cli import build_parser, config_fields
from fixres_dist.reporting import step_times
from fixres_dist.reporting.tensorboard_events import event_scalars
from fixres_dist.training import faults


def test_the_slowed_rank_is_named_with_where_its_time_went(slowed_job):
    """conftest.slowed_job: 4 ranks, rank 2's steps and rank 3's batches 0.4 s slower."""
    folder, result = slowed_job.folder, slowed_job
    warned = [line for line in result.stdout.splitlines() if line.startswith("warning: straggler:")]
    assert len(warned) == 2, result.stdout
    device, loader = warned
    assert device.startswith("warning: straggler: rank 2 (") and " ms per step in forward and backward" in device
    assert "the other ranks waited a median " in device and "gradient all-reduce" in device
    assert loader.startswith("warning: straggler: rank 3 (") and " ms per step waiting for data" in loader
    assert "its loader is the bottleneck: about --workers " in loader and "(now 0)" in loader
    assert "\n  step times (ms per step, median of 4 ranks): data " in result.stdout  # after the epoch's line
    [event] = [e for e in job_events(folder) if e["event"] == "step_times"]
    assert event["epoch"] == 1 and event["findings"] == [line.removeprefix("warning: ") for line in warned]
    ranks = event["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and all(r["steps"] == 10 for r in ranks)
    assert all(set(r["ms_per_step"]) == set(step_times.PHASES) for r in ranks)
    assert all(v is not None and v >= 0 for r in ranks for v in r["ms_per_step"].values())
    assert ranks[2]["ms_per_step"]["compute"] > ranks[0]["ms_per_step"]["compute"] + 80
    assert ranks[3]["ms_per_step"]["data"] > ranks[0]["ms_per_step"]["data"] + 80
    assert ranks[0]["ms_per_step"]["collectives"] > 80  # rank 0 waited for both in the all-reduce
    assert all(0.05 < r["peak_memory_gib"] < 8 and r["memory"] == "peak resident set (VmHWM)" for r in ranks)


def test_the_breakdown_is_tensorboard_scalars(slowed_job):
    folder = slowed_job.folder
    [event] = [e for e in job_events(folder) if e["event"] == "step_times"]
    step, scalars = event_scalars(event, images_per_epoch=80)
    tags = dict(scalars)
    assert step == 80 and len(tags) == 4 * (len(step_times.PHASES) + 1)
    assert tags["step_time_ms/compute/rank2"] == event["ranks"][2]["ms_per_step"]["compute"]
    assert tags["peak_memory_gib/rank3"] == event["ranks"][3]["peak_memory_gib"]


def _summary(data_s: float, compute_s: float, steps: int = 5) -> dict:
    """A real StepTimes on the CPU over ``steps`` steps that wait ``data_s`` and compute ``compute_s``."""
    times = step_times.StepTimes(torch.device("cpu"), rank=0)
    times.start_epoch()
    for _ in range(steps):
        time.sleep(data_s)
        times.mark("batch")
        torch.ones(64, 64) @ torch.ones(64, 64)
        time.sleep(compute_s)
        for point in ("backward", "optimizer", "done"):
            times.mark(point)
    return times.summary()


def test_a_loader_bound_job_says_how_many_workers_would_keep_up():
    measured = _summary(0.05, 0.005)
    ranks = [dict(measured, rank=r) for r in range(2)]  # alike: no straggler, both waiting for data
    assert ranks[0]["ms_per_step"]["collectives"] is None  # no DDP hook: not measured
    # at least what was slept (a loaded machine sleeps longer: no upper bound on times)
    assert ranks[0]["ms_per_step"]["data"] >= 50 and ranks[0]["ms_per_step"]["compute"] >= 5
    [line] = step_times.findings(ranks, epoch=3, workers=2)
    assert line.startswith("loader-bound: in epoch 3 the ranks waited ") and "the loaders are the bottleneck" in line
    # 2 workers deliver a batch every data + other ms, so one batch takes a worker 2 x (data + other)
    times = ranks[0]["ms_per_step"]
    other = times["compute"] + times["optimizer"] + times["after_step"]
    need = step_times.workers_to_keep_up(times["data"], other, 2)
    assert need == max(3, -(-2 * (times["data"] + other) // other)) and f"about --workers {need} per rank" in line
    busy = _summary(0.0, 0.01)
    assert step_times.findings([dict(busy, rank=r) for r in range(2)], 1, 2) == []


@pytest.mark.parametrize("value", ["slow-step:rank=0:seconds=-1", "slow-data:rank=0:seconds=nan",
                                   "slow-step:rank=0:seconds=inf", "slow-step:rank=0:secs=1",
                                   "slow-step:rank=0:step=-5"])
def test_a_malformed_slowing_fault_is_one_line(value):
    with pytest.raises(FixresError, match=r"FIXRES_FAULT=.*: expected ACTION:rank=R:step=S\[:seconds=T\]"):
        faults.planned_faults({"FIXRES_FAULT": value})


def test_no_step_times_records_nothing():
    args = build_parser("scratch").parse_args(["--no-step-times"])
    config = TrainerConfig(**config_fields(args, "scratch"))
    assert config.step_times is False
    times = step_times.StepTimes(torch.device("cpu"), rank=0, enabled=config.step_times)
    times.start_epoch()
    times.mark("batch")
    assert times.steps == [] and times.gather() is None
    assert step_times.workers_to_keep_up(data_ms=50, other_ms=10, workers=0) == 5
