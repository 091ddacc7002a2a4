"""Tensor parallelism (fixres_dist.distributed.tensor_parallel) on 4 real gloo ranks, one start:
a timm ViT split by heads and MLP units over 2 ranks x 2 data-parallel groups, a torchvision ViT's
MLPs over 4 ranks, each equal to the unsplit model's clipped SGD steps; the unsplit model's
weights resumed split; what cannot be split, refused. Then the scripts' ``--tensor-parallel``: a job
equal to DDP's, stopped and resumed unsplit (and back), a FixRes finetune split, and bad input."""
from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

import shown_commands as shown
from conftest import free_port
from fixres_dist.config import TrainerConfig
from fixres_dist.distributed import collectives, layout, sharding
from fixres_dist.distributed import tensor_parallel as tp
from fixres_dist.distributed.tensor_fsdp_strategy import ShardedTensorSplit
from fixres_dist.entry.launch import start_method
from fixres_dist.errors import FixresError
from fixres_dist.training.checkpoint import CHECKPOINT_FILE
from jobs_fixtures import assert_refused_before_start, job, run_shown_split_command
from numeric import assert_near_reference
from split_models import (
    LR,
    MOMENTUM,
    TORCHVISION_VIT,
    VIT,
    assert_same_run,
    batch,
    model_of,
    share,
    unsplit_steps,
)

STEPS, CLIP = 3, 0.5  # a norm the ViT's gradients exceed: clipping acts in every step
# name: (architecture, ranks per tensor group, resumed from the unsplit model after STEPS steps)
RUNS = {"vit-2x2": (VIT, 2, False), "torchvision-4": (TORCHVISION_VIT, 4, False), "resumed-2x2": (VIT, 2, True)}


