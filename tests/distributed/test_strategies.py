"""The strategies (fixres_dist.distributed.strategy and its kinds): each answers the whole interface,
the layout picks one (no collective: checked without a process group), the Network has no mode branch
and delegates every layout-specific act, and the step takes at most 10 parameters."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from fixres_dist.config import TrainerConfig
from fixres_dist.distributed import layout, strategies
from fixres_dist.distributed.ddp_strategy import Replicated
from fixres_dist.distributed.fsdp_strategy import FullySharded
from fixres_dist.distributed.pipeline_strategy import PipelineSplit
from fixres_dist.distributed.strategy import INTERFACE, SingleProcess, Strategy
from fixres_dist.distributed.tensor_fsdp_strategy import ShardedTensorSplit
from fixres_dist.distributed.tensor_strategy import TensorSplit
from fixres_dist.training import engine

ROOT = Path(__file__).resolve().parents[2]
NETWORK = ROOT / "fixres_dist" / "training" / "network.py"
NETWORK_MAX_LINES = 150  # issue 42's bound
STEP_MAX_PARAMETERS = 10
# What a mode branch in the Network would read: a layout's or configuration's parallel kind (attributes),
# or a kind's own code (names, modules imported).
KIND_ATTRIBUTES = {"tensor_parallel", "tensor_enabled", "pipeline_enabled", "pipeline_stages", "shard_enabled",
                   "split", "sharding", "num_tasks", "pipeline", "tensor_mesh", "sharded", "tensor", "whole_groups"}
KIND_CODE = {"DistributedDataParallel", "tensor_parallel", "pipeline", "pipeline_state", "FullySharded",
             "Replicated", "TensorSplit", "PipelineSplit", "SingleProcess"}


@pytest.mark.parametrize("kind", strategies.KINDS)
def test_every_strategy_answers_the_whole_interface(kind):
    assert issubclass(kind, Strategy) and not inspect.isabstract(kind)
    assert all(hasattr(kind, name) for name in INTERFACE)
    assert "wrap" in vars(kind)  # its own wrap, not the abstract one


def test_the_interface_is_the_base_class_s_public_face():
    public = {name for name in vars(Strategy) if not name.startswith("_")}
    assert public == set(INTERFACE)


def _chosen(**fields) -> Strategy:
    config = TrainerConfig(**fields)
    return strategies.strategy_for(layout.of(config), config, torch.device("cpu"), amp=None,
                                   parameter_groups=lambda model: [], log=print, warn=print)


@pytest.mark.parametrize("fields, kind", [
    ({}, SingleProcess), ({"sharding": "full"}, SingleProcess), ({"num_tasks": 4}, Replicated),
    ({"num_tasks": 4, "sharding": "full"}, FullySharded), ({"num_tasks": 4, "sharding": "hybrid"}, FullySharded),
    ({"num_tasks": 4, "tensor_parallel": 2}, TensorSplit), ({"num_tasks": 4, "pipeline_stages": 2}, PipelineSplit),
    ({"num_tasks": 4, "tensor_parallel": 2, "sharding": "full"}, ShardedTensorSplit),
    ({"num_tasks": 2, "tensor_parallel": 2, "sharding": "full"}, TensorSplit)])  # a shard group of 1: no FSDP
def test_the_layout_picks_one_strategy(fields, kind):
    chosen = _chosen(**fields)
    assert type(chosen) is kind
    assert chosen.lays_out_before_evaluating == (kind not in (SingleProcess, Replicated))
    assert chosen.writes_shards == (kind in (FullySharded, ShardedTensorSplit))
    assert chosen.schedules == (kind is PipelineSplit)


def test_one_process_with_a_sharding_asked_for_says_so_when_it_wraps():
    said = []
    config = TrainerConfig(sharding="full")
    chosen = strategies.strategy_for(layout.of(config), config, torch.device("cpu"), amp=None,
                                     parameter_groups=lambda model: [], log=said.append, warn=said.append)
    assert not said
    model = torch.nn.Linear(2, 2)
    assert chosen.wrap(model, None, 8) == (model, model, None)
    assert said == ["--sharding full on 1 rank: nothing to shard; the model trains whole"]


def kind_reads(source: str) -> list[str]:
    """``line: name`` for each place ``source`` reads a parallel kind or names a kind's code."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in KIND_ATTRIBUTES:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in KIND_CODE:
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.ImportFrom | ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[-1] in KIND_CODE]
    return found


def test_the_network_has_no_mode_branch_and_fits_its_bound():
    text = NETWORK.read_text()
    assert len(text.splitlines()) <= NETWORK_MAX_LINES
    assert not kind_reads(text), f"network.py reads a parallel kind: {kind_reads(text)}"
    assert kind_reads("if self.layout.tensor_enabled:\n    pass\nif cfg.sharding != 'ddp':\n    pass\n") == \
        ["1: .tensor_enabled", "3: .sharding"]  # the check sees a branch


def test_the_step_takes_at_most_ten_parameters():
    assert len(inspect.signature(engine.train_step).parameters) <= STEP_MAX_PARAMETERS
    assert not hasattr(engine, "pipeline_train_step")  # one step for every strategy


def test_a_sharded_rank_other_than_0_builds_no_whole_model(tmp_path):
    """``--sharding full`` (and 2-D): every rank but 0 builds on the meta device (no bytes) and only checks
    the weight file against it, reading none of its values; rank 0 builds whole. The shards then come from
    rank 0's tensors (sharding.load_from_rank0), which tests/distributed/test_sharding.py's runs show equal
    to DDP's. DDP builds whole everywhere (each rank's replica)."""
    from fixres_dist.models import architectures, weights
    from fixres_dist.training.network import Network

    path = tmp_path / "w.pth"
    torch.save(architectures.build_model("resnet20", 10).state_dict(), path)
    classes = [f"class {i}" for i in range(10)]
    for sharding, rank, on_meta in (("full", 0, False), ("full", 1, True), ("ddp", 1, False)):
        config = TrainerConfig(mode="finetune", architecture="resnet20", num_tasks=2, global_rank=rank,
                               sharding=sharding, weight_path=str(path))
        found = weights.read_weight_file(path, check_values=rank == 0)
        network = Network(config, classes, 32, found, torch.device("cpu"), print, print)
        assert {p.is_meta for p in network.model.parameters()} == {on_meta}, (sharding, rank)
        assert network.strategy.builds_from_rank0 == (sharding == "full")
