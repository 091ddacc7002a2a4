"""Inside a SLURM job: where this task sits, where the ranks meet, and the requeue protocol.

One protocol for both ways of launching, submitit (``slurm/submit.py``) and plain sbatch
(``slurm/job.sbatch``); both end in :func:`run_task`:

1. **Place.** Global rank, local rank, number of tasks and job id come from SLURM's variables, read
   through ``submitit.JobEnvironment`` (an array task's id is ``<array id>_<index>``); the restart
   count is ``SLURM_RESTART_COUNT``.
2. **Meet.** The ranks meet at the published rendezvous file
   ``<shared>/<job id>/rendezvous-<restart>.json``, so a requeued run never meets a file of its
   earlier run; no port is chosen in advance.
3. **Stop.** SLURM's warning signal (USR2: ``--signal USR2@<delay>``, or ``scancel --signal=USR2
   JOBID``) or SIGTERM: every rank finishes its step, the ranks write one checkpoint together and
   stop (the Trainer's ``Preempted``, exit status 3).
4. **Requeue.** After the warning signal, rank 0 runs ``scontrol requeue <job id>`` (at most
   ``max_requeues`` times); the other ranks wait for the requeue to stop them (exiting first could
   let srun end the job before rank 0 requeues it). SLURM starts the job again with the same id and
   restart count + 1, and the Trainer resumes from the job folder's checkpoint. After SIGTERM
   (``scancel``, SLURM's own preemption) nothing is requeued here: SLURM decides.
5. **Lost peers.** When ranks die or a node drops off the network (not when a rank raised an
   error: that job fails, as it would again), the surviving ranks name them
   (:class:`~fixres_dist.distributed.rendezvous.LostPeers`; or, every peer alive, the network was interrupted:
   :class:`~fixres_dist.distributed.rendezvous.NetworkInterrupted`) and every survivor asks SLURM to requeue the job
   (the first request wins; at most ``max_requeues`` restarts in all): the job starts again, on
   whichever nodes SLURM gives it, and resumes from its last checkpoint. In an elastic job
   (``slurm/job.sbatch`` with a node range sets ``FIXRES_ELASTIC=1``) the survivors exit with
   :data:`RESTART_STEP_EXIT_STATUS` instead, and the batch script starts the step again on the nodes
   that still answer (``FIXRES_STEP`` counts those steps: the rendezvous file is then
   ``rendezvous-<restart>-<step>.json``, and they count against ``max_requeues``).

:class:`SlurmTask` is the callable submitit runs once per task; ``python -m fixres_dist.cluster
main_scratch.py [options]`` (:func:`main`) is what ``slurm/job.sbatch`` starts in every task with srun.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import attrs

from fixres_dist.cluster.inventory import run_command
from fixres_dist.cluster.template import config_from_argv
from fixres_dist.config import TrainerConfig

# TRAINER-SIDE: the Trainer, its preemption exception and the exit status 3 after a preemption
# checkpoint (fixres_dist.distributed.preemption); if they move, only these imports change.
from fixres_dist.distributed.preemption import PREEMPTED_EXIT_STATUS, Preempted
from fixres_dist.distributed.rendezvous import PeersUnreachable
from fixres_dist.errors import FixresError, first_line, say, user_message
from fixres_dist.training.inputs import JobInputs, preflight
from fixres_dist.training.trainer import Trainer

RESTART_STEP_EXIT_STATUS = 4  # elastic job, peers lost: slurm/job.sbatch restarts the step on the survivors
FOLLOWER_WAIT_S = 120    # how long a rank other than 0 waits for rank 0's requeue to stop it
MODES = {"main_scratch.py": "scratch", "scratch": "scratch", "main_finetune.py": "finetune", "finetune": "finetune"}


class TaskFailed(FixresError):
    """Raised by a task that failed; its message is the cause in one line (what monitoring reports)."""


@attrs.frozen
class TaskPlace:
    """Where this task sits in its SLURM job."""

    job_id: str
    global_rank: int
    local_rank: int
    num_tasks: int
    restart: int
    step: int = 0  # the step restarts of this run of an elastic sbatch job (FIXRES_STEP)

    @property
    def restarts(self) -> int:
        """Requeues and step restarts so far: what ``max_requeues`` bounds."""
        return self.restart + self.step


def _count(name: str, environ=None) -> int:
    value = (os.environ if environ is None else environ).get(name, "0")
    return int(value) if value.isdigit() else 0


def restart_count(environ=None) -> int:
    return _count("SLURM_RESTART_COUNT", environ)


def current_place() -> TaskPlace:
    """This task's place, from SLURM's variables, read by submitit's SLURM job environment (also
    outside a submitit job, where ``submitit.JobEnvironment()`` would not know the cluster)."""
    from submitit.slurm.slurm import SlurmJobEnvironment

    env = SlurmJobEnvironment()
    return TaskPlace(env.job_id, env.global_rank, env.local_rank, env.num_tasks, restart_count(),
                     _count("FIXRES_STEP"))


def rendezvous_file(restart: int, step: int = 0) -> str:
    """The rendezvous file of one run of a job (in its job folder): ``rendezvous-<restart>.json``, and
    ``rendezvous-<restart>-<step>.json`` for a step restarted on the survivors of an elastic job."""
    return f"rendezvous-{restart}-{step}.json" if step else f"rendezvous-{restart}.json"


def task_config(template: TrainerConfig, place: TaskPlace) -> TrainerConfig:
    """``template`` (``num_tasks`` = all tasks) placed at one task; FixresError if the sizes disagree."""
    if place.num_tasks != template.num_tasks:
        raise FixresError(f"SLURM started {place.num_tasks} tasks but the job was submitted for "
                          f"{template.num_tasks}; resubmit it")
    # TRAINER-SIDE: TrainerConfig.placed() / rendezvous_url() are the one place for job id and dist_url.
    url = attrs.evolve(template, job_id=place.job_id).rendezvous_url(rendezvous_file(place.restart, place.step))
    return template.placed(num_tasks=place.num_tasks, global_rank=place.global_rank, local_rank=place.local_rank,
                           job_id=place.job_id, dist_url=url if place.num_tasks > 1 else None)


class _StopSignals:
    """SIGTERM and the warning signal around the Trainer.

    The Trainer installs its own handlers while it runs and calls these ones (the previous handlers,
    with no frame) after its preemption checkpoint; that is how this module learns which signal
    stopped the job.
    A signal before the Trainer starts stops the task at once (nothing to checkpoint); after it has
    finished, it is ignored.
    """

    def __init__(self, rank: int, preempt: signal.Signals):
        self.rank, self.preempt = rank, preempt
        self.signum: signal.Signals | None = None
        self.finished = False
        self.previous: dict = {}

    def install(self) -> None:
        self.previous = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, self.preempt)}

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def on_signal(self, signum, frame) -> None:
        if self.signum != self.preempt:  # the warning signal wins (submitit's _interrupt sends TERM, then USR2)
            self.signum = signal.Signals(signum)
        if frame is None:  # called by the Trainer after its checkpoint (a signal delivery has a frame)
            return
        if self.finished:
            print(f"fixres_dist: rank {self.rank}: {self.signum.name} after the run finished; ignored",
                  file=sys.stderr, flush=True)
            return
        raise Preempted(f"stopped by {self.signum.name} before training started; nothing to checkpoint")


def _after_preemption(config: TrainerConfig, stops: _StopSignals, restart: int, max_requeues: int) -> None:
    """Step 4 of the protocol; always raises (SystemExit with the preemption status, or TaskFailed)."""
    rank = config.global_rank
    if stops.signum == signal.SIGTERM:
        print(f"fixres_dist: rank {rank}: stopped by SIGTERM; not requeued here (scancel, or SLURM's own "
              "preemption)", file=sys.stderr, flush=True)
        raise SystemExit(PREEMPTED_EXIT_STATUS)
    if rank != 0:
        print(f"fixres_dist: rank {rank}: waiting for rank 0 to requeue the job",
              file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the requeue stops this task with SIGTERM
        time.sleep(FOLLOWER_WAIT_S)
        raise SystemExit(PREEMPTED_EXIT_STATUS)
    if restart >= max_requeues:
        raise TaskFailed(f"preempted, checkpoint written; not requeued: requeued {restart} time(s) already "
                         f"(max {max_requeues}); run the job again to resume")
    print(f"fixres_dist: job {config.job_id} preempted, checkpoint written; requeueing "
          f"(restart {restart + 1} of at most {max_requeues})", flush=True)
    try:
        run_command(["scontrol", "requeue", config.job_id], timeout=60)
    except FixresError as exc:
        raise TaskFailed(f"preempted, checkpoint written; requeue failed: {exc}") from None
    raise SystemExit(PREEMPTED_EXIT_STATUS)


def _requeue_after_loss(config: TrainerConfig, lost: PeersUnreachable, restart: int, max_requeues: int,
                        elastic: bool = False) -> None:
    """Step 5 of the protocol: requeue the job (any surviving rank); always raises TaskFailed, or, in
    an elastic job, SystemExit(RESTART_STEP_EXIT_STATUS) for the batch script to restart the step."""
    if elastic:
        print(f"fixres_dist: job {config.job_id}: rank {config.global_rank} stops after {lost.reason}; the step "
              "starts again on the nodes that remain, from the last checkpoint", flush=True)
        raise SystemExit(RESTART_STEP_EXIT_STATUS)
    if restart >= max_requeues:
        raise TaskFailed(f"{lost}; not requeued: requeued {restart} time(s) already (max {max_requeues})")
    try:
        run_command(["scontrol", "requeue", config.job_id], timeout=60)
    except FixresError as exc:  # another survivor's request was first, or SLURM refused
        raise TaskFailed(f"{lost}; requeue not done by this rank: {first_line(exc)}") from None
    print(f"fixres_dist: job {config.job_id}: rank {config.global_rank} requeued it (restart {restart + 1} "
          f"of at most {max_requeues}) after {lost.reason}; it resumes from its last checkpoint", flush=True)
    raise TaskFailed(f"{lost}; job requeued")


def _as_dict(result) -> dict:
    # TRAINER-SIDE: Trainer()() returns a dict today and a typed (attrs) result later; both work here.
    return attrs.asdict(result) if attrs.has(type(result)) else dict(result)


def run_task(config: TrainerConfig, restart: int = 0, max_requeues: int = 3, inputs: JobInputs | None = None,
             elastic: bool = False) -> dict:
    """Run the Trainer as one task of a SLURM job, with the requeue protocol (module docstring).
    ``inputs``: what the preflight returned in this process (:class:`~fixres_dist.training.trainer.Trainer`);
    ``restart``: the restarts so far (requeues and step restarts); ``elastic``: peers lost, leave the
    restart to the batch script (step 5).

    Returns the Trainer's result as a dict. On failure prints one line ``fixres_dist: rank R: cause``
    on stderr (and the traceback first for bugs) and raises :class:`TaskFailed`; after a
    preemption raises SystemExit(3) or TaskFailed (see :func:`_after_preemption`).
    """
    rank = config.global_rank
    stops = _StopSignals(rank, signal.Signals[config.preempt_signal])
    stops.install()
    try:
        result = Trainer(config, inputs)()
        stops.finished = True
        return _as_dict(result)
    except Preempted as exc:
        stops.finished = True
        say(f"fixres_dist: rank {rank}: {exc}")
        _after_preemption(config, stops, restart, max_requeues)
    except PeersUnreachable as exc:
        stops.finished = True
        say(f"fixres_dist: rank {rank}: {exc}")
        if not exc.resumable:  # a peer raised an error: it would again, the job fails
            raise TaskFailed(str(exc)) from None
        _requeue_after_loss(config, exc, restart, max_requeues, elastic)
    except Exception as exc:  # one line for every failure; bugs also get their traceback
        stops.finished = True
        cause = user_message(exc)
        if cause is None:
            traceback.print_exc()
            cause = f"{type(exc).__name__}: {first_line(exc)}"
        say(f"fixres_dist: rank {rank}: {cause}")
        raise TaskFailed(cause) from exc
    finally:
        stops.restore()


class SlurmTask:
    """What submitit runs once per task: its place, then :func:`run_task` on ``config`` placed there.

    ``config`` is the job's template (``num_tasks`` = all tasks); ranks, job id and rendezvous are
    filled in per task. Returns the Trainer's result plus ``job_id``, ``restart``
    (``SLURM_RESTART_COUNT``), ``host`` and ``seconds``. Stateless: a requeued job runs the same
    pickled task again, which resumes from the job folder.
    """

    def __init__(self, config: TrainerConfig, max_requeues: int = 3):
        self.config = config
        self.max_requeues = max_requeues

    def __call__(self) -> dict:
        started = time.time()
        place = current_place()
        result = run_task(task_config(self.config, place), place.restart, self.max_requeues)
        return {**result, "job_id": place.job_id, "restart": place.restart, "host": socket.gethostname(),
                "seconds": time.time() - started}

    def __repr__(self) -> str:
        return f"SlurmTask({self.config.mode}, {self.config.num_tasks} task(s))"


def main(argv: list[str] | None = None) -> int:
    """``srun python -m fixres_dist.cluster {main_scratch.py,main_finetune.py} [options]``.

    What ``slurm/job.sbatch`` runs in every task: the same options as the main script (without the
    rank flags), the same protocol as a submitit job. ``FIXRES_MAX_REQUEUES`` (default 3) bounds the
    requeues. Exit status 0, 1 (one line on stderr), 2 (usage), 3 (preempted, not requeued) or 4 (elastic job, peers
    lost: the batch script restarts the step).
    """
    argv = sys.argv[1:] if argv is None else argv
    mode = MODES.get(Path(argv[0]).name) if argv else None
    if mode is None:
        print("usage: python -m fixres_dist.cluster {main_scratch.py,main_finetune.py} [options]",
              file=sys.stderr)
        return 2
    place = current_place()
    max_requeues = os.environ.get("FIXRES_MAX_REQUEUES", "3")
    try:
        if not max_requeues.isdigit():
            raise FixresError(f"FIXRES_MAX_REQUEUES={max_requeues!r} is not a number of requeues")
        config = task_config(config_from_argv(mode, argv[1:], place.num_tasks), place)
        inputs = preflight(config) if place.global_rank == 0 else None  # as main_*.py: before the ranks meet
    except FixresError as exc:
        say(f"fixres_dist: rank {place.global_rank}: {exc}")
        return 1
    try:
        run_task(config, place.restarts, int(max_requeues), inputs, os.environ.get("FIXRES_ELASTIC") == "1")
    except TaskFailed:
        return 1
    return 0
