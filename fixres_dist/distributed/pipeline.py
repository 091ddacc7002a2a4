"""Pipeline parallelism: one classifier cut into stages, one (or, interleaved, several) per rank,
micro-batches kept in flight by a schedule, composed with data parallelism on a 2-D mesh.

A model of a known family is first read as a sequence of *pieces* (:func:`pieces`): its stem (the
patch embedding with the class token and position embeddings of a ViT, the first convolution of a
ResNet), each residual block (:func:`fixres_dist.models.blocks.blocks`) and its head (the last norm
and the classifier). A stage is a contiguous run of pieces (:class:`Stage`); it holds their modules
and parameters under the names they have in the whole model, so that a stage's ``state_dict`` is a
part of the whole model's, and a checkpoint written by the stages (``torch.distributed.checkpoint``)
loads into the whole model, or into another split, unchanged.

The split (:func:`balanced_split`) gives each stage about the same forward FLOPs (counted once with
``torch.utils.flop_counter.FlopCounterMode`` on one image at the training resolution: every rank
counts the same, where timings would differ from rank to rank and the ranks must agree), unless
the caller gives the first piece of each stage. Schedules are ``torch.distributed.pipelining``'s:
GPipe (Huang et al., NeurIPS 2019: all forwards, then all backwards), 1F1B (Narayanan et al.,
PipeDream, SOSP 2019: one forward, one backward in the steady state, fewer activations kept) and
interleaved 1F1B (Narayanan et al., SC 2021: ``virtual`` stages per rank, a smaller bubble).

The ranks form a ``data`` x ``stage`` mesh: global rank = data index x stages + stage index, so
the stages of one pipeline are consecutive ranks (on one node, where they exchange activations);
each stage is wrapped in ``DistributedDataParallel`` over the ranks holding the same stage. The
loss of each micro-batch is its mean cross-entropy and the schedule averages the micro-batches'
gradients, DDP the data-parallel ranks': one step equals the unsplit model's on the whole batch.
Tensors crossing a stage boundary are made contiguous (gloo's send and receive refuse others, and
torchvision's attention returns a non-contiguous output).
"""
from __future__ import annotations

from typing import Callable

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.nn.parallel import DistributedDataParallel
from torch.utils.flop_counter import FlopCounterMode

from fixres_dist.errors import FixresError
from fixres_dist.models.blocks import blocks

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


@attrs.frozen
class Piece:
    """A part of a classifier that a stage boundary cannot cut: ``name`` (in messages), ``owns`` (the
    qualified names, in the whole model, of the modules and parameters it runs) and ``run`` (its
    forward: the previous piece's output, or the (B, 3, H, W) float images, to its own output)."""

    name: str
    owns: tuple[str, ...]
    run: Callable[[torch.Tensor], torch.Tensor]


