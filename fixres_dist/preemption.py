"""Preemption: stop signals, the all-rank agreement to stop, the exit status, chaining to submitit.

SIGTERM or the configured preemption signal (SIGUSR2 by default, SLURM's warning signal) on any
rank is only *recorded* by :class:`StopSignals`. After each step every rank calls
:meth:`StopSignals.agree`: one small all-reduce tells all ranks whether any of them got a signal,
so that they all write one checkpoint together at the same step and then raise :class:`Preempted`.
The launcher turns that into :data:`PREEMPTED_EXIT_STATUS`; running the same command again resumes.
If another Python handler owned the signal before (submitit's requeue handler),
:meth:`StopSignals.chain` calls it after the checkpoint, so the job is requeued at a safe point.
"""
from __future__ import annotations

import signal

import torch

from . import distributed

PREEMPTED_EXIT_STATUS = 3


class Preempted(Exception):
    """Raised on every rank after the preemption checkpoint is written (exit status 3)."""


class StopSignals:
    """Records SIGTERM and the preemption signal while installed (``with StopSignals(...):``).

    The preemption signal wins over SIGTERM: submitit sends SIGTERM, then the warning signal.
    """

    def __init__(self, preempt_signal: str = "SIGUSR2"):
        self.preempt = signal.Signals[preempt_signal]
        self.codes = (None, signal.SIGTERM, self.preempt)  # all-reduced as their index, MAX wins
        self.received: signal.Signals | None = None
        self.previous: dict = {}

    def __enter__(self) -> "StopSignals":
        for signum in set(self.codes[1:]):
            self.previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def _record(self, signum, frame) -> None:
        if self.received != self.preempt:
            self.received = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        """Whether this rank got a stop signal (no communication)."""
        return self.received is not None

    def agree(self, group=None, also: torch.Tensor | None = None) -> signal.Signals | None:
        """All ranks: the stop signal any rank got (the preemption signal first), or None to go on.

        ``also``: an int64 tensor of other per-step flags (a non-finite loss, :mod:`fixres_dist.finite`)
        reduced by MAX in the same all-reduce and replaced in place by the result.
        """
        flag = torch.tensor([self.codes.index(self.received) if self.received in self.codes else 0])
        if also is not None:
            flag = torch.cat([flag, also.to(flag.dtype)])
        distributed.all_reduce_max(flag, group)
        if also is not None:
            also.copy_(flag[1:])
            flag = flag[:1]
        if flag.item():
            self.received = self.codes[int(flag.item())]
        return self.received if flag.item() else None

    def chain(self) -> None:
        """Call the handler that owned the received signal before us (submitit's requeue), if any."""
        handler = self.previous.get(self.received)
        if callable(handler):
            handler(self.received, None)
