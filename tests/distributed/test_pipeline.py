"""Pipeline parallelism (fixres_dist.distributed.pipeline): the pieces and stages of each family in
this process, then real gloo ranks: 2 stages x 2 data-parallel ranks (1F1B), 4 stages (GPipe),
interleaved 1F1B and a BatchNorm ResNet, each equal to the unsplit model's steps; a split run's
sharded checkpoint read whole, and resumed on another split. Then the scripts' ``--pipeline-stages``: a
job equal to DDP's, stopped and resumed unsplit (and back), a FixRes finetune of a ResNet in stages,
``--model-ema`` in stages (its evaluations equal to DDP's, resumed from stages to DDP and back), and bad
input."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import shown_commands as shown
from conftest import free_port, once_per_run, run_script
from fixres_dist.config import PIPELINE_SCHEDULES
from fixres_dist.distributed import checkpoint_shards, collectives
from fixres_dist.distributed import pipeline as pp
from fixres_dist.distributed.fake_group import fake_process_group
from fixres_dist.entry.launch import start_method
from fixres_dist.errors import FixresError
from fixres_dist.models import batchnorm
from fixres_dist.models.architectures import build_model
from fixres_dist.models.ema import ModelEMA
from fixres_dist.training.checkpoint import CHECKPOINT_FILE
from jobs_fixtures import assert_refused_before_start, job, run_shown_split_command
from numeric import assert_near_reference, floating
from split_models import (
    CONVNEXT,
    LR,
    MOMENTUM,
    TORCHVISION_VIT,
    VIT,
    assert_same_run,
    batch,
    events,
    full,
    model_of,
    share,
    unsplit_steps,
)

STEPS = 3


@pytest.mark.numeric
@pytest.mark.parametrize("architecture", [VIT, "resnet20", "resnet18", TORCHVISION_VIT, CONVNEXT])
def test_stages_in_a_row_are_the_model(architecture):
    """Every family: its pieces cover every parameter and buffer, stages of any cut hold disjoint
    parts of the whole model's state_dict under the whole model's names, and run in a row they give
    the model's logits, bit for bit (the same modules on the same tensors: the same kernels)."""
    model = model_of(architecture).eval()
    every = pp.pieces(model, architecture)
    assert every[0].name == "stem" and every[-1].name == "head" and len(every) >= 5
    starts = pp.balanced_split(pp.piece_costs(model, every, 32), 3)
    bounds = [*starts, len(every)]
    stages = [pp.Stage(model, every, range(a, b)).eval() for a, b in zip(bounds, bounds[1:])]
    keys = [set(stage.state_dict()) for stage in stages]
    assert set().union(*keys) == set(model.state_dict()) and sum(map(len, keys)) == len(model.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        y = x
        for stage in stages:
            y = stage(y)
        assert torch.equal(y, model(x))


def test_the_split_balances_forward_flops():
    """The exact minimum of the largest stage's cost, contiguous stages; a given cost list."""
    assert pp.balanced_split([1, 1, 1, 1], 2) == [0, 2]
    assert pp.balanced_split([5, 1, 1, 1, 1, 1], 2) == [0, 1]
    assert pp.balanced_split([1, 2, 3, 4, 5], 3) == [0, 3, 4]
    with pytest.raises(FixresError, match="only 3 pieces"):
        pp.balanced_split([1, 1, 1], 4)
    model = model_of("resnet20")  # 9 blocks of 3 widths: the later blocks cost the same, the first more
    costs = pp.piece_costs(model, pp.pieces(model), 32)
    starts = pp.balanced_split(costs, 2)
    halves = sum(costs[:starts[1]]), sum(costs[starts[1]:])
    assert max(halves) <= 0.6 * sum(costs), halves


def test_what_cannot_be_split_is_refused():
    with pytest.raises(FixresError, match="mobilenet_v3_small cannot be split into stages"):
        pp.pieces(build_model("mobilenet_v3_small", 10), "mobilenet_v3_small")
    model = model_of(VIT)
    model.extra = nn.Linear(2, 2)  # a parameter none of the pieces runs
    with pytest.raises(FixresError, match="no piece runs extra.weight"):
        pp.pieces(model, VIT)
    for schedule, virtual, microbatches, match in (("zigzag", 1, 2, "choose one of gpipe, 1f1b"),
                                                   ("1f1b", 2, 4, "only it does"),
                                                   ("interleaved-1f1b", 1, 4, "only it does"),
                                                   ("1f1b", 1, 1, "at least one per stage"),
                                                   ("interleaved-1f1b", 2, 3, "a multiple of 2")):
        with pytest.raises(FixresError, match=match):
            pp.check_schedule(schedule, virtual, microbatches, 2)


# ------------------------------------------------------------------ real ranks
# (architecture, stages per pipeline, schedule, virtual stages per rank, micro-batches)
SPLITS = {"2x2-1f1b": (VIT, 2, "1f1b", 1, 2), "4-gpipe": (VIT, 4, "gpipe", 1, 4),
          "interleaved": (VIT, 2, "interleaved-1f1b", 2, 4), "resnet20-1f1b": ("resnet20", 4, "1f1b", 1, 4),
          "convnext-2x2": (CONVNEXT, 2, "1f1b", 1, 2)}  # its blocks' permutes: non-contiguous gradients


def run_split(name: str, folder, steps: range, resume=None):
    """This rank's part of split ``name``'s SGD steps; the last stage's ranks record their losses; the
    shards checkpoint written to ``folder`` (after loading ``resume``'s first, when given)."""
    architecture, stages, schedule, virtual, microbatches = SPLITS[name]
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mesh = pp.pipeline_mesh(torch.device("cpu"), world, stages)
    pipe = pp.Pipeline(model_of(architecture), mesh, size=32, schedule=schedule, virtual=virtual,
                       microbatches=microbatches, architecture=architecture)
    optimizer = torch.optim.SGD(pipe.module.parameters(), lr=LR, momentum=MOMENTUM)
    if resume is not None:
        checkpoint_shards.load_into(resume, pipe.module, optimizer, None)
    index, count = mesh.get_local_rank("data"), mesh.size(0)
    losses = []
    for step in steps:
        images, labels = batch(step)
        loss = pipe.train_step(share(images, index, count), share(labels, index, count))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(None if loss is None else loss.item())
    checkpoint_shards.write(folder, steps.stop, pipe.module, optimizer, None, rank)
    pipe.module.eval()
    images, labels = batch(99)
    logits = pipe.forward(share(images, index, count))
    (folder / f"{name}-rank{rank}.json").write_text(json.dumps({
        "losses": losses, "describe": pipe.describe(), "logits": None if logits is None else logits.tolist()}))


def _ranks(rank: int, world: int, port: int, folder) -> None:
    torch.set_num_threads(1)
    collectives.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world, 120)
    for name in SPLITS:
        (folder / name).mkdir(exist_ok=True)
        run_split(name, folder / name, range(STEPS))
    # the 2x2 run's checkpoint resumed on 4 stages x 1 (another split, another data-parallel size)
    (folder / "resumed").mkdir(exist_ok=True)
    run_split("4-gpipe", folder / "resumed", range(STEPS, STEPS + 1),
              resume=folder / "2x2-1f1b" / checkpoint_shards.folder_name(STEPS))
    # the unsplit model's checkpoint (written by the test, one process) resumed on 2 stages x 2
    (folder / "from-unsplit").mkdir(exist_ok=True)
    run_split("2x2-1f1b", folder / "from-unsplit", range(STEPS, STEPS + 1),
              resume=folder / "unsplit" / checkpoint_shards.folder_name(STEPS))
    collectives.destroy_process_group()


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    """Every split of :data:`SPLITS` and two resumes on 4 real gloo ranks, one start (the unsplit
    checkpoint they resume from written here first, in one process)."""
    folder = tmp_path_factory.mktemp("pipeline")
    (folder / "unsplit").mkdir()
    _, model, optimizer = unsplit_steps(VIT, range(STEPS))
    checkpoint_shards.write(folder / "unsplit", STEPS, model, optimizer, None, 0)  # one process: world size 1
    mp.start_processes(_ranks, args=(4, free_port(), folder), nprocs=4, start_method=start_method())
    return folder


