"""From a command line to running ranks: resolve placement, check inputs, run or spawn, exit status.

Exit status: 0 on success; 1 on any failure, after one line ``fixres_dist: rank R: <cause>`` on
stderr (a traceback is printed before it only for unexpected errors, i.e. bugs); 2 for command-line
usage errors (argparse); 3 after a preemption (SIGTERM or the preemption signal): every rank wrote
the checkpoint, and running the same command again resumes. Bad input is found here, before any rank starts or anything is written.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import traceback
from pathlib import Path

import attrs
import torch.multiprocessing as mp

from . import checkpoint, data, distributed, extraction, fixres, models, placement, resolutions, weights
from .cli import build_parser, config_fields
from .config import TrainerConfig
from .errors import FixresError, first_line, say, user_message
from .preemption import PREEMPTED_EXIT_STATUS, Preempted
from .trainer import RunResult, Trainer


def build_config(mode: str, args: argparse.Namespace, environ=None) -> tuple[TrainerConfig, str]:
    """Resolve ranks for parsed ``args``; returns ``(config, placement source)``.

    In spawn mode the config is rank 0's; :func:`spawn` derives the others.
    Raises :class:`FixresError` on invalid or conflicting values.
    """
    where = placement.resolve_placement(args.num_tasks, args.global_rank, args.local_rank,
                                        args.job_id, args.dist_url, environ)
    config = TrainerConfig(**config_fields(args, mode)).placed(
        num_tasks=where.num_tasks, global_rank=where.global_rank, local_rank=where.local_rank,
        job_id=where.job_id, dist_url=where.dist_url)
    return config, where.source


def preflight(config: TrainerConfig) -> None:
    """Check data, architecture, resolutions (measured: :mod:`fixres_dist.resolutions`), weights,
    finetune scope and the features folder before anything starts; raises FixresError."""
    classes = data.check_image_folder(config.data_path or data.embedded_data_path(), 2 * config.num_tasks)
    shared = Path(config.shared_folder_path).absolute()
    existing = next(p for p in (shared / config.job_id, *(shared / config.job_id).parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise FixresError(f"cannot create the job folder {shared / config.job_id}: {existing} is not a writable folder")
    resume = config.resume or shared / config.job_id / checkpoint.CHECKPOINT_FILE
    if config.resume or os.path.exists(resume):
        checkpoint.check_resumable(config, checkpoint.load_checkpoint(resume)["config"], resume)
    models.check_architecture(config.architecture, config.low_res_stem)
    if config.device == "cuda":
        placement.cuda_device(config.local_rank)
    if config.compile:
        import torch._dynamo
        if config.compile not in torch._dynamo.list_backends(exclude_tags=()):
            raise FixresError(f"--compile {config.compile!r} is not a torch.compile backend; known: "
                              f"{', '.join(torch._dynamo.list_backends())}")
    sizes = {config.input_size, config.test_size, config.train_size, *(config.test_sizes or ())} - {None, "auto"}
    for size in sorted(sizes):
        models.check_resolution(config.architecture, size)
    if config.extract_features:
        extraction.check_destination(config.extract_features, config.overwrite)
    found = weights.read_weight_file(config.weight_path, config.weight_key) if config.weight_path else None
    trained_at = (found.config or {}).get("input_size") if found else None
    resolutions.check_run_sizes(config, len(classes), trained_at if isinstance(trained_at, int) else None)
    if found:
        build_size = resolutions.build_size(config)
        model = models.build_model(config.architecture, len(classes), image_size=build_size,
                                   low_res_stem=config.low_res_stem)
        weights.load_weights(model, found)
        if config.mode == "finetune" and not config.eval_only:
            fixres.trainable_modules(model, build_size, config.finetune_scope, config.last_norm)


def run_rank(config: TrainerConfig, checked: bool = False) -> RunResult:
    """Run one rank; on failure print one stderr line and exit 1 (3 after a preemption checkpoint).

    ``checked``: :func:`preflight` already ran for this job in this process or its parent.
    """
    prefix = f"fixres_dist: rank {config.global_rank}:"
    try:
        return Trainer(config, checked=checked)()
    except Preempted as exc:
        say(f"{prefix} {exc}")
        raise SystemExit(PREEMPTED_EXIT_STATUS) from None
    except KeyboardInterrupt:
        say(f"{prefix} interrupted")
    except Exception as exc:  # every failure ends with one line; bugs also get their traceback
        message = user_message(exc)
        if message is None:
            traceback.print_exc()
        say(f"{prefix} {message or f'{type(exc).__name__}: {first_line(exc)}'}")
    finally:
        distributed.destroy_process_group()
    raise SystemExit(1)


def _spawned_rank(index: int, config: TrainerConfig) -> None:
    run_rank(attrs.evolve(config, global_rank=index, local_rank=index), checked=True)


# What the forkserver imports once, before it forks each rank (instead of every rank importing it).
FORKSERVER_PRELOAD = ["fixres_dist.trainer"]


def start_method() -> str:
    """How :func:`spawn` starts ranks: ``forkserver``, with torch, torchvision and this package
    imported once in the server (a rank then starts in a fraction of a second instead of importing
    them for seconds); each rank is still a fresh process forked from a server that never ran a
    kernel, initialised CUDA or started threads. Where forkserver is missing: ``spawn``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    return "forkserver"


def spawn(config: TrainerConfig) -> None:
    """Start ``config.num_tasks`` local ranks and wait.

    SIGTERM, SIGINT and the preemption signal received by this parent are forwarded to the ranks.
    When a rank fails the others are terminated; the parent exits 1 (3 if the ranks were preempted
    and wrote their checkpoint).
    """
    context = mp.start_processes(_spawned_rank, args=(config,), nprocs=config.num_tasks, join=False,
                                 start_method=start_method())

    def forward(signum, frame):
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    forwarded = (signal.SIGTERM, signal.SIGINT, signal.Signals[config.preempt_signal])
    previous = {s: signal.signal(s, forward) for s in forwarded}
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as exc:
        if exc.exit_code == PREEMPTED_EXIT_STATUS:
            raise SystemExit(PREEMPTED_EXIT_STATUS) from None
        cause = f"was killed by {signal.Signals(-exc.exit_code).name}" if exc.exit_code < 0 else \
            f"exited with status {exc.exit_code}"
        say(f"fixres_dist: rank {exc.error_index} {cause}; stopped the other ranks")
        raise SystemExit(1) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(mode: str, argv: list[str] | None = None) -> None:
    """Entry point of ``main_scratch.py`` (``mode="scratch"``) and ``main_finetune.py`` (``"finetune"``)."""
    args = build_parser(mode).parse_args(argv)
    try:
        config, source = build_config(mode, args)
        checked = source in ("spawn", "single") or config.global_rank == 0
        if checked:
            preflight(config)
    except FixresError as exc:
        rank = args.global_rank if args.global_rank is not None else \
            os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
        say(f"fixres_dist: rank {rank}: {exc}")
        raise SystemExit(1) from None
    if source == "spawn":
        spawn(config)
    else:
        run_rank(config, checked)


def main_scratch() -> None:
    """Console entry point ``fixres-scratch`` (same as ``python main_scratch.py``)."""
    main("scratch")


def main_finetune() -> None:
    """Console entry point ``fixres-finetune`` (same as ``python main_finetune.py``)."""
    main("finetune")
