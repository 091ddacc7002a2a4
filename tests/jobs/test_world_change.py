"""A job continued on another number of ranks keeps its recipe (fixres_dist.training.world_change): the
global batch through accumulated micro-batches by default, each rank's batch on request, a bound on
the fewest ranks, and one event per change. The job that changes world twice is compared with the
split-jobs fixture's uninterrupted DDP job (a LayerNorm ViT: no BatchNorm statistics to differ);
tests/jobs/test_multinode.py loses and regains a node under torchrun's elastic agent."""
from __future__ import annotations

import json
import socket

import attrs
import pytest

from fixres_dist.config import TrainerConfig
from fixres_dist.distributed.preemption import Preempted
from fixres_dist.errors import FixresError
from fixres_dist.training import checkpoint, world_change
from jobs_fixtures import job
from split_models import assert_same_run


def events(folder, kind):
    return [e for e in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


@pytest.fixture(scope="module")
def ddp_checkpoint(split_jobs):
    """The split-jobs fixture's DDP checkpoint (2 ranks of 8 images: a global batch of 16) and its config."""
    contents = checkpoint.Contents.from_dict(checkpoint.load_checkpoint(split_jobs / "ddp" / "checkpoint.pth"))
    return contents, TrainerConfig.from_dict(contents.config)


def test_the_global_batch_is_kept_on_fewer_and_more_ranks_unless_asked_otherwise(ddp_checkpoint):
    contents, saved = ddp_checkpoint
    warnings = []

    def on(ranks, **changes):
        return world_change.continued(attrs.evolve(saved, num_tasks=ranks, global_rank=0, **changes), contents,
                                      warnings.append)

    one = on(1)  # the 2 ranks' 8 images each, as 2 micro-batches of 8
    assert (one.global_batch, one.images_per_step, one.accumulation) == (16, 16, 2)
    three = on(3)  # shares of 6, 5 and 5 images
    assert (three.global_batch, three.accumulation) == (16, 1)
    assert on(2).global_batch is None  # the same world: nothing kept by hand
    kept_rank = on(1, world_change="keep-rank-batch")
    assert (kept_rank.global_batch, kept_rank.images_per_step, kept_rank.accumulation) == (None, 8, 1)
    assert on(9).global_batch is None and "would leave some of the 9 data-parallel ranks fewer than 2 images" in \
        warnings[-1]
    assert on(2, pipeline_stages=2).global_batch is None  # 1 pipeline of 2 stages: 1 data-parallel rank
    assert "pipeline stages do not accumulate micro-batches" in warnings[-1]
    assert len(warnings) == 2
    with pytest.raises(Preempted, match="only 1 rank, fewer than --min-world-size 2: stopped before training; "
                                        "the checkpoint of step 10 is kept"):
        on(1, min_world_size=2)
    with pytest.raises(FixresError, match="this job has 1 rank, fewer than --min-world-size 2"):
        world_change.check_minimum(attrs.evolve(saved, num_tasks=1, min_world_size=2), None)
    with pytest.raises(FixresError, match="a global batch of 3 images is too small for 2 data-parallel ranks"):
        attrs.evolve(saved, global_batch=3)


def test_a_loss_noted_by_the_survivors_is_counted_once_by_the_next_run(ddp_checkpoint, tmp_path):
    """What survivors of a lost node had trained since the checkpoint (step 10: the end of epoch 2) is the
    event's ``images_lost``; the record is read once, a run that fails before it resumes keeps it, and a
    record that note_loss could not have written is dropped rather than stopping the run."""
    contents, saved = ddp_checkpoint
    config = attrs.evolve(saved, shared_folder_path=str(tmp_path), num_tasks=1, global_rank=0)
    config.job_folder.mkdir(parents=True)
    world_change.note_loss(config, 2, 48, 13, "lost ranks 2-3 on n2")
    world_change.note_loss(config, 0, 0, 0, "lost rank 1")  # the next run failed before it resumed
    loss = world_change.read_loss(config)
    assert world_change.read_loss(config) is None
    fields = world_change.event(config, contents, ["n1"], 80, loss, 0.003)
    assert fields["images_lost"] == 48 and fields["lost"] == "lost ranks 2-3 on n2"
    assert fields["ranks_before"] == 2 and fields["hosts_before"] == [socket.gethostname()]
    assert fields["hosts_after"] == ["n1"] and fields["epoch"] == 3 and fields["step"] == 10
    assert 0 <= fields["seconds_since_loss"] < 60
    assert (fields["base_lr_before"], fields["base_lr"], fields["micro_batches_before"]) == (0.00625, 0.003, 2)
    stale = dict(loss, step=9)  # a loss before the checkpoint resumed is not this run's
    assert world_change.event(config, contents, ["n1"], 80, stale, 0.003)["images_lost"] is None
    path = config.job_folder / world_change.LOSS_FILE
    record = '{"step": 11, "epoch": 2, "images_in_epoch": 8, "time": '
    for garbage in ('{"step": "abc"}', '{"step": 100}', '[1]', 'not json', record + '9e99}', record + '"x"}'):
        path.write_text(garbage)
        assert world_change.read_loss(config) is None and not path.exists(), garbage


@pytest.mark.numeric
def test_a_job_whose_world_changes_twice_ends_as_the_uninterrupted_one(split_jobs, tiny_data, tmp_path):
    """Stopped on 2 ranks after step 4 (mid-epoch 1), continued on 1 rank accumulating 2 micro-batches
    (the images of the 2 ranks) and stopped after step 7, then finished on 3 ranks (shares of 6, 5 and 5):
    the same 16-image steps, so the same learning rates, losses, top-1 and final weights as the DDP job
    on 2 ranks, every image of each epoch once. Each change is one line and one event."""
    first = job(tmp_path, tiny_data, "w", fault="signal:rank=0:step=3")
    assert first.returncode == 3, first.stderr[-3000:]
    one = job(tmp_path, tiny_data, "w", world=1, fault="signal:rank=0:step=7")
    assert one.returncode == 3, one.stderr[-3000:]
    host = socket.gethostname()
    assert "lr 0.00625 = 0.1 x 16 (global batch kept: 1 rank x 2 accumulated) / 256" in one.stdout, one.stdout
    assert f"world change: 2 ranks on {host} -> 1 rank on {host}: epoch 1 continues at image 64 of 80 of the " \
           "same permutation (no image repeated), step 4; global batch of 16 kept, 2 accumulated micro-batches " \
           "per rank: learning rate and schedule unchanged" in one.stdout, one.stdout
    three = job(tmp_path, tiny_data, "w", world=3)
    assert three.returncode == 0, three.stderr[-3000:]
    assert "global batch of 16 kept: learning rate and schedule unchanged" in three.stdout, three.stdout
    changes = [{k: e[k] for k in ("ranks_before", "ranks_after", "step", "global_batch", "accumulation",
                                  "images_lost")} for e in events(tmp_path / "w", "world_change")]
    assert changes == [
        {"ranks_before": 2, "ranks_after": 1, "step": 4, "global_batch": 16, "accumulation": 2, "images_lost": None},
        {"ranks_before": 1, "ranks_after": 3, "step": 7, "global_batch": 16, "accumulation": 1, "images_lost": None}]
    assert_same_run(tmp_path / "w", split_jobs / "ddp", split_jobs / "ddp-other", ema=False)