def recorded(folder, name):
    """The losses of the last stages' ranks (one list per data-parallel rank) and rank 0's description."""
    runs = [json.loads(path.read_text()) for path in sorted((folder / name).glob("*-rank*.json"))]
    return [run["losses"] for run in runs if run["losses"][0] is not None], runs[0]["describe"]


def whole(folder, name, step=STEPS):
    return checkpoint_shards.read_full(folder / name / checkpoint_shards.folder_name(step))["model"]


@pytest.mark.numeric
@pytest.mark.parametrize("name", list(SPLITS))
def test_a_split_model_steps_as_the_unsplit_one(split_runs, name):
    """Same weights, same batches: the mean loss of the last stages' ranks is the unsplit step's, the
    stages' checkpoint, read whole, holds the unsplit model's weights after the steps, and the logits
    evaluated through the pipeline (each data-parallel rank its share) are the unsplit model's: each
    within rounding of the unsplit model's float32 steps, both measured against the same steps in
    float64 (:func:`numeric.assert_near_reference`)."""
    architecture, stages, _, virtual, microbatches = SPLITS[name]
    data = 4 // stages
    losses, describe = recorded(split_runs, name)
    assert len(losses) == data and describe.startswith(f"pipeline: {stages * virtual} stages")
    # BatchNorm sees micro-batches: the reference accumulates over the same ones
    accumulated = microbatches * data if architecture == "resnet20" else 1
    baseline, model, _ = unsplit_steps(architecture, range(STEPS), accumulated)
    reference, model64, _ = unsplit_steps(architecture, range(STEPS), accumulated, dtype=torch.float64)
    mean = [sum(run[step] for run in losses) / data for step in range(STEPS)]
    assert_near_reference({"loss": mean}, {"loss": baseline}, {"loss": reference}, f"{name}: losses")
    if architecture != "resnet20":  # evaluated through the pipeline: the unsplit model's logits
        runs = [json.loads(p.read_text()) for p in sorted((split_runs / name).glob("*-rank*.json"))]
        logits = torch.cat([torch.tensor(run["logits"]) for run in runs if run["logits"] is not None])
        images = batch(99)[0]
        with torch.no_grad():
            assert_near_reference({"logits": logits}, {"logits": model.eval()(images)},
                                  {"logits": model64.eval()(images.double())}, f"{name}: logits")
    # BatchNorm statistics: each data-parallel rank's own (averaged by the Trainer per epoch), not compared
    trained = {k: v for k, v in floating(model.state_dict()).items() if "running" not in k}
    assert_near_reference({k: whole(split_runs, name)[k] for k in trained}, trained,
                          {k: model64.state_dict()[k] for k in trained}, f"{name}: weights")


