"""How the ranks hold the model: DDP (a full replica each), full shard (FSDP2) or hybrid shard
(HSDP), and activation checkpointing; the full-state checkpoints of a sharded model.

* ``ddp``: ``DistributedDataParallel`` (:class:`~fixres_dist.distributed.ddp_strategy.Replicated` wraps).
* ``full``: ``torch.distributed.fsdp.fully_shard`` per residual block
  (:func:`fixres_dist.distributed.blocks.blocks`), then the root, on a 1-D mesh of all ranks: each rank
  keeps 1/world of the parameters, gradients and optimizer state and gathers a block's parameters
  only around its forward and backward (Zhao et al., "PyTorch FSDP", VLDB 2023; FSDP2 is the
  per-parameter DTensor version). A model of no known family is sharded at the root only (one unit:
  the whole model is gathered at once), with a warning.
* ``hybrid``: the same on a 2-D mesh (``replicate`` x ``shard``): shard within a group of
  ``--shard-group-size`` ranks (default: the ranks on one node), replicate across the groups (HSDP:
  parameters are gathered over the fast intra-node links only; gradients are averaged over all).
* ``reshard_after_forward=False`` keeps each block's gathered parameters from the forward to the
  backward (one all-gather less per block per step, more memory); ``cpu_offload`` keeps the
  sharded parameters, gradients and optimizer step on the CPU (``CPUOffloadPolicy``); ``--amp``
  becomes FSDP2's ``MixedPrecisionPolicy`` (parameters gathered in bf16/fp16, gradients reduced in
  float32) under the same autocast as DDP.

Gradients are averaged over all ranks as DDP averages them, so the same loss scaling gives the same
steps: at the same seed a sharded run equals the DDP run up to float rounding.

Activation checkpointing (:func:`checkpoint_activations`) runs each block's forward under
``torch.utils.checkpoint.checkpoint`` (non-reentrant): only the block's input is kept for the
backward, its inside is recomputed (Chen et al., "Training Deep Nets with Sublinear Memory Cost",
arXiv 1604.06174). It leaves parameter names unchanged, so checkpoints are the same with or without.

Checkpoints: a sharded run writes each rank's shards (:mod:`fixres_dist.distributed.checkpoint_shards`);
a one-file checkpoint (DDP's) goes into a sharded model with :func:`load_state_dict` and
:func:`load_optimizer_state_dict`, which take the full tensors in the layout of an unsharded model and
optimizer. So a DDP checkpoint resumes sharded and a sharded one under DDP, at any world size.
"""
from __future__ import annotations

import contextlib
import socket
import warnings
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fixres_dist.config import TrainerConfig
from fixres_dist.distributed import layout
from fixres_dist.distributed.blocks import blocks
from fixres_dist.errors import FixresError

_FULL_IN = StateDictOptions(full_state_dict=True)  # every rank holds the full tensors; each keeps its shard


def checkpoint_activations(model: nn.Module) -> int:
    """Run each of ``model``'s blocks under activation checkpointing; returns how many (0: no known
    blocks, nothing changed). Do it before sharding."""
    found = blocks(model)
    for _, block in found:
        block.forward = _checkpointed(block.forward, _norm_statistics(block))
    return len(found)


BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _norm_statistics(block: nn.Module) -> list[torch.Tensor]:
    """The running statistics of ``block``'s BatchNorms (mean, variance, batches counted)."""
    return [buffer for module in block.modules() if isinstance(module, BATCH_NORMS)
            for buffer in module.buffers(recurse=False)]


def _checkpointed(forward, statistics: list[torch.Tensor]):
    """``forward`` under non-reentrant activation checkpointing. Its recomputation in the backward runs
    in train mode too, and would update the BatchNorms' running ``statistics`` a second time per step:
    they are put back as the first forward left them."""
    def run(*args, **kwargs):
        calls = []

        def once(*inner, **named):
            calls.append(None)
            if len(calls) == 1 or not statistics:
                return forward(*inner, **named)
            with torch.no_grad():
                kept = [buffer.clone() for buffer in statistics]
            try:  # the recomputation may stop early (torch's checkpoint, once it has what it needs): finally
                return forward(*inner, **named)
            finally:
                with torch.no_grad():
                    for buffer, value in zip(statistics, kept):
                        buffer.copy_(value)
        return checkpoint(once, *args, use_reentrant=False, **kwargs)
    return run