def run(name: str, folder) -> None:
    """This rank's part of run ``name``: split, its SGD steps with clipping, its weights gathered whole."""
    architecture, ranks, resumed = RUNS[name]
    mesh = tp.tensor_mesh(torch.device("cpu"), torch.distributed.get_world_size(), ranks)
    model = model_of(architecture)
    split = tp.parallelize(model, mesh["tensor"], architecture)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    steps = range(STEPS)
    if resumed:  # the unsplit model's weights and momentum after STEPS steps, given whole to every rank
        _, whole, whole_optimizer = unsplit_steps(architecture, steps, clip=CLIP)
        set_model_state_dict(model, whole.state_dict(), options=StateDictOptions(full_state_dict=True))
        for parameter, state in zip(model.parameters(), whole_optimizer.state.values()):
            optimizer.state[parameter] = {"momentum_buffer": _like(parameter, state["momentum_buffer"])}
        steps = range(STEPS, STEPS + 1)
    index, count = mesh.get_local_rank("data"), mesh.size(0)
    losses = []
    for step in steps:
        images, labels = batch(step)
        loss = nn.functional.cross_entropy(model(share(images, index, count)), share(labels, index, count))
        loss.backward()
        tp.average_gradients(model, mesh)
        tp.clip_grad_norm(model, CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = {k: v.tolist() for k, v in sharding.full_state_dicts(model, optimizer)["model"].items()}
    if torch.distributed.get_rank() == 0:
        (folder / f"{name}.json").write_text(json.dumps({"split": split, "weights": weights}))
    (folder / f"{name}-losses{torch.distributed.get_rank()}.json").write_text(json.dumps(losses))


def _like(parameter, full: torch.Tensor):
    """``full`` laid out as ``parameter`` (split the same way when it is split)."""
    if isinstance(parameter, torch.distributed.tensor.DTensor):
        return torch.distributed.tensor.distribute_tensor(full, parameter.device_mesh, parameter.placements)
    return full.clone()


def refusals(folder) -> None:
    mesh = tp.tensor_mesh(torch.device("cpu"), 4, 4)
    said = []
    for architecture in ("resnet20", VIT):  # no transformer block; 4 does not divide test_vit's heads
        try:
            tp.parallelize(model_of(architecture), mesh["tensor"], architecture)
        except FixresError as exc:
            said.append(str(exc))
    for ranks in (3, 0):
        try:
            tp.tensor_mesh(torch.device("cpu"), 4, ranks)
        except FixresError as exc:
            said.append(str(exc))
    if torch.distributed.get_rank() == 0:
        (folder / "refusals.json").write_text(json.dumps(said))


def run_sharded(folder) -> None:
    """FSDP2 x tensor parallelism (2-D) on 2 shard x 2 tensor ranks, as a run lays it out
    (:class:`~fixres_dist.distributed.tensor_fsdp_strategy.ShardedTensorSplit`): its clipped SGD steps on
    each shard rank's share, the weights gathered whole."""
    config = TrainerConfig(num_tasks=4, sharding="full", tensor_parallel=2, architecture=VIT)
    strategy = ShardedTensorSplit(config, layout.of(config), torch.device("cpu"), None, print, print)
    model, forward, _ = strategy.wrap(model_of(VIT), None, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    index, losses = layout.of(config).data_rank(torch.distributed.get_rank()), []
    for step in range(STEPS):
        images, labels = batch(step)
        loss = nn.functional.cross_entropy(forward(share(images, index, 2)), share(labels, index, 2))
        loss.backward()
        strategy.reduce_gradients()
        strategy.clip_grad_norm(list(model.parameters()), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = {k: v.tolist() for k, v in sharding.full_state_dicts(model, optimizer)["model"].items()}
    if torch.distributed.get_rank() == 0:
        (folder / "sharded-2x2.json").write_text(json.dumps({"weights": weights}))
    (folder / f"sharded-2x2-losses{torch.distributed.get_rank()}.json").write_text(json.dumps(losses))


def _ranks(rank: int, world: int, port: int, folder) -> None:
    torch.set_num_threads(1)
    collectives.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world, 120)
    for name in RUNS:
        run(name, folder)
    refusals(folder)
    run_sharded(folder)
    collectives.destroy_process_group()


@pytest.fixture(scope="module")
def tensor_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tensor_parallel")
    mp.start_processes(_ranks, args=(4, free_port(), folder), nprocs=4, start_method=start_method())
    return folder


@pytest.mark.numeric
@pytest.mark.parametrize("name", list(RUNS))
def test_a_split_model_steps_as_the_unsplit_one(tensor_runs, name):
    """The mean loss over the data-parallel groups is the unsplit step's, every rank of a tensor group
    has the same loss, and the weights gathered whole are the unsplit model's after the (clipped) steps:
    within rounding of the unsplit model's float32 steps, both measured against the same steps in
    float64 (:func:`numeric.assert_near_reference`)."""
    architecture, ranks, resumed = RUNS[name]
    recorded = json.loads((tensor_runs / f"{name}.json").read_text())
    losses = [json.loads((tensor_runs / f"{name}-losses{r}.json").read_text()) for r in range(4)]
    groups = [losses[g * ranks:(g + 1) * ranks] for g in range(4 // ranks)]
    assert all(group.count(group[0]) == ranks for group in groups)  # the ranks of a tensor group agree
    steps = range(STEPS + 1 if resumed else STEPS)
    baseline, model, _ = unsplit_steps(architecture, steps, clip=CLIP)
    reference, model64, _ = unsplit_steps(architecture, steps, clip=CLIP, dtype=torch.float64)
    first = STEPS if resumed else 0
    mean = [sum(group[0][i] for group in groups) / len(groups) for i in range(len(losses[0]))]
    assert_near_reference({"loss": mean}, {"loss": baseline[first:]}, {"loss": reference[first:]}, f"{name}: losses")
    blocks = 3 if architecture == TORCHVISION_VIT else 6
    assert recorded["split"] == [blocks, 0 if architecture == TORCHVISION_VIT else blocks]
    assert_near_reference({k: torch.tensor(v) for k, v in recorded["weights"].items()}, model.state_dict(),
                          model64.state_dict(), f"{name}: weights")


@pytest.mark.numeric
def test_a_split_and_sharded_model_steps_as_the_unsplit_one(tensor_runs):
    """FSDP2 x tensor parallelism on 2 shard x 2 tensor ranks: the mean loss over the shard ranks (each
    tensor group's ranks agreeing) and the weights gathered whole are the unsplit model's clipped steps',
    within rounding, both measured against float64 (:func:`numeric.assert_near_reference`)."""
    losses = [json.loads((tensor_runs / f"sharded-2x2-losses{r}.json").read_text()) for r in range(4)]
    assert losses[0] == losses[1] and losses[2] == losses[3]  # a tensor group's ranks: consecutive
    baseline, model, _ = unsplit_steps(VIT, range(STEPS), clip=CLIP)
    reference, model64, _ = unsplit_steps(VIT, range(STEPS), clip=CLIP, dtype=torch.float64)
    mean = [(a + b) / 2 for a, b in zip(losses[0], losses[2])]
    assert_near_reference({"loss": mean}, {"loss": baseline}, {"loss": reference}, "2-D: losses")
    weights = json.loads((tensor_runs / "sharded-2x2.json").read_text())["weights"]
    assert_near_reference({k: torch.tensor(v) for k, v in weights.items()}, model.state_dict(),
                          model64.state_dict(), "2-D: weights")


def test_what_cannot_be_split_is_refused(tensor_runs):
    no_block, heads, three, zero = json.loads((tensor_runs / "refusals.json").read_text())
    assert no_block == ("--tensor-parallel: resnet20 has no transformer block to split (tensor parallelism splits "
                        "ViT/DeiT blocks); train it with --sharding instead")
    assert heads == "--tensor-parallel 4: blocks.0 has 2 attention heads, not a multiple of 4"
    assert three == "--tensor-parallel 3 must divide the number of ranks (4)"
    assert zero == "--tensor-parallel 0 must divide the number of ranks (4)"


# ------------------------------------------------------------------ the scripts
@pytest.mark.numeric
def test_a_tensor_parallel_job_trains_as_ddp(split_jobs):
    """Same seed, same 16-image global batches: losses, learning rates, top-1 (30 images counted once,
    not once per rank of a tensor group) and the final weights, gathered whole into checkpoint.pth."""
    assert_same_run(split_jobs / "tp", split_jobs / "ddp", split_jobs / "ddp-other", ema=False)
    out = (split_jobs / "tp.out").read_text()
    assert "--tensor-parallel 2: 6 MLPs and 6 attentions (by heads) split over tensor groups of 2 ranks, 2 " \
           "data-parallel group(s)" in out
    assert "lr 0.00625 = 0.1 x 8 x 2 / 256" in out  # the linear scaling rule counts data-parallel ranks


@pytest.mark.numeric
def test_a_tensor_parallel_job_stopped_mid_epoch_resumes_unsplit(split_jobs, tiny_data, tmp_path):
    """Stopped after step 3 on 2 tensor groups of 2, resumed on 2 plain DDP ranks: it ends as the
    uninterrupted job (its checkpoint is the unsplit model's)."""
    stopped = job(tmp_path, tiny_data, "s", "--tensor-parallel", 2, world=4, fault="signal:rank=1:step=2")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    resumed = job(tmp_path, tiny_data, "s")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step 3" in resumed.stdout, resumed.stdout[-2000:]
    assert "resuming a 4-rank checkpoint (2 ranks per tensor group) on 2 ranks: the same 2 data-parallel rank(s), " \
           "batches and learning rate" \
        in resumed.stdout and "warning: resuming" not in resumed.stdout
    assert_same_run(tmp_path / "s", split_jobs / "ddp", split_jobs / "ddp-other", ema=False)


@pytest.mark.numeric
@pytest.mark.slow
def test_a_ddp_job_stopped_mid_epoch_resumes_tensor_parallel(split_jobs, tiny_data, tmp_path):
    """And back: stopped on 2 DDP ranks, resumed on 2 tensor groups of 2: the same end."""
    stopped = job(tmp_path, tiny_data, "s", fault="signal:rank=0:step=2")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    resumed = job(tmp_path, tiny_data, "s", "--tensor-parallel", 2, world=4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "s", split_jobs / "ddp", split_jobs / "ddp-other", ema=False)


SHARDED_SPLIT = ("--tensor-parallel", 2, "--sharding", "full")  # 2 shard x 2 tensor on 4 ranks (2-D)


@pytest.mark.numeric
def test_a_sharded_tensor_parallel_job_trains_as_ddp_and_resumes_under_ddp(split_jobs, tiny_data, tmp_path):
    """FSDP2 x tensor parallelism (2 shard x 2 tensor ranks), the same seed and 16-image global batches as
    the 2-rank DDP job: the same losses, top-1 and final weights (its checkpoint's shards, read whole);
    and stopped after step 3, resumed on 2 plain DDP ranks, the same end."""
    whole = job(tmp_path, tiny_data, "tf", *SHARDED_SPLIT, world=4)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "--tensor-parallel 2 x --sharding full: 6 MLPs split over tensor groups of 2 ranks (attention whole), " \
           "then 6 blocks and the root sharded over 4 ranks = 2 shard x 2 tensor" in whole.stdout
    assert_same_run(tmp_path / "tf", split_jobs / "ddp", split_jobs / "ddp-other", ema=False)
    stopped = job(tmp_path, tiny_data, "s", *SHARDED_SPLIT, world=4, fault="signal:rank=1:step=2")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    resumed = job(tmp_path, tiny_data, "s")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step 3" in resumed.stdout, resumed.stdout[-2000:]
    assert_same_run(tmp_path / "s", split_jobs / "ddp", split_jobs / "ddp-other", ema=False)


@pytest.mark.numeric
@pytest.mark.slow
def test_a_ddp_job_stopped_mid_epoch_resumes_sharded_and_tensor_parallel(split_jobs, tiny_data, tmp_path):
    """And back: stopped on 2 DDP ranks, resumed on 2 shard x 2 tensor ranks: the same end."""
    stopped = job(tmp_path, tiny_data, "s", fault="signal:rank=0:step=2")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    resumed = job(tmp_path, tiny_data, "s", *SHARDED_SPLIT, world=4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "s", split_jobs / "ddp", split_jobs / "ddp-other", ema=False)


@pytest.mark.numeric
@pytest.mark.slow
def test_fixres_finetune_of_a_tensor_parallel_model(split_jobs, tiny_data, tmp_path):
    """main_finetune.py on the DDP job's weights at 48 px: split over 2 tensor groups of 2, the same
    finetune as on 2 DDP ranks (head and last norm trained, the rest frozen and split)."""
    for name, extra, world in (("ft-ddp", (), 2), ("ft-ddp-other", ("--channels-last",), 2),
                               ("ft-tp", ("--tensor-parallel", 2), 4)):
        result = job(tmp_path, tiny_data, name, "--weight-path", split_jobs / "ddp" / CHECKPOINT_FILE,
                     "--input-size", 48, "--epochs", 1, *extra, world=world, script="finetune")
        assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path / "ft-tp", tmp_path / "ft-ddp", tmp_path / "ft-ddp-other", ema=False)


@pytest.mark.parametrize("args, message", [
    (("--num-tasks", 4, "--tensor-parallel", 3), "--tensor-parallel 3 must divide the number of ranks (4)"),
    (("--num-tasks", 2, "--tensor-parallel", 2, "--architecture", "resnet20"),
     "--tensor-parallel: resnet20 has no transformer block to split"),
    (("--num-tasks", 2, "--tensor-parallel", 2, "--model-ema"), "--tensor-parallel 2 does not go with --model-ema"),
    (("--num-tasks", 4, "--tensor-parallel", 2, "--sharding", "full", "--model-ema"),
     "--tensor-parallel 2 does not go with --model-ema"),
    (("--num-tasks", 2, "--tensor-parallel", 2, "--architecture", "vit_b_16", "--input-size", 224),
     "--tensor-parallel cannot run torchvision's vit_b_16"),
])
def test_bad_tensor_parallel_input_is_one_line_before_any_rank_starts(capsys, tiny_data, tmp_path, args, message):
    assert_refused_before_start(capsys, tiny_data, tmp_path, args, message)


@pytest.mark.slow
def test_the_tensor_parallel_command_shown(tmp_path):
    """docs/sharding.md's command: 4 ranks, 2 tensor groups of 2, the embedded data for an epoch (4,000
    training images), each of the 1,000 validation images counted once."""
    command = shown.command("python main_scratch.py --num-tasks 4 --tensor-parallel 2")
    out = run_shown_split_command(command, "vit-tp", tmp_path)
    assert "--tensor-parallel 2: 6 MLPs and 6 attentions (by heads) split over tensor groups of 2 ranks, 2 " \
           "data-parallel group(s); 176,714 of 300,746 parameters on this rank" in out
