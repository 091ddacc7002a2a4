"""A dry run of a parallel layout far beyond this machine, on one CPU before any memory is asked for:
the layout validated (:class:`~fixres_dist.distributed.layout.Layout`), its one device mesh built as a
rank builds it, on torch's fake process group (``torch.testing._internal.distributed.fake_pg``:
collectives that move nothing), and the peak memory of one training step of a rank of each pipeline
stage estimated on the ``meta`` device (shapes only). ``python -m fixres_dist.training.dry_run
--num-tasks 1024 --tensor-parallel 8 --pipeline-stages 16 --architecture timm/vit_large_patch16_224``
prints the layout, the mesh and each stage's estimate per rank, the largest last.

A rank's model is made as a run makes it: built whole on the meta device, cut into its pipeline stage
(:class:`~fixres_dist.distributed.pipeline.Stage`, the split balanced by forward FLOPs as a run
balances it), then split by :func:`~fixres_dist.distributed.tensor_parallel.parallelize` on the
mesh's ``tensor`` axis (only the MLP and attention weights it splits). Per rank, in bytes (float32):

* parameters: the elements the rank holds then (sharded: each tensor's first dimension over the
  shard group, padded as FSDP2 pads it, plus the largest piece gathered whole while it runs);
* gradients: those of the trainable ones; DDP's buckets (data-parallel ranks that do not shard, nor
  split tensors) hold a second copy;
* optimizer state: the state tensors ``--opt`` keeps per parameter (counted by stepping it once on a
  small tensor) times the parameters;
* activations: what torch's ``MemTracker`` sees (activations and temporaries) in one micro-batch's
  forward and backward of the rank's stage on meta tensors, times the micro-batches a stage keeps in
  flight (GPipe: all of them; 1F1B: the stages from it to the last, at most all).

Error bound: parameters, gradients and optimizer state are counted exactly (up to the caching
allocator's 512-byte rounding per tensor); activations are the tracker's, as the preflight's
estimate (:mod:`fixres_dist.training.memory_estimate`) counts them, and an upper bound under 1F1B
(a micro-batch's temporaries counted once per micro-batch in flight). Not counted: ``--amp``, the
CUDA context, communication buffers. ``tests/distributed/test_parallel_layout.py`` compares the exact parts with
what the ranks of a real gloo run hold.
"""
from __future__ import annotations

import argparse
import math
import sys

import attrs
import torch
from torch import nn

from fixres_dist.config import OPTIMIZERS, SHARDINGS
from fixres_dist.distributed import pipeline, tensor_parallel
from fixres_dist.distributed.blocks import blocks
from fixres_dist.distributed.layout import Layout
from fixres_dist.errors import FixresError, say
from fixres_dist.models import architectures
from fixres_dist.training import optim
from fixres_dist.training.memory_estimate import MemoryEstimate, fake_process_group, gib

FLOAT_BYTES = 4  # float32 parameters, gradients and optimizer state
SCHEDULES = ("gpipe", "1f1b")  # one stage per rank (interleaved 1F1B's virtual stages: not estimated here)


@attrs.frozen
class DryRun:
    """What :func:`dry_run` found: the ``layout``, the mesh as ``rank`` sees it (``mesh_shape``, axes
    :data:`~fixres_dist.distributed.layout.AXES`; ``coordinates``: the rank's index on each), and one
    :class:`~fixres_dist.training.memory_estimate.MemoryEstimate` per pipeline stage (bytes per rank)."""

    layout: Layout
    rank: int
    mesh_shape: tuple[int, ...]
    coordinates: tuple[int, ...]
    stages: list[MemoryEstimate]

    @property
    def largest(self) -> MemoryEstimate:
        return max(self.stages, key=lambda found: found.peak)

    def lines(self) -> list[str]:
        """What the command prints: the layout, the mesh, each stage's estimate, the largest."""
        axes = " x ".join(f"{name} {size:,}" for name, size in zip(("data", "shard", "stage", "tensor"),
                                                                    self.mesh_shape))
        return [f"layout: {self.layout.describe()}",
                f"mesh: {axes}; rank {self.rank} at {self.coordinates} (built on a fake process group)",
                *(found.describe() for found in self.stages),
                f"largest: {gib(self.largest.peak)} per rank ({self.largest.setting})"]