def device_mesh(config: TrainerConfig, device: torch.device) -> DeviceMesh:
    """The ranks' mesh for ``config.sharding``, a sub-mesh of the job's one mesh (:func:`job_mesh`): 1-D
    ``shard`` (``full``) or ``data`` (the replicate groups) x ``shard`` (``hybrid``, shard groups of
    ``--shard-group-size`` ranks, else of the ranks on one node). A collective: every rank calls it.
    Raises :class:`FixresError` when the world size is not a multiple of the group size, or a node's ranks
    are not consecutive."""
    return job_mesh(config, device)[shard_axes(config)]


def job_mesh(config: TrainerConfig, device: torch.device) -> DeviceMesh:
    """The job's one mesh (:meth:`fixres_dist.distributed.layout.Layout.mesh`, axes ``data``, ``shard``,
    ``stage``, ``tensor``), a hybrid shard group not given being a node's ranks. A collective; raises as
    :func:`device_mesh`."""
    by_node = config.sharding == "hybrid" and not config.shard_group_size
    per_node = _ranks_per_node(config.num_tasks) if by_node else None
    return layout.of(config, per_node).mesh(device.type)


def shard_axes(config: TrainerConfig) -> tuple[str, ...]:
    """The axes of the job's mesh that ``config.sharding`` (``full``, ``hybrid``) shards over."""
    return ("shard",) if config.sharding == "full" else ("data", "shard")


def _ranks_per_node(world: int) -> int:
    """The ranks on each node, from every rank's host name; the ranks of a node must be consecutive."""
    hosts: list[str] = [""] * world
    dist.all_gather_object(hosts, socket.gethostname())
    per_node = hosts.count(hosts[0])
    groups = [hosts[i:i + per_node] for i in range(0, world, per_node)]
    if any(len(set(g)) != 1 or len(g) != per_node for g in groups) or len({g[0] for g in groups}) != len(groups):
        raise FixresError("--sharding hybrid needs the same number of consecutive ranks on every node "
                          f"(hosts by rank: {', '.join(hosts)}); give --shard-group-size")
    return per_node


def shard(modules: list[nn.Module], mesh: DeviceMesh, config: TrainerConfig, amp: torch.dtype | None,
          states: list[dict[str, torch.Tensor]] | None = None, values: bool = True) -> int:
    """FSDP2 on each of ``modules`` alike (the model, and the EMA's copy made before: a sharded module
    cannot be copied): ``fully_shard`` per block, then the root; then rank 0's weights loaded into every
    rank's shards (:func:`load_from_rank0`). ``modules`` may be on the meta device on every rank but 0
    (:attr:`~fixres_dist.distributed.strategy.Strategy.builds_from_rank0`). ``amp``: the ``--amp`` dtype or
    None; ``states``: :func:`rank0_states` of ``modules`` taken before they were split by tensors (default:
    taken here); ``values``: False for a model of shapes only (the memory estimate's): nothing loaded.
    Returns the number of blocks per module (0: root only)."""
    options = dict(mesh=mesh, reshard_after_forward=config.reshard_after_forward,
                   offload_policy=CPUOffloadPolicy() if config.cpu_offload else None)
    if amp is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32)
    if options["offload_policy"] is None:
        del options["offload_policy"]
    states = rank0_states(modules) if states is None and values else states or [{}] * len(modules)
    count = 0
    for module, state in zip(modules, states):
        if config.cpu_offload and values:  # the shards land on the CPU, where NCCL cannot broadcast: rank 0's first
            start_from_rank0(module)
        found = blocks(module)
        for _, block in found:
            fully_shard(block, **options)
        fully_shard(module, **options)
        if values and not config.cpu_offload:
            load_from_rank0(module, state)
        count = len(found)
    return count


def rank0_states(modules: list[nn.Module]) -> list[dict[str, torch.Tensor]]:
    """On rank 0, each of ``modules``' state_dict (its full tensors, kept alive until
    :func:`load_from_rank0` has sent them); on the other ranks an empty dict each (their modules may be
    on the meta device). Before sharding or splitting."""
    return [module.state_dict() if dist.get_rank() == 0 else {} for module in modules]


