"""Benchmark ranks on this machine: N processes forked from a forkserver that imported torch, timm and
the package once, meeting at tcp://127.0.0.1:<a free port>; each writes its figures, or why it
failed in one line, to a JSON file that the parent reads back, one list entry per rank."""
from __future__ import annotations

import contextlib
import json
import socket
import traceback
from pathlib import Path
from typing import Callable

import torch.multiprocessing as mp

from fixres_dist.errors import first_line

# What the forkserver imports once (each rank is forked from it with these already imported).
PRELOAD = ["fixres_dist.training.trainer", "timm", "torch.distributed.fsdp"]
GRACE_SECONDS = 10  # after one rank failed, how long the others have to end before SIGTERM (then SIGKILL)


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
    mp.set_forkserver_preload(PRELOAD)
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
    paths = [result_path(folder, name, rank) for rank in range(spec["world"])]
    return [json.loads(path.read_text()) if path.exists() else {"rank": rank, "error": f"no result ({failure})"}
            for rank, path in enumerate(paths)]
