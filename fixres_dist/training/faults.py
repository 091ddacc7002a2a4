"""Fault injection for tests: kill or break a chosen rank at a chosen step, or break a checkpoint write.

Set ``FIXRES_FAULT`` to ``ACTION:rank=R:step=S`` (several separated by ``,``), where ACTION is

* ``kill``: the rank SIGKILLs itself after global optimizer step S (a vanished node);
* ``raise``: the rank raises ``RuntimeError("injected fault")`` after step S (a bug);
* ``signal``: the rank sends itself the preemption signal after step S (SLURM's warning);
* ``eval-signal``: the same, during the first evaluation after step S (at its first batch);
* ``ckpt-write``: the checkpoint write at or after step S fails half-way with ENOSPC (a full disk);
* ``slow-step``: from step S on, each optimizer step of the rank takes ``seconds=T`` longer (a
  slower device: a straggler);
* ``slow-data``: from step S on, each batch reaches the rank ``seconds=T`` later (a slow loader;
  the delay is in the training process, so more ``--workers`` do not remove it).

``seconds`` defaults to 0.1.

Unset (the normal case), every hook is a no-op.
"""
from __future__ import annotations

import errno
import os
import signal
import time
from typing import Callable

import attrs

from fixres_dist.errors import FixresError

ENV = "FIXRES_FAULT"
ACTIONS = ("kill", "raise", "signal", "eval-signal", "ckpt-write", "slow-step", "slow-data")


@attrs.frozen
class Fault:
    action: str
    rank: int
    step: int
    seconds: float = 0.1


def planned_faults(environ=None) -> list[Fault]:
    """Parse ``FIXRES_FAULT``; raises FixresError on a malformed value."""
    text = (os.environ if environ is None else environ).get(ENV, "").strip()
    faults = []
    for item in filter(None, text.split(",")):
        try:
            action, *pairs = item.split(":")
            fields = dict(pair.split("=") for pair in pairs)
            fault = Fault(action, int(fields.get("rank", 0)), int(fields.get("step", 0)),
                          float(fields.get("seconds", 0.1)))
            if set(fields) - {"rank", "step", "seconds"} or fault.rank < 0 or fault.step < 0 \
                    or not 0 <= fault.seconds < 3600:
                raise ValueError
        except ValueError:
            raise FixresError(f"{ENV}={text!r}: expected ACTION:rank=R:step=S[:seconds=T] (R, S >= 0; "
                              "0 <= T < 3600)") from None
        if fault.action not in ACTIONS:
            raise FixresError(f"{ENV}: unknown action {fault.action!r} (one of {', '.join(ACTIONS)})")
        faults.append(fault)
    return faults


class FaultInjector:
    """Fires the planned faults of one rank at the Trainer's hooks."""

    def __init__(self, rank: int, preempt_signal: int, environ=None):
        self.faults = [f for f in planned_faults(environ) if f.rank == rank]
        self.preempt_signal = preempt_signal

    def after_step(self, global_step: int) -> None:
        for fault in self.faults:
            if fault.step == global_step:
                if fault.action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fault.action == "raise":
                    raise RuntimeError(f"injected fault at step {global_step}")
                if fault.action == "signal":
                    os.kill(os.getpid(), self.preempt_signal)

    def slowed(self, step: Callable, loader, state) -> tuple[Callable, object]:
        """``(step, loader)`` as given, or with ``slow-step`` a step that first sleeps, with
        ``slow-data`` a loader whose batches come later (``batch_sampler`` and ``len`` kept), each from
        its fault's step on (``state.global_step``: the steps done)."""
        slow = {f.action: f for f in self.faults if f.action in ("slow-step", "slow-data")}
        global_step = lambda: state.global_step  # noqa: E731
        if "slow-step" in slow:
            fault, inner = slow["slow-step"], step

            def step(*args):
                if global_step() + 1 >= fault.step:
                    time.sleep(fault.seconds)
                return inner(*args)
        return step, (SlowLoader(loader, slow["slow-data"], global_step) if "slow-data" in slow else loader)

    def during_evaluation(self, global_step: int) -> None:
        for fault in self.faults:
            if fault.action == "eval-signal" and fault.step == global_step:
                self.faults.remove(fault)  # once
                os.kill(os.getpid(), self.preempt_signal)
                break

    def checkpoint_write(self, global_step: int, file) -> None:
        """Called mid-write: writes a partial record, then fails like a full disk."""
        if any(f.action == "ckpt-write" and global_step >= f.step for f in self.faults):
            file.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class SlowLoader:
    """``loader``'s batches, each ``fault.seconds`` later from ``fault.step`` on (:meth:`FaultInjector.slowed`)."""

    def __init__(self, loader, fault: Fault, global_step: Callable[[], int]):
        self.loader, self.fault, self.global_step = loader, fault, global_step
        self.batch_sampler = loader.batch_sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            if self.global_step() + 1 >= self.fault.step:
                time.sleep(self.fault.seconds)
            yield batch
