"""Stop signals: the all-rank agreement to stop, the exit status, chaining to submitit, quiet helpers.

SIGTERM, SIGINT (Ctrl-C) or the configured preemption signal (SIGUSR2 by default, SLURM's warning
signal) on any rank is only *recorded* by :class:`StopSignals`. After each training step (and each
evaluation batch) every rank takes part in a :class:`StepAgreement`: one small all-reduce tells all
ranks whether any of them got a signal (and the earliest step whose loss was not finite on any
rank), so that they all write one checkpoint together at the same step and then raise
:class:`Preempted`. After a training step the all-reduce runs in the background during the next
step (no network round trip per step); before a checkpoint, an evaluation batch or the end of an
epoch the ranks agree on their current state. The launcher turns the stop into :func:`exit_status`
(3, or 130 for SIGINT); running the same command again resumes. If another Python handler owned the signal before
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
import multiprocessing.forkserver
import os
import signal
from typing import Callable

import attrs
import torch

from fixres_dist import finite, startup
from fixres_dist.distributed import collectives
from fixres_dist.errors import say

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
    """The signals that mean "checkpoint and stop": SIGINT, SIGTERM and the preemption signal, but
    those the job was started with ignored (:func:`fixres_dist.startup.inherited_ignored`)."""
    ignored = startup.inherited_ignored()
    return tuple(s for s in dict.fromkeys((signal.SIGINT, signal.SIGTERM, signal.Signals[preempt_signal]))
                 if s not in ignored)


def ignore_signals(signals, worker_id: int | None = None) -> None:
    """Ignore ``signals`` in this process and unblock them (a DataLoader ``worker_init_fn``)."""
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def loader_worker_init(signals, rank_pid: int | None = None, worker_id: int | None = None) -> None:
    """A DataLoader worker's ``worker_init_fn``: ignore the stop ``signals`` (:func:`ignore_signals`) and die
    with its rank, process ``rank_pid`` (SIGKILL when the rank's process ends, however: a worker stuck in a read
    never outlives it; a rank gone before this call ends the worker at once)."""
    ignore_signals(signals)
    startup.die_with_parent(signal.SIGKILL, rank_pid)


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
        for signum in stop_signals(self.preempt.name):
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

    def code(self) -> int:
        """This rank's stop signal as the number all-reduced (MAX) between ranks: 0 for none."""
        return self.codes.index(self.received) if self.received in self.codes else 0

    def adopt(self, code: int) -> signal.Signals | None:
        """Take the signal that the ranks agreed on (the MAX of their :meth:`code`); returns it, or None."""
        if code:
            self.received = self.codes[code]
        return self.received if code else None

    def chain(self) -> None:
        """Call the handler that owned the received signal before us (submitit's requeue), if any."""
        handler = self.previous.get(self.received)
        if callable(handler) and handler is not signal.default_int_handler and not startup.is_guard(handler):
            handler(self.received, None)


@attrs.frozen
class Agreed:
    """What every rank learnt from a :class:`StepAgreement`: the stop signal any rank got (the
    preemption signal first), and the earliest optimizer step whose loss was not finite on any rank."""

    stop: signal.Signals | None = None
    bad_step: int | None = None

    @property
    def go_on(self) -> bool:
        return self.stop is None and self.bad_step is None


class StepAgreement:
    """All ranks agree after every training step whether to go on, without waiting for the network.

    The state agreed on is this rank's stop signal (:class:`StopSignals`) and its first optimizer
    step with a non-finite loss (:class:`fixres_dist.finite.LossWatch`), both reduced by MAX in one
    small all-reduce on the gloo control group. Two ways:

    * :meth:`after_step` (pipelined, after a training step): waits for the all-reduce started after
      the *previous* step, which ran during this step's compute, returns its result, and starts this
      step's. Every rank gets the same result at the same step, so all ranks still checkpoint (or
      stop on a non-finite loss) at the same step, one step after the state it describes. The
      bound: a stop signal that arrives during step k is in the all-reduce started after step k
      and acted on after step k + 1, at most one step later than a blocking check; a non-finite
      loss of step k stops every rank after step k + 1 (k + 2 on CUDA, whose flag is read a step
      late), and the step named is still k. When the result says stop, no new all-reduce starts:
      the caller acts on it.
    * :meth:`now` (drain): waits for the pending all-reduce, then agrees on the current state,
      blocking. Used before whatever must see every rank's state after the last step: a checkpoint
      (nothing non-finite may be written), the end of an epoch, evaluation batches. Dropping the
      pending result loses nothing: both flags only grow (a rank's signal is only ever replaced by
      a stronger one, the first bad step never changes), so the current state contains it.

    Without a process group (one process) both agree at once, with nothing to wait for.
    ``progress()``: called at each agreement reached (the stall watchdog's
    :meth:`~fixres_dist.distributed.watchdog.StallWatchdog.progress`).
    """

    def __init__(self, stops: StopSignals, group=None, progress: Callable[[], None] = lambda: None):
        self.stops, self.group, self.progress = stops, group, progress
        self._pending: tuple[object, torch.Tensor] | None = None  # (handle, flags) of the running all-reduce

    def after_step(self, first_bad: int | None) -> Agreed:
        """After a training step: the agreement on the state after the previous step (see the class)."""
        if not collectives.is_initialized():
            return self.now(first_bad)
        agreed = self._finish() or Agreed()
        if agreed.go_on:
            flags = self._flags(first_bad)
            self._pending = (collectives.start_all_reduce_max(flags, self.group), flags)
        return agreed

    def now(self, first_bad: int | None) -> Agreed:
        """The agreement on every rank's current state (waits for the pending one first)."""
        self._finish()
        return self._read(collectives.all_reduce_max(self._flags(first_bad), self.group))

    def _flags(self, first_bad: int | None) -> torch.Tensor:
        return torch.tensor([self.stops.code(), finite.agreement_code(first_bad)], dtype=torch.int64)

    def _finish(self) -> Agreed | None:
        if self._pending is None:
            return None
        handle, flags = self._pending
        self._pending = None
        handle.wait()
        return self._read(flags)

    def _read(self, flags: torch.Tensor) -> Agreed:
        self.progress()
        stop_code, bad_code = flags.tolist()
        return Agreed(self.stops.adopt(stop_code), finite.agreed_bad_step(bad_code))


def stop_with_launcher() -> None:
    """In a rank started by a local launcher (training's, predict's): ask Linux to send this process SIGTERM
    when its parent exits (best effort, Linux only); raises ``SystemExit(3)`` where the launcher is already gone.

    A spawned rank's parent is the launcher's forkserver, which exits when the launcher's end of its
    "alive" pipe closes; multiprocessing hands every child a copy of that end, which is closed here
    so that the launcher's alone keeps the forkserver up. A launcher killed with SIGKILL thus still
    has its ranks checkpoint and stop instead of running on as orphans.
    """
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    startup.die_with_parent(signal.SIGTERM)
    if os.getppid() == 1:  # the launcher died before the request
        say("fixres_dist: the launcher is gone; this rank does not start")
        raise SystemExit(PREEMPTED_EXIT_STATUS)