@pytest.mark.numeric
@pytest.mark.parametrize("resumed", ["resumed", "from-unsplit"])
def test_a_checkpoint_resumes_on_another_split(split_runs, resumed):
    """2 stages x 2 data-parallel ranks, 3 steps, checkpointed, resumed as 4 stages x 1; and the unsplit
    model's checkpoint after 3 steps resumed as 2 stages x 2: the 4th step equals the unsplit model's
    4th (loss and weights, within rounding of the unsplit float32 steps against float64). The split
    run's checkpoint read whole: the test above."""
    losses, _ = recorded(split_runs, resumed)
    baseline, model, _ = unsplit_steps(VIT, range(STEPS + 1))
    reference, model64, _ = unsplit_steps(VIT, range(STEPS + 1), dtype=torch.float64)
    assert_near_reference({"loss": [sum(run[0] for run in losses) / len(losses)]}, {"loss": baseline[-1:]},
                          {"loss": reference[-1:]}, f"{resumed}: loss")
    weights = whole(split_runs, resumed, STEPS + 1)
    assert_near_reference({k: weights[k] for k in model.state_dict()}, model.state_dict(), model64.state_dict(),
                          f"{resumed}: weights")


def test_the_split_is_measured_without_touching_batchnorm():
    """Counting each piece's FLOPs runs the model in eval mode: a ResNet's BatchNorm statistics and every
    module's mode are as they were (a cut model would otherwise evaluate with statistics of a blank image)."""
    model = build_model("resnet18", 10).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pp.piece_costs(model, pp.pieces(model, "resnet18"), 32)
    assert all(m.training for m in model.modules())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


