"""The best checkpoint by a metric, and early stopping (``--best-metric``, ``--early-stopping-patience``).

:class:`BestCheckpoint` watches one metric of each epoch's evaluation at the test resolution: ``top1``,
``top5`` or ``loss`` of the model's ``eval`` event, or with ``ema_`` before it of the ``--model-ema``
average's ``ema_eval`` (sweeps and a finetune's evaluations before training are not watched). An
evaluation strictly better than the best so far makes its epoch's checkpoint, written at the epoch's end,
the best: :func:`~fixres_dist.training.checkpoint.save_checkpoint` keeps it as ``best.pth`` beside the last
``--keep-checkpoints`` (a ``best`` event and a log line give the value, epoch and optimizer step).

Early stopping (``--early-stopping-patience N``, main_scratch.py's): the evaluations in a row that did not
beat the reference (the last value that beat the one before it by more than ``--early-stopping-min-delta``)
are counted; at N, training ends after that epoch's checkpoint, before ``--epochs``, and the run goes on to its
final result and reports as after its last epoch (exit status 0), with an ``early_stop`` event and a line naming
the best epoch. The plan reads that event (:func:`epochs_to_train`), so a rerun of the job trains no more.

The state (best value, epoch and step; the reference and the evaluations without improvement; where training
stopped) is in every checkpoint (its ``best`` entry, :meth:`BestCheckpoint.state_dict`) and restored on
resume, so a requeued job keeps the same best and stops at the same epoch as one never interrupted. Every
rank decides on rank 0's value of the all-reduced evaluation (one broadcast), so all ranks stop together.
"""
from __future__ import annotations

from fixres_dist.config import METRIC_GOALS, TrainerConfig
from fixres_dist.distributed import collectives
from fixres_dist.errors import FixresError, plural
from fixres_dist.reporting.run_log import RunLog
from fixres_dist.training.checkpoint import BEST_FILE

BEST_EVENT, STOP_EVENT = "best", "early_stop"
STATE_KEYS = ("metric", "value", "epoch", "step", "reference", "without_improvement", "stopped_at")


def improves(goal: str, value: float, best: float | None, by: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` by more than ``by`` (``goal``: ``"higher"`` or ``"lower"`` is
    better; ``by`` >= 0 in the metric's unit). Anything beats None (no evaluation yet); an equal value
    does not."""
    if best is None:
        return True
    return value - best > by if goal == "higher" else best - value > by


def epochs_to_train(config: TrainerConfig, history: list[dict]) -> int:
    """How many epochs the job trains: ``--epochs``, or the epoch (1-based) after which early stopping
    ended training (the ``early_stop`` event of ``history``, the run's events)."""
    stops = [event["epoch"] for event in history if event["event"] == STOP_EVENT]
    return stops[-1] if stops else config.epochs


class BestCheckpoint:
    """The best evaluation of ``config.best_metric`` so far and the early-stopping count (see the module);
    records its events and lines in ``run_log``. Off (every method a no-op, no state) without
    ``--best-metric``.

    ``value``: the best value (percent for top-1/top-5, nats for the loss), ``epoch`` (1-based) and
    ``step`` (the optimizer step whose checkpoint is ``best.pth``): None until the first evaluation;
    ``reference``: the value the patience counts from; ``without_improvement``: evaluations since it;
    ``stopped_at``: the epoch after which early stopping ended training, or None.
    """

    def __init__(self, config: TrainerConfig, run_log: RunLog):
        self.config, self.run_log, self.metric = config, run_log, config.best_metric
        self.field = self.metric.removeprefix("ema_") if self.metric else None
        self.goal = METRIC_GOALS.get(self.field)
        self.value: float | None = None
        self.epoch: int | None = None
        self.step: int | None = None
        self.reference: float | None = None
        self.without_improvement = 0
        self.stopped_at: int | None = None

    def state_dict(self) -> dict | None:
        """The state a checkpoint keeps (plain numbers, read with ``weights_only=True``); None when off."""
        return None if self.metric is None else {key: getattr(self, key) for key in STATE_KEYS}

    def load_state_dict(self, state: dict | None) -> None:
        """Continue from a checkpoint's ``state`` (:meth:`state_dict`; None: its run watched nothing, so
        this one starts afresh). Raises :class:`FixresError` if it watched another metric."""
        if state is None or self.metric is None:
            return
        if state["metric"] != self.metric:
            raise FixresError(f"the checkpoint watched --best-metric {state['metric']}, this run {self.metric}: "
                              "a job keeps its metric (use another --job-id)")
        for key in STATE_KEYS[1:]:
            setattr(self, key, state[key])

    def evaluated(self, evaluation, result, global_step: int) -> bool:
        """Every rank, after ``evaluation`` (a :class:`~fixres_dist.training.plan.Evaluate`) gave ``result``
        (an :class:`~fixres_dist.training.engine.EvalResult`) after ``global_step`` optimizer steps: a new best
        or another evaluation without improvement, recorded. Returns True, on every rank alike, when early
        stopping ends training after this epoch (never after the last one)."""
        if self.metric is None or evaluation.label or evaluation.ema != self.metric.startswith("ema_"):
            return False
        value = collectives.broadcast_object(float(getattr(result, self.field)))  # every rank decides alike
        epoch, patience = evaluation.epoch, self.config.early_stopping_patience
        if improves(self.goal, value, self.value):
            self.value, self.epoch, self.step = value, epoch, global_step
            self.run_log.record(BEST_EVENT, metric=self.metric, value=value, epoch=epoch, step=global_step)
            self.run_log.log(f"best {self.metric} so far: {self.shown(value)} at epoch {epoch} (step {global_step}); "
                             f"its checkpoint is kept as {BEST_FILE}")
        if patience is None:
            return False
        if improves(self.goal, value, self.reference, self.config.early_stopping_min_delta):
            self.reference, self.without_improvement = value, 0
            return False
        self.without_improvement += 1
        if self.without_improvement < patience or epoch >= self.config.epochs:
            self.run_log.log(f"early stopping: {self.metric} not improved{self.by()} for {self.without_improvement} "
                             f"of {patience} evaluations ({self.best_words()})")
            return False
        self.stopped_at = epoch
        self._record_stop(epoch)
        return True

    def _record_stop(self, epoch: int) -> None:
        cfg = self.config
        self.run_log.record(STOP_EVENT, epoch=epoch, metric=self.metric, patience=cfg.early_stopping_patience,
                            min_delta=cfg.early_stopping_min_delta, best_value=self.value, best_epoch=self.epoch,
                            best_step=self.step)
        self.run_log.log(f"early stopping after epoch {epoch} of {cfg.epochs}: {self.metric} did not improve"
                         f"{self.by()} for {plural(cfg.early_stopping_patience, 'evaluation')} in a row; training "
                         f"ends here ({self.best_words()}, {BEST_FILE})")

    def by(self) -> str:
        """``" by more than 0.1"`` with ``--early-stopping-min-delta 0.1``, else empty."""
        delta = self.config.early_stopping_min_delta
        return f" by more than {delta:g}" if delta else ""

    def shown(self, value: float) -> str:
        """``value`` of the metric as the log writes it (``71.25 %``, ``0.6931``)."""
        return f"{value:.4f}" if self.field == "loss" else f"{value:.2f} %"

    def best_words(self) -> str:
        """``"the best: loss 0.6931 at epoch 3 (step 15)"``, or that there is none yet."""
        if self.value is None:
            return f"no {self.metric} evaluated yet"
        return f"the best: {self.metric} {self.shown(self.value)} at epoch {self.epoch} (step {self.step})"
