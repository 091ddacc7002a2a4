"""A dry run of a parallel layout far beyond this machine, on one CPU before any memory is asked for:
the command line checked as a run checks it (its configuration's validators, the preflight's checks of
the resolution and of the split: :func:`fixres_dist.training.inputs.check_sizes`,
:func:`~fixres_dist.training.inputs.check_split`), the layout
(:class:`~fixres_dist.distributed.layout.Layout`) and its one device mesh built as a rank builds it, on
torch's fake process group (``torch.testing._internal.distributed.fake_pg``: collectives that move
nothing), and the peak memory of one training step of a rank of each pipeline stage estimated on the
``meta`` device (shapes only). ``python -m fixres_dist.training.dry_run --num-tasks 1024
--pipeline-stages 16 --architecture timm/vit_large_patch16_224`` prints the layout, the mesh and each
stage's estimate per rank, the largest last.

Its estimate is the preflight's (:func:`fixres_dist.training.memory_estimate.estimate`, the same code
for ``--memory-budget``): a layout that splits the model (tensor groups, pipeline stages, each
data-parallel group sharded or not) counted stage by stage on the meta device
(:mod:`~fixres_dist.training.split_memory`: parameters, gradients and optimizer state exact, activations
an upper bound), any other by torch's trackers on fake tensors. A layout the run refuses is refused in
one line (``the run refuses this layout: ...``); with ``--sized-ahead``, one it refuses only for now
(pipeline x tensor, stages sharded, tensor groups in hybrid shards) is sized for when it is built. Not
counted: the CUDA context, communication buffers; activations are float32 even under ``--amp``.
"""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

import attrs

from fixres_dist import arguments
from fixres_dist.config import OPTIMIZERS, PIPELINE_SCHEDULES, SHARDINGS, TrainerConfig
from fixres_dist.distributed.layout import Layout
from fixres_dist.errors import FixresError, first_line, say

if TYPE_CHECKING:
    from fixres_dist.training.memory_estimate import MemoryEstimate

# The most ranks a dry run takes: torch's fake process group builds a mesh of 2**16 ranks in about 2 s
# on one CPU core (2**18: 5 s, 2**20: 14 s, then the estimate), and fails beyond 2**31.
MAX_RANKS = 2 ** 16
DESCRIPTION = (f"Check a parallel layout of up to {MAX_RANKS:,} ranks on one CPU, before any memory is asked for: the "
               "command line as a run checks it, the layout's device mesh built as its last rank builds it (on a "
               "fake process group), and the peak memory per rank of each pipeline stage estimated (on the meta "
               "device). Prints the layout, the mesh and each stage's estimate, the largest last; a layout the "
               "run refuses: one line, exit status 1. See docs/sharding.md (The layout, and a dry run of it).")


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
    refused: str | None = None  # --sized-ahead: the run's refusal of this layout for now

    @property
    def largest(self) -> MemoryEstimate:
        return max(self.stages, key=lambda found: found.peak)

    def lines(self) -> list[str]:
        """What the command prints: the layout, the mesh, each stage's estimate, the largest."""
        from fixres_dist.training.memory_estimate import gib

        axes = " x ".join(f"{name} {size:,}" for name, size in zip(("data", "shard", "stage", "tensor"),
                                                                    self.mesh_shape))
        return [f"layout: {self.layout.describe()}",
                f"mesh: {axes}; rank {self.rank} at {self.coordinates} (built on a fake process group)",
                *(found.describe() for found in self.stages),
                f"largest: {gib(self.largest.peak)} per rank ({self.largest.setting})"]


def _ranks(text: str) -> int:
    """--num-tasks: a positive whole number of ranks, at most :data:`MAX_RANKS`."""
    value = arguments.positive_int(text)
    if value > MAX_RANKS:
        raise argparse.ArgumentTypeError(f"a dry run takes at most {MAX_RANKS:,} ranks (its fake process group "
                                         f"builds a mesh that large in seconds), got {text}")
    return value


def _fields(args: argparse.Namespace, for_now: bool = False) -> dict:
    """The configuration fields of ``args``: a training run's, as the scripts would make it (``args.tensor``
    and ``args.pipeline``: ``--tensor-parallel`` and ``--pipeline-stages``); with ``for_now``, without what a
    run refuses only for now: a split model sharded (then replicated; tensor groups sharded in full run),
    pipeline x tensor (then the pipeline alone)."""
    sharding, group, tensor = args.sharding, args.shard_group_size, args.tensor
    if for_now and (tensor > 1 or args.pipeline > 1):
        sharding, group, tensor = "ddp", None, 1 if args.pipeline > 1 else tensor
    return {"num_tasks": args.num_tasks, "architecture": args.architecture, "input_size": args.input_size,
            "test_size": args.input_size, "batch": args.batch, "opt": args.opt, "sharding": sharding,
            "shard_group_size": group, "tensor_parallel": tensor, "pipeline_stages": args.pipeline,
            "pipeline_microbatches": args.pipeline_microbatches, "pipeline_schedule": args.pipeline_schedule}


def asked(args: argparse.Namespace) -> Layout:
    """The layout the command line asks for (as :func:`fixres_dist.distributed.layout.of` makes a run's, a
    hybrid shard group given), also where ``--sized-ahead`` configures the run without part of it. Raises
    :meth:`Layout.of_world`'s one line where its sizes do not divide ``--num-tasks``."""
    return Layout.of_world(args.num_tasks, sharding=args.sharding if args.num_tasks > 1 else "ddp",
                           shard_group=args.shard_group_size, tensor=args.tensor, pipeline=args.pipeline)