# ------------------------------------------------------------------ the scripts
@pytest.mark.numeric
def test_a_pipeline_job_trains_as_ddp(split_jobs):
    """Same seed, same 16-image global batches, on 2 pipelines of 2 stages: losses, learning rates, top-1
    (30 images counted once, on the last stages; a rank's 15 in batches of 8 and 7, the 7 as one
    micro-batch) and the final weights, gathered from the stages into checkpoint.pth, are DDP's."""
    assert_same_run(split_jobs / "pp", split_jobs / "ddp", split_jobs / "ddp-other", ema=False)
    out = (split_jobs / "pp.out").read_text()
    assert "--pipeline-stages 2: pipeline: 2 stages x 2 data-parallel ranks, Schedule1F1B, 2 micro-batches per " \
           "step; this rank holds stage 0: stem .. blocks.2; 174,784 parameters on this rank" in out
    assert "lr 0.00625 = 0.1 x 8 x 2 / 256" in out  # the linear scaling rule counts data-parallel ranks


@pytest.mark.numeric
def test_a_pipeline_job_with_activation_checkpointing_ends_as_the_same_job_without(split_jobs, tiny_data, tmp_path):
    """``--activation-checkpointing`` on 2 pipelines of 2 stages: each stage's blocks (the model's own,
    checkpointed before the cut) recompute their forward in the 1F1B schedule's backward. The cut is the
    same (the FLOPs are counted once per block) and the job ends as the split_jobs' pipeline job bit for
    bit: losses, learning rates, top-1 and the final weights. On CPU the recomputation runs the same kernels
    on the same inputs (no dropout in the test ViT; the RNG state would be restored anyway), and the
    gradients flow through the same operations: equal, not merely within rounding."""
    result = job(tmp_path, tiny_data, "ac", "--pipeline-stages", 2, "--activation-checkpointing", world=4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "activation checkpointing: 6 blocks recompute their forward in the backward" in result.stdout
    assert "2 micro-batches per step; this rank holds stage 0: stem .. blocks.2; 174,784 parameters" in result.stdout
    reference = split_jobs / "pp"
    for kind in ("train", "eval"):
        ours, theirs = events(tmp_path / "ac", kind), events(reference, kind)
        assert len(ours) == len(theirs) > 0, kind
        for x, y in zip(ours, theirs):
            assert all(x.get(f) == y.get(f) for f in ("epoch", "loss", "lr", "top1", "images")), (kind, x, y)
    ours, theirs = (full(folder / CHECKPOINT_FILE)["model"] for folder in (tmp_path / "ac", reference))
    assert ours.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in ours.items())


@pytest.mark.numeric
def test_a_pipeline_job_stopped_mid_epoch_resumes_unsplit(split_jobs, tiny_data, tmp_path):
    """Stopped after step 3 on 2 pipelines of 2 stages cut by hand (by the last stage of the first), resumed on 2 plain
    DDP ranks: it ends as the uninterrupted job (its checkpoint is the whole model's, its optimizer's
    state numbered as an unsplit optimizer's)."""
    stopped = job(tmp_path, tiny_data, "s", "--pipeline-stages", 2, "--pipeline-split", "0,3", world=4,
                  fault="signal:rank=1:step=2")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    assert "this rank holds stage 0: stem .. blocks.1;" in stopped.stdout  # the cut given, not the balanced one
    assert "fixres_dist: rank 3 (stage 1 of pipeline 1): " in stopped.stderr, stopped.stderr[-2000:]  # who stopped
    resumed = job(tmp_path, tiny_data, "s")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming a 4-rank checkpoint (2 pipeline stages) on 2 ranks: the same 2 data-parallel rank(s), " \
           "batches and learning rate" in resumed.stdout, resumed.stdout[-2000:]
    assert "resumed from" in resumed.stdout and "step 3" in resumed.stdout
    assert_same_run(tmp_path / "s", split_jobs / "ddp", split_jobs / "ddp-other", ema=False)