def _present(model: nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
    """The names among ``names`` that ``model`` has (a timm ViT without class token has no ``cls_token``)."""
    found = []
    for name in names:
        parent, _, leaf = name.rpartition(".")
        if getattr(model.get_submodule(parent) if parent else model, leaf, None) is not None:
            found.append(name)
    return tuple(found)


def _torchvision_vit(model) -> tuple[Piece, Piece]:
    def stem(x):
        x = model._process_input(x)
        x = torch.cat([model.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return model.encoder.dropout(x + model.encoder.pos_embedding)

    def head(x):
        return model.heads(model.encoder.ln(x)[:, 0])
    return (Piece("stem", ("conv_proj", "class_token", "encoder.pos_embedding", "encoder.dropout"), stem),
            Piece("head", ("encoder.ln", "heads"), head))


def _timm_vit(model) -> tuple[Piece, Piece]:
    def stem(x):
        return model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))

    def head(x):
        return model.forward_head(model.norm(x))
    owns = ("patch_embed", "cls_token", "reg_token", "pos_embed", "pos_drop", "patch_drop", "norm_pre")
    return (Piece("stem", _present(model, owns), stem),
            Piece("head", _present(model, ("norm", "attn_pool", "fc_norm", "head_drop", "head")), head))


def _resnet(model) -> tuple[Piece, Piece]:
    stem_names = _present(model, ("conv1", "bn1", "relu", "maxpool"))

    def stem(x):
        for name in stem_names:
            x = getattr(model, name)(x)
        return x

    def head(x):
        return model.fc(torch.flatten(model.avgpool(x), 1))
    return Piece("stem", stem_names, stem), Piece("head", ("avgpool", "fc"), head)


def _family(model: nn.Module):
    if hasattr(model, "encoder") and hasattr(model, "class_token") and hasattr(model, "_process_input"):
        return _torchvision_vit
    if hasattr(model, "patch_embed") and hasattr(model, "blocks") and hasattr(model, "forward_head"):
        return _timm_vit
    if all(hasattr(model, name) for name in ("conv1", "layer1", "avgpool", "fc")):
        return _resnet
    return None


def pieces(model: nn.Module, architecture: str = "this model") -> list[Piece]:
    """``model`` as its stem, its residual blocks and its head, in forward order: torchvision's and
    timm's ViTs (DeiT included), torchvision's ResNets and the CIFAR ResNets. Raises
    :class:`FixresError` naming ``architecture`` for any other model, or one with parameters none of
    its pieces runs (it cannot be split)."""
    family = _family(model)
    found = blocks(model)
    if family is None or not found:
        raise FixresError(f"--pipeline-stages: {architecture} cannot be split into stages (pipeline parallelism "
                          "knows torchvision's and timm's ViTs and the ResNets); train it with --sharding instead")
    stem, head = family(model)
    every = [stem, *(Piece(name, (name,), block) for name, block in found), head]
    owned = tuple(name for piece in every for name in piece.owns)
    left = [name for name, _ in [*model.named_parameters(), *model.named_buffers()]
            if not any(name == own or name.startswith(own + ".") for own in owned)]
    if left:
        raise FixresError(f"--pipeline-stages: {architecture} cannot be split into stages: no piece runs "
                          f"{', '.join(left[:3])}{', ...' if len(left) > 3 else ''}")
    return every


def piece_costs(model: nn.Module, every: list[Piece], size: int) -> list[float]:
    """Forward FLOPs of each of ``model``'s pieces on one (1, 3, ``size``, ``size``) image (pixels), in the
    model's dtype and device. Every rank counts the same (no timing): the split is agreed without talking."""
    parameter = next(model.parameters())
    x = torch.zeros(1, 3, size, size, dtype=parameter.dtype, device=parameter.device)
    costs = []
    with torch.no_grad():
        for piece in every:
            counter = FlopCounterMode(display=False)
            with counter:
                x = piece.run(x)
            costs.append(float(counter.get_total_flops()))
    return costs


def _get(model: nn.Module, name: str):
    parent, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(parent) if parent else model, leaf)


def balanced_split(costs: list[float], stages: int) -> list[int]:
    """The index of the first piece of each of ``stages`` contiguous stages that makes the largest
    stage's total cost as small as possible (dynamic programming, exact; ties: earlier stages
    lighter). Raises :class:`FixresError` when there are fewer pieces than stages."""
    n = len(costs)
    if stages > n:
        raise FixresError(f"--pipeline-stages {stages}: the model has only {n} pieces (stem, blocks, head) to split")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[s][i]: the smallest largest-stage cost of pieces i.. cut into s stages; cut[s][i]: the first cut
    best = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
    cut = [[n] * (n + 1) for _ in range(stages + 1)]
    best[0][n] = 0.0
    for s in range(1, stages + 1):
        for i in range(n - s, -1, -1):
            for j in range(i + 1, n - s + 2):
                worst = max(prefix[j] - prefix[i], best[s - 1][j])
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    starts, i = [], 0
    for s in range(stages, 0, -1):
        starts.append(i)
        i = cut[s][i]
    return starts


