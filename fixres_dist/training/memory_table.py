"""``python -m fixres_dist.training.memory_table``: the estimated peak memory per rank (GiB) of a training
step for several choices at once (DDP, full and hybrid sharding, with and without activation
checkpointing) as a table on stdout, without a data folder (:func:`main`; docs/sharding.md, 'Will it
fit'). Each row is :func:`fixres_dist.training.memory_estimate.estimate`. Bad input is one line on
stderr: exit status 2 for a usage error, 1 for a model or size that cannot be. For example
``python -m fixres_dist.training.memory_table --architecture resnet50 --input-size 224 --batch 64 --num-tasks 8``.
"""
from __future__ import annotations

import argparse

import attrs

from fixres_dist.arguments import OneLineParser, positive_int
from fixres_dist.config import OPTIMIZERS, TrainerConfig
from fixres_dist.errors import FixresError, say
from fixres_dist.training.memory_estimate import GIB, METHOD, estimate

MODULE = "fixres_dist.training.memory_table"
PROG = f"python -m {MODULE}"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="The estimated peak memory per rank (GiB) of a training step, for DDP, "
                      "full and hybrid sharding, with and without activation checkpointing: torch's MemTracker/"
                      "FSDPMemTracker on fake tensors, in seconds on a CPU (docs/sharding.md, 'Will it fit').")
    p.add_argument("--architecture", help="model name, as main_scratch.py's --architecture (required)")
    p.add_argument("--input-size", type=positive_int, metavar="PX", help="training resolution in pixels (required)")
    p.add_argument("--batch", type=positive_int, default=64, help="images per rank per step (default: %(default)s)")
    p.add_argument("--num-tasks", type=positive_int, default=1, help="ranks (default: %(default)s)")
    p.add_argument("--num-classes", type=positive_int, default=1000, help="classes (default: %(default)s)")
    p.add_argument("--amp", choices=("bf16", "fp16", "off"), default="off", help="mixed precision (default: off)")
    p.add_argument("--opt", choices=OPTIMIZERS, default="sgd", help="optimizer (default: sgd)")
    p.add_argument("--shard-group-size", type=positive_int, metavar="N",
                   help="also a row for hybrid sharding in groups of N ranks")
    p.add_argument("--low-res-stem", action="store_true", help="torchvision ResNets' 3x3 stride-1 stem")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help="the device trained on: on cuda the optimizer is torch's foreach one (default: cuda when "
                        "available, else cpu)")
    return p


def table_rows(args: argparse.Namespace) -> list[tuple[str, TrainerConfig | str]]:
    """(label, configuration or why the configuration refuses it) for each row of the table. Raises
    :class:`FixresError` for bad input: an unknown architecture, a size it cannot train at, a batch
    or group size that cannot be."""
    from fixres_dist.models import architectures, resolutions

    architectures.check_architecture(args.architecture, args.low_res_stem)
    architectures.check_resolution(args.architecture, args.input_size)
    if args.shard_group_size and args.num_tasks % args.shard_group_size:
        raise FixresError(f"--shard-group-size {args.shard_group_size} does not divide --num-tasks {args.num_tasks}")
    base = TrainerConfig(architecture=args.architecture, input_size=args.input_size, batch=args.batch,
                         num_tasks=args.num_tasks, amp=args.amp, opt=args.opt, device=args.device,
                         low_res_stem=args.low_res_stem)
    probe = resolutions.Probe(args.architecture, args.num_classes, args.input_size, low_res_stem=args.low_res_stem,
                              batch=args.batch)
    resolutions.check_sizes(probe, [args.input_size], [])
    choices = [("ddp", {}), ("ddp + AC", {"activation_checkpointing": True})]
    if args.num_tasks > 1:
        choices += [("full", {"sharding": "full"}),
                    ("full + AC", {"sharding": "full", "activation_checkpointing": True})]
    if args.shard_group_size and args.num_tasks > 1:
        choices.append((f"hybrid ({args.shard_group_size})", {"sharding": "hybrid",
                                                               "shard_group_size": args.shard_group_size}))
    rows: list[tuple[str, TrainerConfig | str]] = []
    for label, fields in choices:
        try:
            rows.append((label, attrs.evolve(base, **fields)))
        except FixresError as exc:
            rows.append((label, str(exc)))
    return rows


def table(args: argparse.Namespace, rows: list[tuple[str, TrainerConfig | str]]) -> str:
    """The estimates of ``rows`` (:func:`table_rows`) as a text table, GiB per rank."""
    ranks = f"{args.num_tasks} ranks" if args.num_tasks > 1 else "1 rank (nothing to shard)"
    lines = [f"{args.architecture} at {args.input_size} px, batch {args.batch} per rank, {ranks}, {args.opt}, "
             f"amp {args.amp}, {args.num_classes} classes, on {args.device}: peak memory per rank in GiB ({METHOD})",
             f"{'choice':<14}{'peak':>8}{'params':>9}{'grads':>9}{'optim':>9}{'activ':>9}"]
    for label, config in rows:
        found = estimate(config, args.num_classes) if isinstance(config, TrainerConfig) else None
        if found is not None and found.known:
            sizes = (found.peak, found.parameters, found.gradients, found.optimizer, found.activations)
            lines.append(f"{label:<14}{sizes[0] / GIB:>8.3f}" + "".join(f"{s / GIB:>9.3f}" for s in sizes[1:]))
        else:
            lines.append(f"{label:<14}  no estimate: {found.reason if found is not None else config}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m fixres_dist.training.memory_table``: the table of :func:`table` on stdout; bad input in one
    line on stderr (exit status 2 for a usage error, 1 for a model or size that cannot be)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.architecture or args.input_size is None:
        parser.error("--architecture and --input-size are required")
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        rows = table_rows(args)
    except FixresError as exc:
        say(f"{PROG}: {exc}")
        raise SystemExit(1) from None
    print(table(args, rows), flush=True)


if __name__ == "__main__":
    main()
