"""The memory per rank of a split layout's training step (tensor groups, pipeline stages, each
data-parallel group sharded or not), in bytes, counted on the ``meta`` device (shapes only), one
stage at a time: the mechanism behind :func:`fixres_dist.training.memory_estimate.estimate` for a
layout that splits the model, and so behind the preflight's ``--memory-budget`` and the dry run alike.

A rank's model is made as a run makes it: built whole on the meta device (a finetune's frozen layers
frozen), cut into its pipeline stage (:class:`~fixres_dist.distributed.pipeline.Stage`, the cut
balanced by forward FLOPs as a run balances it, or ``--pipeline-split``'s), then split by
:func:`~fixres_dist.distributed.tensor_parallel.parallelize` on the mesh's ``tensor`` axis. Per rank:

* parameters: the elements the rank holds (sharded: each tensor's first dimension over the shard
  group, padded as FSDP2 pads it, plus the largest block gathered whole while it runs), float32; with
  ``--model-ema`` also the average's copy of them and of the rank's buffers (a pipeline rank averages its
  stages' only);
* gradients: those of the trainable ones; DDP's buckets (data-parallel ranks that neither shard nor
  split tensors, pipeline stages included) hold a second copy;
* optimizer state: the state tensors ``--opt`` keeps per parameter (counted by stepping it once on a
  small tensor) times the trainable parameters, plus the step's temporaries: :data:`STEP_TEMPORARIES`
  tensors the size of the largest parameter (on a CPU the step loops over the parameters), of all of
  them (on CUDA torch's foreach step makes them for every parameter at once);
* activations: what torch's ``MemTracker`` sees at most (activations and temporaries) in one
  micro-batch's forward and backward of the rank's stage, times the micro-batches the schedule keeps
  in flight there (torch's 1F1B: the stages from it to the last, at most all; GPipe and interleaved
  1F1B: all of them); plus the whole batch as floats (every rank of a split model normalises it) and
  the buffers a stage receives into, one per micro-batch (the input of a stage after the first, the
  output's gradient of one before the last).

Parameters, gradients and optimizer state are exact (interleaved 1F1B: its N-stage cut stands for the
rank's two virtual stages); activations an upper bound (float32 even under ``--amp``; see
docs/sharding.md for the factor measured against real gloo ranks).
"""
from __future__ import annotations

import copy
import functools
import math

import attrs
import torch
from torch import nn

from fixres_dist.distributed import pipeline, tensor_parallel
from fixres_dist.distributed.blocks import blocks
from fixres_dist.distributed.layout import Layout
from fixres_dist.models import architectures

FLOAT_BYTES = 4  # float32 parameters, gradients, optimizer state and activations
STEP_TEMPORARIES = 2  # tensors the size of one parameter that a looping optimizer step makes at once


@attrs.frozen
class SplitStep:
    """One training step of a split layout, as the estimate needs it: ``layout``, the model
    (``architecture``, ``classes``, ``size`` in pixels, a finetune's ``frozen`` scope and last norm or
    None), ``batch`` (images per data-parallel rank), ``microbatches`` and ``schedule`` (``gpipe``,
    ``1f1b`` or ``interleaved-1f1b``; unstaged: micro-batches of accumulation, one in flight), ``cut``
    (``--pipeline-split``'s first piece of each stage, or None: balanced), ``opt``, ``momentum``, and
    ``foreach``: whether the optimizer steps all parameters at once (torch's choice on CUDA);
    ``low_res_stem``: ``--low-res-stem``; ``activation_checkpointing``: the blocks recompute their forward
    in the backward (``--activation-checkpointing``, applied before the cut as a run does); ``model_ema``:
    ``--model-ema`` keeps a copy of what the rank holds."""

    layout: Layout
    architecture: str
    classes: int
    size: int
    batch: int
    microbatches: int = 1
    schedule: str = "1f1b"
    cut: tuple[int, ...] | None = None
    opt: str = "sgd"
    momentum: float = 0.9
    frozen: tuple[str, str | None] | None = None
    foreach: bool = False
    low_res_stem: bool = False
    activation_checkpointing: bool = False
    model_ema: bool = False

    @property
    def micro(self) -> int:
        """Images per micro-batch (the last, smaller one of an uneven split counts as a full one)."""
        return math.ceil(self.batch / self.microbatches)


