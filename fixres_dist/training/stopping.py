"""When every rank stops together: on a stop signal any rank got, or a non-finite loss on any rank.

:class:`StopController` asks the ranks' :class:`~fixres_dist.distributed.preemption.StepAgreement`
after each training step (pipelined: at most one step late), after each evaluation batch and at
an epoch's end; on a signal every rank writes one checkpoint together if anything was trained
since the last one and raises :class:`~fixres_dist.distributed.preemption.Preempted` (exit status 3,
130 for SIGINT); on a non-finite loss every rank raises
:class:`~fixres_dist.finite.NonFiniteLoss` at the same step (:mod:`fixres_dist.finite`).
"""
from __future__ import annotations

import signal
from typing import Callable

from fixres_dist.distributed.preemption import Preempted, StepAgreement
from fixres_dist.finite import LossWatch
from fixres_dist.training.checkpointer import Checkpointer
from fixres_dist.training.state import TrainState


class StopController:
    """Stops for ``state``'s run: ``agreement`` (the session's), ``watch`` (the optimizer step's loss
    watch) and ``checkpointer`` (which writes the stop checkpoint, all ranks); ``log``: rank 0's."""

    def __init__(self, agreement: StepAgreement, watch: LossWatch, checkpointer: Checkpointer, state: TrainState,
                 log: Callable[[str], None]):
        self.agreement, self.watch, self.checkpointer, self.state = agreement, watch, checkpointer, state
        self.log = log

    def agree(self, now: bool = True) -> signal.Signals | None:
        """All ranks: the stop signal any rank got, or None; if any rank's loss was not finite, all
        raise :class:`~fixres_dist.finite.NonFiniteLoss` here, together, naming the earliest
        such step.

        ``now``: about every rank's state at this point (before a checkpoint, at an epoch's end,
        after an evaluation batch). Else (after a training step) about the state after the previous
        step, agreed on in the background meanwhile (:meth:`StepAgreement.after_step`).
        """
        if now:
            self.watch.flush()  # CUDA: this step's flag too
            agreed = self.agreement.now(self.watch.first_bad)
        else:
            agreed = self.agreement.after_step(self.watch.first_bad)
        if agreed.bad_step is not None:
            raise self.checkpointer.diverged(self.state, agreed.bad_step)
        return agreed.stop

    def after_step(self, checkpoint_every: int) -> None:
        """After an optimizer step: checkpoint every ``checkpoint_every`` steps (0: never), agreeing
        on every rank's state first; else agree one step late, without waiting for the network."""
        self.checkpointer.unsaved = True
        due = bool(checkpoint_every) and self.state.global_step % checkpoint_every == 0
        stop = self.agree(now=due)
        if due:
            self.checkpointer.save(self.state)
        if stop is not None:
            self.stop(stop)

    def stop_if_asked(self) -> None:
        """After an evaluation batch or an epoch: if any rank got a stop signal, stop (:meth:`stop`)."""
        stop = self.agree()
        if stop is not None:
            self.stop(stop)

    def stop(self, stop: signal.Signals) -> None:
        """All ranks, once they agreed on ``stop``: write one checkpoint together if anything was
        trained since the last one, then raise Preempted."""
        state, folder = self.state, self.checkpointer.config.job_folder
        where = f"epoch {state.epoch + 1}, image {state.images_in_epoch}, step {state.global_step}"
        if self.checkpointer.unsaved:
            stop = self.agree() or stop  # the step just done, on every rank: it may have diverged
            self.checkpointer.save(self.state)
            done = f"checkpoint written in {folder}"
        elif self.checkpointer.last_step is not None:
            done = f"its checkpoint of step {self.checkpointer.last_step} in {folder} is up to date"
        else:
            done = "nothing trained yet, nothing to checkpoint"
        how = f"{'interrupted' if stop == signal.SIGINT else 'preempted'} by {stop.name}"
        self.log(f"{how} at {where}: {done}; run the same command again to resume")
        raise Preempted(f"{how}; stopped at {where}: {done}", stop)
