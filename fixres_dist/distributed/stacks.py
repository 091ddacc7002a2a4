"""Where a stuck process is: the Python stacks of this rank's threads and of other processes (its
loader workers, a frozen peer on this host), written to one owner-only file for the stall watchdog
(:mod:`fixres_dist.distributed.watchdog`).

This process's own threads are read with ``sys._current_frames`` (named by :mod:`threading`); other
processes with ``py-spy dump --nonblocking`` (PyPI ``py-spy``, installed by ``scripts/setup.sh``),
which reads a process's memory without stopping it, so that it also reads one stopped by SIGSTOP.
py-spy needs the right to trace the process (same user; a child process, or
``/proc/sys/kernel/yama/ptrace_scope`` 0, or root); where it is missing or refused, the file says so
and gives what ``/proc`` tells (state, the kernel function the process waits in).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import psutil

PY_SPY_SECONDS = 10.0  # at most this long for one process's py-spy dump


def py_spy() -> str | None:
    """The ``py-spy`` executable: beside this interpreter (a virtual environment's), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def thread_stacks() -> str:
    """Every thread of this process, innermost call last, each headed by its name."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, '?')} ({ident}):\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


def describe_process(pid: int) -> str:
    """``pid N (name, state S, waiting in W)``, from psutil and ``/proc`` (what is readable)."""
    try:
        process = psutil.Process(pid)
        what = f"pid {pid} ({process.name()}, state {process.status()}"
    except psutil.Error:
        return f"pid {pid} (gone)"
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
        what += f", waiting in {wchan}" if wchan and wchan != "0" else ""
    except OSError:
        pass
    return what + ")"


def process_stacks(pid: int) -> str:
    """Another process's Python stacks (py-spy), or why they could not be read."""
    spy = py_spy()
    if spy is None:
        return "  (py-spy is not installed: `pip install py-spy` to record the stacks of other processes)\n"
    try:
        done = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
                              timeout=PY_SPY_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"  (py-spy failed: {exc})\n"
    if done.returncode != 0:
        return f"  (py-spy could not read it: {(done.stderr or done.stdout).strip().splitlines()[-1:]})\n"
    return done.stdout


def children() -> list[int]:
    """This process's child processes, recursively (its loader workers among them)."""
    try:
        return [child.pid for child in psutil.Process().children(recursive=True)]
    except psutil.Error:
        return []


def write_stacks(path: Path, header: str, own: bool = True, others: list[int] | None = None) -> Path:
    """Write ``header``, then this process's threads (``own``) and each of ``others``' stacks (default:
    this process's children) to ``path``, owner-only (0600), replacing an older file; returns ``path``.
    Raises ``OSError`` when the folder cannot be written."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"{header}\n{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, host {os.uname().nodename}\n\n")
        if own:
            out.write(f"=== this process, {describe_process(os.getpid())}: its threads\n{thread_stacks()}\n")
        for pid in children() if others is None else others:
            out.write(f"=== {describe_process(pid)}\n{process_stacks(pid)}\n")
    return path