def states_per_parameter(opt: str, momentum: float) -> int:
    """How many tensors the size of a parameter ``--opt`` keeps per parameter (SGD with momentum 1,
    AdamW 2), counted by stepping it once on a small one."""
    from fixres_dist.training import optim

    parameter = nn.Parameter(torch.zeros(3, device="cpu"))
    parameter.grad = torch.ones(3, device="cpu")
    optimizer = optim.build_optimizer(opt, [{"params": [parameter]}], 0.1, momentum)
    optimizer.step()
    return sum(1 for t in optimizer.state[parameter].values() if torch.is_tensor(t) and t.shape == parameter.shape)


def in_flight(schedule: str, stages: int, stage: int, microbatches: int) -> int:
    """The micro-batches whose activations stage ``stage`` of ``stages`` keeps at once under ``schedule``."""
    return min(stages - stage, microbatches) if schedule == "1f1b" else microbatches


def _local_elements(parameter: torch.Tensor, shard: int) -> int:
    local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
    if shard == 1 or local.dim() == 0:
        return local.numel()
    return math.ceil(local.shape[0] / shard) * (local.numel() // max(local.shape[0], 1))


def _activations(stage_module: nn.Module, shape: tuple[int, ...], first: bool, last: bool) -> int:
    """Activation and temporary bytes that MemTracker sees at most in one forward and backward of
    ``stage_module`` on an input of ``shape`` (meta tensors: the images, or the previous stage's output).
    One untracked step first makes the gradients, so that the tracked step's peak is the activations'
    (not the moment its gradients are made, late in the backward, when most activations are freed).
    Stages alike (the same modules, parameter shapes and trained parameters, on the same input: the
    middle stages of a ViT cut evenly; a forward replaced, as activation checkpointing does, included) are
    tracked once."""
    alike = (tuple((type(m).__name__, "forward" in vars(m),
                    tuple((tuple((p.to_local() if hasattr(p, "to_local") else p).shape), p.requires_grad)
                          for p in m.parameters(recurse=False))) for m in stage_module.modules()),
             tuple(shape), first, last)
    if alike not in _ACTIVATIONS:
        _ACTIVATIONS[alike] = _tracked_activations(stage_module, shape, first, last)
    return _ACTIVATIONS[alike]


_ACTIVATIONS: dict[tuple, int] = {}  # _activations' answers, by what makes two stages alike


def _tracked_activations(stage_module: nn.Module, shape: tuple[int, ...], first: bool, last: bool) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    x = torch.zeros(shape, device="meta", requires_grad=not first)

    def step():
        out = stage_module(x)
        loss = nn.functional.cross_entropy(out, torch.zeros(len(out), dtype=torch.long, device="meta")) if last \
            else out.float().sum()
        loss.backward()

    step()
    tracker = MemTracker()
    tracker.track_external(stage_module)
    with tracker:
        step()
    snapshot = max(tracker.get_tracker_snapshot("peak").values(), key=lambda s: s.get("Total", 0))
    return sum(size for kind, size in snapshot.items() if getattr(kind, "value", kind) in ("Activation", "Temp"))


@functools.lru_cache(maxsize=1)
def _built(architecture: str, classes: int, size: int, low_res_stem: bool, device: torch.device) -> nn.Module:
    """The model as built on ``device`` (the meta device), once per layout's estimate: each stage copies it."""
    return architectures.build_model(architecture, classes, image_size=size, low_res_stem=low_res_stem)


def _whole(step: SplitStep) -> nn.Module:
    model = copy.deepcopy(_built(step.architecture, step.classes, step.size, step.low_res_stem,
                                 torch.get_default_device()))
    if step.frozen is not None:
        from fixres_dist.fixres import finetuning

        finetuning.freeze_for_finetune(model, step.size, *step.frozen)
    if step.activation_checkpointing:
        from fixres_dist.distributed import sharding

        sharding.checkpoint_activations(model)
    return model


def bounds(step: SplitStep) -> list[int] | None:
    """The first piece of each stage and the number of pieces (the run's cut); None unstaged. Call on
    the meta device. Raises :class:`~fixres_dist.errors.FixresError` for a model that cannot be split so."""
    model = _whole(step)
    if step.layout.tensor_enabled:  # the whole model can be split (each stage's blocks then are)
        tensor_parallel.splittable(model, step.layout.tensor, step.architecture)
    if not step.layout.pipeline_enabled:
        return None
    every = pipeline.pieces(model, step.architecture)
    if step.cut is not None:
        pipeline.check_starts(list(step.cut), step.layout.pipeline, len(every))
        return [*step.cut, len(every)]
    return [*pipeline.balanced_split(pipeline.piece_costs(model, every, step.size), step.layout.pipeline), len(every)]


def rank_model(step: SplitStep, mesh, cut: list[int] | None, stage: int) -> tuple[nn.Module, list, str]:
    """``(model, shapes, where)``: what a rank of pipeline stage ``stage`` of the cut ``cut`` (:func:`bounds`)
    holds, split over the ``mesh``'s tensor axis as a run splits it; the shapes of its micro-batch's input
    (images, or the previous stage's output) and output; ``where``: the stage in words, empty unstaged. Call
    on the meta device, on a (fake) process group of the layout's ranks whose ``mesh`` (:meth:`Layout.mesh`)
    is given."""
    model = _whole(step)
    every = pipeline.pieces(model, step.architecture) if cut is not None else None
    shapes = [(step.micro, 3, step.size, step.size)]
    if every is not None:
        x = torch.zeros(shapes[0], device="meta")
        with torch.no_grad():
            for index, piece in enumerate(every[:cut[stage + 1]]):
                x = piece.run(x)
                if index + 1 in (cut[stage], cut[stage + 1]):
                    shapes.append(tuple(x.shape))
        shapes = shapes[-2:] if stage > 0 else shapes[:2]
        model = pipeline.Stage(model, every, range(cut[stage], cut[stage + 1]))
    if step.layout.tensor_enabled and blocks(model):  # a stage of the stem or head alone: nothing to split
        tensor_parallel.parallelize(model, mesh["tensor"], step.architecture)
    return model, shapes, f"stage {stage} ({model.describe()}), " if every is not None else ""


def stage_parts(step: SplitStep, mesh, cut: list[int] | None, stage: int, states: int) -> tuple[str, dict[str, int]]:
    """``(where, parts)`` for a rank of pipeline stage ``stage`` (module docstring; :func:`rank_model`
    says where to call it): ``where`` names the stage and what it keeps (``"stage 1 (blocks.2 .. head),
    1 micro-batch(es) of 4 images in flight"``), ``parts`` the bytes of ``parameters``, ``gradients``,
    ``optimizer``, ``activations``."""
    found = step.layout
    model, shapes, where = rank_model(step, mesh, cut, stage)
    held = [(_local_elements(p, found.shard), p.requires_grad) for p in model.parameters()]
    elements = sum(n for n, _ in held)
    trained = sum(n for n, trains in held if trains)
    if found.shard_enabled:  # the largest block gathered whole while it runs (FSDP2 shards per block)
        elements += max((sum(p.numel() for p in block.parameters()) for _, block in blocks(model)), default=0)
    largest = trained if step.foreach else max((n for n, trains in held if trains), default=0)
    last = stage == found.pipeline - 1
    kept = in_flight(step.schedule, found.pipeline, stage, step.microbatches)
    # every rank of a split model normalises the whole batch to floats; a stage receives each micro-batch's
    # input (after the first) and its output's gradient (before the last) into buffers of their own
    received = (stage > 0) * math.prod(shapes[0]) + (not last) * math.prod(shapes[-1])
    activations = (_activations(model, shapes[0], stage == 0, last) * kept
                   + (step.batch * 3 * step.size ** 2 + step.microbatches * received) * FLOAT_BYTES)
    buckets = found.data_parallel_enabled and not found.shard_enabled and not found.tensor_enabled
    averaged = (sum(_local_elements(p, found.shard) for p in model.parameters()) * FLOAT_BYTES  # --model-ema's copy
                + sum(b.numel() * b.element_size() for b in model.buffers())) if step.model_ema else 0
    parts = {"parameters": elements * FLOAT_BYTES + averaged,
             "gradients": trained * FLOAT_BYTES * (2 if buckets else 1),
             "optimizer": (trained * states + largest * STEP_TEMPORARIES) * FLOAT_BYTES,
             "activations": activations}
    return f"{where}{kept} micro-batch(es) of {step.micro} images in flight", parts