def states_per_parameter(opt: str, momentum: float) -> int:
    """How many tensors the size of a parameter ``--opt`` keeps per parameter (SGD with momentum 1,
    AdamW 2), counted by stepping it once on a small one."""
    parameter = nn.Parameter(torch.zeros(3))
    parameter.grad = torch.ones(3)
    optimizer = optim.build_optimizer(opt, [{"params": [parameter]}], 0.1, momentum)
    optimizer.step()
    return sum(1 for t in optimizer.state[parameter].values() if torch.is_tensor(t) and t.shape == parameter.shape)


def _local_elements(parameter: torch.Tensor, shard: int) -> int:
    local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
    if shard == 1 or local.dim() == 0:
        return local.numel()
    return math.ceil(local.shape[0] / shard) * (local.numel() // max(local.shape[0], 1))


def in_flight(schedule: str, stages: int, stage: int, microbatches: int) -> int:
    """The micro-batches whose activations stage ``stage`` of ``stages`` keeps at once under ``schedule``."""
    return min(stages - stage, microbatches) if schedule == "1f1b" else microbatches


def _activations(stage_module: nn.Module, images: torch.Tensor, last: bool) -> int:
    """Activation and temporary bytes that MemTracker sees in one forward and backward of ``stage_module``
    on ``images`` (meta tensors: the previous stage's output, or the images)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(stage_module)
    with tracker:
        out = stage_module(images)
        loss = nn.functional.cross_entropy(out, torch.zeros(len(out), dtype=torch.long, device="meta")) if last \
            else out.float().sum()
        loss.backward()
    snapshot = max(tracker.get_tracker_snapshot("peak").values(), key=lambda s: s.get("Total", 0))
    return sum(size for kind, size in snapshot.items() if getattr(kind, "value", kind) in ("Activation", "Temp"))


def _bounds(args, found: Layout) -> list[int] | None:
    """The first piece of each stage and the number of pieces (a run's balanced cut); None unstaged. Raises
    :class:`FixresError` for a model that cannot be split so."""
    model = architectures.build_model(args.architecture, args.classes, image_size=args.input_size)
    if found.tensor_enabled:  # the whole model can be split (each stage's blocks then are)
        tensor_parallel.splittable(model, found.tensor, args.architecture)
    if not found.pipeline_enabled:
        return None
    every = pipeline.pieces(model, args.architecture)
    return [*pipeline.balanced_split(pipeline.piece_costs(model, every, args.input_size), found.pipeline), len(every)]


def _stage(args, found: Layout, mesh, bounds: list[int] | None, stage: int, states: int) -> MemoryEstimate:
    """The estimate for a rank of pipeline stage ``stage`` (module docstring) of the cut ``bounds``."""
    model = architectures.build_model(args.architecture, args.classes, image_size=args.input_size)
    every = pipeline.pieces(model, args.architecture) if bounds is not None else None
    shape = (args.micro, 3, args.input_size, args.input_size)
    if every is not None:
        chosen = range(bounds[stage], bounds[stage + 1])
        x = torch.zeros(shape, device="meta")
        with torch.no_grad():
            for piece in every[:bounds[stage]]:
                x = piece.run(x)
        shape, model = tuple(x.shape), pipeline.Stage(model, every, chosen)
    if found.tensor_enabled and blocks(model):  # a stage of the stem or head alone: nothing to split
        tensor_parallel.parallelize(model, mesh["tensor"], args.architecture)
    elements = sum(_local_elements(p, found.shard) for p in model.parameters())
    if found.shard_enabled:  # the largest block gathered whole while it runs (FSDP2 shards per block)
        elements += max((sum(p.numel() for p in block.parameters()) for _, block in blocks(model)), default=0)
    images = torch.zeros(shape, device="meta", requires_grad=stage > 0)
    activations = _activations(model, images, stage == found.pipeline - 1)
    kept = in_flight(args.pipeline_schedule, found.pipeline, stage, args.microbatches)
    buckets = found.data_parallel_enabled and not found.shard_enabled and not found.tensor_enabled
    parts = {"parameters": elements * FLOAT_BYTES, "gradients": elements * FLOAT_BYTES * (2 if buckets else 1),
             "optimizer": elements * FLOAT_BYTES * states, "activations": activations * kept}
    where = f"stage {stage} ({model.describe()}), " if every is not None else ""
    setting = (f"{where}{args.architecture} at {args.input_size} px, {kept} micro-batch(es) of {args.micro} images "
               f"in flight, {args.opt}")
    return MemoryEstimate(setting, sum(parts.values()), **parts)


def dry_run(args: argparse.Namespace) -> DryRun:
    """Validate ``args``' layout, build its mesh as the last rank on a fake process group of that many
    ranks (no process group may exist in this process), estimate each stage's peak per rank. Raises
    :class:`FixresError` (one line) for a layout, model or batch that cannot run."""
    found = Layout.of_world(args.num_tasks, sharding=args.sharding, shard_group=args.shard_group_size,
                            tensor=args.tensor_parallel, pipeline=args.pipeline_stages)
    args.microbatches = args.pipeline_microbatches or found.pipeline
    if args.batch % args.microbatches:
        raise FixresError(f"--batch {args.batch} does not split into {args.microbatches} equal micro-batches "
                          "(--pipeline-microbatches; default: one per stage)")
    args.micro, rank, states = args.batch // args.microbatches, found.world - 1, states_per_parameter(args.opt, 0.9)
    with fake_process_group(found.world, rank=rank), torch.device("meta"):
        mesh = found.mesh("cpu")
        shape, where = tuple(mesh.shape), tuple(mesh.get_coordinate())
        bounds = _bounds(args, found)
        stages = [_stage(args, found, mesh, bounds, stage, states) for stage in range(found.pipeline)]
    return DryRun(found, rank, shape, where, stages)


def parser() -> argparse.ArgumentParser:
    """The command line (the scripts' flag names)."""
    p = argparse.ArgumentParser(prog="python -m fixres_dist.training.dry_run", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-tasks", type=int, required=True, help="ranks in the job")
    p.add_argument("--tensor-parallel", type=int, default=1, help="ranks per tensor group (default 1)")
    p.add_argument("--pipeline-stages", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--sharding", choices=SHARDINGS, default="ddp", help="how data-parallel ranks hold the model")
    p.add_argument("--shard-group-size", type=int, default=None, help="--sharding hybrid's shard group (ranks)")
    p.add_argument("--architecture", default="timm/vit_large_patch16_224", help="default %(default)s")
    p.add_argument("--input-size", type=int, default=224, help="training resolution in pixels (default 224)")
    p.add_argument("--classes", type=int, default=1000, help="classes of the head (default 1000)")
    p.add_argument("--batch", type=int, default=64, help="images per data-parallel rank per step (default 64)")
    p.add_argument("--pipeline-microbatches", type=int, default=None, help="default: one per stage")
    p.add_argument("--pipeline-schedule", choices=SCHEDULES, default="1f1b", help="default 1f1b")
    p.add_argument("--opt", choices=OPTIMIZERS, default="sgd", help="default sgd (with momentum 0.9)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command: prints :meth:`DryRun.lines`; exit status 0, or 1 with one line on stderr."""
    try:
        found = dry_run(parser().parse_args(argv))
    except FixresError as exc:
        say(f"fixres_dist: dry run: {exc}")
        return 1
    print("\n".join(found.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
