"""Pipeline parallelism: one classifier cut into stages, one (or, interleaved, several) per rank,
micro-batches kept in flight by a schedule, composed with data parallelism on a 2-D mesh.

A model of a known family is first read as a sequence of *pieces* (:func:`pieces`): its stem (the
patch embedding with the class token and position embeddings of a ViT, the first convolution of a
ResNet), each residual block (:func:`fixres_dist.distributed.blocks.blocks`) and its head (the last norm
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
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.flop_counter import FlopCounterMode

from fixres_dist.distributed.blocks import blocks
from fixres_dist.distributed.collectives import BUFFER_SYNC
from fixres_dist.distributed.layout import Layout
from fixres_dist.errors import FixresError

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


def _convnext(model) -> tuple[Piece, Piece, list[Piece]]:
    stem = model.features[0]
    downsampling = [Piece(f"features.{i}", (f"features.{i}",), model.features[i])
                    for i in range(2, len(model.features), 2)]  # between the stages of blocks

    def head(x):
        return model.classifier(model.avgpool(x))
    return Piece("stem", ("features.0",), stem), Piece("head", ("avgpool", "classifier"), head), downsampling


def _family(model: nn.Module):
    if type(model).__name__ == "ConvNeXt" and all(hasattr(model, n) for n in ("features", "avgpool", "classifier")):
        return _convnext
    if hasattr(model, "encoder") and hasattr(model, "class_token") and hasattr(model, "_process_input"):
        return _torchvision_vit
    if hasattr(model, "patch_embed") and hasattr(model, "blocks") and hasattr(model, "forward_head"):
        return _timm_vit
    if all(hasattr(model, name) for name in ("conv1", "layer1", "avgpool", "fc")):
        return _resnet
    return None


def pieces(model: nn.Module, architecture: str = "this model") -> list[Piece]:
    """``model`` as its stem, its residual blocks and its head, in forward order: torchvision's and
    timm's ViTs (DeiT included), torchvision's ResNets and ConvNeXts (each downsampling layer a piece
    between its stages of blocks) and the CIFAR ResNets. Raises
    :class:`FixresError` naming ``architecture`` for any other model, or one with parameters none of
    its pieces runs (it cannot be split)."""
    family = _family(model)
    found = blocks(model)
    if family is None or not found:
        raise FixresError(f"--pipeline-stages: {architecture} cannot be split into stages (pipeline parallelism "
                          "knows timm's ViTs, the ResNets and ConvNeXt); train it with --sharding "
                          "instead")
    stem, head, *between = family(model)
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    inner = [Piece(name, (name,), block) for name, block in found] + (between[0] if between else [])
    every = [stem, *sorted(inner, key=lambda piece: order[piece.name]), head]
    owned = tuple(name for piece in every for name in piece.owns)
    left = [name for name, _ in [*model.named_parameters(), *model.named_buffers()]
            if not any(name == own or name.startswith(own + ".") for own in owned)]
    if left:
        raise FixresError(f"--pipeline-stages: {architecture} cannot be split into stages: no piece runs "
                          f"{', '.join(left[:3])}{', ...' if len(left) > 3 else ''}")
    return every


def piece_costs(model: nn.Module, every: list[Piece], size: int) -> list[float]:
    """Forward FLOPs of each of ``model``'s pieces on one (1, 3, ``size``, ``size``) image (pixels), in the
    model's dtype and device, in eval mode (BatchNorm statistics untouched; every module's mode restored).
    Every rank counts the same (no timing): the split is agreed without talking."""
    parameter = next(model.parameters())
    x = torch.zeros(1, 3, size, size, dtype=parameter.dtype, device=parameter.device)
    costs, modes = [], [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            for piece in every:
                counter = FlopCounterMode(display=False)
                with counter:
                    x = piece.run(x)
                costs.append(float(counter.get_total_flops()))
    finally:
        for module, training in modes:
            module.training = training
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


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous (gloo sends and receives no other)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, gradient: torch.Tensor) -> torch.Tensor:
        return gradient.contiguous()


class Stage(nn.Module):
    """The pieces ``every[i]`` for ``i`` in ``chosen`` (ascending) of a model as one module: their modules
    and parameters under their qualified names in the whole model (``state_dict`` keys are the whole
    model's), its forward their forwards in order, its output and its input's gradient contiguous (what
    crosses to the next stage and back). A rank's stages together are one too (:attr:`Pipeline.module`:
    its optimizer and checkpoints)."""

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
        if x.requires_grad:  # the gradient sent back to the previous stage: contiguous too (a ConvNeXt's is not)
            x = _ContiguousGradient.apply(x)
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
    """The ``data`` x ``stage`` mesh of ``world_size`` ranks, a sub-mesh of the job's one mesh
    (:meth:`fixres_dist.distributed.layout.Layout.mesh`; a collective: every rank calls it).
    Raises :class:`FixresError` unless ``stages`` divides the world size."""
    return Layout.of_world(world_size, pipeline=stages).mesh(device.type)["data", "stage"]


class Pipeline:
    """This rank's stages of ``model`` (built whole, identically on every rank, then cut: the parts of
    other stages are deleted) and the schedules that run them.

    ``mesh``: :func:`pipeline_mesh`'s; ``schedule``: a key of :data:`SCHEDULES`; ``microbatches``:
    per step (>= the number of stages for 1F1B); ``virtual``: stages per rank (interleaved 1F1B
    only, else 1); ``starts``: the first piece of each of the stages x virtual stages (default:
    :func:`balanced_split` of :func:`piece_costs` at ``size`` pixels); ``loss``: (logits, labels) ->
    mean loss of a micro-batch (default cross-entropy). ``summed``: instead, each micro-batch's loss is
    its *summed* cross-entropy (``label_smoothing``) times the ``scale`` given to :meth:`train_step`,
    and the micro-batches' gradients are summed, not averaged (an uneven global batch keeps its exact
    mean, as :func:`fixres_dist.training.engine.train_step` does). ``buffer_sync``: DDP re-broadcasts
    the data-parallel group's first rank's buffers at each forward (off: each rank keeps its own
    BatchNorm statistics, and data-parallel ranks may run different micro-batch counts).

    A batch whose size or resolution the pipeline has not run yet gets schedules of its own (the
    stages learn the shapes they exchange once per shape); one that does not split into
    ``microbatches`` equal micro-batches runs as many as divide it, all forwards then all backwards
    (GPipe, or looped breadth-first with several stages per rank). Raises :class:`FixresError` for a
    split, schedule or micro-batch count that cannot run, before any rank computes.
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh, *, size: int, schedule: str = "1f1b",
                 microbatches: int | None = None, virtual: int = 1, starts: list[int] | None = None,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 architecture: str = "this model", summed: bool = False, label_smoothing: float = 0.0,
                 buffer_sync: bool = True):
        ranks, data = mesh.size(1), mesh.size(0)
        count = ranks * virtual
        microbatches = microbatches or count
        check_schedule(schedule, virtual, microbatches, ranks)
        every = pieces(model, architecture)
        self.batchnorm = has_batchnorm(model)  # the whole model's: every rank of the pipeline agrees
        if starts is not None:
            check_starts(list(starts), count, len(every))
        self.starts = list(starts) if starts is not None else balanced_split(piece_costs(model, every, size), count)
        bounds = [*self.starts, len(every)]
        rank = mesh.get_local_rank("stage")
        self.indices = [rank + k * ranks for k in range(virtual)]  # interleaved: stages r, r + ranks, ...
        self.stages = [Stage(model, every, range(bounds[i], bounds[i + 1])) for i in self.indices]
        held = sorted(p for i in self.indices for p in range(bounds[i], bounds[i + 1]))
        self.module = Stage(model, every, held)  # all this rank's weights: its optimizer's and checkpoints'
        _drop_others(model, every, set(held))
        self.device = next(p for stage in self.stages for p in stage.parameters()).device
        # find_unused_parameters: DDP's bucket rebuild after the first step would count each micro-batch's
        # backward (an internal assert in the reducer); with it, DDP does not rebuild its buckets. A stage
        # with nothing to train (a finetune's frozen part) needs no DDP.
        self.modules = [DistributedDataParallel(s, process_group=mesh.get_group("data"), find_unused_parameters=True,
                                                **{BUFFER_SYNC: buffer_sync})
                        if data > 1 and any(p.requires_grad for p in s.parameters()) else s
                        for s in self.stages]
        self.group, self.data_group = mesh.get_group("stage"), mesh.get_group("data")
        self.is_first, self.is_last = 0 in self.indices, count - 1 in self.indices
        self.schedule_kind, self.virtual = schedule, virtual
        self.microbatches, self.count, self.data = microbatches, count, data
        self.summed, self.label_smoothing, self.scale = summed, label_smoothing, 1.0
        self.loss = loss or nn.functional.cross_entropy
        self._schedules: dict[tuple, object] = {}

    def _summed_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.float(), targets, reduction="sum",
                                           label_smoothing=self.label_smoothing) * self.scale

    def split_count(self, batch: int, training: bool = False) -> int:
        """How many equal micro-batches a batch of ``batch`` images runs as: ``microbatches``, or the
        largest count below it that divides ``batch``; training a model with BatchNorm, one that leaves
        each micro-batch 2 images or more (BatchNorm cannot train on one)."""
        most = min(self.microbatches, max(1, batch // 2) if training and self.batchnorm else batch)
        return next(m for m in range(most, 0, -1) if batch % m == 0)

    def schedule_for(self, images: torch.Tensor, training: bool):
        """The schedule that runs a batch shaped as ``images`` (B, 3, H, W), made at its first use (every
        rank of the pipeline at once: all are given the same batch)."""
        count = self.split_count(images.shape[0], training)
        key = (training, count, tuple(images.shape))
        if key not in self._schedules:
            runners = [PipelineStage(m, i, self.count, self.device, group=self.group)
                       for m, i in zip(self.modules, self.indices)]
            kind = SCHEDULES[self.schedule_kind] if count == self.microbatches else \
                ScheduleLoopedBFS if self.virtual > 1 else ScheduleGPipe
            self._schedules[key] = kind(runners if self.virtual > 1 else runners[0], n_microbatches=count,
                                        loss_fn=None if not training else self._summed_loss if self.summed
                                        else self.loss, scale_grads=not self.summed)
        return self._schedules[key]

    def train_step(self, images: torch.Tensor, labels: torch.Tensor, scale: float = 1.0) -> torch.Tensor | None:
        """Forward and backward of this pipeline's batch, ``images`` (B, 3, H, W) float and ``labels``
        (B,) int64 (or (B, classes) float soft targets); every stage of the pipeline is given the same
        batch (only the first reads the images, the last the labels). The gradients are then in this
        rank's parameters, averaged over the micro-batches (``summed``: the summed losses times
        ``scale``, summed) and over the data-parallel ranks. Returns on the last stage's ranks the
        batch's mean loss (``summed``: its summed cross-entropy, unscaled), None on the others."""
        losses: list[torch.Tensor] = []
        self.scale = scale
        args = (images,) if self.is_first else ()
        self.schedule_for(images, True).step(*args, target=labels if self.is_last else None, losses=losses,
                                             return_outputs=False)
        if not self.is_last:
            return None
        return torch.stack(losses).sum().detach() / scale if self.summed else torch.stack(losses).mean().detach()

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor | None:
        """Logits (B, classes) of ``images`` (B, 3, H, W) on the last stage's ranks, None on the others
        (evaluation: the same micro-batches, no backward)."""
        args = (images,) if self.is_first else ()
        return self.schedule_for(images, False).eval(*args)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip this pipeline's gradients to L2 norm ``max_norm``, the norm of all stages' gradients
        together (each rank's squared norm summed over the pipeline's ranks), as ``clip_grad_norm_`` does
        on the whole model; returns that norm (a 0-dim float32 tensor)."""
        parameters = [p for p in self.module.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for parameter in parameters:
            squares += parameter.grad.detach().float().pow(2).sum()
        dist.all_reduce(squares, group=self.group)
        norm = squares.sqrt()
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
        return norm

    def evaluator(self, classes: int) -> nn.Module:
        """A module for evaluation loops: its forward of (B, 3, H, W) images is the pipeline's logits on
        the last stage, zeros (B, ``classes``) on the other stages' ranks (whose sums do not count)."""
        return _Evaluated(self, classes)

    def describe(self) -> str:
        """One line: the mesh, the schedule and the pieces of this rank's stages."""
        held = "; ".join(f"stage {i}: {s.describe()}" for i, s in zip(self.indices, self.stages))
        ranks = self.count // self.virtual
        stages = f"{self.count} stages on {ranks} ranks ({self.virtual} per rank)" if self.virtual > 1 else \
            f"{self.count} stages"
        batches = f"{self.microbatches} micro-batch{'es' if self.microbatches > 1 else ''}"
        return (f"pipeline: {stages} x {self.data} data-parallel ranks, {self.schedule_name()}, {batches} per step; "
                f"this rank holds {held}")

    def schedule_name(self) -> str:
        return SCHEDULES[self.schedule_kind].__name__


class _Evaluated(nn.Module):
    def __init__(self, pipe: Pipeline, classes: int):
        super().__init__()
        self.held, self.pipe, self.classes = pipe.module, pipe, classes  # held: eval_mode reaches the stages

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = self.pipe.forward(images)
        return logits if logits is not None else images.new_zeros(images.shape[0], self.classes)


def check_starts(starts: list[int], count: int, pieces: int) -> None:
    """Raise :class:`FixresError` unless ``starts`` gives the first piece of each of ``count`` stages of
    a model of ``pieces`` pieces: 0 first, strictly increasing, each below ``pieces``."""
    if len(starts) != count or starts[0] != 0 or sorted(set(starts)) != starts or starts[-1] >= pieces:
        given = ",".join(map(str, starts))
        raise FixresError(f"--pipeline-split {given}: give the first piece of each of the {count} stages, "
                          f"increasing from 0, below {pieces} (the stem, the blocks, the head)")

def has_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` has a BatchNorm layer (its micro-batches then need 2 images or more to train)."""
    return any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules())

def virtual_stages(schedule: str) -> int:
    """Stages per rank that ``schedule`` runs: 2 for interleaved 1F1B, else 1."""
    return 2 if schedule == "interleaved-1f1b" else 1

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
