"""The Trainer: one rank's part of a job, from rendezvous to the last checkpoint, told as a story.

``Trainer(config)()`` runs the job in this process and returns a :class:`RunResult`:

* :meth:`Trainer.build`: open the rank's session (:class:`~fixres_dist.distributed.session.RankSession`: the job
  lock, meeting the other ranks); read the inputs (:class:`~fixres_dist.training.inputs.JobInputs`: data, the
  checkpoint to continue, weights) and what a world change keeps (:mod:`.world_change`); start the run's log; build
  the network (sharded at once with ``--sharding full/hybrid``); plan the job (:mod:`.plan`) and run it up to
  training (a FixRes finetune first measures top-1, may pick the test resolution); wrap, build the step, restore.
* :meth:`Trainer.fit`: run the rest of the plan: epochs (train, average BatchNorm statistics over ranks, evaluate
  exactly, checkpoint; early stopping may end them sooner), the final sweep, the reports and the features.

Its parts own their state: the step (:mod:`.step`), the checkpoints (:mod:`.checkpointer`; the best one and early
stopping: :mod:`.best_checkpoint`), the stops on a signal or a diverged loss (:mod:`.stopping`), the evaluations.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable

import attrs
import torch
from torch.utils.data import DataLoader

from fixres_dist import io
from fixres_dist.config import TrainerConfig
from fixres_dist.data.job_data import JobData
from fixres_dist.distributed import checkpoint_shards, collectives
from fixres_dist.distributed.preemption import Preempted
from fixres_dist.distributed.session import RankSession
from fixres_dist.errors import FixresWarning
from fixres_dist.finite import LossWatch
from fixres_dist.fixres import finetuning
from fixres_dist.reporting import progress
from fixres_dist.reporting.run_log import RunLog, resumed_board_at, resumed_runs
from fixres_dist.training import engine, plan, recipes, world_change
from fixres_dist.training.checkpointer import Checkpointer
from fixres_dist.training.evaluator import Evaluator
from fixres_dist.training.faults import FaultInjector
from fixres_dist.training.inputs import JobInputs
from fixres_dist.training.network import Network
from fixres_dist.training.state import TrainState
from fixres_dist.training.step import TrainStep
from fixres_dist.training.stopping import StopController


@attrs.frozen
class RunResult:
    """What ``Trainer(config)()`` returns on every rank: the final evaluation of the run.

    ``resolution`` in pixels, ``top1``/``top5`` in percent, ``loss`` the mean cross-entropy
    (nats), ``images`` the number of distinct validation images counted.
    """

    rank: int
    resolution: int
    top1: float
    top5: float
    loss: float
    images: int


class Trainer:
    """Train (``mode="scratch"``) or FixRes-finetune (``mode="finetune"``) one classifier with DDP, or
    evaluate it (``eval_only``).

    ``Trainer(config)()`` runs this rank's part and returns a :class:`RunResult`. Raises :class:`FixresError`
    for bad input or peers that never arrive, :class:`Preempted` after a stop checkpoint. Tests and benchmarks
    may call :meth:`build`, then :meth:`train_step` / :meth:`train_epoch` / :meth:`fit`, then :meth:`close`.

    ``inputs``: what :func:`fixres_dist.training.inputs.preflight` returned in this process (else the rank reads
    them after meeting its peers). ``locked``, ``announce``: see :class:`RankSession`. ``log``: where rank 0's
    lines go. ``index_note``, ``config_note``: the launcher's lines on the file index (rank 0's unlogged), on --config.
    """

    def __init__(self, config: TrainerConfig, inputs: JobInputs | None = None, *, locked: bool = False,
                 announce: bool = False, index_note: str | None = None, config_note: str | None = None,
                 log: Callable[[str], None] | None = None):
        self.config, self.inputs, self.index_note, self.config_note = config, inputs, index_note, config_note
        self.run_log = RunLog(config, log)
        self.session = RankSession(config, self.run_log.log, locked=locked, announce=announce)
        self.faults = FaultInjector(config.global_rank, self.session.stops.preempt)
        self.clock = progress.JobClock()  # rank 0's measured rates, for the job's remaining time
        self.data = self.network = self.step = self.plan = self.final = self._resume = None
        self.state = TrainState(config.first_input_size)

    def __call__(self) -> RunResult:
        with self.session, warnings.catch_warnings():
            warnings.simplefilter("ignore", FixresWarning)  # rank 0 logs each as a "warning:" line
            try:
                self.build()
                return self.fit()
            except Preempted:
                self.session.stops.chain()  # submitit's handler: it requeues the job now that the checkpoint exists
                raise
            except Exception as exc:
                failure = self.session.failed(exc)
                if failure is not None:
                    world_change.after_failure(self.config, self.state, failure)  # where a lost peer left the job
                    raise failure from None
                raise
            finally:
                self.close()

    def build(self, train_loader: DataLoader | None = None) -> None:
        """Everything before the first training step (see the module's story). ``train_loader``:
        train from this loader instead of the data folder's (:class:`~fixres_dist.data.job_data.JobData`)."""
        cfg, log = self.config, self.run_log.log
        self.session.open("\n".join(filter(None, (self.config_note, cfg.recipe and recipes.describe(cfg)))) or None)
        inputs = self.inputs or JobInputs.read(cfg)
        self.config = cfg = world_change.continued(cfg, inputs.resume.contents if inputs.resume else None,
                                                   self.run_log.warn)  # a global batch kept from another world size
        if cfg.global_rank == 0:
            io.remove_stale_temporaries(cfg.job_folder)  # of a killed run
            checkpoint_shards.remove_partial(cfg.job_folder)
            inputs.index.save()
        log(self.index_note if self.index_note and not inputs.index.built else inputs.index.describe())
        self.data = JobData(cfg, inputs, self.session.device, log, train_loader)
        self._resume = resume = inputs.resume
        if resume is not None and resume.note:
            log(resume.note)
        self.state = TrainState.start(cfg, resume.contents if resume else None)
        per_epoch, seen = self.data.images_per_epoch, self.state.images_seen(self.data.images_per_epoch)
        self.run_log.start(cfg, resume.contents.metrics if resume else [],
                           resumed_board_at(resume, cfg.job_folder, seen), seen, per_epoch, resumed_runs(resume, cfg))
        self.network = Network(cfg, self.data.classes, Network.build_size(cfg, self.state.input_size),
                               inputs.weights, self.session.device, log, self.run_log.warn)
        self.protocol = plan.protocol(cfg)
        if self.network.strategy.lays_out_before_evaluating:  # every evaluation runs on its parts
            self.network.lay_out(self.state.input_size, self.protocol.trains)
        self.checkpointer = Checkpointer(cfg, self.run_log, self.faults, self.network, per_epoch,
                                         self.session.control_group, inputs.index.identity())
        self.stops = StopController(self.session.agreement, LossWatch(), self.checkpointer, self.state, log)
        self.plan = plan.Plan(self.protocol.steps(self.state, self.run_log, self.network.train_size, bool(resume)))
        self.remaining = plan.Remaining(cfg, self.state, self.plan, self.clock, per_epoch, len(self.data.val_set))
        self.evaluator = Evaluator(cfg, self.data, self.network, self.run_log, self.clock, self._after_eval_batch,
                                   self.remaining.postfix, progress.shown(self.config))
        if self.protocol.trains:
            for step in self.plan:  # a finetune's evaluations before training, up to training's start
                self._run(step)
                if step == plan.Action("start training"):
                    break

    def fit(self) -> RunResult:
        """Run the rest of the plan: train the remaining epochs (or evaluate), sweep, report, extract."""
        for step in self.plan:
            self._run(step)
        collectives.barrier()
        return RunResult(rank=self.config.global_rank, **{k: self.final[k] for k in
                                                          ("resolution", "top1", "top5", "loss", "images")})

    def _run(self, step: plan.Step) -> None:
        """One step of the plan (its actions: :data:`fixres_dist.training.plan.ACTIONS`)."""
        cfg, state = self.config, self.state
        if isinstance(step, plan.TrainEpoch):
            self.train_epoch()
            if cfg.dist_bn == "reduce":
                collectives.average_batchnorm_statistics(self.network.model, self.network.strategy.data_group)
            if self.step.ema is not None:
                self.step.ema.average_statistics(self.network.model, self.network.strategy.data_group)
        elif isinstance(step, plan.Evaluate):
            result = self.evaluator.evaluate(step.epoch, step.size, step.label, step.what,
                                             self.step.ema.module if step.ema else None)
            if self.checkpointer.best.evaluated(step, result, state.global_step):  # early stopping: no more epochs
                self.plan.replace(self.protocol.from_training(state, self.run_log))
        elif isinstance(step, plan.EndEpoch):
            state.epoch, state.images_in_epoch = state.epoch + 1, 0
            self.checkpointer.save(state)
            self.stops.stop_if_asked()
        elif step.name == "start training":
            self._start_training()
        elif step.name in plan.FIXRES_ACTIONS:
            self.protocol.act(step.name, state, self.run_log, self.network)
            if step.name == "choose input size":
                self.plan.replace(self.protocol.steps(state, self.run_log, self.network.train_size, resumed=True))
        elif step.name == "final result":
            where = {} if cfg.eval_only else {"resolution": state.eval_size(cfg)}
            self.final = self.run_log.events("eval", **where)[-1]
        elif step.name == "sweep report":
            self.evaluator.report_sweep(self.network.lineage_at(state.input_size),
                                        state.images_seen(self.data.images_per_epoch))
        elif step.name == "features":
            self.evaluator.extract_features(state.eval_size(cfg))

    def _start_training(self) -> None:
        """The network laid out, the train loader, the optimizer step; then the checkpoint continued."""
        cfg, size = self.config, self.state.input_size
        self.network.lay_out(size, trains=True)
        self.network.warn_below_train_size(size)
        self.data.train(size, self.network.preprocessing)
        self.step = TrainStep(cfg, self.network, self.network.average, len(self.data.classes), self.stops.watch,
                              len(self.data.train_loader), len(self.data.train_set), self.run_log.log,
                              self.run_log.warn)
        self.checkpointer.train_with(self.step)
        if self._resume is not None:
            self.checkpointer.restore(self._resume, self.state, len(self.data.train_set))

    def train_epoch(self) -> engine.EpochResult:
        """Train epoch ``state.epoch`` from image ``state.images_in_epoch``; records its ``train`` event."""
        cfg, state = self.config, self.state
        epoch, first_image, started = state.epoch, state.images_in_epoch, time.perf_counter()
        finetuning.set_train_mode(self.network.wrapped)
        where, counted = self.network.layout, self.network.layout.counts_metrics(cfg.global_rank)
        resumed = cfg.global_rank == where.totals_rank and state.images_in_epoch  # it continues the epoch's totals
        state.meter = engine.EpochMeter(self.network.device, state.resumed_sums if resumed else (0.0, 0.0, 0.0),
                                        state.resumed_seconds if state.images_in_epoch else 0.0, counted)
        bar = progress.Bar(self.data.images_per_epoch, f"epoch {epoch + 1}/{cfg.epochs}", enabled=progress.shown(cfg),
                           initial=state.images_in_epoch, postfix=self.remaining.postfix)
        try:
            result = engine.train_one_epoch(*self.faults.slowed(self.train_step, self.data.train_loader, state),
                                            state.meter, epoch=epoch, start_image=state.images_in_epoch,
                                            set_progress=self.step.set_progress, after_step=self._after_step,
                                            progress_bar=bar if bar.enabled else None, times=self.step.times)
        finally:
            bar.close()
        self.clock.add_training(state.images_in_epoch - first_image, time.perf_counter() - started)
        self.stops.stop_if_asked()  # every rank's state after the epoch's last step, not yet agreed on
        state.meter = None
        self.run_log.epoch_trained(epoch, result, self.step.lr, self.step.times.gather(self.session.control_group))
        return result

    def train_step(self, images: torch.Tensor, labels: torch.Tensor, global_batch: int | None = None) -> torch.Tensor:
        """One optimizer step (:class:`~fixres_dist.training.step.TrainStep`) on this rank's uint8 images."""
        loss = self.step(images, labels, global_batch, self.state.global_step)
        self.run_log.step_scalars(self.state.global_step, self.state.images_seen(self.data.images_per_epoch),
                                  loss, labels.numel(), self.step.lr)
        return loss

    def _after_step(self, images_done: int) -> None:
        self.state.images_in_epoch, self.state.global_step = images_done, self.state.global_step + 1
        self.step.after_step(self.state.global_step)
        self.faults.after_step(self.state.global_step)
        self.stops.after_step(self.config.ckpt_every)

    def _after_eval_batch(self) -> None:
        self.faults.during_evaluation(self.state.global_step)
        self.stops.stop_if_asked()

    @property
    def model(self) -> torch.nn.Module:
        """The unwrapped classifier (evaluation and checkpoints use it)."""
        return self.network.model

    def close(self) -> None:
        """Stop the loader workers, leave the process group and release the job folder."""
        if self.data is not None:
            self.data.close()
        self.run_log.close()
        self.session.close()  # last: the job lock
