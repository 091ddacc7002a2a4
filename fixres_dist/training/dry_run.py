"""A dry run of a parallel layout far beyond this machine, on one CPU before any memory is asked for:
the layout validated (:class:`~fixres_dist.distributed.layout.Layout`), its one device mesh built as a
rank builds it, on torch's fake process group (``torch.testing._internal.distributed.fake_pg``:
collectives that move nothing), and the peak memory of one training step of a rank of each pipeline
stage estimated on the ``meta`` device (shapes only). ``python -m fixres_dist.training.dry_run
--num-tasks 1024 --tensor-parallel 8 --pipeline-stages 16 --architecture timm/vit_large_patch16_224``
prints the layout, the mesh and each stage's estimate per rank, the largest last.

Its estimate is the preflight's (:func:`fixres_dist.training.memory_estimate.estimate`, the same code
for ``--memory-budget``): a layout that splits the model (tensor groups, pipeline stages, each
data-parallel group sharded or not) counted stage by stage on the meta device
(:mod:`~fixres_dist.training.split_memory`: parameters, gradients and optimizer state exact, activations
an upper bound), any other by torch's trackers on fake tensors. Here the layout may be one that a run
refuses for now (pipeline x tensor, split x sharding): the dry run sizes it for when it is built.
Not counted: the CUDA context, communication buffers; activations are float32 even under ``--amp``.
"""
from __future__ import annotations

import argparse
import sys

import attrs

from fixres_dist.config import OPTIMIZERS, SHARDINGS, TrainerConfig
from fixres_dist.distributed.fake_group import fake_process_group
from fixres_dist.distributed.layout import Layout
from fixres_dist.errors import FixresError, say
from fixres_dist.training import memory_estimate
from fixres_dist.training.memory_estimate import MemoryEstimate, gib
from fixres_dist.training.split_memory import SplitStep

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


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


def _step(args, found: Layout) -> SplitStep:
    return SplitStep(found, args.architecture, args.classes, args.input_size, args.batch, args.microbatches,
                     args.pipeline_schedule, opt=args.opt)


def _unsplit_config(args, found: Layout) -> TrainerConfig:
    """A run's configuration of ``args`` (a layout that does not split the model): its estimate is the
    tracked route's."""
    return TrainerConfig(num_tasks=found.world, architecture=args.architecture, input_size=args.input_size,
                         test_size=args.input_size, batch=args.batch, opt=args.opt,
                         sharding=args.sharding if found.world > 1 else "ddp", dist_bn="reduce",
                         shard_group_size=found.shard if args.sharding == "hybrid" and found.world > 1 else None)


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
    rank = found.world - 1
    with fake_process_group(found.world, rank=rank):
        mesh = found.mesh("cpu")
        shape, where = tuple(mesh.shape), tuple(mesh.get_coordinate())
        if found.split:
            setting = f"{args.architecture} at {args.input_size} px, {args.opt}"
            stages = memory_estimate.split_estimates(_step(args, found), setting)
        else:
            stages = [memory_estimate.estimate(_unsplit_config(args, found), args.classes)]
    if not stages[0].known:
        raise FixresError(stages[0].describe())
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
