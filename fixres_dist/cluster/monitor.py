"""Following submitted jobs: their SLURM states and, once they end, each task's outcome.

States come from submitit's ``SlurmInfoWatcher`` (one ``sacct`` call for all the jobs watched, every
``poll_s`` seconds: accounting, not slurmctld, answers it) and "finished" means what submitit
means by it. Outcomes come from submitit's ``Job.result()`` / ``Job.exception()``: a task that
failed inside raised :class:`~fixres_dist.cluster.task.TaskFailed`, whose one-line message is the
cause; a task without a result was stopped from outside (its job failed, was cancelled or killed).
"""
from __future__ import annotations

import time

import attrs

POLL_S = 5.0        # between two sacct calls while following jobs (the CLI's --poll-s)
FAILED_MARKER = "TaskFailed: "


@attrs.frozen
class Watched:
    """What :func:`watch` saw: ``events`` are ``(seconds since started, job id, state)`` for every
    state change (a requeue shows as RUNNING -> PENDING -> RUNNING); ``states`` the last ones."""

    events: list
    states: dict

    @property
    def running_after(self) -> float | None:
        running = [t for t, _, state in self.events if state == "RUNNING"]
        return running[0] if running else None


def watch(jobs, on_change=None, started: float | None = None, timeout: float | None = None,
          poll_s: float = POLL_S) -> Watched:
    """Follow ``jobs`` (submitit jobs or SLURM job ids, array tasks as ``<id>_<index>``) until all
    have finished (or ``timeout`` seconds after ``started``). ``on_change(event)`` sees each event."""
    from submitit.slurm.slurm import SlurmInfoWatcher

    started = time.time() if started is None else started
    ids = [str(getattr(job, "job_id", job)) for job in jobs]
    watcher = SlurmInfoWatcher(delay_s=max(1, int(poll_s)))
    for job_id in ids:
        watcher.register_job(job_id)
    states: dict[str, str] = {}
    events = []
    while True:
        watcher.update()
        for job_id in ids:
            state = watcher.get_state(job_id, mode="cache")
            if states.get(job_id) != state:
                states[job_id] = state
                event = (time.time() - started, job_id, state)
                events.append(event)
                if on_change:
                    on_change(event)
        if all(watcher.is_done(job_id, mode="cache") or _has_results(job) for job_id, job in zip(ids, jobs)):
            break
        if timeout is not None and time.time() - started > timeout:
            break
        time.sleep(poll_s)
    return Watched(events, states)


def _has_results(job) -> bool:
    """A submitit job whose tasks all left a result (also where sacct cannot say: no accounting)."""
    if not hasattr(job, "task"):
        return False
    return all(job.task(rank).paths.result_pickle.exists() for rank in range(job.num_tasks))


def failure_cause(exc: Exception) -> tuple[bool, str]:
    """``(raised inside the task?, one line)`` for what submitit's ``Job.exception()`` returned."""
    from submitit.core.utils import FailedJobError

    text = str(exc)
    if isinstance(exc, FailedJobError) and FAILED_MARKER in text:
        return True, text.rsplit(FAILED_MARKER, 1)[1].strip().splitlines()[0]
    if isinstance(exc, FailedJobError):  # raised outside run_task (e.g. the task could not be unpickled)
        return True, f"{type(exc).__name__}: the task raised; see its log"
    return False, "ended without a result (stopped from outside: the job failed, was cancelled or killed)"


def task_outcomes(job) -> list[tuple[int, object, str | None]]:
    """``(rank, result or None, error line or None)`` for every task of a finished submitit job.

    Failed tasks come first, the one that failed earliest (by its error pickle's time) at the front:
    a rank that raised before the ranks that only lost it, before the ranks that were killed.
    """
    outcomes, order = [], []
    for rank in range(job.num_tasks):
        task = job.task(rank)
        exc = task.exception()
        if exc is None:
            outcomes.append((rank, task.result(), None))
            order.append((2, 0.0, rank))
            continue
        raised, cause = failure_cause(exc)
        try:
            when = task.paths.result_pickle.stat().st_mtime
        except OSError:
            when = float("inf")
        outcomes.append((rank, None, cause))
        order.append((0 if raised else 1, when, rank))
    return [outcomes[rank] for _, _, rank in sorted(order)]


def first_failure(outcomes) -> tuple[int, str] | None:
    """The failed task that :func:`task_outcomes` put first, as ``(rank, error line)``."""
    failed = [(rank, error) for rank, _, error in outcomes if error is not None]
    return failed[0] if failed else None
