"""Tensor parallelism (fixres_dist.distributed.tensor_parallel) on 4 real gloo ranks, one start:
a timm ViT split by heads and MLP units over 2 ranks x 2 data-parallel groups, a torchvision ViT's
MLPs over 4 ranks, each equal to the unsplit model's clipped SGD steps; the unsplit model's
weights resumed split; what cannot be split, refused."""
from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from conftest import free_port
from fixres_dist.distributed import collectives
from fixres_dist.distributed import tensor_parallel as tp
from fixres_dist.entry.launch import start_method
from fixres_dist.errors import FixresError
from split_models import LR, MOMENTUM, TORCHVISION_VIT, VIT, batch, model_of, share, unsplit_steps

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
    weights = {k: v.tolist() for k, v in tp.full_state_dict(model).items()}
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


def _ranks(rank: int, world: int, port: int, folder) -> None:
    torch.set_num_threads(1)
    collectives.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world, 120)
    for name in RUNS:
        run(name, folder)
    refusals(folder)
    collectives.destroy_process_group()


@pytest.fixture(scope="module")
def tensor_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tensor_parallel")
    mp.start_processes(_ranks, args=(4, free_port(), folder), nprocs=4, start_method=start_method())
    return folder


@pytest.mark.parametrize("name", list(RUNS))
def test_a_split_model_steps_as_the_unsplit_one(tensor_runs, name):
    """The mean loss over the data-parallel groups is the unsplit step's, every rank of a tensor group
    has the same loss, and the weights gathered whole are the unsplit model's after the (clipped) steps."""
    architecture, ranks, resumed = RUNS[name]
    recorded = json.loads((tensor_runs / f"{name}.json").read_text())
    losses = [json.loads((tensor_runs / f"{name}-losses{r}.json").read_text()) for r in range(4)]
    groups = [losses[g * ranks:(g + 1) * ranks] for g in range(4 // ranks)]
    assert all(group.count(group[0]) == ranks for group in groups)  # the ranks of a tensor group agree
    reference, model, _ = unsplit_steps(architecture, range(STEPS + 1 if resumed else STEPS), clip=CLIP)
    mean = [sum(group[0][i] for group in groups) / len(groups) for i in range(len(losses[0]))]
    assert mean == pytest.approx(reference[STEPS:] if resumed else reference, rel=1e-5)
    blocks = 3 if architecture == TORCHVISION_VIT else 6
    assert recorded["split"] == [blocks, 0 if architecture == TORCHVISION_VIT else blocks]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(torch.tensor(recorded["weights"][key]), value, rtol=1e-5, atol=1e-6, msg=key)


def test_what_cannot_be_split_is_refused(tensor_runs):
    no_block, heads, three, zero = json.loads((tensor_runs / "refusals.json").read_text())
    assert no_block.startswith("--tensor-parallel: resnet20 has no transformer block to split")
    assert heads == "--tensor-parallel 4: blocks.0 has 2 attention heads, not a multiple of 4"
    assert three == "--tensor-parallel 3 must divide the number of ranks (4)"
    assert zero == "--tensor-parallel 0 must divide the number of ranks (4)"
