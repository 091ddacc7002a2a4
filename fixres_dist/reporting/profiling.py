"""``--profile``: a :mod:`torch.profiler` trace of a window of training steps on every rank.

The window: ``--profile N`` steps after ``--profile-after W`` steps of this process (a warm-up:
the first steps pay for allocations, cuDNN's search and compilation). Each rank writes, into
``<job folder>/profile/``:

* ``rank<R>.<timestamp>.pt.trace.json``: the Chrome trace (named as ``torch.profiler.tensorboard_trace_handler``
  names it), which Chrome's and Perfetto's trace viewers open, and TensorBoard's profiler plugin reads
  from the folder (``tensorboard --logdir <job folder>/profile``);
* ``rank<R>.txt``: the top operators by self time (CPU, and CUDA on a GPU): ``key_averages().table``.

Both are written as every file of the job folder is (:mod:`fixres_dist.io`): owner-only (0600), whole
or not at all. A profile is optional: a trace that cannot be written (a full disk) is a warning line
naming the file and the cause, nothing partial is left, and training goes on.

Each step of the window is a ``ProfilerStep#K`` span: the time between two steps, so the loader's
wait for data shows before the step's forward, backward and optimizer operators. CPU activity is
recorded always, CUDA activity on a GPU. Nothing is recorded, and nothing costs anything, without
``--profile`` (no profiler object exists).

:func:`draw_trace` (``python -m fixres_dist.reporting.profiling TRACE.json PICTURE.png``) draws a
trace's timeline with matplotlib, for a page or a report where no trace viewer runs.
"""
from __future__ import annotations

import errno
import inspect
import os
import time
from pathlib import Path
from typing import Callable

from torch.profiler import ProfilerActivity, profile, schedule

from fixres_dist import io
from fixres_dist.errors import FixresError

FOLDER = "profile"
TOP_OPERATORS = 25


def check_window(steps: int, after: int, run_steps: int, done: int = 0) -> None:
    """Refuse a window that the run cannot reach: ``after + steps`` optimizer steps of the
    ``run_steps`` this process has left (``done`` before it, by a run it resumes). Raises
    :class:`FixresError` in one line saying how many steps the run has."""
    if after + steps > run_steps:
        left = f" left ({done} were done before this resume)" if done else ""
        raise FixresError(f"--profile {steps} after --profile-after {after}: the window ends at step {after + steps}, "
                          f"but this run has {max(run_steps, 0)} optimizer steps{left}; lower --profile-after or "
                          "--profile")


def check_folder(folder: Path) -> None:
    """Refuse a trace folder that cannot be written: a file in its place, or an existing folder
    without write permission (a new one is made under the job folder, checked before). Raises
    :class:`FixresError` in one line."""
    if folder.exists() and (not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK)):
        raise FixresError(f"--profile: cannot write the traces into {folder}: "
                          f"{'not a folder' if not folder.is_dir() else 'not writable'}; remove it or use another "
                          "--job-id")


class StepProfiler:
    """The profiler of one rank's training steps (module docstring): ``steps`` recorded after ``after``
    steps of this process, written into ``folder`` as ``rank<rank>...``; ``log``: rank 0's log, which
    says where the files went; ``warn``: every rank's warning line (a file that could not be written).
    Call :meth:`after_step` after each optimizer step; the profiler stops by itself after its window,
    and :meth:`close` stops it early (a run that ends inside the window writes what it recorded).
    Raises :class:`FixresError` when ``folder`` cannot be made."""

    def __init__(self, folder: Path, rank: int, steps: int, after: int, device: str,
                 log: Callable[[str], None], warn: Callable[[str], None]):
        self.folder, self.rank, self.log, self.warn = Path(folder), rank, log, warn
        try:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)  # inside the owner-only job folder
        except OSError as exc:
            raise FixresError(f"--profile: cannot make {self.folder} ({exc.strerror or exc}); free space there or run "
                              "without --profile") from None
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        warmup = 1 if after else 0  # the profiler's own warm-up step, taken from the steps before the window
        self.profiler = profile(activities=activities, record_shapes=False,
                                schedule=schedule(wait=after - warmup, warmup=warmup, active=steps, repeat=1),
                                on_trace_ready=self._write)
        self.profiler.start()
        self.running, self.stopped = True, False

    def after_step(self) -> None:
        """One optimizer step done: the window moves on (and is written as it ends)."""
        if self.running:
            self.profiler.step()

    def _write(self, done: profile) -> None:
        self.running = False
        writing = self.folder / f"rank{self.rank}.{time.time_ns()}.pt.trace.json"
        try:
            io.write_private_by_name(writing, lambda name: export_trace(done, name))
            writing = self.folder / f"rank{self.rank}.txt"
            sort = "self_cuda_time_total" if ProfilerActivity.CUDA in done.activities else "self_cpu_time_total"
            io.write_private(writing, done.key_averages().table(sort_by=sort, row_limit=TOP_OPERATORS).encode())
        except OSError as exc:  # a full disk: the profile is left out, the training goes on
            self.warn(f"--profile: cannot write {writing} ({exc.strerror or exc}): nothing partial is kept, and "
                      f"training goes on without this rank's {'trace' if writing.suffix == '.json' else 'table'}; "
                      f"free space in {self.folder}, or run without --profile")
            return
        self.log(f"profile: {self.folder} (a Chrome trace and the top operators of each rank; "
                 f"tensorboard --logdir {self.folder})")

    def close(self) -> None:
        """Stop now, writing what the window recorded if it is under way (nothing if it had not begun)."""
        if not self.stopped:
            self.stopped = True
            self.profiler.stop()


