"""The stall watchdog: a rank that makes no progress for ``--stall-timeout`` seconds ends the job,
naming the stalled rank, its host and what it was doing, with every rank's stacks in the job folder.

A job hangs when one rank stops (a data read on a hung network filesystem, a loader worker that
never answers, a process frozen by SIGSTOP or a node that stops answering but keeps its sockets):
the others then wait for it in their next collective. Without a watchdog nothing is said until
``--dist-timeout`` (if at all: the stuck rank itself waits in no collective), and a cluster
allocation burns.

* **Progress** is an all-rank step agreement reached (:class:`~fixres_dist.distributed.preemption.StepAgreement`
  calls :meth:`StallWatchdog.progress`): after every training step, before every checkpoint, at every
  evaluation batch. A daemon thread looks every :data:`POLL_S` seconds at how long ago that was.
* **The phase** is read off the watched thread's Python stack (:func:`phase_of`): waiting for a
  batch from the loader workers, reading images in the rank, in a collective (waiting for peers), in
  the backward pass, writing a checkpoint, compiling. It names what a stalled rank was doing, and
  makes the watchdog patient where slowness is normal (checkpoint files, ``torch.compile``).
* **The limit**: before the first agreement (start-up: building, loading, compiling, the first batch)
  :data:`AUTO_STARTUP_S`, or ``--stall-timeout`` if longer; then ``--stall-timeout SECONDS`` for every
  phase; ``0`` turns the watchdog off; the default (``auto``) is derived from the steps seen:
  :data:`AUTO_FACTOR` times the longest gap between two agreements of this run so far, at least
  :data:`AUTO_FLOOR_S`, and :data:`AUTO_STARTUP_S` in the patient phases. After a stop
  signal (SIGTERM, the launcher gone: :func:`fixres_dist.startup.die_with_parent`), a rank that does
  not reach its next step within :data:`STOP_GRACE_S` is stalled too: no rank outlives its launcher.
* **On a stall** the rank that saw it first marks the stall in the rendezvous store; every rank that
  still runs Python writes its stacks and its loader workers' (:mod:`fixres_dist.distributed.stacks`) to
  ``<job folder>/stalls/rank<R>.txt`` and reports its phase; ranks that do not report and whose heartbeat
  stopped are named as not answering (their stacks taken from this host where they run here). Every
  rank prints one line naming the stalled rank, host and phase, and ends with :data:`STALL_EXIT_STATUS`
  (its loader workers die with it). Nothing is written but the stacks: the last checkpoint is kept and
  the same command resumes from it.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import attrs
import psutil

from fixres_dist.distributed import stacks, store_threads
from fixres_dist.errors import say

STALL_EXIT_STATUS = 5
STALLS_FOLDER = "stalls"
POLL_S = 1.0  # how often the watchdog looks (seconds)
AUTO_FACTOR = 10.0  # auto: this many times the longest gap between two agreements seen ...
AUTO_FLOOR_S = 120.0  # ... at least this long (seconds) ...
AUTO_STARTUP_S = 1200.0  # ... and this long before the first agreement and in patient phases
STOP_GRACE_S = 30.0  # after a stop signal, the most a rank may take to reach its next step
REPORTS_S = 5.0  # how long the ranks' reports of a stall are awaited (several heartbeats)


@attrs.frozen
class Phase:
    """What a rank's watched thread is doing: ``what`` (words), whether it ``waits`` for its peers
    (in a collective), whether it is ``patient`` (long by nature: checkpoint files, compiling), whether it
    is ``failing`` (already ending: handling a peer's failure, which it will name itself)."""

    what: str
    waits: bool = False
    patient: bool = False
    failing: bool = False


WAITS = Phase("in a collective, waiting for its peers", waits=True)
FAILING = Phase("handling a failure of its peers", waits=True, failing=True)
# (fragment of a frame's file name, phase): the innermost frame that matches names the phase.
RULES = (
    ("fixres_dist/distributed/session.py", FAILING),  # RankSession.failed: finding who failed, telling the others
    ("fixres_dist/distributed/rendezvous.py", FAILING),
    ("torch/_dynamo/", Phase("compiling the model (torch.compile)", patient=True)),
    ("torch/_inductor/", Phase("compiling the model (torch.compile)", patient=True)),
    ("torch/distributed/checkpoint/", Phase("writing or reading a sharded checkpoint", patient=True)),
    ("torch/serialization.py", Phase("writing or reading a checkpoint file", patient=True)),
    ("fixres_dist/io.py", Phase("writing or reading a checkpoint file", patient=True)),
    ("torch/distributed/", WAITS),
    ("torch/nn/parallel/distributed.py", WAITS),
    ("torch/utils/data/dataloader.py", Phase("waiting for a batch from its loader workers")),
    ("fixres_dist/data/", Phase("reading images (in the rank's own process)")),
    ("torch/autograd/", Phase("in the backward pass or its gradient all-reduce (waiting for its peers)", waits=True)),
)
CONTEXTS = {"train_one_epoch": "training", "evaluate": "evaluating", "extract_features": "extracting features"}


def phase_of(frame) -> Phase:
    """The :class:`Phase` of a thread whose innermost frame is ``frame`` (None: not running)."""
    chain = []
    while frame is not None:
        chain.append(frame)
        frame = frame.f_back
    if not chain:
        return Phase("not running")
    phase = next((rule for f in chain for fragment, rule in RULES if fragment in f.f_code.co_filename), None)
    if phase is None:
        ours = next((f for f in chain if "fixres_dist" in f.f_code.co_filename), chain[0])
        phase = Phase(f"in {ours.f_code.co_name} ({Path(ours.f_code.co_filename).name}:{ours.f_lineno})")
    context = next((f for f in chain if f.f_code.co_name in CONTEXTS and "fixres_dist" in f.f_code.co_filename), None)
    if context is not None:
        epoch = context.f_locals.get("epoch")
        where = CONTEXTS[context.f_code.co_name] + (f", epoch {epoch + 1}" if isinstance(epoch, int) else "")
        phase = attrs.evolve(phase, what=f"{phase.what} ({where})")
    return phase


def phase_of_thread(ident: int) -> Phase:
    """The :class:`Phase` of this process's thread ``ident`` (:func:`phase_of` its innermost frame)."""
    return phase_of(sys._current_frames().get(ident))


def limit(timeout: float | None, phase: Phase, agreements: int, longest_gap: float, stopping: bool) -> float:
    """Seconds without progress after which a rank in ``phase`` is stalled (module docstring):
    ``timeout`` (None: auto) after ``agreements`` agreements whose longest gap was ``longest_gap``
    seconds; ``stopping``: a stop signal was received or the launcher is gone."""
    if not agreements:
        seconds = max(timeout or 0.0, AUTO_STARTUP_S)
    elif timeout is not None:
        seconds = timeout
    elif phase.patient:
        seconds = AUTO_STARTUP_S
    else:
        seconds = max(AUTO_FLOOR_S, AUTO_FACTOR * longest_gap)
    return min(seconds, STOP_GRACE_S) if stopping and not phase.patient else seconds


@attrs.frozen
class Report:
    """One rank's account of a stall: host, phase, seconds since its last progress, agreements."""

    rank: int
    host: str
    pid: int
    what: str
    waits: bool
    idle: float
    agreements: int


def diagnose(reports: dict[int, Report], silent: dict[int, str], stopping: str = "") -> str:
    """Who stalled, in words: ``silent`` ranks (rank -> "rank R on H (state)") first, as not answering;
    else the ranks that do not wait for their peers, with their phase; else every rank waits.
    ``stopping``: why the ranks should be stopping (a stop signal, the launcher's end), when the stall is a rank
    that did not reach its stop."""
    after = f" after {stopping}" if stopping else ""
    if silent:
        return f"{'; '.join(silent.values())}: no report and no heartbeat (stopped, frozen, or cut off from the " \
               f"network){after}"
    stuck = [r for r in reports.values() if not r.waits] or []
    if stuck:
        return "; ".join(f"rank {r.rank} on {r.host} (pid {r.pid}) made no progress for {r.idle:.0f} s{after}, {r.what}"
                         for r in sorted(stuck, key=lambda r: r.rank))
    longest = max(reports.values(), key=lambda r: r.idle)
    return (f"every rank waits for its peers ({longest.what}, {longest.idle:.0f} s){after}: none is stuck elsewhere, "
            "so the collectives themselves hang (the network, or gloo/NCCL)")


_running = []  # this process's running watchdog (one per rank), for progress()


def progress() -> None:
    """Progress of this process's running watchdog, from a loop that reaches no agreement (feature
    extraction, per batch); a no-op without one."""
    for running in _running:
        running.progress()


class StallWatchdog:
    """This rank's stall watchdog (module docstring). ``timeout``: ``--stall-timeout`` (None: auto,
    0: off); ``folder``: the job folder; ``stop_signal()``: the stop signal received, or None. It
    watches the thread that creates it. :meth:`attach` the rendezvous once the ranks met (None for one
    process), :meth:`start`, call :meth:`progress` at each agreement, :meth:`stop` at the end."""

    def __init__(self, timeout: float | None, rank: int, folder: Path, stop_signal: Callable[[], object]):
        self.timeout, self.rank, self.folder, self.stop_signal = timeout, rank, Path(folder), stop_signal
        self.parent = os.getppid()  # the launcher (or its forkserver, torchrun's agent, slurmstepd)
        self.watched = threading.get_ident()
        self.rendezvous = None
        self.last, self.longest, self.agreements = time.monotonic(), 0.0, 0
        self._stopped = threading.Event()

    def attach(self, rendezvous) -> None:
        self.rendezvous = rendezvous

    def progress(self) -> None:
        """An agreement was reached: every rank passed this point."""
        now = time.monotonic()
        if self.agreements:
            self.longest = max(self.longest, now - self.last)
        self.agreements += 1
        self.last = now

    def start(self) -> None:
        if self.timeout != 0:
            _running[:] = [self]
            store_threads.start(self._watch, "fixres-stall-watchdog")

    def stop(self) -> None:
        self._stopped.set()
        if self in _running:
            _running.remove(self)

    def stopping(self) -> str:
        """Why this rank should be stopping: the stop signal its handler recorded, or its launcher's end
        (its parent gone: the handler of the SIGTERM that follows runs only once the main thread moves), or ""."""
        received = self.stop_signal()
        if received is not None:
            return getattr(received, "name", str(received))
        return "its launcher's end" if os.getppid() != self.parent else ""

    def phase(self) -> Phase:
        return phase_of_thread(self.watched)

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_S):
            idle = time.monotonic() - self.last
            if idle < POLL_S * 2:
                continue
            if self.rendezvous is not None and self.rendezvous.stall_marked():
                return self._end(idle, self.phase())
            phase = self.phase()
            stalled = idle > limit(self.timeout, phase, self.agreements, self.longest, bool(self.stopping()))
            if stalled and not phase.failing:
                if self.rendezvous is not None:
                    self.rendezvous.mark_stall()
                return self._end(idle, phase)

    def _end(self, idle: float, phase: Phase) -> None:
        """Write this rank's stacks, exchange reports, name the stalled rank, end the process (a rank
        already ending through its failure path only reports)."""
        if self._stopped.is_set():
            return
        stopping = self.stopping()
        folder = self.folder / STALLS_FOLDER
        try:
            stacks.write_stacks(folder / f"rank{self.rank}.txt", f"rank {self.rank}: {phase.what}; no progress for "
                                f"{idle:.0f} s ({self.agreements} agreements so far)")
            where = f"stacks in {folder}/"
        except OSError as exc:
            where = f"its stacks could not be written ({exc.strerror}: {folder})"
        me = Report(self.rank, os.uname().nodename, os.getpid(), phase.what, phase.waits, idle, self.agreements)
        reports, silent = {self.rank: me}, {}
        if self.rendezvous is not None:
            found, silent = self.rendezvous.stall_reports(attrs.asdict(me), REPORTS_S)
            reports = {rank: Report(**report) for rank, report in found.items()}
            here = [r.rank for r in reports.values() if r.host == me.host]
            if self.rank == min(here):  # one rank per host reads the silent ones that run here
                self._stacks_of_silent(silent, folder)
        if self._stopped.is_set() or phase.failing:  # the run ended meanwhile, or ends through its failure path
            return
        say(f"fixres_dist: rank {self.rank}: stalled: {diagnose(reports, silent, stopping)}; {where}; the last "
            f"checkpoint is kept: run the same command to resume (exit status {STALL_EXIT_STATUS}, --stall-timeout: "
            "docs/checkpoints.md)")
        store_threads.end_process(STALL_EXIT_STATUS)

    def stalled_peers(self) -> str | None:
        """After a collective of this rank failed with every peer alive: whether a peer stalled. Marks the
        stall (each peer still running writes its stacks and ends, :data:`STALL_EXIT_STATUS`) and returns
        :func:`diagnose`'s words when a peer is silent or does not wait for its peers, else None."""
        if self.rendezvous is None:
            return None
        self.stop()  # this rank ends through its failure; its own watchdog stands down
        self.rendezvous.mark_stall()
        me = Report(self.rank, os.uname().nodename, os.getpid(), WAITS.what, True, time.monotonic() - self.last,
                    self.agreements)
        found, silent = self.rendezvous.stall_reports(attrs.asdict(me), REPORTS_S)
        reports = {rank: Report(**report) for rank, report in found.items()}
        if not silent and all(r.waits for r in reports.values()):
            return None
        return f"{diagnose(reports, silent)}; stacks in {self.folder / STALLS_FOLDER}/"

    def _stacks_of_silent(self, silent: dict[int, str], folder: Path) -> None:
        """The stacks of the silent ranks that run on this host, from py-spy (the first live rank here)."""
        for rank, pid in self.rendezvous.local_pids(silent).items():
            if psutil.pid_exists(pid):
                try:
                    stacks.write_stacks(folder / f"rank{rank}.txt", f"rank {rank}: silent (read by rank {self.rank})",
                                        own=False, others=[pid])
                except OSError:
                    pass