@pytest.mark.numeric
@pytest.mark.slow
def test_a_ddp_job_stopped_mid_epoch_resumes_in_stages(split_jobs, tiny_data, tmp_path):
    """And back: stopped on 2 DDP ranks, resumed on 2 pipelines of 2 stages (rank 0 is not the rank that
    carries the epoch's totals then): the same end. The resumed epoch's speed counts its time before the
    stop as well as its images before it (rank 0 reports it: once it counted the images only; stopped after
    4 of the epoch's 5 steps, the speed over the last step alone is well above the speed before the stop)."""
    stopped = job(tmp_path, tiny_data, "s", fault="signal:rank=0:step=3")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    before = torch.load(tmp_path / "s" / CHECKPOINT_FILE, weights_only=True)["epoch_seconds"]
    resumed = job(tmp_path, tiny_data, "s", "--pipeline-stages", 2, world=4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "s", split_jobs / "ddp", split_jobs / "ddp-other", ema=False)
    epochs = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    [stopped_epoch] = [e for e in epochs if e["event"] == "train" and e["epoch"] == 1][-1:]
    assert 0 < before and stopped_epoch["img_per_s"] < stopped_epoch["images"] / before, (before, stopped_epoch)


@pytest.mark.slow
def test_a_pipeline_job_resumed_on_as_many_ranks_cut_otherwise_says_what_changed(tiny_data, tmp_path):
    """Stopped on 2 pipelines of 2 stages, resumed on the same 4 ranks as 1 pipeline of 4: the data-parallel
    ranks went from 2 to 1, so the learning rate is re-derived and the line says so (not a silent change)."""
    stopped = job(tmp_path, tiny_data, "s", "--pipeline-stages", 2, world=4, fault="signal:rank=1:step=2")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    resumed = job(tmp_path, tiny_data, "s", "--pipeline-stages", 4, world=4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "warning: the global batch of 16 images is not kept (pipeline stages do not accumulate micro-batches)" \
        in resumed.stdout, resumed.stdout[-2000:]
    assert re.search(r"warning: world change: 4 ranks on \S+ -> 4 ranks \(4 pipeline stages\) on \S+: .*global batch "
                     r"16 -> 8: peak lr 0.00625 -> 0.003125 by the linear scaling rule, 5 -> 10 steps per epoch",
                     resumed.stdout), resumed.stdout



@pytest.mark.numeric
def test_fixres_finetune_of_a_resnet_in_stages(scratch_job, finetune_job, finetune_job_other, few_data, tmp_path):
    """The session's DDP finetune (:func:`jobs_fixtures.finetune_job`: resnet18 at 48 px on 2 ranks) again
    as 2 pipelines of 2 stages (GPipe, one micro-batch: BatchNorm sees what DDP's does): the first stage
    wholly frozen (nothing to train on its ranks), the head and last BatchNorm on the last, that
    BatchNorm synchronised and its statistics averaged over the stage's 2 data-parallel ranks; the
    evaluations before finetuning, the finetune and the final weights equal the DDP finetune's."""
    result = run_script("finetune", "--num-tasks", 4, "--job-id", "f", "--shared-folder-path", tmp_path,
                        "--data-path", few_data, "--weight-path", scratch_job / CHECKPOINT_FILE, "--input-size", 48,
                        "--batch", 8, "--epochs", 1, "--workers", 1, "--no-progress", "--pipeline-stages", 2,
                        "--pipeline-schedule", "gpipe", "--pipeline-microbatches", 1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "BatchNorm statistics over all 2 data-parallel ranks' images: layer4.1.bn2" in result.stdout
    assert_same_run(tmp_path / "f", finetune_job.folder, finetune_job_other.folder, ema=False)


# ------------------------------------------------------------------ --model-ema in stages
# The split jobs' options with a BatchNorm ResNet (the average's running statistics are averaged too), averaged
# after every step with a decay that keeps it well apart from the weights; in stages, one micro-batch per step
# (GPipe): BatchNorm then sees the images DDP's sees.
EMA = ("--architecture", "resnet20", "--model-ema", "--model-ema-steps", 1, "--model-ema-decay", 0.5)
IN_STAGES = ("--pipeline-stages", 2, "--pipeline-schedule", "gpipe", "--pipeline-microbatches", 1)


@pytest.fixture(scope="session")
def ema_jobs(tiny_data, tmp_path_factory) -> Path:
    """:data:`EMA`'s job (2 epochs of 5 steps) under DDP on 2 ranks (``ddp``), again with the other memory
    format (``ddp-other``: the same computation in another summation order, :func:`split_models.assert_same_run`)
    and on 2 pipelines of 2 stages (``pp``); each job's stdout in ``<name>.out``."""
    def make(folder: Path) -> Path:
        for name, extra, world in (("ddp", (), 2), ("ddp-other", ("--channels-last",), 2), ("pp", IN_STAGES, 4)):
            result = job(folder, tiny_data, name, *EMA, *extra, world=world)
            assert result.returncode == 0, result.stderr[-3000:]
            (folder / f"{name}.out").write_text(result.stdout)
        return folder
    return once_per_run(tmp_path_factory, "ema_jobs", make)


@pytest.mark.numeric
def test_a_pipeline_job_evaluates_its_ema_as_ddp(ema_jobs):
    """``--model-ema`` on 2 pipelines of 2 stages: each rank averages its stages' parameters and BatchNorm
    buffers after every step, evaluates the average through a pipeline of its own (the ``eval EMA`` lines:
    top-1 equal, loss within rounding of DDP's), averages its statistics over the stage's data-parallel ranks
    at each epoch's end, and the checkpoint gathers it whole under DDP's keys (weights within rounding, the
    update count equal): the average is DDP's, as the model is."""
    assert_same_run(ema_jobs / "pp", ema_jobs / "ddp", ema_jobs / "ddp-other")
    out = (ema_jobs / "pp.out").read_text()
    assert "this rank holds stage 0: stem .. layer2.0; 29,008 parameters on this rank; the EMA's average of them " \
           "alike" in out, out[-2000:]
    assert len(re.findall(r"eval EMA @32px: top-1 ", out)) == 2
    ours, theirs = (full(ema_jobs / name / CHECKPOINT_FILE) for name in ("pp", "ddp"))
    assert ours["model_ema_state"] == theirs["model_ema_state"] == {"updates": 10}


@pytest.mark.numeric
def test_a_pipeline_job_s_ema_resumes_under_ddp_and_back(ema_jobs, tiny_data, tmp_path):
    """Stopped after step 3 in stages, resumed on 2 DDP ranks and stopped again after step 8 (in the second
    epoch), then resumed in stages to its end: the average continues across both changes of layout (the
    checkpoint's whole ``model_ema`` and update count, each rank's BatchNorm buffers averaged) and the job
    ends as the uninterrupted DDP job, the EMA's evaluations and weights included (a restarted average
    would copy the weights at its next update: its next evaluation is off by far more than rounding)."""
    stopped = job(tmp_path, tiny_data, "s", *EMA, *IN_STAGES, world=4, fault="signal:rank=1:step=2")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    assert full(tmp_path / "s" / CHECKPOINT_FILE)["model_ema_state"] == {"updates": 3}
    on_ddp = job(tmp_path, tiny_data, "s", *EMA, fault="signal:rank=0:step=7")
    assert on_ddp.returncode == 3, on_ddp.stderr[-3000:]
    assert "resuming a 4-rank checkpoint (2 pipeline stages) on 2 ranks" in on_ddp.stdout, on_ddp.stdout[-2000:]
    back = job(tmp_path, tiny_data, "s", *EMA, *IN_STAGES, world=4)
    assert back.returncode == 0, back.stderr[-3000:]
    assert "resuming a 2-rank checkpoint on 4 ranks (2 pipeline stages)" in back.stdout, back.stdout[-2000:]
    assert "resumed from" in back.stdout and "step 8" in back.stdout
    assert_same_run(tmp_path / "s", ema_jobs / "ddp", ema_jobs / "ddp-other")


def test_the_ema_copies_a_model_whose_batchnorm_is_synchronised_over_a_stage_s_ranks():
    """A finetune in stages synchronises its trainable BatchNorm over the stage's data-parallel ranks (a process
    group, which cannot be copied) before the EMA copies the model: the copy names the same group, and the
    model keeps it (a fake process group of 4 ranks, this process rank 0)."""
    with fake_process_group(4):
        stage_ranks = torch.distributed.new_group([0, 2])
        model = model_of("resnet20")
        assert batchnorm.synchronise(model, ["layer3.2.bn2"], "cpu", stage_ranks) == ["layer3.2.bn2"]
        average = ModelEMA(model, 0.5, 1).module
        assert model.layer3[2].bn2.group is stage_ranks and average.layer3[2].bn2.group is stage_ranks
        assert average.layer3[2].bn2 is not model.layer3[2].bn2
        assert all(torch.equal(a, b) for a, b in zip(average.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("args, message", [
    (("--num-tasks", 4, "--pipeline-stages", 3), "--pipeline-stages 3 must divide the number of ranks (4)"),
    (("--num-tasks", 2, "--pipeline-stages", 2, "--architecture", "mobilenet_v3_small"),
     "--pipeline-stages: mobilenet_v3_small cannot be split into stages"),
    (("--num-tasks", 16, "--pipeline-stages", 16, "--batch", 16),
     "--pipeline-stages 16: timm/test_vit has only 8 pieces"),
    (("--num-tasks", 2, "--pipeline-stages", 2, "--pipeline-microbatches", 3),
     "--batch 8 does not split into 3 equal micro-batches"),
    (("--num-tasks", 2, "--pipeline-stages", 2, "--pipeline-microbatches", 1),
     "--pipeline-microbatches 1: 1f1b needs at least one per stage (2)"),
    (("--num-tasks", 2, "--pipeline-microbatches", 2), "--pipeline-microbatches applies to a model cut into stages"),
    (("--num-tasks", 2, "--pipeline-stages", 2, "--pipeline-microbatches", 8, "--architecture", "resnet20"),
     "--batch 8 in 8 micro-batches leaves 1 image per micro-batch: resnet20's BatchNorm cannot train on one"),
    (("--num-tasks", 2, "--pipeline-split", "0,3"), "--pipeline-split applies to a model cut into stages"),
    (("--num-tasks", 2, "--pipeline-stages", 2, "--pipeline-split", "0,8"),
     "--pipeline-split 0,8: give the first piece of each of the 2 stages, increasing from 0, below 8"),
    (("--num-tasks", 2, "--pipeline-stages", 2, "--pipeline-split", "3"), "--pipeline-split 3: give the first piece"),
    (("--num-tasks", 4, "--pipeline-stages", 2, "--tensor-parallel", 2),
     "--pipeline-stages 2 does not go with --tensor-parallel"),
    (("--num-tasks", 2, "--pipeline-stages", 2, "--grad-accum-steps", 2),
     "use --pipeline-microbatches instead of --grad-accum-steps 2"),
    (("--num-tasks", 2, "--pipeline-stages", 2, "--architecture", "vit_b_16", "--input-size", 224),
     "--pipeline-stages cannot run torchvision's vit_b_16"),
])
def test_bad_pipeline_input_is_one_line_before_any_rank_starts(capsys, tiny_data, tmp_path, args, message):
    assert_refused_before_start(capsys, tiny_data, tmp_path, ("--batch", 8, *args), message)


def test_the_schedules_are_the_configs():
    assert tuple(pp.SCHEDULES) == PIPELINE_SCHEDULES


@pytest.mark.slow
def test_the_pipeline_command_shown(tmp_path):
    """docs/sharding.md's command: 4 ranks, 2 pipelines of 2 stages, the embedded data for an epoch (4,000
    training images), each of the 1,000 validation images counted once."""
    command = shown.command("python main_scratch.py --num-tasks 4 --pipeline-stages 2")
    out = run_shown_split_command(command, "vit-pp", tmp_path)
    assert "--pipeline-stages 2: pipeline: 2 stages x 2 data-parallel ranks, Schedule1F1B, 2 micro-batches per " \
           "step; this rank holds stage 0: stem .. blocks.2" in out