def export_trace(done: profile, path: Path) -> None:
    """Write the Chrome trace of ``done`` into the file ``path``. Raises OSError when it cannot be
    written whole: torch's Python writer says why; kineto's (torch without it) leaves its temporary
    ``<path>.tmp`` instead of renaming it, which is removed (the cause then told by the free space)."""
    if "use_python_export" in inspect.signature(done.export_chrome_trace).parameters:
        done.export_chrome_trace(str(path), use_python_export=True)
        return
    done.export_chrome_trace(str(path))
    left = Path(f"{path}.tmp")
    if left.exists():
        full = os.statvfs(path.parent).f_bavail == 0
        left.unlink()
        code = errno.ENOSPC if full else errno.EIO
        raise OSError(code, os.strerror(code) if full else "torch's trace writer failed (its log says why)")


def _outermost(events: list[dict]) -> list[dict]:
    """The events of one thread or stream that no earlier one encloses, by start time."""
    kept, end = [], float("-inf")
    for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if event["ts"] >= end:
            kept.append(event)
            end = event["ts"] + event["dur"]
    return kept


def _kind(event: dict) -> str:
    name = event["name"]
    if "DataLoader" in name:
        return "waiting for data"
    if name.startswith("Optimizer."):
        return "optimizer"
    if "backward" in name.lower() or "Backward" in name or "autograd" in name:
        return "backward"
    if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
        return "GPU kernel"
    return "forward and other"


def _spans(trace: Path) -> list[dict]:
    """The complete events (``"ph": "X"``, with a name, a start, a duration and a thread) of a Chrome
    trace; :class:`FixresError` for a file that is not one."""
    import json

    try:
        return [e for e in json.loads(Path(trace).read_text())["traceEvents"]
                if isinstance(e, dict) and e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))
                and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("name"), str) and "tid" in e]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FixresError(f"{trace}: not a torch.profiler Chrome trace ({type(exc).__name__}: {exc})") from None


def draw_trace(trace: Path, picture: Path, title: str = "") -> None:
    """Draw the Chrome trace ``trace`` (a ``--profile`` file) as a timeline into ``picture`` (PNG): one
    lane per CPU thread (its outermost operators) and per GPU stream (kernels), the ``ProfilerStep``
    spans above them; colours by what an operator does (data, forward, backward, optimizer, kernel).
    Milliseconds from the window's start on the x axis. Raises :class:`FixresError` for a file that
    is not such a trace."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not Path(trace).is_file():
        raise FixresError(f"{trace}: no such file")
    if Path(picture).is_dir() or not Path(picture).resolve().parent.is_dir():
        raise FixresError(f"{picture}: not a file in an existing folder")
    if Path(picture).suffix.lower() not in (".png", ".pdf", ".svg", ".jpg"):
        raise FixresError(f"{picture}: name a .png, .pdf, .svg or .jpg file")
    events = _spans(trace)
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise FixresError(f"{trace}: no ProfilerStep spans: not a --profile trace")
    start = min(e["ts"] for e in steps)
    lanes: dict[str, list[dict]] = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and not e["name"].startswith("ProfilerStep#"):
            lanes.setdefault(f"CPU thread {e['tid']}", []).append(e)
        elif e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            lanes.setdefault(f"GPU stream {e['tid']}", []).append(e)
    colours = {"waiting for data": "tab:orange", "forward and other": "tab:blue", "backward": "tab:red",
               "optimizer": "tab:green", "GPU kernel": "tab:purple"}
    names = sorted(lanes, key=lambda lane: (lane.startswith("GPU"), -len(lanes[lane])))
    fig, axis = plt.subplots(figsize=(12, 1.2 + 0.6 * len(names)))
    for row, lane in enumerate(names):
        for e in _outermost(lanes[lane]) if lane.startswith("CPU") else lanes[lane]:
            axis.barh(row, e["dur"] / 1000, left=(e["ts"] - start) / 1000, height=0.6, color=colours[_kind(e)],
                      linewidth=0)
    for e in steps:
        axis.barh(len(names), e["dur"] / 1000, left=(e["ts"] - start) / 1000, height=0.5, color="lightgrey",
                  edgecolor="black", linewidth=0.5)
        axis.text((e["ts"] - start + e["dur"] / 2) / 1000, len(names), e["name"], ha="center", va="center",
                  fontsize=7)
    axis.set_yticks(range(len(names) + 1), [*names, "steps"])
    axis.invert_yaxis()
    axis.set_xlabel("milliseconds from the window's start")
    axis.set_title(title or Path(trace).name, fontsize=9, pad=22)
    axis.legend(handles=[matplotlib.patches.Patch(color=c, label=k) for k, c in colours.items()], fontsize=7,
                loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=5, frameon=False)
    fig.tight_layout()
    try:
        fig.savefig(picture, dpi=110)
    except (OSError, ValueError) as exc:
        raise FixresError(f"cannot write {picture}: {getattr(exc, 'strerror', None) or exc}") from None
    finally:
        plt.close(fig)


if __name__ == "__main__":
    import sys

    from fixres_dist.errors import say

    usage = "usage: python -m fixres_dist.reporting.profiling TRACE.json PICTURE.png [TITLE]"
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(f"{usage}\n\nDraw a --profile Chrome trace's timeline (CPU threads, GPU streams, the steps) as a PNG.")
        raise SystemExit(0)
    if len(sys.argv) not in (3, 4):
        say(usage)
        raise SystemExit(2)
    try:
        draw_trace(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:])
    except FixresError as exc:
        say(f"fixres_dist.reporting.profiling: {exc}")
        raise SystemExit(1) from None
