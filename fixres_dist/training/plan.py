"""What a job does, as a list of steps: one protocol per job kind, and the plan the Trainer runs.

A protocol (:class:`FromScratch`, :class:`FixResFinetune`, :class:`EvaluateOnly`) turns the
configuration and where the run is into the steps still to run: epochs (train, evaluate at the
test resolution, its EMA's too, end the epoch with a checkpoint; up to ``--epochs``, or the epoch after which
early stopping ended training: :mod:`~fixres_dist.training.best_checkpoint`), the evaluations before a FixRes
finetune (FixRes, Touvron et al. 2019, section 5: top-1 at the train and test resolutions before
finetuning) and the choice of ``--input-size auto``, the final sweep, the reports and features.
The Trainer takes the steps from :class:`Plan` one by one, and the progress display reads the
evaluations still to come from the same plan: the job's remaining time follows what it runs.
"""
from __future__ import annotations

from collections import deque

import attrs

from fixres_dist.config import TrainerConfig
from fixres_dist.fixres import sweep
from fixres_dist.reporting import progress, reports
from fixres_dist.reporting.run_log import RunLog
from fixres_dist.training import best_checkpoint
from fixres_dist.training.state import TrainState


@attrs.frozen
class Evaluate:
    """Top-1 at ``size`` pixels after ``epoch`` epochs; ``label``: a sweep's stage (or
    ``train-resolution``), empty for an epoch's evaluation; ``ema``: of the weights' EMA;
    ``what``: where it stands in the job, for the progress bar."""

    size: int
    epoch: int
    label: str = ""
    what: str = ""
    ema: bool = False


@attrs.frozen
class TrainEpoch:
    """Train epoch ``epoch`` (0-based) from where the run is in it."""

    epoch: int


@attrs.frozen
class EndEpoch:
    """Epoch ``epoch`` is done: the next one starts, a checkpoint is written."""

    epoch: int


@attrs.frozen
class Action:
    """A step without parameters, by name: see :data:`ACTIONS`."""

    name: str


ACTIONS = {
    "train-resolution from sweep": "the sweep before finetuning measured the train resolution: record it as such",
    "choose input size": "--input-size auto: the best test resolution of the sweep before finetuning",
    "start training": "freeze what does not train and wrap in DDP (sharded runs did both when built), build "
                      "the optimizer, restore the checkpoint",
    "final result": "the run's result: its last evaluation at the test resolution",
    "finetune table": "log the FixRes table (reports.finetune_table)",
    "sweep report": "the table and plot of the sweeps (resolution_sweep.md/.png)",
    "features": "extract logits and embeddings (--extract-features)",
}

FIXRES_ACTIONS = ("train-resolution from sweep", "choose input size", "finetune table")  # FixResFinetune.act

Step = Evaluate | TrainEpoch | EndEpoch | Action


class Plan:
    """The steps still to run, in order (iterating takes them)."""

    def __init__(self, steps: list[Step]):
        self._steps = deque(steps)

    def __iter__(self):
        while self._steps:
            yield self._steps.popleft()

    def replace(self, steps: list[Step]) -> None:
        """Replan: ``steps`` instead of those left."""
        self._steps = deque(steps)

    def epochs_at_end(self, now: int) -> int:
        """The epochs trained when the plan is done: the last one still to end (``--epochs``, or fewer once
        early stopping ended training), else ``now`` (the epochs trained so far)."""
        return max((step.epoch + 1 for step in self._steps if isinstance(step, EndEpoch)), default=now)

    def evaluations(self) -> list[int]:
        """The test resolutions (pixels) of the evaluations still to start, in order."""
        return [step.size for step in self._steps if isinstance(step, Evaluate)]


def sweep_steps(sizes, epoch: int, stage: str) -> list[Evaluate]:
    """Evaluations at each of ``sizes``, recorded with label ``stage``
    (:data:`fixres_dist.fixres.sweep.STAGE_NAMES`)."""
    sizes = list(sizes)
    return [Evaluate(size, epoch, stage, f"{index + 1}/{len(sizes)} of the sweep"
                     + ("" if stage == "sweep" else f" {sweep.STAGE_NAMES[stage]}"))
            for index, size in enumerate(sizes)]


class FromScratch:
    """Train ``--epochs`` epochs, evaluating each; then the ``--test-sizes`` sweep ("trained")."""

    trains = True

    def __init__(self, config: TrainerConfig):
        self.config = config

    def steps(self, state: TrainState, run_log: RunLog, train_size: int | None, resumed: bool) -> list[Step]:
        """The steps of the job from ``state``; ``train_size``: the resolution (pixels) the weights were
        trained at, if known; ``resumed``: the run continues a checkpoint."""
        return [*self.before_training(state, train_size, resumed), Action("start training"),
                *self.from_training(state, run_log)]

    def from_training(self, state: TrainState, run_log: RunLog) -> list[Step]:
        """The steps once training started: the epochs left (up to ``--epochs``, or where early stopping ended
        training), the final result, what follows the last epoch and the reports."""
        end = best_checkpoint.epochs_to_train(self.config, run_log.history)
        return [*self.epochs(state, run_log, end), Action("final result"), *self.after_training(state, end),
                *self.reports()]

    def before_training(self, state: TrainState, train_size: int | None, resumed: bool) -> list[Step]:
        return []

    def epochs(self, state: TrainState, run_log: RunLog, end: int) -> list[Step]:
        """The epochs left of ``end`` in all (``--epochs``, or fewer once early stopping ended training), each
        trained unless its ``train`` event is recorded (a stop came during its evaluation) and evaluated unless
        recorded."""
        cfg, size, steps = self.config, state.eval_size(self.config), []
        for epoch in range(state.epoch, end):
            what = f"epoch {epoch + 1}/{cfg.epochs}"
            if not run_log.events("train", epoch=epoch + 1):
                steps.append(TrainEpoch(epoch))
            if not run_log.epoch_evaluated(epoch + 1):
                steps.append(Evaluate(size, epoch + 1, what=what))
            if cfg.model_ema and not run_log.epoch_evaluated(epoch + 1, "ema_eval"):
                steps.append(Evaluate(size, epoch + 1, what=what, ema=True))
            steps.append(EndEpoch(epoch))
        return steps

    def after_training(self, state: TrainState, end: int) -> list[Step]:
        """What follows the last epoch, ``end`` epochs trained."""
        return sweep_steps(self.config.test_sizes or (), end, "trained")

    def reports(self) -> list[Step]:
        cfg = self.config
        return [*([Action("sweep report")] if cfg.test_sizes else []),
                *([Action("features")] if cfg.extract_features else [])]


