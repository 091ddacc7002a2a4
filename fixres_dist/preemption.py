"""Stop signals: the all-rank agreement to stop, the exit status, chaining to submitit, quiet helpers.

SIGTERM, SIGINT (Ctrl-C) or the configured preemption signal (SIGUSR2 by default, SLURM's warning
signal) on any rank is only *recorded* by :class:`StopSignals`. After each training step (and each
evaluation batch) every rank calls :meth:`StopSignals.agree`: one small all-reduce tells all ranks
whether any of them got a signal, so that they all write one checkpoint together at the same step
and then raise :class:`Preempted`. The launcher turns that into :func:`exit_status` (3, or 130 for
SIGINT); running the same command again resumes. If another Python handler owned the signal before
(submitit's requeue handler), :meth:`StopSignals.chain` calls it after the checkpoint, so the job is
requeued at a safe point.

SLURM (time limit, preemption, ``scancel --signal``), ``timeout``, ``kill -- -PGID``, container
runtimes and Ctrl-C signal *every* process of a job, not only the ranks. The helper processes
therefore ignore the stop signals and leave the decision to the ranks: DataLoader workers
(:func:`shielded_fork_context`, :func:`ignore_signals`) and the spawn launcher's forkserver and
resource tracker (:func:`ignoring`).
"""
from __future__ import annotations

import contextlib
import multiprocessing.context
import signal

import torch

from . import distributed, startup

PREEMPTED_EXIT_STATUS = 3
INTERRUPTED_EXIT_STATUS = 128 + signal.SIGINT  # 130, the shells' status for Ctrl-C


def exit_status(received: signal.Signals | None) -> int:
    """The exit status after a stop checkpoint: 130 for SIGINT (Ctrl-C), else 3 (preempted)."""
    return INTERRUPTED_EXIT_STATUS if received == signal.SIGINT else PREEMPTED_EXIT_STATUS


class Preempted(Exception):
    """Raised on every rank after the stop checkpoint is written (or when there was nothing to save).

    ``signal`` is the stop signal agreed on (None when unknown); :func:`exit_status` gives the status.
    """

    def __init__(self, message: str, received: signal.Signals | None = None):
        super().__init__(message)
        self.signal = received


def stop_signals(preempt_signal: str = "SIGUSR2") -> tuple[signal.Signals, ...]:
    """The signals that mean "checkpoint and stop": SIGINT, SIGTERM and the preemption signal."""
    return tuple(dict.fromkeys((signal.SIGINT, signal.SIGTERM, signal.Signals[preempt_signal])))


def ignore_signals(signals, worker_id: int | None = None) -> None:
    """Ignore ``signals`` in this process and unblock them (a DataLoader ``worker_init_fn``)."""
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


@contextlib.contextmanager
def ignoring(signals):
    """Ignore ``signals`` while the block runs; processes started meanwhile (a forkserver, the
    resource tracker: fork + exec keeps ignored signals ignored) ignore them for good."""
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signals}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def shielded_fork_context(signals) -> multiprocessing.context.BaseContext:
    """A fork context whose processes start with ``signals`` blocked (DataLoader workers).

    The block closes the window between the fork and the worker's ``worker_init_fn``
    (:func:`ignore_signals`), where a signal to the whole process group would still kill the
    worker (PyTorch's worker SIGTERM handler). Nothing is lost: the rank itself sees every signal.
    """
    blocked = tuple(signals)

    class ShieldedForkProcess(multiprocessing.context.ForkProcess):
        def start(self):
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
            try:
                super().start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    class ShieldedForkContext(multiprocessing.context.ForkContext):
        Process = ShieldedForkProcess

    return ShieldedForkContext()


class StopSignals:
    """Records SIGINT, SIGTERM and the preemption signal while installed (``with StopSignals(...):``).

    The preemption signal wins over SIGTERM, and SIGTERM over SIGINT: submitit sends SIGTERM, then
    the warning signal.
    """

    def __init__(self, preempt_signal: str = "SIGUSR2"):
        self.preempt = signal.Signals[preempt_signal]
        # all-reduced as their index, MAX wins
        self.codes = (None, *dict.fromkeys((signal.SIGINT, signal.SIGTERM, self.preempt)))
        self.received: signal.Signals | None = None
        self.previous: dict = {}

    def __enter__(self) -> "StopSignals":
        for signum in self.codes[1:]:
            self.previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def _record(self, signum, frame) -> None:
        if self.received is None or self.codes.index(signum) > self.codes.index(self.received):
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
        if callable(handler) and handler is not signal.default_int_handler and not startup.is_guard(handler):
            handler(self.received, None)
