"""``python -m fixres_dist.bench.strategies``: one model over several parallel layouts on N local
ranks, side by side: images per second, step time and peak memory per rank of each.

For every layout of ``--layouts`` (DDP, FSDP2 full or hybrid shard, tensor parallel, pipeline stages:
:mod:`fixres_dist.bench.layouts`), ``--ranks`` fresh local processes (gloo on the CPU; NCCL, one GPU
per rank, on CUDA) each build the project's Trainer through ``TrainerConfig``
(:mod:`fixres_dist.bench.trainer_rank`) and train on one fixed in-memory batch of ``--batch`` images
per data-parallel rank: peak memory over ``--memory-steps`` steps after the one that makes the
optimizer state (:mod:`fixres_dist.bench.rank_memory`: live tensor bytes on the CPU, CUDA's
``max_memory_allocated`` on a GPU), then ``--steps`` timed steps after ``--warmup``. A row: images/s
over the data-parallel ranks (``--batch`` x data-parallel ranks / the step), the step (the slowest
rank's median, seconds), peak MiB per rank (the largest rank), model states MiB per rank (parameters,
gradients, optimizer state), and both against the ``ddp`` row. For example::

    python -m fixres_dist.bench.strategies --ranks 4 --layouts ddp,full,hybrid:2,tensor:2,pipeline:2

Bad input (an unknown layout, ``--ranks`` below 1, a layout whose sizes do not divide ``--ranks``, an
unknown model or a size it cannot take, too few GPUs, a ``--json`` file that cannot be written) is
one line on stderr and exit status 2, before any rank starts. A layout that cannot run (the Trainer
refuses it before start: a model that cannot be split so; or a rank fails: out of memory) is a row
saying why in one line; the others go on (exit status 1 if none could be measured). ``--json FILE``
writes every rank's figures (atomically, readable by the owner only). Ctrl-C (SIGINT), SIGTERM or SIGUSR2
at any moment ends the ranks and the forkserver, removes their temporary folder, leaves ``--json`` as it
was, and exits with one line: status 130 for SIGINT, else 3.
"""
from __future__ import annotations

if __name__ == "__main__":
    from fixres_dist import startup

    startup.guard_signals()  # first: Ctrl-C while torch loads is one line, not a traceback
    startup.quiet_native_logs()  # before torch is imported: c10d's page of C++ frames when a rank's store goes away

import argparse
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from fixres_dist.arguments import OneLineParser, positive_int
from fixres_dist.bench.__main__ import check_writable
from fixres_dist.bench.layouts import GRAMMAR, parse_layouts
from fixres_dist.errors import FixresError, first_line, plural, say
from fixres_dist.io import write_private
from fixres_dist.startup import SIGNALS, ignore_signals, inherited_ignored

PROG = "python -m fixres_dist.bench.strategies"
COLUMNS = ("layout", "mesh", "img/s", "step s", "peak MiB/rank", "model states MiB/rank", "img/s / DDP",
           "peak / DDP")
MIB = 2 ** 20
CHECK_PORT = 29500  # the port of the configurations checked before the ranks start (nothing listens on it)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="One model over several parallel layouts on N local ranks: img/s, "
                      "step time and peak memory per rank of each, side by side (docs/sharding.md).")
    p.add_argument("--architecture", default="timm/vit_small_patch16_224",
                   help="the model, as main_scratch.py's --architecture (default: %(default)s)")
    p.add_argument("--size", type=positive_int, help="input size in pixels (default: 64 on the CPU, 224 on a GPU)")
    p.add_argument("--batch", type=positive_int, default=16,
                   help="images per data-parallel rank per step (default: 16)")
    p.add_argument("--ranks", type=positive_int, default=2, help="local ranks (processes) per layout (default: 2)")
    p.add_argument("--layouts", type=parse_layouts, default="ddp,full,tensor:2,pipeline:2", metavar="L,L",
                   help=f"layouts: {GRAMMAR} (default: %(default)s)")
    p.add_argument("--amp", choices=("off", "bf16", "fp16"), default="off", help="mixed precision (default: off)")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps per layout (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default: %(default)s)")
    p.add_argument("--memory-steps", type=positive_int, default=1,
                   help="steps whose peak memory is measured, before the warmup (default: %(default)s)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available, else cpu")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write every rank's figures as JSON")
    return p


def spec_of(args: argparse.Namespace, layout, name: str) -> dict:
    """The ranks' spec (:mod:`fixres_dist.bench.trainer_rank`) of ``layout``."""
    return {"name": name, "world": args.ranks, "device": args.device, "architecture": args.architecture,
            "size": args.size, "batch": args.batch, "amp": args.amp, "fields": layout.fields(),
            "memory_steps": args.memory_steps, "warmup": args.warmup, "steps": args.steps}


