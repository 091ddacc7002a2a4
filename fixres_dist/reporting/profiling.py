"""``--profile``: a :mod:`torch.profiler` trace of a window of training steps on every rank.

The window: ``--profile N`` steps after ``--profile-after W`` steps of this process (a warm-up:
the first steps pay for allocations, cuDNN's search and compilation). Each rank writes, into
``<job folder>/profile/``:

* ``rank<R>.<host>.<pid>.<ms>.pt.trace.json``: the Chrome trace (``torch.profiler.tensorboard_trace_handler``),
  which Chrome's and Perfetto's trace viewers open, and TensorBoard's profiler plugin reads from the
  folder (``tensorboard --logdir <job folder>/profile``);
* ``rank<R>.txt``: the top operators by self time (CPU, and CUDA on a GPU): ``key_averages().table``.

Each step of the window is a ``ProfilerStep#K`` span: the time between two steps, so the loader's
wait for data shows before the step's forward, backward and optimizer operators. CPU activity is
recorded always, CUDA activity on a GPU. Nothing is recorded, and nothing costs anything, without
``--profile`` (no profiler object exists).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from fixres_dist import io
from fixres_dist.errors import FixresError

FOLDER = "profile"
TOP_OPERATORS = 25


def check_window(steps: int, after: int, run_steps: int) -> None:
    """Refuse a window that the run cannot reach: ``after + steps`` optimizer steps of ``run_steps``.
    Raises :class:`FixresError` in one line saying how many steps the run has."""
    if after + steps > run_steps:
        raise FixresError(f"--profile {steps} after --profile-after {after}: the window ends at step {after + steps}, "
                          f"but this run has {run_steps} optimizer steps; lower --profile-after or --profile")


class StepProfiler:
    """The profiler of one rank's training steps (module docstring): ``steps`` recorded after ``after``
    steps of this process, written into ``folder`` as ``rank<rank>...``; ``log``: rank 0's log, which
    says where the files went. Call :meth:`after_step` after each optimizer step; the profiler stops by
    itself after its window, and :meth:`close` stops it early (a run that ends inside the window writes
    what it recorded)."""

    def __init__(self, folder: Path, rank: int, steps: int, after: int, device: str,
                 log: Callable[[str], None]):
        self.folder, self.rank, self.log = Path(folder), rank, log
        self.folder.mkdir(parents=True, exist_ok=True)
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
        tensorboard_trace_handler(str(self.folder), worker_name=f"rank{self.rank}")(done)
        sort = "self_cuda_time_total" if ProfilerActivity.CUDA in done.activities else "self_cpu_time_total"
        table = done.key_averages().table(sort_by=sort, row_limit=TOP_OPERATORS)
        io.write_private(self.folder / f"rank{self.rank}.txt", table.encode(), mode=0o644)
        self.running = False
        self.log(f"profile: {self.folder} (a Chrome trace and the top operators of each rank; "
                 f"tensorboard --logdir {self.folder})")

    def close(self) -> None:
        """Stop now, writing what the window recorded if it is under way (nothing if it had not begun)."""
        if not self.stopped:
            self.stopped = True
            self.profiler.stop()
