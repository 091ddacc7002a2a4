"""Benchmark ranks on this machine: N processes forked from a forkserver that imported torch, timm and
the package once, meeting at tcp://127.0.0.1:<a free port>; each writes its figures, or why it
failed in one line, to a JSON file that the parent reads back, one list entry per rank.

The parent decides when to stop: the forkserver is started with SIGINT blocked, which it and every rank
forked from it inherit, so that a Ctrl-C sent to the whole process group (as a terminal sends it) reaches
the parent alone; on it the parent ends the ranks and the forkserver (:func:`stop_all`) and only then
removes their folder (:mod:`fixres_dist.bench.strategies`)."""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import traceback
from pathlib import Path
from typing import Callable

import torch.multiprocessing as mp

from fixres_dist.errors import first_line

# What the forkserver imports once (each rank is forked from it with these already imported).
PRELOAD = ["fixres_dist.bench.preload"]
GRACE_SECONDS = 10  # after one rank failed, how long the others have to end before SIGTERM (then SIGKILL)
STOP_SECONDS = 5  # after SIGTERM, how long a rank has to end before SIGKILL


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def result_path(folder: str | Path, name: str, rank: int) -> Path:
    return Path(folder) / f"{name}-rank{rank}.json"


@contextlib.contextmanager
def rank_result(folder: str | Path, name: str, rank: int):
    """Yields this rank's result dict (``{"rank": rank}``), written as JSON on the way out; an exception
    is printed with its traceback, recorded as ``result["error"]`` (``"Type: first line"``) and raised again."""
    result = {"rank": rank}
    try:
        yield result
    except Exception as exc:
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {first_line(exc)}"
        raise
    finally:
        result_path(folder, name, rank).write_text(json.dumps(result))


def run_ranks(target: Callable, spec: dict, folder: str | Path, name: str | None = None,
              grace: float = GRACE_SECONDS) -> list[dict]:
    """Run ``target(rank, spec, port, folder)`` on ``spec["world"]`` local ranks and return each rank's
    result (written with :func:`rank_result` under ``name``, default ``spec["name"]``); a rank that wrote
    none is ``{"rank": r, "error": "no result (...)"}``. When a rank fails, the others have ``grace``
    seconds to end, then are ended (SIGTERM, then SIGKILL), and the parent goes on."""
    name = name or spec["name"]
    start_forkserver()
    failure = "the process wrote none"
    try:
        context = mp.start_processes(target, args=(spec, free_port(), str(folder)), nprocs=spec["world"],
                                     start_method="forkserver", join=False)
        while not context.join(grace_period=grace):
            pass
    except mp.ProcessRaisedException as exc:  # the rank printed its traceback and wrote its error
        failure = f"ended when rank {exc.error_index} failed"
    except mp.ProcessExitedException as exc:  # killed, or exited without raising
        failure = f"ended when rank {exc.error_index} exited: {first_line(exc)}"
    except BaseException:  # Ctrl-C, SIGTERM: no rank outlives this call, nor writes after it
        stop_ranks()
        raise
    paths = [result_path(folder, name, rank) for rank in range(spec["world"])]
    return [json.loads(path.read_text()) if path.exists() else {"rank": rank, "error": f"no result ({failure})"}
            for rank, path in enumerate(paths)]


_STARTED_HERE: list[int] = []  # the pid of the forkserver start_forkserver started (stop_all ends only that one)


def start_forkserver() -> None:
    """Start the forkserver (once per process) with SIGINT blocked: it, and every rank forked from it,
    inherit the blocked signal, so that neither prints a KeyboardInterrupt traceback (not even while the
    forkserver imports :data:`PRELOAD`) nor writes a result after the parent gave up on it. A forkserver
    the calling process runs already (a test session's) is used as it is, and left running."""
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None:
        multiprocessing.forkserver.ensure_running()
        return
    mp.set_forkserver_preload(PRELOAD)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a SIGINT meanwhile is delivered to the parent now
    _STARTED_HERE.append(server._forkserver_pid)


def stop_ranks(timeout: float = STOP_SECONDS) -> None:
    """End every rank this process started that is still running (SIGTERM, then SIGKILL after
    ``timeout`` seconds) and wait until each has ended."""
    children = multiprocessing.active_children()
    for child in children:
        with contextlib.suppress(OSError):
            child.terminate()
    for child in children:
        child.join(timeout)
    for child in children:
        if child.is_alive():
            with contextlib.suppress(OSError):
                child.kill()
            child.join()


def stop_all() -> None:
    """:func:`stop_ranks`, then the forkserver (SIGTERM: it may still be importing) and wait for it."""
    stop_ranks()
    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None or pid not in _STARTED_HERE:  # none, or the caller's own: it stays (other jobs fork from it)
        return
    _STARTED_HERE.remove(pid)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(OSError, AttributeError):
        server._stop()  # closes its pipe, waits for it, removes its socket