def check(args: argparse.Namespace, folder: str) -> None:
    """Everything that makes the whole command wrong, before any rank starts; raises :class:`FixresError`
    in one line. Fills in ``args.device`` and ``args.size``."""
    if args.warmup < 0:
        raise FixresError(f"--warmup {args.warmup}: must be >= 0")
    for layout in args.layouts:
        layout.check(args.ranks)
    if args.json:
        check_writable("--json", args.json)
    import torch

    from fixres_dist.models import architectures

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    args.device = args.device or ("cuda" if gpus else "cpu")
    if args.device == "cuda" and gpus < args.ranks:
        raise FixresError(f"--device cuda: one GPU per rank, and torch sees {gpus} for --ranks {args.ranks}")
    args.size = args.size or (224 if args.device == "cuda" else 64)
    architectures.check_architecture(args.architecture)
    architectures.check_resolution(args.architecture, args.size)
    check_patches(args.architecture, args.size)
    why = refusal(spec_of(args, parse_layouts("ddp")[0], "check"), folder)  # what every layout is refused for
    if why:
        raise FixresError(why)


def check_patches(architecture: str, size: int) -> None:
    """Raise :class:`FixresError` in one line, as the scripts' resolution check does for a torchvision ViT,
    where ``architecture`` (a timm model too: its ``patch_embed``) cuts images into square patches that do
    not divide ``size``: the model the ranks build for ``size`` px runs at no size at all, and the Trainer's
    own check can only say that. Built on the meta device: nothing is allocated."""
    from fixres_dist.models import architectures, resolutions

    try:
        model = resolutions.build_on_meta(architecture, 10, architectures.DEFAULT_SIZE)
    except Exception:  # noqa: BLE001 - the Trainer's check says why a model cannot be built
        return
    patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    patch = patch if isinstance(patch, (tuple, list)) else (patch, patch)
    patch = patch[0] if isinstance(patch[0], int) and patch[0] == patch[1] and patch[0] > 1 else None
    if patch and size % patch:  # the words of architectures.check_resolution's for a torchvision ViT
        below = size - size % patch
        raise FixresError(f"--size {size}: {architecture} needs an image size divisible by its patch size {patch}; "
                          f"{size} is not (nearest: {f'{below} or {below + patch}' if below else patch})")


def refusal(spec: dict, folder: str) -> str | None:
    """Why the Trainer refuses this layout before start (its configuration's checks and the launcher's
    preflight, as main_scratch.py's), or None."""
    from fixres_dist.bench.trainer_rank import rank_config
    from fixres_dist.training.inputs import preflight

    try:
        preflight(rank_config(spec, 0, CHECK_PORT, folder))
    except FixresError as exc:
        return first_line(exc)
    return None


def summary(layout, args: argparse.Namespace, ranks: list[dict], error: str | None) -> dict:
    """A layout's row: its figures over the ranks (the slowest median step, the largest peak), or its error."""
    row = {"layout": layout.text, "mesh": layout.mesh(args.ranks), "fields": layout.fields(), "ranks": ranks}
    failed = sorted((r for r in ranks if r.get("error")), key=lambda r: r["error"].startswith("no result"))  # the cause
    error = error or (f"rank {failed[0]['rank']}: {failed[0]['error']}" if failed else None)
    if error:
        return {**row, "error": error}
    step = max(r["step_s"] for r in ranks)
    return {**row, "error": None, "step_s": step, "img_s": args.batch * layout.data_parallel(args.ranks) / step,
            "peak_mib": max(r["peak"] for r in ranks) / MIB, "resident_mib": max(r["resident"] for r in ranks) / MIB,
            "model_states_mib": max(sum(r["model_states"].values()) for r in ranks) / MIB}


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each measured row's img/s and peak memory over the ``ddp`` row's (None without one)."""
    ddp = next((r for r in rows if r["layout"] == "ddp" and not r["error"]), None)
    for r in rows:
        if not r["error"]:
            r["img_s_over_ddp"] = r["img_s"] / ddp["img_s"] if ddp else None
            r["peak_over_ddp"] = r["peak_mib"] / ddp["peak_mib"] if ddp else None
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table, a layout per row (a failed one says why)."""
    def figure(value, digits):
        return "-" if value is None else f"{value:,.{digits}f}"

    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * (len(COLUMNS) - 2)]
    for r in rows:
        figures = (["error: " + r["error"], "", "", "", "", ""] if r["error"] else
                   [figure(r["img_s"], 1), figure(r["step_s"], 3), figure(r["peak_mib"], 1),
                    figure(r["model_states_mib"], 1), figure(r["img_s_over_ddp"], 2), figure(r["peak_over_ddp"], 2)])
        lines.append("| " + " | ".join([r["layout"], r["mesh"], *figures]) + " |")
    return "\n".join(lines)


