"""Tensor parallelism: each ViT block's matrices split over the ranks of a ``tensor`` mesh dimension
(Shoeybi et al., "Megatron-LM", arXiv 1909.08053, section 3), with ``torch.distributed.tensor.parallel``.

In each transformer block, on ``T`` ranks:

* the MLP's first linear layer is split by output features (``ColwiseParallel``: each rank computes
  1/T of the hidden units), the second by input features (``RowwiseParallel``: each rank's partial
  product, summed by one all-reduce in the forward);
* timm's attention (DeiT's too) is split by heads: each rank holds the query, key and value rows of
  H/T heads of the fused ``qkv`` layer (a ``_StridedShard`` of its weight: the rows of each of q, k
  and v split in T, so that the full tensor keeps the whole model's layout) and computes those
  heads; the output projection is split by input features (``RowwiseParallel``). torchvision's ViT
  computes its attention in ``nn.MultiheadAttention``, whose packed projection and head count cannot
  be split from outside: there the attention stays whole (replicated) and only the MLP is split.

Activations between blocks, norms, the embeddings and the head stay whole on every rank, so the
gradients of those replicated parameters are the same on every rank of the group without a
collective. Inputs of a split layer are marked replicated, which makes the backward all-reduce
their gradients. The split parameters are ``DTensor``s: ``torch.distributed.checkpoint``'s state-dict
functions give their full tensors (or shards) under the whole model's names, so checkpoints are the
unsplit model's (:func:`fixres_dist.distributed.sharding.full_state_dicts` gathers them; a full state
dict goes back in with ``torch.distributed.checkpoint.state_dict.set_model_state_dict``).

Composed with data parallelism on a ``data`` x ``tensor`` mesh (:func:`tensor_mesh`: the ranks of one
group consecutive, on one node): every rank of a tensor group is given the same images, and after
the backward :func:`average_gradients` averages each gradient (a split one's local shard) over the
ranks of the ``data`` dimension, which hold the same shards: what DDP does, without its bucketing
and overlap. Neither DDP nor FSDP2 takes these parameters as they are: DDP's TP path replaces the
parameters and loses them from the state dict, and FSDP2 treats the heads' strided split of ``qkv``
as a plain one, so the full tensors it gathers are permuted. :func:`clip_grad_norm` clips the norm of
the whole gradient, split and replicated parameters together.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from fixres_dist.distributed.blocks import blocks
from fixres_dist.distributed.layout import Layout
from fixres_dist.errors import FixresError


def _by_heads(module: nn.Linear, mesh: DeviceMesh) -> None:
    """``module`` (the fused q, k, v projection) split by heads: each of its three row blocks split
    over ``mesh``; its input marked replicated, its output this rank's heads as a plain tensor."""
    def partition(name, layer, device_mesh):
        for key, parameter in list(layer.named_parameters(recurse=False)):
            layer.register_parameter(key, nn.Parameter(distribute_tensor(  # frozen stays frozen (a finetune)
                parameter, device_mesh, [_StridedShard(0, split_factor=3)]), requires_grad=parameter.requires_grad))

    def replicated_input(layer, inputs, device_mesh):
        return (DTensor.from_local(inputs[0], device_mesh, [Replicate()], run_check=False), *inputs[1:])

    def local_output(layer, output, device_mesh):
        return output.to_local()

    distribute_module(module, mesh, partition, replicated_input, local_output)


def _timm_attention(block: nn.Module) -> nn.Module | None:
    """``block``'s attention when it is timm's (a fused ``qkv`` linear layer), else None."""
    attention = getattr(block, "attn", None)
    return attention if isinstance(getattr(attention, "qkv", None), nn.Linear) else None


def _check_heads(attention: nn.Module, ranks: int, where: str) -> None:
    if not isinstance(getattr(attention, "norm", None), nn.Identity) or getattr(attention, "gate", None) is not None:
        raise FixresError(f"--tensor-parallel: {where}'s attention normalises or gates across its heads; it cannot "
                          "be split by heads")
    if attention.num_heads % ranks:
        raise FixresError(f"--tensor-parallel {ranks}: {where} has {attention.num_heads} attention heads, not a "
                          f"multiple of {ranks}")


def _split_heads(attention: nn.Module, mesh: DeviceMesh) -> None:
    ranks = mesh.size()
    _by_heads(attention.qkv, mesh)
    parallelize_module(attention, mesh, {"proj": RowwiseParallel()})
    attention.num_heads //= ranks
    attention.attn_dim //= ranks


def _mlp_layers(block: nn.Module) -> tuple[str, str] | None:
    """The names (in ``block``) of its MLP's two linear layers: timm's ``mlp.fc1``/``mlp.fc2`` (with no
    norm between them), torchvision's ``mlp.0``/``mlp.3``; None when it has no such MLP."""
    mlp = getattr(block, "mlp", None)
    if mlp is None:
        return None
    if isinstance(getattr(mlp, "fc1", None), nn.Linear) and isinstance(getattr(mlp, "fc2", None), nn.Linear) \
            and isinstance(getattr(mlp, "norm", nn.Identity()), nn.Identity):
        return "mlp.fc1", "mlp.fc2"
    if isinstance(mlp, nn.Sequential) and len(mlp) == 5 and isinstance(mlp[0], nn.Linear) \
            and isinstance(mlp[3], nn.Linear):
        return "mlp.0", "mlp.3"
    return None


