"""The start of ``main_scratch.py`` and ``main_finetune.py``, and of their console entry points
``fixres-scratch`` and ``fixres-finetune``: parse the command line with the script's parser
(:mod:`fixres_dist.entry.cli`, which imports nothing heavy), then import the launcher, and torch,
and run (:func:`fixres_dist.entry.launch.main`). ``--help`` and usage errors (exit status 2) thus
answer without torch.
"""
from __future__ import annotations

from fixres_dist import startup
from fixres_dist.entry.cli import build_parser


def run_script(mode: str, argv: list[str] | None = None) -> None:
    """What ``main_<mode>.py`` and the console entry points run: parse ``argv`` (default: the
    command line) before anything heavy is imported, then import the launcher (and torch) and run
    (:func:`fixres_dist.entry.launch.main`). Stop signals before the launcher listens end it with one line,
    and those that arrive once the job is over are ignored (:mod:`fixres_dist.startup`). Once the
    launcher ran, the process ends through :func:`fixres_dist.distributed.store_threads.end_process`
    (``os._exit`` with the exit status: no native thread can abort the interpreter's finalization)."""
    startup.guard_signals()  # before torch loads: Ctrl-C or SIGTERM while starting is one line, not a traceback
    startup.quiet_native_logs()
    status = 0
    try:
        args = build_parser(mode).parse_args(argv)  # --help, a usage error: SystemExit, as any script
        from fixres_dist.entry.launch import main  # torch loads here, once the command line has parsed

        try:
            main(mode, args)
        except SystemExit as exc:
            status = exc.code
    finally:
        startup.ignore_signals()
    from fixres_dist.distributed import store_threads

    store_threads.end_process(status)


def main_scratch() -> None:
    """Console entry point ``fixres-scratch`` (same as ``python main_scratch.py``)."""
    run_script("scratch")


def main_finetune() -> None:
    """Console entry point ``fixres-finetune`` (same as ``python main_finetune.py``)."""
    run_script("finetune")
