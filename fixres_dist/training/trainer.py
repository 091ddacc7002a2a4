"""The Trainer: one rank's part of a job, from rendezvous to the last checkpoint.

``Trainer(config)()`` runs the job in this process and returns a :class:`RunResult`. It reads as
the story, top to bottom:

* :meth:`Trainer.build`: lock the job folder (rank 0) and meet the other ranks; build the data;
  find the checkpoint to continue from (:func:`fixres_dist.training.checkpoint.resume_source`); build the
  model; (finetune: measure top-1 before, at the train and test resolutions, and pick the test
  resolution if ``--input-size auto``); freeze what does not train, build the optimizer and wrap in
  DDP; restore the checkpoint;
* :meth:`Trainer.fit`: (``--eval-only``: evaluate, report and stop) train epoch by epoch, averaging
  BatchNorm statistics over ranks, evaluating exactly (and the weights' EMA, ``--model-ema``),
  checkpointing; then the resolution sweep, the FixRes table and the feature extraction, as asked.

A step (:func:`fixres_dist.training.engine.train_step`) takes this rank's share of a global batch, in
``--grad-accum-steps`` micro-batches, mixed (:mod:`fixres_dist.training.mixing`) and clipped as asked; the
optimizer and the learning-rate schedule are :mod:`fixres_dist.training.optim`'s; rank 0 also writes
TensorBoard curves (:mod:`fixres_dist.reporting.tensorboard_events`).

The loops are :mod:`fixres_dist.training.engine`, the stop agreement :mod:`fixres_dist.distributed.preemption`, the
tables :mod:`fixres_dist.reporting.reports`. Rank 0 alone logs, shows progress and writes files; checkpoints
hold every rank's RNG state. SIGTERM, SIGINT or ``config.preempt_signal`` on any rank makes all ranks
stop together after the same training step (at most one step after the one during which it
arrived: the ranks agree in the background, :class:`~fixres_dist.distributed.preemption.StepAgreement`) or
evaluation batch, write one checkpoint if anything was trained since the last one, and raise
:class:`~fixres_dist.distributed.preemption.Preempted` (exit status 3, 130 for SIGINT), after which the handler
that owned the signal before (submitit's) is called. A non-finite loss on any rank stops all ranks
at the same step, in the same agreement, and nothing non-finite is written (:mod:`fixres_dist.training.finite`).
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import attrs
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from fixres_dist.models import batchnorm, lineage, architectures, preprocessing, resolutions, weights
from fixres_dist.training import mixing, checkpoint, engine, finite, optim, recipes
from fixres_dist.data import pipeline, file_index
from fixres_dist.distributed import collectives, joblock, placement
from fixres_dist.reporting import extraction, progress, reports
from fixres_dist.fixres import finetuning, sweep
from fixres_dist import io
from fixres_dist.models.ema import ModelEMA
from fixres_dist.config import CONFIG_FILE, TrainerConfig
from fixres_dist.training.engine import AMP_DTYPES, EvalResult
from fixres_dist.errors import FixresError, FixresWarning, first_line, is_terminal, plural, user_message
from fixres_dist.training.faults import FaultInjector
from fixres_dist.reporting.metrics import METRICS_FILE, MetricsLog
from fixres_dist.distributed.preemption import Preempted, StepAgreement, StopSignals, stop_signals
from fixres_dist.distributed.rendezvous import LostPeers, NetworkInterrupted, RendezvousInterrupted

BOARD_KEY = "tensorboard_at"  # checkpoint entry: where the job's TensorBoard event files stop (images trained on)

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
    """Train (``mode="scratch"``) or FixRes-finetune (``mode="finetune"``) one classifier with DDP.

    Callable: ``Trainer(config)()`` runs this rank's part and returns a :class:`RunResult`. Raises
    :class:`FixresError` for bad input or peers that never arrive, :class:`Preempted` after a
    preemption checkpoint. Tests and benchmarks may instead call :meth:`build`, then
    :meth:`train_step` / :meth:`train_epoch` / :meth:`fit`, then :meth:`close`.

    ``checked``: the launcher's preflight (:func:`fixres_dist.entry.launch.preflight`) already checked the
    data folder, the features folder and the checkpoint's configuration in this process or its
    parent; the Trainer does not repeat those checks. ``locked``: the launcher holds the job lock
    (:mod:`fixres_dist.distributed.joblock`; spawn mode), else rank 0 takes it. ``announce``: a non-zero rank
    prints one line when it has met its peers (ranks started in their own shells). ``index_note``: the
    preflight's line about the data's file index (built or reused: :mod:`fixres_dist.data.file_index`),
    which rank 0 logs instead of its own (it then only loads the index the preflight wrote). ``log``:
    where rank 0's messages go (default the console, above the progress bar).
    """

    def __init__(self, config: TrainerConfig, *, checked: bool = False, locked: bool = False, announce: bool = False,
                 index_note: str | None = None, log: Callable[[str], None] | None = None):
        self.config = config
        self.checked, self.locked, self.announce, self.index_note = checked, locked, announce, index_note
        self._log = log or tqdm.write
        self.rank0 = config.global_rank == 0
        self.device = torch.device("cpu")
        self.stops = StopSignals(config.preempt_signal)
        self.agreement = StepAgreement(self.stops)  # on the control group once the ranks met
        self.rendezvous = None  # fixres_dist.distributed.rendezvous.Rendezvous once the ranks met (world > 1)
        self.control_group = None  # gloo group for stop flags and gathered RNG states
        self.faults = FaultInjector(config.global_rank, self.stops.preempt)
        self.metrics = MetricsLog(config.job_folder / METRICS_FILE, False)
        self.history: list[dict] = []
        self._lock = None
        # The data.
        self.classes: list[str] = []
        self.train_set = self.val_set = self.train_loader = None
        self.val_loaders: dict[int, object] = {}  # resolution -> loader (persistent workers)
        # The model. The training resolution; with --input-size auto, the first test size until the
        # sweep before the finetune picks one. train_size: what the weights were trained at from
        # scratch (pixels; None: unknown), from the lineage of the weights loaded (lineage.for_run).
        self.input_size = config.input_size if config.input_size != "auto" else config.test_sizes[0]
        self.weights_lineage = lineage.Lineage()
        self.train_size: int | None = None
        self.new_head: tuple[int, int] | None = None  # (classes, the weight file's head's classes) if new
        self.model = self.ddp = self.forward = None  # unwrapped, DDP-wrapped, maybe compiled
        self.optimizer = self.scaler = None
        self.ema: ModelEMA | None = None  # --model-ema
        self.mixing: mixing.BatchMixing | None = None  # --mixup-alpha/--cutmix-alpha (enabled or not)
        self.board = None  # rank 0's TensorBoard event files with --tensorboard (tensorboard_events.py)
        self._board_every = 1  # optimizer steps between two per-step points of the training curves
        self._board_until = 0  # images trained on at the last checkpoint written while the event log worked
        self._progress = 0.0  # epochs of training done when the current step started (the LR schedule's)
        self.base_lr = optim.scaled_learning_rate(config.learning_rate, config.batch, config.num_tasks,
                                                  config.grad_accum_steps)
        self.amp = AMP_DTYPES[config.amp]
        # What the weights expect of their input (normalisation, test crop, interpolation); the
        # architecture's until _build_model has read the weight file (preprocessing.resolve).
        self.preprocessing = preprocessing.resolve(config)
        self._compile_checked = not config.compile
        # Where the run is, and the checkpoint it resumes from.
        self.epoch, self.images_in_epoch, self.global_step = 0, 0, 0
        self.meter: engine.EpochMeter | None = None  # this rank's sums of the epoch in progress
        self.watch = finite.LossWatch()  # the first step whose loss was not finite, on this rank
        self._checkpoint_step: int | None = None  # global step of the last checkpoint written or resumed
        self.resumed = None  # (path, state) of the checkpoint to resume from
        self._resumed_sums, self._resumed_seconds = (0.0, 0.0, 0.0), 0.0  # the epoch so far, before a resume
        self._unsaved = False  # trained since the last checkpoint
        # Rank 0's progress display (progress.py): measured rates, what the job still has to evaluate.
        self.clock = progress.JobClock()
        # "train" (also before it), "epoch-eval" / "epoch-eval-ema" (an epoch's evaluation of the weights /
        # of their EMA), "final"
        self._phase = "train"
        self._sweep_rest: list[int] = []  # resolutions of the sweep in progress after the current one

    # ----------------------------------------------------------------- the story
    def __call__(self) -> RunResult:
        with self.stops, warnings.catch_warnings():
            warnings.simplefilter("ignore", FixresWarning)  # rank 0 logs each as a "warning:" line
            try:
                self.build()
                return self.fit()
            except Preempted:
                self.stops.chain()  # submitit's handler: it requeues the job now that the checkpoint exists
                raise
            except Exception as exc:
                if self.rendezvous is not None:
                    failure = self._tell_peers(exc)
                    self.rendezvous.hold_store()  # rank 0: until the others have read what happened
                    if failure is not None:
                        raise failure from None
                raise
            finally:
                self.close()

    def _tell_peers(self, exc: Exception) -> Exception | None:
        """After ``exc`` on this rank: say why it stops to the other ranks, through the store.
        Returns the one-line error to raise instead of ``exc`` when the cause is elsewhere: peers
        that failed or vanished (:class:`~fixres_dist.distributed.rendezvous.LostPeers`, named with their host),
        or, every peer alive, the network (:class:`~fixres_dist.distributed.rendezvous.NetworkInterrupted`);
        None when the cause is this rank's own (its traceback is shown)."""
        gone = self.rendezvous.lost_peers() if isinstance(exc, (RuntimeError, dist.DistError)) else ""
        if gone:
            self.rendezvous.announce_lost(gone)
            return LostPeers(gone)
        if collectives.is_collective_failure(exc):
            failure = NetworkInterrupted(first_line(exc), collectives.collective_timeout(self.config.dist_timeout))
            self.rendezvous.announce_failure(str(failure))
            return failure
        self.rendezvous.announce_failure(user_message(exc) or f"{type(exc).__name__}: {first_line(exc)}")
        return None

    def build(self, train_loader=None) -> None:
        """Everything before the first training step (see the module's story).

        ``train_loader``: train from this loader (yielding ``(images, labels, unreadable count)``,
        with an :class:`~fixres_dist.data.samplers.ExactBatchSampler`) instead of the data folder's
        (benchmarks: one fixed in-memory batch).
        """
        cfg = self.config
        self.train_loader = train_loader
        self._setup_process_group()
        self._open_job_folder()
        self._build_data()
        self._find_checkpoint()
        if self.rank0:  # only now: a refused resume must leave the folder as it was
            io.write_private(cfg.job_folder / CONFIG_FILE, cfg.to_json() + "\n")
            self.metrics.rewrite(self.history)  # drops events the checkpoint does not know of
            self._open_board()
        self._build_model()
        if cfg.eval_only:
            return
        if cfg.mode == "finetune" and self.resumed is None:
            self._evaluate_before_finetune()
        self._prepare_training()
        if self.resumed is not None:
            self._restore(*self.resumed)

    def fit(self) -> RunResult:
        """Train the remaining epochs (or, ``--eval-only``, evaluate), then sweep, report, extract."""
        cfg = self.config
        if cfg.eval_only:
            self._sweep("sweep", cfg.test_sizes or (self.eval_size,))
            return self._finish([e for e in self.history if e["event"] == "eval"][-1])
        while self.epoch < cfg.epochs:
            if not self._epoch_recorded():  # else a stop came during its evaluation: it only lacks that
                self.train_epoch()
                if cfg.dist_bn == "reduce":
                    collectives.average_batchnorm_statistics(self.model)
                if self.ema is not None:
                    self.ema.average_statistics(self.model)
            self._phase = "epoch-eval"
            what = f"epoch {self.epoch + 1}/{cfg.epochs}"
            if not self._evaluated(self.epoch + 1, "eval"):
                self._evaluate(self.epoch + 1, self.eval_size, what=what)
            if self.ema is not None and not self._evaluated(self.epoch + 1, "ema_eval"):
                self._phase = "epoch-eval-ema"
                self._evaluate(self.epoch + 1, self.eval_size, what=what, ema=True)
            self.epoch, self.images_in_epoch = self.epoch + 1, 0
            self._save_checkpoint()
            self._stop_if_asked()
        final = [e for e in self.history if e["event"] == "eval" and e["resolution"] == self.eval_size][-1]
        self._phase = "final"
        if cfg.test_sizes and cfg.mode == "finetune":
            self._sweep("after", self._finetune_sweep_sizes())
        elif cfg.test_sizes:
            self._sweep("trained")
        if cfg.mode == "finetune":
            self.log(reports.finetune_table(self.history, cfg.architecture, cfg.num_tasks, self.input_size,
                                            self.eval_size, self.new_head, self.weights_lineage.finetuned_at))
        return self._finish(final)

    def _finish(self, final: dict) -> RunResult:
        """Sweep report and features, if asked; the result every rank returns."""
        cfg = self.config
        if cfg.test_sizes:
            self._report_sweep()
        if cfg.extract_features:
            self._extract_features()
        collectives.barrier()
        return RunResult(rank=cfg.global_rank, **{k: final[k] for k in ("resolution", "top1", "top5", "loss", "images")})

    def close(self) -> None:
        """Stop the loader workers, leave the process group and release the job folder."""
        for loader in (self.train_loader, *self.val_loaders.values()):
            pipeline.close_loader(loader)
        if self.rendezvous is not None:
            self.rendezvous.stop_heartbeat()
        collectives.destroy_process_group()
        self.rendezvous = self.control_group = None
        if self.board is not None:
            self.board.close()
            self.board = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def run_name(self) -> str:
        """What this run is, in its log, metrics and reports: ``evaluation`` (``--eval-only``, whichever
        script ran it), else ``scratch`` or ``finetune``."""
        return "evaluation" if self.config.eval_only else self.config.mode

    @property
    def network(self) -> lineage.Lineage:
        """The lineage of the network this run reports on and checkpoints (:mod:`fixres_dist.models.lineage`):
        the weights evaluated (``--eval-only``), those trained from scratch here at the training
        resolution, or those finetuned here at ``self.input_size`` from weights trained at ``self.train_size``."""
        if self.config.eval_only:
            return self.weights_lineage
        if self.config.mode == "scratch":
            return lineage.Lineage(self.input_size)
        return lineage.Lineage(self.train_size, self.input_size)

    @property
    def eval_size(self) -> int:
        """The test resolution in pixels: ``--test-size``, else the training resolution."""
        return self.config.test_size or self.input_size

    # ------------------------------------------------------------------ setup
    def _setup_process_group(self) -> None:
        """Pick the device and thread count, then meet the other ranks (see fixres_dist.distributed.rendezvous)."""
        cfg = self.config
        if not os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(placement.threads_per_rank(cfg.num_tasks))
        if cfg.device == "cuda":
            self.device = placement.cuda_device(cfg.local_rank)
            torch.cuda.set_device(self.device)
            torch.backends.cudnn.benchmark = True  # fixed input sizes: let cuDNN pick the fastest kernels
        io.make_private_folder(cfg.job_folder)  # holds the lock and the rendezvous file
        if self.rank0:
            if not self.locked:  # before any rendezvous: a second launch of a live job stops here
                self._lock = joblock.JobLock.acquire(cfg.job_folder, cfg.num_tasks)
            derived = " (derived from the configuration: the same command resumes this job)" \
                if cfg.job_id == cfg.derived_job_id() else ""
            self.log(f"job {cfg.job_id}{derived}: {self.run_name} {cfg.architecture}, {cfg.num_tasks} rank(s) on "
                     f"{self.device.type}, folder {cfg.job_folder}")
            if cfg.recipe:
                self.log(recipes.describe(cfg))
        else:
            joblock.check_joinable(cfg.job_folder, cfg.global_rank)
        try:
            self.rendezvous = collectives.init_process_group(
                cfg.dist_backend, cfg.dist_url, cfg.global_rank, cfg.num_tasks, cfg.dist_timeout,
                should_stop=lambda: self.stops.requested,
                check_joinable=lambda: joblock.check_joinable(cfg.job_folder, cfg.global_rank))
        except RendezvousInterrupted as exc:
            raise Preempted(f"{exc}; nothing to checkpoint yet", self.stops.received) from None
        if self.rank0:
            joblock.record_met(cfg.job_folder)
            if self.rendezvous is not None:
                self.log(self.rendezvous.describe())
        elif self.announce:
            print(f"fixres_dist: rank {cfg.global_rank} of {cfg.num_tasks} met its peers (job {cfg.job_id}); "
                  "rank 0 logs the run", flush=True)
        torch.manual_seed(cfg.seed + cfg.global_rank)
        self.control_group = collectives.control_group()
        self.agreement = StepAgreement(self.stops, self.control_group)

    def _open_job_folder(self) -> None:
        """Rank 0: drop temporary files of a killed run."""
        cfg = self.config
        self.metrics = MetricsLog(cfg.job_folder / METRICS_FILE, self.rank0)
        if self.rank0:
            io.remove_stale_temporaries(cfg.job_folder)

    def _build_data(self) -> None:
        """The train and val datasets, from the data's file index (:mod:`fixres_dist.data.file_index`):
        loaded and checked, or walked if the data changed; rank 0 writes a walked one."""
        cfg = self.config
        root = cfg.data_path or pipeline.embedded_data_path()
        index = file_index.data_index(root, cfg.file_index_folder)
        if not self.checked:
            pipeline.check_image_folder(root, index=index)
            if cfg.extract_features:
                extraction.check_destination(cfg.extract_features, cfg.overwrite)
        if self.rank0:
            index.save()
        self.log(self.index_note if self.index_note and not index.built else index.describe())
        self.train_set, self.val_set = pipeline.image_folder(root, "train", index), pipeline.image_folder(root, "val", index)
        self.classes = list(self.train_set.classes)
        hidden = [*self.train_set.hidden, *self.val_set.hidden]
        if hidden:
            shown = ", ".join(os.path.relpath(p, root) for p in hidden[:3]) + (", ..." if len(hidden) > 3 else "")
            self.log(f"data: skipped {len(hidden)} hidden files and folders ({shown}); hidden names are never "
                     "classes or images")
        if len(self.train_set) < 2 * cfg.num_tasks:
            raise FixresError(f"{len(self.train_set)} training images are too few for {cfg.num_tasks} ranks")

    def _loader(self, dataset, transform, training: bool):
        """A loader of this rank's share: shuffled with training semantics (an optimizer step's share:
        ``--grad-accum-steps`` micro-batches; ``--ra-sampler``'s repeats), or in order (evaluation)."""
        cfg = self.config
        return pipeline.make_loader(dataset, transform, batch_size=cfg.batch * (cfg.grad_accum_steps if training else 1),
                                reps=cfg.ra_reps if training else 1, world_size=cfg.num_tasks,
                                rank=cfg.global_rank, shuffle=training, seed=cfg.seed, workers=cfg.workers,
                                pin_memory=self.device.type == "cuda", skip_bad_images=cfg.skip_bad_images,
                                training=training, ignored_signals=stop_signals(cfg.preempt_signal))

    def _find_checkpoint(self) -> None:
        """The job folder's checkpoint, else the one ``--resume`` names, else none (checkpoint.resume_source)."""
        cfg = self.config
        path, note = checkpoint.resume_source(cfg.job_folder, cfg.resume)
        if path is None:
            return
        if note:
            self.log(note)
        state = checkpoint.load_checkpoint(path)
        if not self.checked:
            checkpoint.check_resumable(cfg, state["config"], path)
        self.history = list(state["metrics"])
        self.input_size = state.get("input_size", self.input_size)  # --input-size auto: the size chosen
        self.resumed = (path, state)

    def _open_board(self) -> None:
        """Rank 0, ``--tensorboard``: open the job's event files where the checkpoint resumed from, or
        where they stop if that is earlier (the log was off or had failed); what an interrupted run
        wrote after that point is hidden and the events the checkpoint knows are rewritten from it (no
        duplicate points on a curve, no gap in the per-epoch ones)."""
        per_epoch = self._images_per_epoch
        path, state = self.resumed if self.resumed is not None else (None, {"epoch": 0, "images_in_epoch": 0})
        resume_at = state["epoch"] * per_epoch + state["images_in_epoch"]
        if path is not None and Path(path).resolve().parent == self.config.job_folder.resolve():  # else this folder holds no events yet
            self._board_until = state.get(BOARD_KEY, resume_at if state["config"].get("tensorboard") else 0)
        if not self.config.tensorboard:
            return  # the checkpoints carry on where the event files stop
        from fixres_dist.reporting.tensorboard_events import TensorBoardLog

        since = min(resume_at, self._board_until)
        self.board = TensorBoardLog(self.config.job_folder, per_epoch, resume_at=since, on_failure=self._board_failed)
        self.log(f"TensorBoard: event files in {self.board.folder} (x axis: images trained on; "
                 f"tensorboard --logdir {self.board.folder})"
                 + (f"; the curves from image {since:,} on rewritten from the checkpoint's history" if since < resume_at
                    else ""))
        self.board.replay(self.history, since=since)
        self._board_until = since
        steps = -(-per_epoch // (self.config.batch * self.config.grad_accum_steps * self.config.num_tasks))
        self._board_every = max(1, steps // 50)  # about 50 points an epoch

    def _board_failed(self, message: str) -> None:
        """The TensorBoard log stopped (a write failed): say so once; training goes on."""
        self.board = None
        self._warn(f"{message}; training goes on (metrics.jsonl has every figure)")

    @property
    def _board_position(self) -> int:
        """Images trained on since the job started: the x axis of the TensorBoard curves."""
        return self.epoch * self._images_per_epoch + self.images_in_epoch

    @property
    def _images_per_epoch(self) -> int:
        """Training images per epoch (the x axis of the TensorBoard curves counts images trained on)."""
        return self.train_loader.batch_sampler.dataset_size if self.train_loader is not None else len(self.train_set)

    def _build_model(self) -> None:
        """The unwrapped classifier at ``self.input_size`` (``--eval-only``: the first size evaluated),
        with ``--weight-path`` loaded, and the input preprocessing its weights expect (logged)."""
        cfg = self.config
        size = resolutions.build_size(cfg) if cfg.eval_only else self.input_size  # resumed: the size trained at
        model = architectures.build_model(cfg.architecture, len(self.classes), image_size=size,
                                   low_res_stem=cfg.low_res_stem)
        found = None
        if cfg.weight_path:
            found = weights.read_weight_file(cfg.weight_path, cfg.weight_key)
            self.log(found.describe())
            loaded = weights.load_weights(model, found)
            if loaded.note:
                self.log(loaded.note)
            if loaded.new_head_from is not None:
                self.new_head = (len(self.classes), loaded.new_head_from)
        self.preprocessing = preprocessing.resolve(cfg, found.config if found else None)
        self.log(self.preprocessing.describe())
        self.weights_lineage = lineage.for_run(cfg, found)
        self.train_size = self.weights_lineage.train_size
        if cfg.eval_only:
            self.log(f"evaluating weights: {self.weights_lineage.describe()}")
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model.to(self.device)  # unwrapped: evaluation and checkpoints use it

    def _prepare_training(self) -> None:
        """Finetune: freeze what does not train. Then the train loader, the optimizer and the DDP wrap."""
        cfg = self.config
        if cfg.mode == "finetune":
            self.model = architectures.for_resolution(self.model, self.input_size)  # ViT: position embeddings
            trainable = finetuning.freeze_for_finetune(self.model, self.input_size, cfg.finetune_scope, cfg.last_norm)
            count = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            self.log(f"finetuning ({cfg.finetune_scope}) {count:,} of {sum(p.numel() for p in self.model.parameters()):,} "
                     f"parameters in {len(trainable)} tensors: {', '.join(trainable)}")
            below = finetuning.finetune_resolution_warning(self.train_size, self.input_size)
            if below:
                self._warn(below)
            if cfg.num_tasks > 1:  # trainable BatchNorms see the union of all ranks' images
                norms = [name for name, m in self.model.named_modules() if isinstance(m, finetuning.NORM_TYPES)
                         and any(p.requires_grad for p in m.parameters(recurse=False))]
                synchronised = batchnorm.synchronise(self.model, norms, self.device.type)
                if synchronised:
                    self.log(f"BatchNorm statistics over all {cfg.num_tasks} ranks' images: {', '.join(synchronised)}")
        if cfg.sync_bn and cfg.num_tasks > 1:
            synchronised = batchnorm.synchronise(self.model, None, self.device.type)
            self.log(f"--sync-bn: {len(synchronised)} BatchNorm layers synchronised over {cfg.num_tasks} ranks")
        prep = self.preprocessing
        transform = pipeline.train_transform(self.input_size, prep.interpolation, cfg.auto_augment, cfg.random_erase,
                                         prep.normalization[0]) if cfg.mode == "scratch" else \
            pipeline.finetune_transform(self.input_size, cfg.finetune_augmentation, prep.crop_ratio, prep.interpolation)
        if self.train_loader is None:
            self.train_loader = self._loader(self.train_set, transform, training=True)
        self.optimizer = optim.build_optimizer(cfg.opt, optim.parameter_groups(self.model, cfg.weight_decay,
                                                                               cfg.norm_weight_decay),
                                               self.base_lr, cfg.momentum)
        accumulated = f" x {cfg.grad_accum_steps} accumulated" if cfg.grad_accum_steps > 1 else ""
        self.log(f"{cfg.opt} lr {self.base_lr:g} = {cfg.learning_rate:g} x {cfg.batch} x {cfg.num_tasks}{accumulated} / "
                 f"{optim.REFERENCE_BATCH} (linear scaling rule), {len(self.train_loader)} steps per epoch"
                 + (f", repeated augmentation x{cfg.ra_reps} (an epoch: about {-(-len(self.train_set) // cfg.ra_reps):,} "
                    f"images, {cfg.ra_reps} copies each)" if cfg.ra_reps > 1 else "")
                 + (" (more copies than ranks: some copies of an image share a rank)" if cfg.ra_reps > cfg.num_tasks
                    else ""))
        self._check_schedule()
        self.mixing = mixing.BatchMixing(cfg.mixup_alpha, cfg.cutmix_alpha, len(self.classes), cfg.seed)
        if cfg.model_ema:
            self.ema = ModelEMA(self.model, cfg.model_ema_decay, cfg.model_ema_steps)
            self._check_ema_horizon()
        self.ddp = self.model if cfg.num_tasks == 1 else DistributedDataParallel(
            self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            forward_sync_buffers=cfg.dist_bn == "broadcast")
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp == "fp16")
        # compiled lazily, at the first step (see _forward)
        self.forward = torch.compile(self.ddp, backend=cfg.compile) if cfg.compile else self.ddp

    def _check_schedule(self) -> None:
        """Warn when the learning-rate schedule cannot run its course in this run (a recipe's or the
        default warmup kept on a much shorter run): the rate would only rise, or never step down."""
        cfg = self.config
        after = cfg.epochs - cfg.warmup_epochs
        if cfg.warmup_epochs and after <= 0:
            self._warn(f"--warmup-epochs {cfg.warmup_epochs:g} covers the whole run ({plural(cfg.epochs, 'epoch')}): the "
                       "learning rate only rises and never decays; lower --warmup-epochs")
        elif cfg.lr_scheduler == "step" and cfg.lr_step_size >= after:
            self._warn(f"--lr-step-size {cfg.lr_step_size} is not less than the {after:g} epochs after the warmup: "
                       "the step schedule never decays in this run; lower --lr-step-size")

    def _check_ema_horizon(self) -> None:
        """Warn when the run gives the EMA too few updates after the warmup to move from where it started
        (a recipe's decay kept on a much shorter run): it would report the starting weights."""
        cfg = self.config
        steps = len(self.train_loader) * cfg.epochs
        updates = max(0, steps - math.ceil(cfg.warmup_epochs * len(self.train_loader))) // cfg.model_ema_steps
        kept = cfg.model_ema_decay ** updates
        if kept > 0.1:
            message = (f"--model-ema gets {plural(updates, 'update')} after the warmup in this run (one every "
                       f"{cfg.model_ema_steps} of {steps} steps): with decay {cfg.model_ema_decay:g} the average keeps "
                       f"{100 * kept:.0f} % of the weights it started from; lower --model-ema-steps or --model-ema-decay")
            self._warn(message)

    def _restore(self, path, state: dict) -> None:
        """Continue from ``state``: parameters, optimizer, position in the epoch, RNG and BatchNorm buffers."""
        cfg = self.config
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler.is_enabled() and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.images_in_epoch, self.global_step = state["epoch"], state["images_in_epoch"], state["global_step"]
        self._checkpoint_step = self.global_step
        self._resumed_sums = state.get("epoch_sums") or (0.0, 0.0, 0.0)  # the epoch's loss so far
        self._resumed_seconds = state.get("epoch_seconds", 0.0)
        ranks = state["ranks"]
        same_world = len(ranks) == cfg.num_tasks
        if same_world:
            checkpoint.set_rng_state(ranks[cfg.global_rank]["rng"])
        buffers = checkpoint.rank_buffers(ranks, cfg.global_rank if same_world else None)
        self.model.load_state_dict({**self.model.state_dict(), **buffers})
        if self.ema is not None:
            self.ema.load(state["model_ema"], state["model_ema_state"],
                          checkpoint.rank_buffers(ranks, cfg.global_rank if same_world else None, "ema_buffers"))
        if not same_world:
            self._warn(f"resuming a {len(ranks)}-rank checkpoint on {plural(cfg.num_tasks, 'rank')}: lr re-derived "
                       f"by the linear scaling rule ({self.base_lr:g}), BatchNorm statistics averaged, epoch "
                       f"{self.epoch + 1} continues at image {self.images_in_epoch} of {len(self.train_set)} "
                       "of the same permutation (no image repeated); RNG streams restart")
        if self.epoch >= cfg.epochs:
            self.log(f"{path}: this job already completed its {cfg.epochs} epochs; nothing to do "
                     "(use another --job-id for a new run)")
        else:
            self.log(f"resumed from {path}: epoch {self.epoch + 1}, image {self.images_in_epoch} of the epoch, "
                     f"step {self.global_step}")

    # --------------------------------------------------------------- training
    def train_epoch(self) -> engine.EpochResult:
        """Train epoch ``self.epoch`` from image ``self.images_in_epoch``; records its ``train`` event."""
        cfg, epoch = self.config, self.epoch
        finetuning.set_train_mode(self.ddp)
        dataset_size = self.train_loader.batch_sampler.dataset_size
        # After a mid-epoch resume, rank 0 starts from the epoch's totals before the stop.
        resumed = self.rank0 and self.images_in_epoch
        self.meter = engine.EpochMeter(self.device, self._resumed_sums if resumed else (0.0, 0.0, 0.0),
                                       self._resumed_seconds if resumed else 0.0)
        self._phase, started, first_image = "train", time.perf_counter(), self.images_in_epoch
        bar = progress.Bar(dataset_size, f"epoch {epoch + 1}/{cfg.epochs}", enabled=self.show_progress,
                           initial=self.images_in_epoch, postfix=self._job_left)
        try:
            result = engine.train_one_epoch(self._step, self.train_loader, self.meter, epoch=epoch,
                                            start_image=self.images_in_epoch, set_progress=self._set_learning_rate,
                                            after_step=self._after_step, progress_bar=bar if bar.enabled else None)
        finally:
            bar.close()
        self.clock.add_training(self.images_in_epoch - first_image, time.perf_counter() - started)
        stop = self._agree()  # every rank's state after the epoch's last step, which is not yet agreed on
        if stop is not None:
            self._stop(stop)
        self.meter = None
        lr = self.optimizer.param_groups[0]["lr"]
        self._record("train", epoch=epoch + 1, loss=result.loss, lr=lr, img_per_s=result.img_per_s,
                     **({"skipped_images": result.skipped} if result.skipped else {}),
                     **({"left_out_images": result.left_out} if result.left_out else {}))
        self.log(f"epoch {epoch + 1}/{cfg.epochs}: train loss {result.loss:.4f}, lr {lr:.4g}, "
                 f"{result.img_per_s:,.0f} img/s"
                 + (f", {result.skipped} unreadable images skipped" if result.skipped else "")
                 + (f", its last {result.left_out} images left out: fewer than 2 per rank after resuming on "
                    f"{cfg.num_tasks} ranks" if result.left_out else ""))
        return result

    @property
    def show_progress(self) -> bool:
        """Whether this process draws progress bars: rank 0, with ``--progress``, or by default when
        its stderr is a terminal (not a log file or a pipe)."""
        wanted = self.config.progress
        return self.rank0 and (is_terminal(sys.stderr) if wanted is None else wanted)

    def _job_left(self, bar: progress.Bar, evaluating: int | None = None) -> str:
        """A bar's postfix: the job's estimated remaining time (:class:`~fixres_dist.reporting.progress.JobClock`).
        ``bar``: the training epoch's, or the bar of the evaluation at ``evaluating`` pixels."""
        cfg = self.config
        per_epoch = self.train_loader.batch_sampler.dataset_size if self.train_loader is not None else len(self.train_set)
        train_left = 0 if cfg.eval_only else max(0, (cfg.epochs - self.epoch) * per_epoch - self.images_in_epoch)
        evaluations = [(len(self.val_set), size) for size in self._evaluations_left()]
        if evaluating is not None:
            evaluations.append((bar.total - bar.done, evaluating))
        live = (bar.done - bar.initial, bar.seconds()) if evaluating is None else (0, 0.0)
        seconds = self.clock.remaining(train_left, self.input_size, evaluations, live)
        if seconds is not None and evaluating is None and bar.done > bar.initial:  # never less than this epoch's
            seconds = max(seconds, (bar.total - bar.done) * bar.seconds() / (bar.done - bar.initial))
        return f"job {progress.format_seconds(seconds)} left"

    def _evaluations_left(self) -> list[int]:
        """Resolutions (pixels) of the evaluations the job has still to start, in order."""
        cfg = self.config
        if cfg.eval_only or self._phase == "final":
            return list(self._sweep_rest)
        epochs = cfg.epochs - self.epoch - self._phase.startswith("epoch-eval")
        this_epochs_ema = [self.eval_size] if self._phase == "epoch-eval" and self.ema is not None else []
        final = (self._finetune_sweep_sizes() if cfg.mode == "finetune" else list(cfg.test_sizes)) \
            if cfg.test_sizes else []
        return [*self._sweep_rest, *this_epochs_ema, *[self.eval_size] * (epochs * (2 if self.ema is not None else 1)),
                *final]

    def _evaluated(self, epoch: int, event: str) -> bool:
        """Whether epoch ``epoch``'s evaluation (``eval``, or ``ema_eval`` of the EMA) is recorded: a stop
        during the epoch's evaluations leaves the ones done in the checkpoint."""
        return any(e["event"] == event and e["epoch"] == epoch and "label" not in e for e in self.history)

    def _epoch_recorded(self) -> bool:
        """Whether epoch ``self.epoch`` already has its ``train`` event (trained, not yet evaluated)."""
        return any(e["event"] == "train" and e["epoch"] == self.epoch + 1 for e in self.history)

    def train_step(self, images: torch.Tensor, labels: torch.Tensor, global_batch: int | None = None) -> torch.Tensor:
        """One optimizer step (:func:`fixres_dist.training.engine.train_step`) on this rank's uint8 images."""
        return self._step(images, labels, global_batch)

    def _step(self, images, labels, global_batch):
        cfg = self.config
        loss = engine.train_step(self._forward, self.optimizer, self.scaler, images, labels, device=self.device,
                                 world=cfg.num_tasks, global_batch=global_batch, amp=self.amp,
                                 channels_last=cfg.channels_last, label_smoothing=cfg.label_smoothing,
                                 normalization=self.preprocessing.normalization, accumulation=cfg.grad_accum_steps,
                                 no_sync=self.ddp.no_sync if self.ddp is not self.model else None,
                                 mix=self._mix if self.mixing.enabled else None, clip_grad_norm=cfg.clip_grad_norm)
        self.watch.observe(self.global_step + 1, loss)
        if self.board is not None and self.global_step % self._board_every == 0:  # rank 0's images' loss
            self.board.step_scalars(self._board_position, loss.item() / labels.numel(),
                                    self.optimizer.param_groups[0]["lr"])
        return loss

    def _mix(self, images: torch.Tensor, labels: torch.Tensor, micro_batch: int):
        """MixUp/CutMix of one micro-batch, drawn from (seed, step, rank, micro-batch) alone: the same
        after a resume (:mod:`fixres_dist.training.mixing`)."""
        return self.mixing(images, labels, (self.global_step + 1, self.config.global_rank, micro_batch))

    def _set_learning_rate(self, progress: float) -> None:
        cfg = self.config
        self._progress = progress
        lr = self.base_lr * optim.lr_factor(progress, cfg.epochs, cfg.warmup_epochs, cfg.lr_scheduler,
                                            cfg.lr_step_size, cfg.lr_gamma)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _after_step(self, images_done: int) -> None:
        self.images_in_epoch, self.global_step = images_done, self.global_step + 1
        if self.ema is not None:
            self.ema.after_step(self.model, self.global_step, warming_up=self._progress < self.config.warmup_epochs)
        self._unsaved = True
        self.faults.after_step(self.global_step)
        checkpoint_due = bool(self.config.ckpt_every) and self.global_step % self.config.ckpt_every == 0
        stop = self._agree(now=checkpoint_due)  # else one step late, without waiting for the network
        if checkpoint_due:
            self._save_checkpoint()
        if stop is not None:
            self._stop(stop)

    def _forward(self, images: torch.Tensor) -> torch.Tensor:
        """The DDP model's forward, compiled with ``--compile``.

        Compilation happens at the first call; if it fails, the run warns with the cause and goes on
        uncompiled (same results, eager speed) rather than losing the job to a compiler problem.
        """
        if self._compile_checked:
            return self.forward(images)
        try:
            logits = self.forward(images)
        except Exception as exc:  # any compiler failure; a genuine error recurs below, uncompiled
            self._warn(f"--compile {self.config.compile} failed ({type(exc).__name__}: {first_line(exc)}); "
                       "continuing uncompiled")
            self.forward, self._compile_checked = self.ddp, True
            return self.ddp(images)
        self._compile_checked = True
        return logits

    def _agree(self, now: bool = True) -> signal.Signals | None:
        """All ranks: the stop signal any rank got, or None; if any rank's loss was not finite, all
        raise :class:`~fixres_dist.training.finite.NonFiniteLoss` here, together, naming the earliest such step.

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
            self._diverged(agreed.bad_step)
        return agreed.stop

    def _diverged(self, step: int) -> None:
        """Every rank: stop the run at a non-finite loss of optimizer step ``step``; nothing more is written."""
        cfg = self.config
        self._record("diverged", epoch=self.epoch + 1, step=step, reason="non-finite loss")
        kept = (f"the last good checkpoint (step {self._checkpoint_step}) is kept in {cfg.job_folder}"
                if self._checkpoint_step is not None else "no checkpoint was written")
        raise finite.NonFiniteLoss(f"non-finite loss (NaN or infinity) at epoch {self.epoch + 1}, step {step}: "
                                   f"training stopped on all ranks; {kept}; lower --learning-rate "
                                   "(or raise --warmup-epochs) and use a new --job-id")

    def _after_eval_batch(self) -> None:
        self.faults.during_evaluation(self.global_step)
        self._stop_if_asked()

    def _stop_if_asked(self) -> None:
        """After an evaluation batch or an epoch: if any rank got a stop signal, stop (:meth:`_stop`)."""
        stop = self._agree()
        if stop is not None:
            self._stop(stop)

    def _stop(self, stop: signal.Signals) -> None:
        """All ranks, once they agreed on ``stop``: write one checkpoint together if anything was
        trained since the last one, then raise Preempted."""
        where = f"epoch {self.epoch + 1}, image {self.images_in_epoch}, step {self.global_step}"
        if self._unsaved:
            stop = self._agree() or stop  # the step just done, on every rank: it may have diverged
            self._save_checkpoint()
            done = f"checkpoint written in {self.config.job_folder}"
        elif self._checkpoint_step is not None:
            done = f"its checkpoint of step {self._checkpoint_step} in {self.config.job_folder} is up to date"
        else:
            done = "nothing trained yet, nothing to checkpoint"
        how = f"{'interrupted' if stop == signal.SIGINT else 'preempted'} by {stop.name}"
        self.log(f"{how} at {where}: {done}; run the same command again to resume")
        raise Preempted(f"{how}; stopped at {where}: {done}", stop)

    # ------------------------------------------------------------- evaluation
    def _evaluate(self, epoch: int, size: int, label: str = "", what: str = "", ema: bool = False) -> EvalResult:
        """Exact top-1/top-5 at test resolution ``size`` (pixels); recorded as an ``eval`` event, or with
        ``ema`` of the weights' moving average, as an ``ema_eval`` event. ``what``: where it stands in
        the job, for the progress bar (``"epoch 2/6"``, ``"2/3 of the sweep ..."``)."""
        if size not in self.val_loaders:
            self.val_loaders[size] = self._loader(self.val_set, self._test_transform(size), training=False)
        started = time.perf_counter()
        network = self.ema.module if ema else self.model
        bar = progress.Bar(len(self.val_set), f"eval{' EMA' if ema else ''} {size} px" + (f" ({what})" if what else ""),
                           enabled=self.show_progress, postfix=lambda b: self._job_left(b, size))
        try:
            result = engine.evaluate(architectures.for_resolution(network, size), self.val_loaders[size], self.device,
                                     self.amp, self.config.channels_last, self.preprocessing.normalization,
                                     after_batch=self._after_eval_batch, progress_bar=bar if bar.enabled else None)
        finally:
            bar.close()
        self.clock.add_evaluation(result.images, size, time.perf_counter() - started)
        if not math.isfinite(result.loss):  # all-reduced: every rank raises together
            raise finite.NonFiniteLoss(f"non-finite outputs (NaN or infinity) evaluating at {size} px"
                                       f"{f' after epoch {epoch}' if epoch else ''}: the weights diverged or "
                                       "overflow; nothing more is written")
        self._record("ema_eval" if ema else "eval", epoch=epoch, resolution=size, top1=result.top1, top5=result.top5,
                     loss=result.loss, images=result.images, **({"label": label} if label else {}))
        self.log(f"eval{' EMA' if ema else ''}{' ' + label if label else ''} @{size}px: top-1 {result.top1:.2f} %, "
                 f"top-5 {result.top5:.2f} %, loss {result.loss:.4f} ({result.images} images)")
        return result

    def _test_transform(self, size: int):
        """The test preprocessing at ``size`` pixels with the weights' crop ratio and interpolation."""
        return pipeline.test_transform(size, self.preprocessing.crop_ratio, self.preprocessing.interpolation)

    def _evaluate_before_finetune(self) -> None:
        """Top-1 at the train resolution and, before finetuning, at the test resolution(s).

        With ``--input-size auto`` the finetune resolution becomes the best of this sweep
        (:func:`fixres_dist.fixres.sweep.best_resolution`).
        """
        cfg = self.config
        swept = self._finetune_sweep_sizes()
        if self.train_size and self.train_size not in swept:
            self._sweep_rest = swept  # what follows, for the job's remaining time
            self._evaluate(0, self.train_size, "train-resolution", what="the train resolution, before finetuning")
        self._sweep("before", swept)
        if self.train_size in swept:  # the same weights, images and preprocessing: the same evaluation
            same = sweep.by_stage(self.history)["before"][self.train_size]
            self._record("eval", **{k: same[k] for k in ("epoch", "resolution", "top1", "top5", "loss", "images")},
                         label="train-resolution")
        if cfg.input_size == "auto":
            swept = sweep.by_stage(self.history)["before"]
            self.input_size = sweep.best_resolution([swept[size] for size in cfg.test_sizes])
            self._record("input_size", resolution=self.input_size, rule="best top-1 of the sweep before finetuning, "
                         "smallest within one standard error")
            self.log(f"--input-size auto: finetuning at {self.input_size} px, the best test resolution before finetuning")

    def _finetune_sweep_sizes(self) -> list[int]:
        """``--test-sizes`` and the finetune resolution: what is measured before and after finetuning."""
        sizes = list(self.config.test_sizes or ())
        return sizes if self.input_size in sizes else [*sizes, self.input_size]

    def _sweep(self, stage: str, sizes=None) -> None:
        """Evaluate at each of ``sizes`` (default ``--test-sizes``), recorded with label ``stage``."""
        sizes = list(sizes or self.config.test_sizes)
        for index, size in enumerate(sizes):
            self._sweep_rest = sizes[index + 1:]
            self._evaluate(self.epoch, size, stage, what=f"{index + 1}/{len(sizes)} of the sweep"
                           + ("" if stage == "sweep" else f" {sweep.STAGE_NAMES[stage]}"))
        self._sweep_rest = []

    def _report_sweep(self) -> None:
        """Table and plot of the sweeps so far (resolution_sweep.md/.png); names the best resolution."""
        cfg = self.config
        title = f"top-1 against test resolution: {cfg.architecture}, {self.run_name}\njob {cfg.job_id}"
        text, fields = reports.sweep_report(self.history, self.network, title, cfg.job_folder if self.rank0 else None,
                                            on_figure=self._board_figure)
        self._record("sweep", run=self.run_name, **fields)
        self.log("\n" + text + f"\nplot: {cfg.job_folder / reports.PLOT_FILE}")

    def _board_figure(self, figure) -> None:
        if self.board is not None:
            self.board.figure("resolution_sweep", figure, self._board_position)

    def _extract_features(self) -> None:
        """Logits, embeddings and labels of ``--extract-split`` at the test resolution (extraction.py)."""
        cfg, size = self.config, self.eval_size
        dataset = self.val_set if cfg.extract_split == "val" else self.train_set
        loader = self._loader(dataset, self._test_transform(size), training=False)
        model = architectures.for_resolution(self.model, size)
        head, _ = finetuning.find_head_and_last_norm(model, size)
        source = cfg.weight_path if cfg.eval_only else str(cfg.job_folder / checkpoint.CHECKPOINT_FILE)
        info = extraction.extract(model, head, loader, self.device, cfg.extract_features, size,
                                  {"split": cfg.extract_split, "architecture": cfg.architecture,
                                   "weights": source, "classes": self.classes}, self.rank0,
                                  self.amp, cfg.channels_last, self.preprocessing.normalization)
        self._record("features", folder=str(cfg.extract_features), **{k: v for k, v in info.items() if k != "classes"})
        self.log(f"features of {info['images']} {cfg.extract_split} images at {size} px: logits {info['num_classes']}, "
                 f"embeddings {info['embedding_dim']} wide, in {cfg.extract_features}")

    # ------------------------------------------------------------ checkpoints
    def _save_checkpoint(self) -> None:
        """All ranks: gather per-rank RNG and BatchNorm buffers; rank 0 writes; all learn the outcome."""
        cfg = self.config
        mine = {"rng": checkpoint.rng_state(), "buffers": checkpoint.buffers_of(self.model),
                **({"ema_buffers": checkpoint.buffers_of(self.ema.module)} if self.ema is not None else {})}
        ranks = collectives.gather_object(mine, self.control_group)
        sums = self.meter.totals() if self.meter is not None and self.images_in_epoch else \
            torch.zeros(3, dtype=torch.float64, device=self.device)
        epoch_sums = collectives.all_reduce_sum(sums).tolist()  # all ranks: a collective
        if not all(map(math.isfinite, epoch_sums)):  # a last guard: the callers agreed on this step first
            self._diverged(self.global_step)
        error = None
        if self.rank0:
            if self.board is not None:  # the event files hold the curves up to here
                self._board_until = self._board_position
            dataset_size = self.train_loader.batch_sampler.dataset_size
            try:
                checkpoint.save_checkpoint(cfg.job_folder, {
                    "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "schedule": {"base_lr": self.base_lr, "progress": self.epoch + self.images_in_epoch / dataset_size},
                    "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                    "input_size": self.input_size, "epoch_sums": epoch_sums, "epoch": self.epoch,
                    "images_in_epoch": self.images_in_epoch, "global_step": self.global_step, "ranks": ranks,
                    "epoch_seconds": self.meter.seconds() if self.meter is not None and self.images_in_epoch else 0.0,
                    "config": cfg.to_dict(), "metrics": self.history, lineage.RECORD_KEY: self.network.record(),
                    BOARD_KEY: self._board_until,
                    **({"model_ema": self.ema.state_dict(), "model_ema_state": self.ema.extra_state()}
                       if self.ema is not None else {})},
                    self.global_step, cfg.keep_checkpoints, self.faults.checkpoint_write, protect=cfg.resume)
            except FixresError as exc:
                error = str(exc)
        error = collectives.broadcast_object(error)
        if error:
            raise FixresError(error if self.rank0 else f"rank 0 could not write the checkpoint: {error}")
        self._unsaved, self._checkpoint_step = False, self.global_step

    def _record(self, event: str, **fields) -> None:
        entry = MetricsLog.event(event, **fields)  # with its time, which a resumed run's rewrite keeps
        self.history.append(entry)
        self.metrics.write(entry)
        if self.board is not None:
            self.board.event(entry)

    def log(self, message: str) -> None:
        if self.rank0:
            self._log(message)

    def _warn(self, message: str) -> None:
        """Rank 0: a :class:`~fixres_dist.errors.FixresWarning` and a ``warning:`` line in the log
        (``Trainer(config)()`` shows only the line)."""
        if self.rank0:
            warnings.warn(message, FixresWarning, stacklevel=3)
            self.log(f"warning: {message}")