def measure(args: argparse.Namespace, folder: str) -> list[dict]:
    """Every layout's row, in the order given; each runs on fresh ranks."""
    from fixres_dist.bench.local_ranks import run_ranks
    from fixres_dist.bench.trainer_rank import measure_rank

    rows = []
    for index, layout in enumerate(args.layouts):
        spec = spec_of(args, layout, f"layout{index}")
        started = time.perf_counter()
        error = refusal(spec, folder)
        ranks = [] if error else run_ranks(measure_rank, spec, folder)
        rows.append(summary(layout, args, ranks, error))
        r = rows[-1]
        print(f"{layout.text}: " + (f"error: {r['error']}" if r["error"] else
              f"{r['img_s']:,.1f} img/s, {r['peak_mib']:,.1f} MiB/rank") + f" ({time.perf_counter() - started:.0f} s)",
              flush=True)
    return with_ratios(rows)


class Stopped(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGUSR2 while the layouts are measured; ``signum``: which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum, frame) -> None:
    raise Stopped(signum)


def listen() -> dict:
    """Stop signals raise :class:`Stopped` from here on (those the command was started with ignored stay
    ignored); returns the handlers they replace."""
    ignored = inherited_ignored()
    return {signum: signal.signal(signum, _stop) for signum in SIGNALS if signum not in ignored}


def main(argv: list[str] | None = None) -> list[dict]:
    """Parse, check, measure every layout, print the table, write ``--json``; returns the rows. Bad input:
    one line on stderr, exit status 2; no layout measured: exit status 1; SIGINT or SIGTERM: the ranks
    and their folder gone, one line, exit status 130 or 3."""
    args = build_parser().parse_args(argv)
    import torch

    from fixres_dist.bench import local_ranks

    replaced = listen()
    folder = tempfile.mkdtemp(prefix="fixres-strategies-")
    stopped = None
    try:
        try:
            check(args, folder)
        except FixresError as exc:
            say(f"{PROG}: {exc}")
            raise SystemExit(2) from None
        where = (f"{torch.cuda.get_device_name()} x {args.ranks}, NCCL" if args.device == "cuda" else
                 f"cpu, {len(os.sched_getaffinity(0))} cores, gloo")
        print(header(args, where), flush=True)
        rows = measure(args, folder)
        print(table(rows), flush=True)
        if args.json:
            try:  # atomic, owner-only: a kill mid-write leaves the previous file as it was
                write_private(args.json, json.dumps({"command": PROG, "device": where, "settings": {
                    k: getattr(args, k) for k in ("architecture", "size", "batch", "ranks", "amp", "steps", "warmup",
                                                  "memory_steps")}, "layouts": rows}, indent=1) + "\n")
            except OSError as exc:
                say(f"{PROG}: cannot write --json {args.json}: {exc.strerror or exc}")
                raise SystemExit(1) from None
    except Stopped as stop:
        stopped = stop
        ignore_signals()  # a second Ctrl-C while the ranks end changes nothing
        local_ranks.stop_all()  # before the folder goes: no rank writes into it afterwards
        shutil.rmtree(folder, ignore_errors=True)  # with any file a rank wrote as it was stopped
        say(f"{PROG}: stopped by {signal.Signals(stop.signum).name}; nothing written")
        raise SystemExit(130 if stop.signum == signal.SIGINT else 3) from None
    finally:
        if stopped is None:  # done, refused or failed: a late Ctrl-C cannot interrupt the cleanup
            before = {signum: signal.getsignal(signum) for signum in SIGNALS}
            ignore_signals()
            local_ranks.stop_all()  # the forkserver too: nothing of this command outlives it
            shutil.rmtree(folder, ignore_errors=True)
            for signum, handler in {**before, **replaced}.items():  # as they were, for a caller
                if handler is not None:
                    signal.signal(signum, handler)
    if all(r["error"] for r in rows):
        say(f"{PROG}: no layout could be measured (each row says why)")
        raise SystemExit(1)
    return rows


def header(args: argparse.Namespace, where: str) -> str:
    """The first line of the output: the model, the batch, the ranks, the steps."""
    return (f"{PROG}: {args.architecture} @ {args.size} px, batch {args.batch} per data-parallel rank, amp "
            f"{args.amp}, {plural(args.ranks, 'rank')} on {where}; {plural(args.steps, 'timed step')} after "
            f"{plural(args.warmup, 'warm-up step')}; load "
            f"average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