class FixResFinetune(FromScratch):
    """FixRes: top-1 before finetuning at the train resolution and the test resolution(s) (``--input-size
    auto``: then pick the finetune resolution), finetune at the test resolution, sweep again ("after"),
    and the FixRes table."""

    def sweep_sizes(self, input_size: int) -> list[int]:
        """``--test-sizes`` and the finetune resolution: what is measured before and after finetuning."""
        sizes = list(self.config.test_sizes or ())
        return sizes if input_size in sizes else [*sizes, input_size]

    def before_training(self, state: TrainState, train_size: int | None, resumed: bool) -> list[Step]:
        if resumed:
            return []
        swept = self.sweep_sizes(state.input_size)
        steps = [] if not train_size or train_size in swept else [
            Evaluate(train_size, 0, "train-resolution", "the train resolution, before finetuning")]
        steps += sweep_steps(swept, state.epoch, "before")
        if train_size in swept:
            steps.append(Action("train-resolution from sweep"))
        if self.config.input_size == "auto":
            steps.append(Action("choose input size"))
        return steps

    def after_training(self, state: TrainState, end: int) -> list[Step]:
        return [*(sweep_steps(self.sweep_sizes(state.input_size), end, "after")
                  if self.config.test_sizes else []), Action("finetune table")]

    def act(self, name: str, state: TrainState, run_log: RunLog, network) -> None:
        """One of :data:`FIXRES_ACTIONS` for the run at ``state`` of ``network``
        (:class:`~fixres_dist.training.network.Network`)."""
        cfg = self.config
        if name == "train-resolution from sweep":  # the same weights, images and preprocessing: the same evaluation
            same = sweep.by_stage(run_log.history)["before"][network.train_size]
            run_log.record("eval", **{k: same[k] for k in ("epoch", "resolution", "top1", "top5", "loss", "images")},
                           label="train-resolution")
        elif name == "choose input size":
            swept = sweep.by_stage(run_log.history)["before"]
            state.input_size = sweep.best_resolution([swept[size] for size in cfg.test_sizes])
            run_log.record("input_size", resolution=state.input_size, rule="best top-1 of the sweep before "
                           "finetuning, smallest within one standard error")
            run_log.log(f"--input-size auto: finetuning at {state.input_size} px, the best test resolution before "
                        "finetuning")
        elif name == "finetune table":
            run_log.log(reports.finetune_table(run_log.history, cfg.architecture, cfg.num_tasks, state.input_size,
                                               state.eval_size(cfg), network.new_head,
                                               network.weights_lineage.finetuned_at))


class EvaluateOnly(FromScratch):
    """``--eval-only``: evaluate the weights at ``--test-sizes`` (else the test resolution)."""

    trains = False

    def steps(self, state: TrainState, run_log: RunLog, train_size: int | None, resumed: bool) -> list[Step]:
        sizes = self.config.test_sizes or (state.eval_size(self.config),)
        return [*sweep_steps(sizes, state.epoch, "sweep"), Action("final result"), *self.reports()]


def protocol(config: TrainerConfig) -> FromScratch:
    """The protocol of ``config``'s job kind."""
    if config.eval_only:
        return EvaluateOnly(config)
    return FixResFinetune(config) if config.mode == "finetune" else FromScratch(config)


class Remaining:
    """The job's estimated remaining time, as a progress bar's postfix (``"job 03:12 left"``), from
    the rates :class:`~fixres_dist.reporting.progress.JobClock` measured, the training left by
    ``state`` and the evaluations left in ``plan`` (each of ``val_images`` images)."""

    def __init__(self, config: TrainerConfig, state: TrainState, plan: Plan, clock: progress.JobClock,
                 images_per_epoch: int, val_images: int):
        self.config, self.state, self.plan, self.clock = config, state, plan, clock
        self.images_per_epoch, self.val_images = images_per_epoch, val_images

    def postfix(self, bar: progress.Bar, evaluating: int | None = None) -> str:
        """``bar``: the training epoch's, or the bar of the evaluation at ``evaluating`` pixels."""
        cfg, state = self.config, self.state
        train_left = 0 if cfg.eval_only else max(0, (self.plan.epochs_at_end(state.epoch) - state.epoch)
                                                 * self.images_per_epoch - state.images_in_epoch)
        evaluations = [(self.val_images, size) for size in self.plan.evaluations()]
        if evaluating is not None:
            evaluations.append((bar.total - bar.done, evaluating))
        live = (bar.done - bar.initial, bar.seconds()) if evaluating is None else (0, 0.0)
        seconds = self.clock.remaining(train_left, state.input_size, evaluations, live)
        if seconds is not None and evaluating is None and bar.done > bar.initial:  # never less than this epoch's
            seconds = max(seconds, (bar.total - bar.done) * bar.seconds() / (bar.done - bar.initial))
        return f"job {progress.format_seconds(seconds)} left"