@torch.no_grad()
def load_from_rank0(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Rank 0's full tensors ``state`` (:func:`rank0_states`) into every rank's part of ``module`` (sharded,
    split by tensors, or both), one tensor at a time (``set_model_state_dict(broadcast_from_rank0=True)``):
    a rank other than 0 holds at most one full tensor at once, never the whole model, and its ``module``
    may be on the meta device (its parts are then allocated on the process group's device). Buffers outside
    the state_dict (non-persistent) are broadcast from rank 0 too. A collective: every rank calls it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on the meta device and the default device
        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    unsaved = set(dict(module.named_buffers())) - set(module.state_dict())
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    for name in sorted(unsaved):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        buffer = owner.get_buffer(leaf)
        if buffer.is_meta:
            buffer = torch.empty_like(buffer, device=device)
            owner.register_buffer(leaf, buffer, persistent=False)
        dist.broadcast(buffer, src=0)


@torch.no_grad()
def start_from_rank0(module: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank, as DDP broadcasts them when it wraps (each rank
    then keeps its part of the same model, whatever each initialised). Before splitting (tensors, stages)."""
    for tensor in module.state_dict().values():
        dist.broadcast(tensor, src=0)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 module (its parameters are DTensor shards)."""
    return isinstance(module, FSDPModule)


def holds_dtensors(module: nn.Module) -> bool:
    """Whether some of ``module``'s parameters are DTensors: sharded (FSDP2) or split (tensor parallelism)."""
    return is_sharded(module) or any(isinstance(p, DTensor) for p in module.parameters())


def full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """All ranks (a collective): ``{"model": ..., "optimizer": ...}`` of a model with DTensor parameters,
    gathered whole, in the layout of an unsharded model and optimizer (the optimizer's state keyed by
    parameter number, as ``optimizer.state_dict()``): what a one-file checkpoint holds, and what
    :func:`load_state_dict` and :func:`load_optimizer_state_dict` take back."""
    named = get_optimizer_state_dict(model, optimizer, options=_FULL_IN)
    names = {param: name for name, param in model.named_parameters()}
    number = {names[param]: index for index, param in
              enumerate(param for group in optimizer.param_groups for param in group["params"])}
    return {"model": get_model_state_dict(model, options=_FULL_IN),
            "optimizer": {"state": {number[name]: value for name, value in named["state"].items()},
                          "param_groups": [{**group, "params": [number[name] for name in group["params"]]}
                                           for group in named["param_groups"]]}}


def load_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full ``state`` (every rank holds it) into ``module``; a sharded or split module keeps its part."""
    if not holds_dtensors(module):
        module.load_state_dict(state)
        return
    set_model_state_dict(module, state, options=_FULL_IN)


def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load an unsharded optimizer's ``state`` (as :func:`optimizer_state_dict` writes it) into
    ``optimizer`` of ``model``, sharded, split or neither."""
    if not holds_dtensors(model):
        optimizer.load_state_dict(state)
        return
    names = {param: name for name, param in model.named_parameters()}
    order = [names[param] for group in optimizer.param_groups for param in group["params"]]
    if len(order) != sum(len(group["params"]) for group in state["param_groups"]):
        raise FixresError(f"the checkpoint's optimizer has {sum(len(g['params']) for g in state['param_groups'])} "
                          f"parameters, this run's {len(order)}")
    named = {"state": {order[number]: value for number, value in state["state"].items()},
             "param_groups": [{**group, "params": [order[number] for number in group["params"]]}
                              for group in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, named, options=_FULL_IN)


@torch.no_grad()
def load_buffers(module: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Copy ``buffers`` (name -> tensor: BatchNorm statistics) into ``module``'s, sharded or not
    (buffers are never sharded); those it does not hold are left (a pipeline rank holds its stages'
    of a whole model's, e.g. the average over the ranks of a checkpoint written on another layout)."""
    own = dict(module.named_buffers())
    for name, value in buffers.items():
        if name in own:
            own[name].copy_(value)


@contextlib.contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients without reducing them (a sharded model's ``no_sync``: the last
    micro-batch, outside this context, reduces the sum)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)




def forwards_to_match(model: nn.Module, sampler) -> int:
    """How many forwards every rank runs to evaluate a sharded ``model`` with an evaluation
    ``sampler`` (:class:`~fixres_dist.data.samplers.ExactBatchSampler`): its number of global batches
    (each forward gathers parameters with every rank, so a rank with fewer batches runs blank ones,
    :func:`blank_forwards`); 0 for a plain model (no rank waits for another)."""
    return len(sampler.global_batch_sizes()) if is_sharded(model) else 0


@torch.no_grad()
def blank_forwards(model: nn.Module, count: int, size: int, device: torch.device, channels_last: bool) -> None:
    """``count`` forwards of ``model`` on one blank ``size`` x ``size`` image, outputs discarded."""
    blank = torch.zeros(1, 3, size, size, device=device)
    if channels_last:
        blank = blank.contiguous(memory_format=torch.channels_last)
    for _ in range(count):
        model(blank)
