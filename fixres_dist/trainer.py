"""The Trainer: one rank's part of a job, from rendezvous to the last checkpoint.

``Trainer(config)()`` runs the job in this process. The story, in :meth:`Trainer._run`:
meet the other ranks; build the data and the model; find the job folder's checkpoint if there is
one; (``--eval-only``: evaluate, report and stop); (finetune: measure top-1 before, at the train
and test resolutions, and pick the test resolution if ``--input-size auto``); freeze what does not
train and wrap in DDP; restore the checkpoint; train epoch by epoch, averaging BatchNorm statistics
over ranks, evaluating exactly, checkpointing; then the resolution sweep, the FixRes table and the
feature extraction, as asked.
Rank 0 alone logs, shows progress and writes files; checkpoints hold every rank's RNG state.

Preemption: SIGTERM or ``config.preempt_signal`` (SIGUSR2 by default, SLURM's warning signal) on
any rank makes all ranks agree, after their current step, to write one checkpoint and stop with
:class:`Preempted` (exit status 3). If another Python handler owned that signal before (submitit's),
it is called after the checkpoint, so submitit requeues the job at a safe point.
"""
from __future__ import annotations

import fcntl
import math
import os
import signal
import time
import warnings

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from . import batchnorm, checkpoint, data, distributed, extraction, fixres, models, sweep
from .config import CONFIG_FILE, TrainerConfig
from .errors import FixresError, first_line, user_message
from .faults import FaultInjector
from .metrics import METRICS_FILE, EvalResult, MetricsLog, evaluate

REFERENCE_BATCH = 256
PREEMPTED_EXIT_STATUS = 3
# Fields that may change between a checkpoint and the run resuming it.
RESUMABLE_CHANGES = {"num_tasks", "global_rank", "local_rank", "dist_url", "dist_timeout", "dist_backend",
                     "workers", "progress", "ckpt_every", "keep_checkpoints", "resume", "preempt_signal",
                     "shared_folder_path", "job_id", "device", "skip_bad_images", "test_sizes",
                     "extract_features", "extract_split", "overwrite", "amp", "channels_last", "compile"}
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}


def check_resumable(config: TrainerConfig, saved: dict, path) -> None:
    """Raise FixresError if the checkpoint at ``path`` (its config dict ``saved``) is of another run."""
    changed = sorted(k for k, v in config.to_dict().items() if k not in RESUMABLE_CHANGES and saved.get(k) != v)
    if changed:
        diff = ", ".join(f"{k}: {saved.get(k)!r} -> {getattr(config, k)!r}" for k in changed[:3])
        raise FixresError(f"{path} holds a checkpoint of another configuration ({diff}); "
                          "use another --job-id, or --resume with a matching checkpoint")


