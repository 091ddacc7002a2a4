"""One rank's session in a job: its device, the job lock, the rendezvous and process group, the
stop signals and the all-rank agreement on them, and what it tells its peers when it fails.

:class:`RankSession` is the first part a :class:`~fixres_dist.training.trainer.Trainer` opens and the
last it closes. Its errors: :class:`~fixres_dist.errors.FixresError` (the job folder in use, peers that
never arrive: :mod:`fixres_dist.distributed.rendezvous`), :class:`~fixres_dist.distributed.preemption.Preempted`
(a stop signal while waiting for the peers).
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist

from fixres_dist import io
from fixres_dist.config import TrainerConfig
from fixres_dist.distributed import collectives, joblock, layout, placement
from fixres_dist.distributed.preemption import Preempted, StepAgreement, StopSignals
from fixres_dist.distributed.rendezvous import LostPeers, NetworkInterrupted, RendezvousInterrupted
from fixres_dist.distributed.watchdog import StallWatchdog
from fixres_dist.errors import FixresError, first_line, user_message


class RankSession:
    """This rank's place among its peers, from the rendezvous to leaving the process group.

    ``locked``: the launcher holds the job lock (:mod:`fixres_dist.distributed.joblock`; spawn mode),
    else rank 0 takes it. ``announce``: a rank other than 0 prints one line on stdout when it has met
    its peers (ranks started in their own shells). ``log``: rank 0's log (a no-op on other ranks).

    ``device`` (``cpu`` or this rank's GPU), ``stops`` (the stop signals received, installed while the
    session is entered with ``with``), ``agreement`` (the step agreement, on the gloo control group
    once :meth:`open` met the peers), ``control_group``.
    """

    def __init__(self, config: TrainerConfig, log: Callable[[str], None], *, locked: bool = False,
                 announce: bool = False):
        self.config, self.log, self.locked, self.announce = config, log, locked, announce
        self.device = torch.device("cpu")
        self.stops = StopSignals(config.preempt_signal)
        self.agreement = StepAgreement(self.stops)
        self.rendezvous = None  # fixres_dist.distributed.rendezvous.Rendezvous once the ranks met (world > 1)
        self.control_group = None  # gloo group for stop flags and gathered RNG states
        self.lock = None
        self.watchdog = None  # this rank's StallWatchdog, once open() met the peers

    def __enter__(self) -> "RankSession":
        self.stops.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.stops.__exit__(*exc)

    def open(self, intro: str | None = None) -> None:
        """Pick the device and thread count, take the job lock (rank 0), meet the other ranks
        (:func:`fixres_dist.distributed.collectives.init_process_group`) and seed this rank's RNG
        (``--seed`` + global rank). ``intro``: rank 0's line after the job's first one (the Trainer's
        recipe, :func:`fixres_dist.training.recipes.describe`), or None."""
        cfg = self.config
        if not os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(placement.threads_per_rank(cfg.num_tasks))
        if cfg.device == "cuda":
            self.device = placement.cuda_device(cfg.local_rank)
            torch.cuda.set_device(self.device)
            torch.backends.cudnn.benchmark = True  # fixed input sizes: let cuDNN pick the fastest kernels
        io.make_private_folder(cfg.job_folder)  # holds the lock and the rendezvous file
        if cfg.global_rank == 0:
            if not self.locked:  # before any rendezvous: a second launch of a live job stops here
                self.lock = joblock.JobLock.acquire(cfg.job_folder, cfg.num_tasks)
            derived = " (derived from the configuration: the same command resumes this job)" \
                if cfg.job_id == cfg.derived_job_id() else ""
            self.log(f"job {cfg.job_id}{derived}: {cfg.run_name} {cfg.architecture}, {layout.of(cfg).describe()} on "
                     f"{self.device.type}, folder {cfg.job_folder}")
            if intro:
                self.log(intro)
        else:
            joblock.check_joinable(cfg.job_folder, cfg.global_rank)
        self._meet()
        torch.manual_seed(cfg.seed + cfg.global_rank)
        self.control_group = collectives.control_group()
        self.watchdog = StallWatchdog(cfg.stall_timeout, cfg.global_rank, cfg.job_folder, lambda: self.stops.received)
        self.watchdog.attach(self.rendezvous)
        self.watchdog.start()
        self.agreement = StepAgreement(self.stops, self.control_group, self.watchdog.progress)

    def _meet(self) -> None:
        cfg = self.config
        try:
            self.rendezvous = collectives.init_process_group(
                cfg.dist_backend, cfg.dist_url, cfg.global_rank, cfg.num_tasks, cfg.dist_timeout,
                should_stop=lambda: self.stops.requested,
                check_joinable=lambda: joblock.check_joinable(cfg.job_folder, cfg.global_rank))
        except RendezvousInterrupted as exc:
            raise Preempted(f"{exc}; nothing to checkpoint yet", self.stops.received) from None
        if cfg.global_rank == 0:
            joblock.record_met(cfg.job_folder)
            if self.rendezvous is not None:
                self.log(self.rendezvous.describe())
                self.rendezvous.watch_clients(lambda line: self.log(f"warning: {line}"))
        elif self.announce:
            print(f"fixres_dist: rank {cfg.global_rank} of {cfg.num_tasks} met its peers (job {cfg.job_id}); "
                  "rank 0 logs the run", flush=True)

    def failed(self, exc: Exception) -> Exception | None:
        """After ``exc`` on this rank: say why it stops to the other ranks, through the store, and
        (rank 0) keep the store up until they have read it. Returns the one-line error to raise
        instead of ``exc`` when the cause is elsewhere: peers that failed or vanished
        (:class:`~fixres_dist.distributed.rendezvous.LostPeers`, named with their host), or, every peer
        alive, the network (:class:`~fixres_dist.distributed.rendezvous.NetworkInterrupted`); None when
        the cause is this rank's own (its traceback is shown) or there are no peers."""
        if self.rendezvous is None:
            return None
        failure = self._tell_peers(exc)
        self.rendezvous.hold_store()  # rank 0: until the others have read what happened
        return failure

    def _tell_peers(self, exc: Exception) -> Exception | None:
        gone = self.rendezvous.lost_peers() if isinstance(exc, (RuntimeError, dist.DistError)) else ""
        if gone:
            self.rendezvous.announce_lost(gone)
            return LostPeers(gone)
        stalled = self.watchdog.stalled_peers() if collectives.is_collective_failure(exc) and self.watchdog else None
        if stalled:
            failure = FixresError(f"stalled: {stalled}")
            self.rendezvous.announce_failure(str(failure))
            return failure
        if collectives.is_collective_failure(exc):
            failure = NetworkInterrupted(first_line(exc), collectives.collective_timeout(self.config.dist_timeout))
            self.rendezvous.announce_failure(str(failure))
            return failure
        self.rendezvous.announce_failure(user_message(exc) or f"{type(exc).__name__}: {first_line(exc)}")
        return None

    def close(self) -> None:
        """Stop the stall watchdog, leave the process group and release the job lock (idempotent)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.rendezvous is not None:
            self.rendezvous.stop_heartbeat()
        collectives.destroy_process_group()
        self.rendezvous = self.control_group = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None