class Stage(nn.Module):
    """The pieces ``every[i]`` for ``i`` in ``chosen`` (ascending) of a model as one module: their modules
    and parameters under their qualified names in the whole model (``state_dict`` keys are the whole
    model's), its forward their forwards in order, its output contiguous (what crosses to the next
    stage). A rank's stages together are one too (:attr:`Pipeline.module`: its optimizer and checkpoints)."""

    def __init__(self, model: nn.Module, every: list[Piece], chosen: range | list[int]):
        super().__init__()
        self.runs = [every[i].run for i in chosen]
        self.names = [every[i].name for i in chosen]
        for i in chosen:
            for name in every[i].owns:
                self._adopt(name, _get(model, name))

    def _adopt(self, name: str, value) -> None:
        *path, leaf = name.split(".")
        holder: nn.Module = self
        for part in path:
            if not hasattr(holder, part):
                holder.add_module(part, nn.Module())
            holder = getattr(holder, part)
        if isinstance(value, nn.Parameter):
            holder.register_parameter(leaf, value)
        elif isinstance(value, nn.Module):
            holder.add_module(leaf, value)
        elif isinstance(value, torch.Tensor):
            holder.register_buffer(leaf, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for run in self.runs:
            x = run(x)
        return x.contiguous()

    def describe(self) -> str:
        return self.names[0] if len(self.names) == 1 else f"{self.names[0]} .. {self.names[-1]}"


def _drop_others(model: nn.Module, every: list[Piece], kept: set[int]) -> None:
    """Delete from ``model`` what none of the ``kept`` pieces runs: a rank holds its stages' weights only."""
    for index, piece in enumerate(every):
        if index not in kept:
            for name in piece.owns:
                parent, _, leaf = name.rpartition(".")
                delattr(model.get_submodule(parent) if parent else model, leaf)


def pipeline_mesh(device: torch.device, world_size: int, stages: int) -> DeviceMesh:
    """The ``data`` x ``stage`` mesh of ``world_size`` ranks (a collective: every rank calls it).
    Raises :class:`FixresError` unless ``stages`` divides the world size."""
    if stages < 1 or world_size % stages:
        raise FixresError(f"--pipeline-stages {stages} must divide the number of ranks ({world_size})")
    return dist.device_mesh.init_device_mesh(device.type, (world_size // stages, stages),
                                             mesh_dim_names=("data", "stage"))


class Pipeline:
    """This rank's stages of ``model`` (built whole, identically on every rank, then cut: the parts of
    other stages are deleted) and the schedule that runs them.

    ``mesh``: :func:`pipeline_mesh`'s; ``schedule``: a key of :data:`SCHEDULES`; ``microbatches``:
    per step (>= the number of stages for 1F1B); ``virtual``: stages per rank (interleaved 1F1B
    only, else 1); ``starts``: the first piece of each of the stages x virtual stages (default:
    :func:`balanced_split` of :func:`piece_costs` at ``size`` pixels); ``loss``: (logits, labels) ->
    mean loss of a micro-batch (default cross-entropy). Raises :class:`FixresError` for a split,
    schedule or micro-batch count that cannot run, before any rank computes.
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh, *, size: int, schedule: str = "1f1b",
                 microbatches: int | None = None, virtual: int = 1, starts: list[int] | None = None,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 architecture: str = "this model"):
        ranks, data = mesh.size(1), mesh.size(0)
        count = ranks * virtual
        microbatches = microbatches or count
        check_schedule(schedule, virtual, microbatches, ranks)
        every = pieces(model, architecture)
        self.starts = list(starts) if starts is not None else balanced_split(piece_costs(model, every, size), count)
        if len(self.starts) != count or self.starts[0] != 0 or sorted(set(self.starts)) != self.starts \
                or self.starts[-1] >= len(every):
            given = ",".join(map(str, self.starts))
            raise FixresError(f"--pipeline-split {given}: give the first piece of each of the {count} stages, "
                              f"increasing from 0, below {len(every)}")
        bounds = [*self.starts, len(every)]
        rank = mesh.get_local_rank("stage")
        self.indices = [rank + k * ranks for k in range(virtual)]  # interleaved: stages r, r + ranks, ...
        self.stages = [Stage(model, every, range(bounds[i], bounds[i + 1])) for i in self.indices]
        held = sorted(p for i in self.indices for p in range(bounds[i], bounds[i + 1]))
        self.module = Stage(model, every, held)  # all this rank's weights: its optimizer's and checkpoints'
        _drop_others(model, every, set(held))
        device = next(p for stage in self.stages for p in stage.parameters()).device
        # find_unused_parameters: DDP's bucket rebuild after the first step would count each micro-batch's
        # backward (an internal assert in the reducer); with it, DDP does not rebuild its buckets
        self.modules = [DistributedDataParallel(s, process_group=mesh.get_group("data"), find_unused_parameters=True)
                        if data > 1 else s
                        for s in self.stages]
        group = mesh.get_group("stage")
        runners = [PipelineStage(m, i, count, device, group=group) for m, i in zip(self.modules, self.indices)]
        self.is_first, self.is_last = 0 in self.indices, count - 1 in self.indices
        kind = SCHEDULES[schedule]
        loss = loss or nn.functional.cross_entropy
        self.schedule = kind(runners if virtual > 1 or schedule == "interleaved-1f1b" else runners[0],
                             n_microbatches=microbatches, loss_fn=loss)
        self.microbatches, self.count, self.data = microbatches, count, data

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of this pipeline's batch, ``images`` (B, 3, H, W) float and ``labels``
        (B,) int64, B a multiple of the micro-batch count; every stage of the pipeline is given the
        same batch (only the first reads the images, the last the labels). The gradients are then in
        this rank's parameters, averaged over the micro-batches and the data-parallel ranks. Returns
        the batch's mean loss on the last stage's ranks, None on the others."""
        self._check_batch(labels.shape[0])
        losses: list[torch.Tensor] = []
        args = (images,) if self.is_first else ()
        self.schedule.step(*args, target=labels if self.is_last else None, losses=losses)
        return torch.stack(losses).mean().detach() if self.is_last else None

    @torch.no_grad()
    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Logits (B, classes) of ``images`` (B, 3, H, W) on the last stage's ranks, None on the others
        (evaluation: the same micro-batches, no backward; ``labels`` (B,), which the schedule's loss
        reads on the last stage)."""
        self._check_batch(images.shape[0])
        args = (images,) if self.is_first else ()
        return self.schedule.eval(*args, target=labels if self.is_last else None)

    def _check_batch(self, size: int) -> None:
        if size % self.microbatches:
            raise FixresError(f"a batch of {size} images does not split into {self.microbatches} equal micro-batches")

    def describe(self) -> str:
        """One line: the mesh, the schedule and the pieces of this rank's stages."""
        held = "; ".join(f"stage {i}: {s.describe()}" for i, s in zip(self.indices, self.stages))
        return (f"pipeline: {self.count} stages x {self.data} data-parallel ranks, {self.schedule_name()}, "
                f"{self.microbatches} micro-batches per step; this rank holds {held}")

    def schedule_name(self) -> str:
        return type(self.schedule).__name__


def check_schedule(schedule: str, virtual: int, microbatches: int, ranks: int) -> None:
    """Raise :class:`FixresError` unless ``schedule`` can run ``virtual`` stages per rank on ``ranks``
    ranks per pipeline with ``microbatches`` micro-batches per step."""
    if schedule not in SCHEDULES:
        raise FixresError(f"--pipeline-schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if (schedule == "interleaved-1f1b") != (virtual > 1):
        raise FixresError("--pipeline-schedule interleaved-1f1b runs 2 or more virtual stages per rank; "
                          "only it does")
    if microbatches < 1 or (schedule != "gpipe" and microbatches < ranks):
        raise FixresError(f"--pipeline-microbatches {microbatches}: {schedule} needs at least one per stage ({ranks})")
    if schedule == "interleaved-1f1b" and microbatches % ranks:
        raise FixresError(f"--pipeline-microbatches {microbatches}: interleaved 1F1B needs a multiple of {ranks}")