def _make_private_folder(folder) -> None:
    """Create ``folder`` (and parents) and make it owner-only; FixresError if that is impossible."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)
    except OSError as exc:
        raise FixresError(f"cannot use job folder {folder}: {exc.strerror or exc}") from None


def _write_private(path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


class Preempted(Exception):
    """Raised on every rank after the preemption checkpoint is written (exit status 3)."""


def scaled_learning_rate(base_lr: float, batch_per_rank: int, num_tasks: int) -> float:
    """Linear scaling rule: ``base_lr x (batch_per_rank x num_tasks) / 256``.

    ``base_lr`` is the rate for a global batch of 256 images (Goyal et al., "Accurate, Large
    Minibatch SGD: Training ImageNet in 1 Hour", arXiv 1706.02677, section 2.1).
    """
    return base_lr * batch_per_rank * num_tasks / REFERENCE_BATCH


def warmup_cosine(progress: float, epochs: int, warmup_epochs: float) -> float:
    """LR factor at ``progress`` epochs: linear warmup (Goyal et al., section 2.2), then half a cosine.

    A function of progress in epochs (not of a step count), so that it is unchanged when a run
    resumes on another world size.
    """
    if progress < warmup_epochs:
        return progress / warmup_epochs
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup_epochs) / max(1e-12, epochs - warmup_epochs))))


class Trainer:
    """Train (``mode="scratch"``) or FixRes-finetune (``mode="finetune"``) one classifier with DDP.

    Callable: ``Trainer(config)()`` runs this rank's part and returns a dict with the final
    evaluation (``top1``, ``top5`` in percent, ``loss``, ``images``, ``resolution`` in pixels).
    Raises :class:`FixresError` for bad input or peers that never arrive, :class:`Preempted` after a
    preemption checkpoint.
    """

    def __init__(self, config: TrainerConfig):
        self.config = config
        self.rank0 = config.global_rank == 0
        self.device = torch.device("cpu")
        self.epoch, self.images_in_epoch, self.global_step = 0, 0, 0
        self.history: list[dict] = []
        # The training resolution; with --input-size auto, the first test size until the sweep picks one.
        self.input_size = config.input_size if config.input_size != "auto" else config.test_sizes[0]
        self._stop_signal = None
        self._epoch_sums, self._resumed_sums = None, [0.0, 0.0, 0.0]

    # ----------------------------------------------------------------- the story
    def __call__(self) -> dict:
        previous = self._install_signal_handlers()
        try:
            self._setup_process_group()
            return self._run()
        except Preempted:
            chained = previous.get(self._stop_signal)
            if callable(chained):  # submitit's handler: it requeues through self.checkpoint()
                chained(self._stop_signal, None)
            raise
        except Exception as exc:
            gone = distributed.lost_peers() if isinstance(exc, (RuntimeError, dist.DistError)) else ""
            if gone:  # a collective failed because a peer failed or vanished: name it, no traceback
                raise FixresError(f"lost {gone}; stopping") from None
            distributed.announce_failure(user_message(exc) or f"{type(exc).__name__}: {first_line(exc)}")
            raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            distributed.destroy_process_group()

    def _run(self) -> dict:
        cfg = self.config
        self._prepare_job_folder()
        self._build_data()
        state = self._checkpoint_to_resume()
        if self.rank0:  # only now: a refused resume must leave the folder as it was
            _write_private(cfg.job_folder / CONFIG_FILE, cfg.to_json() + "\n")
            self.metrics.rewrite(self.history)  # drops events the checkpoint does not know of
        self._build_model()
        if cfg.eval_only:
            return self._evaluate_only()
        if cfg.mode == "finetune" and state is None:
            self._evaluate_before_finetune()
        self._prepare_training()
        if state is not None:
            self._restore(state)
        while self.epoch < cfg.epochs:
            self._train_one_epoch()
            if cfg.dist_bn == "reduce":
                distributed.average_batchnorm_statistics(self.model)
            self._evaluate(self.epoch + 1, self.eval_size)
            self.epoch, self.images_in_epoch = self.epoch + 1, 0
            self._save_checkpoint()
            self._stop_if_asked()
        final = [e for e in self.history if e["event"] == "eval" and e["resolution"] == self.eval_size][-1]
        if cfg.test_sizes and cfg.mode == "finetune":
            self._sweep("after", self._finetune_sweep_sizes())
        elif cfg.test_sizes:
            self._sweep("trained")
        if cfg.mode == "finetune":
            self._print_finetune_table()
        return self._finish(final)

    def _finish(self, final: dict) -> dict:
        """Sweep report and features, if asked; the result every rank returns."""
        cfg = self.config
        if cfg.test_sizes:
            self._report_sweep()
        if cfg.extract_features:
            self._extract_features()
        distributed.barrier()
        return {"rank": cfg.global_rank, **{k: final[k] for k in ("resolution", "top1", "top5", "loss", "images")}}

    @property
    def eval_size(self) -> int:
        """The test resolution in pixels: ``--test-size``, else the training resolution."""
        return self.config.test_size or self.input_size

    def checkpoint(self, *args, **kwargs):
        """submitit's preemption hook: a resubmission of this job, which resumes from its folder."""
        import submitit
        return submitit.helpers.DelayedSubmission(type(self)(self.config))

    # ------------------------------------------------------------------ setup
    def _setup_process_group(self) -> None:
        """Pick the device and thread count, then meet the other ranks (see fixres_dist.distributed)."""
        cfg = self.config
        if not os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(distributed.threads_per_rank(cfg.num_tasks))
        if cfg.device == "cuda":
            self.device = distributed.cuda_device(cfg.local_rank)
            torch.cuda.set_device(self.device)
            torch.backends.cudnn.benchmark = True  # fixed input sizes: let cuDNN pick the fastest kernels
        if cfg.dist_url.startswith("file://"):
            _make_private_folder(cfg.job_folder)  # holds the rendezvous file
        try:
            distributed.init_process_group(cfg.dist_backend, cfg.dist_url, cfg.global_rank, cfg.num_tasks,
                                           cfg.dist_timeout, should_stop=lambda: self._stop_signal is not None)
        except distributed.RendezvousInterrupted as exc:
            raise Preempted(f"{exc}; nothing to checkpoint yet") from None
        job_id = distributed.broadcast_object(cfg.job_id)  # torchrun without a run id: rank 0's
        if job_id != cfg.job_id:
            self.config = cfg = attrs.evolve(cfg, job_id=job_id)
        _make_private_folder(cfg.job_folder)
        torch.manual_seed(cfg.seed + cfg.global_rank)
        self.faults = FaultInjector(cfg.global_rank, signal.Signals[cfg.preempt_signal])
        self._control_group = None
        if distributed.is_initialized():  # the stop flag travels on CPU, without a device sync
            self._control_group = dist.new_group(backend="gloo") if cfg.dist_backend != "gloo" else dist.group.WORLD

    def _install_signal_handlers(self) -> dict:
        signals = {signal.SIGTERM, signal.Signals[self.config.preempt_signal]}
        previous = {}
        for signum in signals:
            previous[signum] = signal.signal(signum, self._on_stop_signal)
        return previous

    def _on_stop_signal(self, signum, frame) -> None:
        if self._stop_signal != signal.Signals[self.config.preempt_signal]:  # the preemption signal wins
            self._stop_signal = signal.Signals(signum)

    def _prepare_job_folder(self) -> None:
        """Rank 0: lock the job folder against a second run, drop temporary files of a killed one."""
        cfg = self.config
        self.metrics = MetricsLog(cfg.job_folder / METRICS_FILE, self.rank0)
        if self.rank0:
            self._lock = open(cfg.job_folder / ".lock", "a")
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise FixresError(f"job folder {cfg.job_folder} is in use by another run; "
                                  "wait for it or use another --job-id") from None
            for stale in cfg.job_folder.glob(".checkpoint-*.tmp"):
                stale.unlink(missing_ok=True)
            self.log(f"job {cfg.job_id}: {cfg.mode} {cfg.architecture}, {cfg.num_tasks} rank(s) on "
                     f"{self.device.type}, folder {cfg.job_folder}")

    def _build_data(self) -> None:
        cfg = self.config
        root = cfg.data_path or data.embedded_data_path()
        self.classes = data.check_image_folder(root)
        self.train_set, self.val_set = data.image_folder(root, "train"), data.image_folder(root, "val")
        if len(self.train_set) < 2 * cfg.num_tasks:
            raise FixresError(f"{len(self.train_set)} training images are too few for {cfg.num_tasks} ranks")
        if cfg.extract_features:
            extraction.check_destination(cfg.extract_features, cfg.overwrite)
        self.val_loaders = {}  # resolution -> loader (persistent workers)

    def _loader(self, dataset, transform, shuffle: bool):
        cfg = self.config
        return data.make_loader(dataset, transform, batch_size=cfg.batch, world_size=cfg.num_tasks,
                                rank=cfg.global_rank, shuffle=shuffle, seed=cfg.seed, workers=cfg.workers,
                                pin_memory=self.device.type == "cuda", skip_bad_images=cfg.skip_bad_images)

    def _build_model(self) -> None:
        """The unwrapped classifier at ``self.input_size``, with ``--weight-path`` loaded."""
        cfg = self.config
        model = models.build_model(cfg.architecture, len(self.classes), image_size=self.input_size,
                                   low_res_stem=cfg.low_res_stem)
        weight_config = None
        if cfg.weight_path:
            state, weight_config = models.read_weight_file(cfg.weight_path)
            note = models.load_weights(model, state, cfg.weight_path)
            if note:
                self.log(note)
        trained_at = cfg.input_size if cfg.mode == "scratch" else (weight_config or {}).get("input_size")
        self.train_size = cfg.train_size or (trained_at if isinstance(trained_at, int) else None)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model.to(self.device)  # unwrapped: evaluation and checkpoints use it

    def _prepare_training(self) -> None:
        """Finetune: freeze what does not train. Then the train loader, the optimizer and the DDP wrap."""
        cfg = self.config
        if cfg.mode == "finetune":
            self.model = models.for_resolution(self.model, self.input_size)  # ViT: position embeddings
            trainable = fixres.freeze_for_finetune(self.model, self.input_size, cfg.finetune_scope, cfg.last_norm)
            count = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            self.log(f"finetuning ({cfg.finetune_scope}) {count:,} of {sum(p.numel() for p in self.model.parameters()):,} "
                     f"parameters in {len(trainable)} tensors: {', '.join(trainable)}")
            below = fixres.finetune_resolution_warning(self.train_size, self.input_size)
            if below and self.rank0:
                warnings.warn(below, stacklevel=2)
                self.log(f"warning: {below}")
            if cfg.num_tasks > 1:  # trainable BatchNorms see the union of all ranks' images
                norms = [name for name, m in self.model.named_modules() if isinstance(m, fixres.NORM_TYPES)
                         and any(p.requires_grad for p in m.parameters(recurse=False))]
                synchronised = batchnorm.synchronise(self.model, norms, self.device.type)
                if synchronised:
                    self.log(f"BatchNorm statistics over all {cfg.num_tasks} ranks' images: {', '.join(synchronised)}")
        if cfg.sync_bn and cfg.num_tasks > 1:
            synchronised = batchnorm.synchronise(self.model, None, self.device.type)
            self.log(f"--sync-bn: {len(synchronised)} BatchNorm layers synchronised over {cfg.num_tasks} ranks")
        transform = data.train_transform(self.input_size) if cfg.mode == "scratch" else \
            data.finetune_transform(self.input_size, cfg.finetune_augmentation)
        self.train_loader = self._loader(self.train_set, transform, shuffle=True)
        self._build_optimizer()
        self.ddp = self.model if cfg.num_tasks == 1 else DistributedDataParallel(
            self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            forward_sync_buffers=cfg.dist_bn == "broadcast")
        self.amp = AMP_DTYPES[cfg.amp]
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp == "fp16")
        self.forward = self.ddp
        if cfg.compile:  # compiled lazily, at the first step (see _train_step)
            self.forward = torch.compile(self.ddp, backend=cfg.compile)
            self._compile_checked = False

    def _build_optimizer(self) -> None:
        cfg = self.config
        self.base_lr = scaled_learning_rate(cfg.learning_rate, cfg.batch, cfg.num_tasks)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(params, lr=self.base_lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        self.log(f"lr {self.base_lr:g} = {cfg.learning_rate:g} x {cfg.batch} x {cfg.num_tasks} / {REFERENCE_BATCH} "
                 f"(linear scaling rule), {len(self.train_loader)} steps per epoch")

    # ----------------------------------------------------------------- resume
    def _checkpoint_to_resume(self) -> dict | None:
        """The checkpoint named by ``--resume`` or found in the job folder (checked), or None."""
        cfg = self.config
        path = cfg.resume or cfg.job_folder / checkpoint.CHECKPOINT_FILE
        if not cfg.resume and not os.path.exists(path):
            return None
        state = checkpoint.load_checkpoint(path)
        check_resumable(cfg, state["config"], path)
        self.history = list(state["metrics"])
        self.input_size = state.get("input_size", self.input_size)  # --input-size auto: the size chosen
        self._resume_path = path
        return state

    def _restore(self, state: dict) -> None:
        """Continue from ``state``: parameters, optimizer, position in the epoch, RNG and BatchNorm buffers."""
        cfg, path = self.config, self._resume_path
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler.is_enabled() and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.images_in_epoch, self.global_step = state["epoch"], state["images_in_epoch"], state["global_step"]
        self._resumed_sums = state.get("epoch_sums") or [0.0, 0.0, 0.0]  # the epoch's loss so far
        ranks = state["ranks"]
        if len(ranks) == cfg.num_tasks:
            mine = ranks[cfg.global_rank]
            checkpoint.set_rng_state(mine["rng"])
            self.model.load_state_dict({**self.model.state_dict(), **mine["buffers"]})
        else:
            averaged = {k: sum(r["buffers"][k].double() for r in ranks) / len(ranks) for k in ranks[0]["buffers"]}
            self.model.load_state_dict({**self.model.state_dict(),
                                        **{k: v.to(ranks[0]["buffers"][k].dtype) for k, v in averaged.items()}})
            self.log(f"warning: resuming a {len(ranks)}-rank checkpoint on {cfg.num_tasks} ranks: lr re-derived "
                     f"by the linear scaling rule ({self.base_lr:g}), BatchNorm statistics averaged, epoch "
                     f"{self.epoch + 1} continues at image {self.images_in_epoch} of {len(self.train_set)} "
                     "of the same permutation (no image repeated or skipped); RNG streams restart")
        if self.epoch >= cfg.epochs:
            self.log(f"{path}: this job already completed its {cfg.epochs} epochs; nothing to do "
                     "(use another --job-id for a new run)")
        else:
            self.log(f"resumed from {path}: epoch {self.epoch + 1}, image {self.images_in_epoch} of the epoch, "
                     f"step {self.global_step}")

    # --------------------------------------------------------------- training
    def _train_one_epoch(self) -> None:
        cfg, epoch = self.config, self.epoch
        fixres.set_train_mode(self.ddp)
        sampler = self.train_loader.batch_sampler
        sampler.set_epoch(epoch, skip=self.images_in_epoch)
        global_batches = sampler.global_batch_sizes()
        # This rank's summed loss, images and unreadable images of the epoch, on the device (no host
        # sync per step); after a mid-epoch resume, rank 0 starts from the totals before the stop.
        self._epoch_sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        self._epoch_counts = [0, 0]  # images, unreadable images: host integers, no device copy per step
        if self.rank0 and self.images_in_epoch:
            self._epoch_sums += torch.tensor(self._resumed_sums, dtype=torch.float64, device=self.device)
        images_seen = 0
        bar = tqdm(total=len(self.train_set), initial=self.images_in_epoch, unit="img", unit_scale=True,
                   leave=False, desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=not (self.rank0 and cfg.progress))
        start = time.perf_counter()
        for step, (images, labels, skipped) in enumerate(self.train_loader):
            self._set_learning_rate(epoch + self.images_in_epoch / len(self.train_set))
            loss = self._train_step(images, labels, global_batches[step])
            self._epoch_sums[0] += loss.double()
            self._epoch_counts[0] += labels.numel()
            self._epoch_counts[1] += skipped
            images_seen += labels.numel()
            done = sampler.images_done(step + 1)
            bar.update(done - self.images_in_epoch)
            self.images_in_epoch, self.global_step = done, self.global_step + 1
            if self.rank0 and cfg.progress and step % 20 == 0:
                bar.set_postfix(loss=f"{loss.item() / labels.numel():.3f}")
            self.faults.after_step(self.global_step)
            if cfg.ckpt_every and self.global_step % cfg.ckpt_every == 0:
                self._save_checkpoint()
            self._stop_if_asked()
        bar.close()
        seconds = time.perf_counter() - start
        seen = torch.tensor([float(images_seen)], dtype=torch.float64, device=self.device)  # by this process
        loss_sum, images, skipped, seen = distributed.all_reduce_sum(torch.cat([self._epoch_totals(), seen])).tolist()
        self._epoch_sums = None
        img_per_s = seen / seconds
        lr = self.optimizer.param_groups[0]["lr"]
        self._record("train", epoch=epoch + 1, loss=loss_sum / max(images, 1), lr=lr,
                     img_per_s=img_per_s, **({"skipped_images": int(skipped)} if skipped else {}))
        self.log(f"epoch {epoch + 1}/{cfg.epochs}: train loss {loss_sum / max(images, 1):.4f}, lr {lr:.4g}, "
                 f"{img_per_s:,.0f} img/s" + (f", {int(skipped)} unreadable images skipped" if skipped else ""))

    def _epoch_totals(self) -> torch.Tensor:
        """This rank's (summed loss, images, unreadable images) of the epoch so far, float64 on the device."""
        counts = torch.tensor(self._epoch_counts, dtype=torch.float64, device=self.device)
        return self._epoch_sums + torch.cat([torch.zeros(1, dtype=torch.float64, device=self.device), counts])

    def _set_learning_rate(self, progress: float) -> None:
        lr = self.base_lr * warmup_cosine(progress, self.config.epochs, self.config.warmup_epochs)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _train_step(self, images: torch.Tensor, labels: torch.Tensor, global_batch: int | None = None) -> torch.Tensor:
        """One optimizer step on this rank's uint8 (B, 3, H, W) share of a global batch.

        The loss is the mean over the *global* batch (``global_batch`` images on all ranks; default
        B x world size): this rank's summed cross-entropy x world size / global batch, which DDP's
        gradient averaging turns into exactly the gradient of one process on the whole batch, even
        when the last batch is split unevenly. Returns the detached *summed* loss of this rank's images.
        """
        images = data.to_device(images, self.device, self.config.channels_last)
        labels = labels.to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=self.amp or torch.bfloat16, enabled=self.amp is not None):
            logits = self._forward(images)
        loss_sum = F.cross_entropy(logits.float(), labels, reduction="sum")
        world = self.config.num_tasks
        loss = loss_sum * (world / (global_batch or labels.numel() * world))
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()  # fp16: scaled against underflow; otherwise as is
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss_sum.detach()

    def _forward(self, images: torch.Tensor) -> torch.Tensor:
        """The DDP model's forward, compiled with ``--compile``.

        Compilation happens at the first call; if it fails, the run warns with the cause and goes on
        uncompiled (same results, eager speed) rather than losing the job to a compiler problem.
        """
        if self.forward is self.ddp or self._compile_checked:
            return self.forward(images)
        try:
            logits = self.forward(images)
        except Exception as exc:  # any compiler failure; a genuine error recurs below, uncompiled
            warnings.warn(f"--compile {self.config.compile} failed ({type(exc).__name__}: {first_line(exc)}); "
                          "continuing uncompiled", stacklevel=2)
            self.log(f"warning: torch.compile failed ({type(exc).__name__}: {first_line(exc)}); continuing uncompiled")
            self.forward = self.ddp
            return self.ddp(images)
        self._compile_checked = True
        return logits

    def _stop_if_asked(self) -> None:
        """If any rank got a stop signal: all ranks checkpoint here together, then raise Preempted."""
        # 0: go on, 1: SIGTERM, 2: the preemption signal (it wins: submitit sends SIGTERM, then USR2)
        codes = [None, signal.SIGTERM, signal.Signals[self.config.preempt_signal]]
        flag = torch.tensor([codes.index(self._stop_signal) if self._stop_signal in codes else 0])
        if self._control_group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._control_group)
        if flag.item() == 0:
            return
        self._stop_signal = codes[int(flag.item())]
        self._save_checkpoint()
        self.log(f"preempted by {self._stop_signal.name} at epoch {self.epoch + 1}, image {self.images_in_epoch}, "
                 f"step {self.global_step}: checkpoint written; run the same command again to resume")
        raise Preempted(f"preempted by {self._stop_signal.name}; checkpoint written in {self.config.job_folder}")

    # ------------------------------------------------------------- evaluation
    def _evaluate(self, epoch: int, size: int, label: str = "") -> EvalResult:
        """Exact top-1/top-5 at test resolution ``size`` (pixels); recorded as an ``eval`` event."""
        if size not in self.val_loaders:
            self.val_loaders[size] = self._loader(self.val_set, data.test_transform(size), shuffle=False)
        result = evaluate(models.for_resolution(self.model, size), self.val_loaders[size], self.device,
                          AMP_DTYPES[self.config.amp], self.config.channels_last)
        self._record("eval", epoch=epoch, resolution=size, top1=result.top1, top5=result.top5,
                     loss=result.loss, images=result.images, **({"label": label} if label else {}))
        self.log(f"eval{' ' + label if label else ''} @{size}px: top-1 {result.top1:.2f} %, "
                 f"top-5 {result.top5:.2f} %, loss {result.loss:.4f} ({result.images} images)")
        return result

    def _evaluate_before_finetune(self) -> None:
        """Top-1 at the train resolution and, before finetuning, at the test resolution(s).

        With ``--input-size auto`` the finetune resolution becomes the best of this sweep
        (:func:`fixres_dist.sweep.best_resolution`).
        """
        cfg = self.config
        if self.train_size:
            self._evaluate(0, self.train_size, "train-resolution")
        self._sweep("before", self._finetune_sweep_sizes())
        if cfg.input_size == "auto":
            swept = sweep.by_stage(self.history)["before"]
            self.input_size = sweep.best_resolution([swept[size] for size in cfg.test_sizes])
            self._record("input_size", resolution=self.input_size, rule="best top-1 of the sweep before finetuning, "
                         "smallest within one standard error")
            self.log(f"--input-size auto: finetuning at {self.input_size} px, the best test resolution before finetuning")

    def _evaluate_only(self) -> dict:
        """``--eval-only``: evaluate the weights at every test size, report, extract; no training."""
        sizes = self.config.test_sizes or (self.eval_size,)
        self._sweep("sweep", sizes)
        final = [e for e in self.history if e["event"] == "eval"][-1]
        return self._finish(final)

    def _finetune_sweep_sizes(self) -> list[int]:
        """``--test-sizes`` and the finetune resolution: what is measured before and after finetuning."""
        sizes = list(self.config.test_sizes or ())
        return sizes if self.input_size in sizes else [*sizes, self.input_size]

    def _sweep(self, stage: str, sizes=None) -> None:
        for size in sizes or self.config.test_sizes:
            self._evaluate(self.epoch, size, stage)

    def _report_sweep(self) -> None:
        """Table and plot of the sweeps so far (resolution_sweep.md/.png); names the best resolution."""
        cfg = self.config
        stages = sweep.by_stage(self.history)
        latest = [s for s in ("sweep", "before", "trained", "after") if s in stages][-1]
        best = sweep.best_resolution(list(stages[latest].values()))
        estimate = fixres.apparent_size_test_resolution(self.train_size) if self.train_size else None
        images = next(iter(stages[latest].values()))["images"]
        title = f"top-1 against test resolution: {cfg.architecture}, {cfg.mode}\njob {cfg.job_id}, {images} validation images"
        text = sweep.table(stages, best, self.train_size, estimate, title)
        self._record("sweep", stage=latest, best_resolution=best, train_resolution=self.train_size,
                     apparent_size_estimate=estimate)
        if self.rank0:
            _write_private(cfg.job_folder / sweep.TABLE_FILE, text + "\n")
            sweep.plot(cfg.job_folder / sweep.PLOT_FILE, stages, best, self.train_size, estimate, title)
        self.log("\n" + text + f"\nplot: {cfg.job_folder / sweep.PLOT_FILE}")

    def _extract_features(self) -> None:
        """Logits, embeddings and labels of ``--extract-split`` at the test resolution (extraction.py)."""
        cfg, size = self.config, self.eval_size
        dataset = self.val_set if cfg.extract_split == "val" else self.train_set
        loader = self._loader(dataset, data.test_transform(size), shuffle=False)
        model = models.for_resolution(self.model, size)
        head, _ = fixres.find_head_and_last_norm(model, size)
        info = extraction.extract(model, head, loader, self.device, cfg.extract_features, size,
                                  {"split": cfg.extract_split, "architecture": cfg.architecture,
                                   "weights": cfg.weight_path if cfg.eval_only else str(cfg.job_folder / checkpoint.CHECKPOINT_FILE),
                                   "classes": self.classes}, self.rank0,
                                  AMP_DTYPES[cfg.amp], cfg.channels_last)
        self._record("features", folder=str(cfg.extract_features), **{k: v for k, v in info.items() if k != "classes"})
        self.log(f"features of {info['images']} {cfg.extract_split} images at {size} px: logits {info['num_classes']}, "
                 f"embeddings {info['embedding_dim']} wide, in {cfg.extract_features}")

    def _print_finetune_table(self) -> None:
        evals = [e for e in self.history if e["event"] == "eval"]
        names = {"train-resolution": "train resolution, no finetuning", "before": "test resolution, no finetuning"}
        before = [e for e in evals if e.get("label") == "train-resolution"] + \
                 [e for e in evals if e.get("label") == "before" and e["resolution"] == self.input_size][-1:]
        after = [e for e in evals if not e.get("label") and e["resolution"] == self.eval_size][-1]
        rows = [(names[e["label"]], e) for e in before] + [("test resolution, FixRes finetuned", after)]
        lines = ["", f"FixRes finetune of {self.config.architecture} ({self.config.num_tasks} rank(s), "
                     f"{after['images']} validation images)",
                 f"| {'evaluation':<36} | resolution | top-1 % | top-5 % |",
                 f"|{'-' * 38}|------------|---------|---------|"]
        lines += [f"| {name:<36} | {e['resolution']:>7} px | {e['top1']:7.2f} | {e['top5']:7.2f} |" for name, e in rows]
        gains = [f"{after['top1'] - e['top1']:+.2f} top-1 points over the {names[e['label']].split(',')[0]} "
                 f"({e['resolution']} px)" for e in before]
        lines.append("finetuning at the test resolution bought " + "; ".join(gains))
        self.log("\n".join(lines))

    # ------------------------------------------------------------ checkpoints
    def _save_checkpoint(self) -> None:
        """All ranks: gather per-rank RNG and BatchNorm buffers; rank 0 writes; all learn the outcome."""
        cfg = self.config
        mine = {"rng": checkpoint.rng_state(),
                "buffers": {k: v.cpu() for k, v in self.model.state_dict().items()
                            if k.endswith(("running_mean", "running_var", "num_batches_tracked"))}}
        ranks = [None] * cfg.num_tasks
        if distributed.is_initialized():
            dist.gather_object(mine, ranks if self.rank0 else None, dst=0, group=self._control_group)
        else:
            ranks = [mine]
        sums = self._epoch_totals() if self._epoch_sums is not None and self.images_in_epoch else \
            torch.zeros(3, dtype=torch.float64, device=self.device)
        epoch_sums = distributed.all_reduce_sum(sums).tolist()  # all ranks: a collective
        error = None
        if self.rank0:
            try:
                checkpoint.save_checkpoint(cfg.job_folder, {
                    "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "schedule": {"base_lr": self.base_lr, "progress": self.epoch + self.images_in_epoch / len(self.train_set)},
                    "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                    "input_size": self.input_size, "epoch_sums": epoch_sums, "epoch": self.epoch, "images_in_epoch": self.images_in_epoch,
                    "global_step": self.global_step, "ranks": ranks, "config": cfg.to_dict(),
                    "metrics": self.history}, self.global_step, cfg.keep_checkpoints, self.faults.checkpoint_write)
            except FixresError as exc:
                error = str(exc)
        error = distributed.broadcast_object(error)
        if error:
            raise FixresError(error if self.rank0 else f"rank 0 could not write the checkpoint: {error}")

    def _record(self, event: str, **fields) -> None:
        self.history.append({"event": event, **fields})
        self.metrics.write(event, **fields)

    def log(self, message: str) -> None:
        if self.rank0:
            tqdm.write(message)