def config_of(args: argparse.Namespace) -> tuple[TrainerConfig, str | None]:
    """The run's configuration of ``args``, checked by its validators, and None; with ``--sized-ahead``,
    for a layout the run refuses only for now, the configuration without that (:func:`_fields`) and the
    run's refusal. Raises :class:`FixresError` (one line) for what the run refuses, and for a hybrid shard
    without ``--shard-group-size`` (a run's default is a node's ranks: a dry run has no nodes)."""
    if args.sharding == "hybrid" and args.num_tasks > 1:
        if args.shard_group_size is None:
            raise FixresError("--sharding hybrid needs --shard-group-size in a dry run (a run shards within a "
                              "node's ranks by default, and a dry run has no nodes)")
        if args.shard_group_size == 1:
            raise FixresError("--shard-group-size 1 shards over one rank, which is DDP: use --sharding ddp")
    try:
        return TrainerConfig(**_fields(args)), None
    except FixresError as exc:
        refused = f"the run refuses this layout: {exc}"
        if not args.sized_ahead:
            raise FixresError(refused) from None
    try:
        return TrainerConfig(**_fields(args, for_now=True)), refused
    except FixresError as exc:
        raise FixresError(f"the run refuses this layout: {exc}") from None


def dry_run(args: argparse.Namespace) -> DryRun:
    """Check ``args`` as a run would (:func:`config_of`; the preflight's checks of the resolution and of
    the split), build the layout's mesh as its last rank on a fake process group of that many ranks (no
    process group may exist in this process), estimate each stage's peak per rank. Raises
    :class:`FixresError` (one line) for a layout, model or batch that cannot run."""
    config, refused = config_of(args)  # before importing torch: a refusal in a fraction of a second
    found = asked(args)
    from fixres_dist.distributed.fake_group import fake_process_group
    from fixres_dist.training import inputs, memory_estimate

    inputs.check_sizes(config, args.classes)
    try:
        inputs.check_split(config, args.classes)
    except FixresError as exc:
        raise FixresError(f"the run refuses this layout: {exc}") from None
    rank = found.world - 1
    with fake_process_group(found.world, rank=rank):
        mesh = found.mesh("cpu")
        shape, where = tuple(mesh.shape), tuple(mesh.get_coordinate())
        if found.split:
            setting = f"{args.architecture} at {args.input_size} px, {args.opt}"
            step = attrs.evolve(memory_estimate.split_step(config, args.classes), layout=found)
            stages = memory_estimate.split_estimates(step, setting)
        else:
            stages = [memory_estimate.estimate(config, args.classes)]
    if not stages[0].known:
        raise FixresError(stages[0].describe())
    return DryRun(found, rank, shape, where, stages, refused)


def parser() -> argparse.ArgumentParser:
    """The command line (the scripts' flag names and their types; usage errors in one line)."""
    whole = arguments.positive_int
    p = arguments.OneLineParser(prog="python -m fixres_dist.training.dry_run", description=DESCRIPTION,
                    formatter_class=arguments.Formatter)
    p.add_argument("--num-tasks", type=_ranks, required=True, help=f"ranks in the job (at most {MAX_RANKS:,})")
    # Parsed as the Layout's sizes (args.tensor, args.pipeline), shown as the scripts' flags
    p.add_argument("--tensor-parallel", dest="tensor", metavar="TENSOR_PARALLEL", type=whole, default=1,
                   help="ranks per tensor group (default 1)")
    p.add_argument("--pipeline-stages", dest="pipeline", metavar="PIPELINE_STAGES", type=whole, default=1,
                   help="pipeline stages (default 1)")
    p.add_argument("--sharding", choices=SHARDINGS, default="ddp", help="how data-parallel ranks hold the model")
    p.add_argument("--shard-group-size", type=whole, default=None,
                   help="--sharding hybrid's shard group (ranks; required with it)")
    p.add_argument("--architecture", default="timm/vit_large_patch16_224", help="default %(default)s")
    p.add_argument("--input-size", type=arguments.training_size, default=224,
                   help="training resolution in pixels (default 224)")
    p.add_argument("--num-classes", "--classes", dest="classes", type=whole, default=1000, metavar="N",
                   help="classes of the head (default 1000)")
    p.add_argument("--batch", type=whole, default=64, help="images per data-parallel rank per step (default 64)")
    p.add_argument("--pipeline-microbatches", type=whole, default=None,
                   help="with --pipeline-stages (default: one per stage, two with interleaved-1f1b)")
    p.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES, default="1f1b",
                   help="with --pipeline-stages (default 1f1b)")
    p.add_argument("--opt", choices=OPTIMIZERS, default="sgd", help="default sgd (with momentum 0.9)")
    p.add_argument("--sized-ahead", action="store_true",
                   help="size a layout the run refuses only for now (pipeline x tensor, stages sharded, tensor "
                        "groups in hybrid shards) for when it is built, instead of refusing it")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command: prints :meth:`DryRun.lines`; exit status 0, or 1 with one line on stderr (2 for a
    usage error)."""
    args = parser().parse_args(argv)
    try:
        found = dry_run(args)
    except FixresError as exc:
        say(f"fixres_dist: dry run: {first_line(exc)}")
        return 1
    except Exception as exc:  # what no check foresaw: still one line
        say(f"fixres_dist: dry run: {type(exc).__name__}: {first_line(exc)}"[:400])
        return 1
    if found.refused:
        say(f"fixres_dist: dry run: {found.refused}; sized for when it is built (--sized-ahead)")
    print("\n".join(found.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