def splittable(model: nn.Module, ranks: int, architecture: str = "this model",
               heads: bool = True) -> list[tuple[str, nn.Module, tuple]]:
    """``model``'s transformer blocks that :func:`parallelize` splits over ``ranks`` ranks, as ``(name,
    block, (first, second MLP layer names))``; reads shapes only (a model on the ``meta`` device will
    do: the preflight's check). Raises :class:`FixresError` naming ``architecture`` when it has no
    transformer block with an MLP of two linear layers (ResNets, ConvNeXt: nothing to split here), or
    a hidden width (with ``heads``, a head count) that ``ranks`` does not divide."""
    found = []
    for name, block in blocks(model):
        layers = _mlp_layers(block)
        if layers is None:
            continue
        hidden = block.get_submodule(layers[0]).out_features
        if hidden % ranks:
            raise FixresError(f"--tensor-parallel {ranks}: {name}'s MLP has {hidden} hidden units, not a multiple of "
                              f"{ranks}")
        if heads and _timm_attention(block) is not None:
            _check_heads(_timm_attention(block), ranks, name)
        found.append((name, block, layers))
    if not found:
        raise FixresError(f"--tensor-parallel: {architecture} has no transformer block to split (tensor parallelism "
                          "splits ViT/DeiT blocks); train it with --sharding instead")
    return found


def parallelize(model: nn.Module, mesh: DeviceMesh, architecture: str = "this model",
                heads: bool = True) -> tuple[int, int]:
    """Split ``model``'s transformer blocks over ``mesh`` (1-D: the ``tensor`` dimension), in place;
    returns ``(MLPs split, attentions split)``. ``heads``: timm's attentions split by heads too (False:
    kept whole, as FSDP2 on top needs: it would gather the heads' strided ``qkv`` permuted). Every rank
    of ``mesh`` must then be given the same images. Raises :class:`FixresError` as :func:`splittable`
    (before changing anything)."""
    found, attentions = splittable(model, mesh.size(), architecture, heads), 0
    for _, block, (first, second) in found:
        parallelize_module(block, mesh, {first: ColwiseParallel(), second: RowwiseParallel()})
        if heads and _timm_attention(block) is not None:
            _split_heads(_timm_attention(block), mesh)
            attentions += 1
    return len(found), attentions


def local_parameters(model: nn.Module) -> int:
    """How many of ``model``'s parameter elements this rank holds (a split one: its shard)."""
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())



def tensor_mesh(device: torch.device, world_size: int, ranks: int) -> DeviceMesh:
    """The ``data`` x ``tensor`` mesh of ``world_size`` ranks in groups of ``ranks`` consecutive ones, a
    sub-mesh of the job's one mesh (:meth:`fixres_dist.distributed.layout.Layout.mesh`; a collective: every
    rank calls it). Raises :class:`FixresError` unless ``ranks`` divides the world size."""
    return Layout.of_world(world_size, tensor=ranks).mesh(device.type)["data", "tensor"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def average_gradients(model: nn.Module, mesh: DeviceMesh) -> None:
    """Average ``model``'s gradients over ``mesh``'s ``data`` dimension, in place (after the backward,
    before the optimizer step; nothing with one data-parallel group). All-reduces are started
    together and then waited for."""
    if mesh.size(0) == 1:
        return
    group, count = mesh.get_group("data"), mesh.size(0)
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    for handle in [dist.all_reduce(grad, group=group, async_op=True) for grad in grads]:
        handle.wait()
    for grad in grads:
        grad.div_(count)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale ``model``'s gradients so that the L2 norm of all of them together is at most ``max_norm``
    (``torch.nn.utils.clip_grad_norm_``'s rule); returns that norm before clipping (a 0-dim tensor). The
    split parameters' norms are summed over their mesh (one group per mesh: the tensor group's, and
    under FSDP2 also the shard mesh's and the 2-D one); the replicated ones count once."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    by_mesh: dict = {None: []}  # the plain (replicated) parameters first, then each mesh's, in model order
    for parameter in parameters:
        by_mesh.setdefault(parameter.grad.device_mesh if isinstance(parameter.grad, DTensor) else None,
                           []).append(parameter)
    squares = torch.zeros((), device=parameters[0].grad.device if parameters else None)
    for mesh, group in by_mesh.items():
        if group:
            norm = torch.nn.utils.get_total_norm([p.grad for p in group])
            squares = squares + (norm if mesh is None else norm.full_tensor()) ** 2
    total = squares.sqrt()
    for group in by_mesh.values():
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=False)
    return total

