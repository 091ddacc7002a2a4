"""The Trainer: one rank's part of a job, from rendezvous to the last checkpoint.

``Trainer(config)()`` runs the job in this process. The story, in :meth:`Trainer._run`:
meet the other ranks; build data, model and optimizer; resume from the job folder's checkpoint if
there is one; (finetune: measure top-1 before); train epoch by epoch, averaging BatchNorm
statistics over ranks, evaluating exactly, checkpointing; (finetune: print the FixRes table).
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

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from . import checkpoint, data, distributed, fixres, models
from .config import CONFIG_FILE, TrainerConfig
from .errors import FixresError, first_line, user_message
from .faults import FaultInjector
from .metrics import METRICS_FILE, EvalResult, MetricsLog, evaluate

REFERENCE_BATCH = 256
PREEMPTED_EXIT_STATUS = 3
# Fields that may change between a checkpoint and the run resuming it.
RESUMABLE_CHANGES = {"num_tasks", "global_rank", "local_rank", "dist_url", "dist_timeout", "dist_backend",
                     "workers", "progress", "ckpt_every", "keep_checkpoints", "resume", "preempt_signal",
                     "shared_folder_path", "job_id", "device", "skip_bad_images"}


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
        self._stop_signal = None

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
        self._build_model()
        self._build_optimizer()
        resumed = self._resume()
        if self.rank0:  # only now: a refused resume must leave the folder as it was
            _write_private(cfg.job_folder / CONFIG_FILE, cfg.to_json() + "\n")
            if resumed:  # events after the checkpoint were lost with the run: drop them from the log
                self.metrics.rewrite(self.history)
        if cfg.mode == "finetune" and not resumed:
            self._evaluate_before_finetune()
        while self.epoch < cfg.epochs:
            self._train_one_epoch()
            if cfg.dist_bn == "reduce":
                distributed.average_batchnorm_statistics(self.model)
            self._evaluate(self.epoch + 1, cfg.eval_size)
            self.epoch, self.images_in_epoch = self.epoch + 1, 0
            self._save_checkpoint()
            self._stop_if_asked()
        final = [e for e in self.history if e["event"] == "eval" and e["resolution"] == cfg.eval_size][-1]
        if cfg.mode == "finetune":
            self._print_finetune_table()
        distributed.barrier()
        return {"rank": cfg.global_rank, **{k: final[k] for k in ("resolution", "top1", "top5", "loss", "images")}}

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
            if cfg.local_rank >= torch.cuda.device_count():
                raise FixresError(f"local rank {cfg.local_rank} has no GPU ({torch.cuda.device_count()} visible)")
            self.device = torch.device("cuda", cfg.local_rank)
            torch.cuda.set_device(self.device)
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
        train_tf = data.train_transform(cfg.input_size) if cfg.mode == "scratch" else data.test_transform(cfg.input_size)
        self.train_loader = self._loader(self.train_set, train_tf, shuffle=True)
        self.val_loaders = {}  # resolution -> loader (persistent workers)

    def _loader(self, dataset, transform, shuffle: bool):
        cfg = self.config
        return data.make_loader(dataset, transform, batch_size=cfg.batch, world_size=cfg.num_tasks,
                                rank=cfg.global_rank, shuffle=shuffle, seed=cfg.seed, workers=cfg.workers,
                                pin_memory=self.device.type == "cuda", skip_bad_images=cfg.skip_bad_images)

    def _build_model(self) -> None:
        cfg = self.config
        model = models.build_model(cfg.architecture, len(self.classes))
        self.weight_config = None
        if cfg.weight_path:
            state, self.weight_config = models.read_weight_file(cfg.weight_path)
            models.load_weights(model, state, cfg.weight_path)
        model.to(self.device)
        if cfg.mode == "finetune":
            trainable = fixres.freeze_for_finetune(model, cfg.input_size)
            count = sum(p.numel() for p in model.parameters() if p.requires_grad)
            self.log(f"finetuning {count:,} of {sum(p.numel() for p in model.parameters()):,} parameters: "
                     f"{', '.join(trainable)}")
        self.model = model  # unwrapped: evaluation and checkpoints use it
        self.ddp = model if cfg.num_tasks == 1 else DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            forward_sync_buffers=cfg.dist_bn == "broadcast")

    def _build_optimizer(self) -> None:
        cfg = self.config
        self.base_lr = scaled_learning_rate(cfg.learning_rate, cfg.batch, cfg.num_tasks)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(params, lr=self.base_lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        self.log(f"lr {self.base_lr:g} = {cfg.learning_rate:g} x {cfg.batch} x {cfg.num_tasks} / {REFERENCE_BATCH} "
                 f"(linear scaling rule), {len(self.train_loader)} steps per epoch")

    # ----------------------------------------------------------------- resume
    def _resume(self) -> bool:
        """Load the checkpoint named by ``--resume`` or found in the job folder; True if resumed."""
        cfg = self.config
        path = cfg.resume or cfg.job_folder / checkpoint.CHECKPOINT_FILE
        if not cfg.resume and not os.path.exists(path):
            return False
        state = checkpoint.load_checkpoint(path)
        check_resumable(cfg, state["config"], path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.epoch, self.images_in_epoch, self.global_step = state["epoch"], state["images_in_epoch"], state["global_step"]
        self.history = list(state["metrics"])
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
        return True

    # --------------------------------------------------------------- training
    def _train_one_epoch(self) -> None:
        cfg, epoch = self.config, self.epoch
        fixres.set_train_mode(self.ddp)
        sampler = self.train_loader.batch_sampler
        sampler.set_epoch(epoch, skip=self.images_in_epoch)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # no host sync per step
        images_seen, skipped_images = 0, 0
        bar = tqdm(total=len(self.train_set), initial=self.images_in_epoch, unit="img", unit_scale=True,
                   leave=False, desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=not (self.rank0 and cfg.progress))
        start = time.perf_counter()
        for step, (images, labels, skipped) in enumerate(self.train_loader):
            self._set_learning_rate(epoch + self.images_in_epoch / len(self.train_set))
            loss = self._train_step(images, labels)
            loss_sum += loss.double() * labels.numel()
            images_seen, skipped_images = images_seen + labels.numel(), skipped_images + skipped
            done = sampler.images_done(step + 1)
            bar.update(done - self.images_in_epoch)
            self.images_in_epoch, self.global_step = done, self.global_step + 1
            if self.rank0 and cfg.progress and step % 20 == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}")
            self.faults.after_step(self.global_step)
            if cfg.ckpt_every and self.global_step % cfg.ckpt_every == 0:
                self._save_checkpoint()
            self._stop_if_asked()
        bar.close()
        seconds = time.perf_counter() - start
        sums = torch.stack([loss_sum, torch.tensor(float(images_seen), dtype=torch.float64, device=self.device),
                            torch.tensor(float(skipped_images), dtype=torch.float64, device=self.device)])
        loss_sum, images, skipped = distributed.all_reduce_sum(sums).tolist()
        lr = self.optimizer.param_groups[0]["lr"]
        self._record("train", epoch=epoch + 1, loss=loss_sum / max(images, 1), lr=lr,
                     img_per_s=images / seconds, **({"skipped_images": int(skipped)} if skipped else {}))
        self.log(f"epoch {epoch + 1}/{cfg.epochs}: train loss {loss_sum / max(images, 1):.4f}, lr {lr:.4g}, "
                 f"{images / seconds:,.0f} img/s" + (f", {int(skipped)} unreadable images skipped" if skipped else ""))

    def _set_learning_rate(self, progress: float) -> None:
        lr = self.base_lr * warmup_cosine(progress, self.config.epochs, self.config.warmup_epochs)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _train_step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One optimizer step on a uint8 (B, 3, H, W) batch; returns the detached mean loss."""
        images = data.normalize(images.to(self.device, non_blocking=True))
        labels = labels.to(self.device, non_blocking=True)
        loss = F.cross_entropy(self.ddp(images), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

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
        if size not in self.val_loaders:
            self.val_loaders[size] = self._loader(self.val_set, data.test_transform(size), shuffle=False)
        result = evaluate(self.model, self.val_loaders[size], self.device)
        self._record("eval", epoch=epoch, resolution=size, top1=result.top1, top5=result.top5,
                     loss=result.loss, images=result.images, **({"label": label} if label else {}))
        self.log(f"eval{' ' + label if label else ''} @{size}px: top-1 {result.top1:.2f} %, "
                 f"top-5 {result.top5:.2f} %, loss {result.loss:.4f} ({result.images} images)")
        return result

    def _evaluate_before_finetune(self) -> None:
        cfg = self.config
        train_size = cfg.train_size or (self.weight_config or {}).get("input_size")
        if train_size:
            self._evaluate(0, train_size, "train-resolution")
        self._evaluate(0, cfg.input_size, "before")

    def _print_finetune_table(self) -> None:
        evals = [e for e in self.history if e["event"] == "eval"]
        names = {"train-resolution": "train resolution, no finetuning", "before": "test resolution, no finetuning"}
        before = [e for e in evals if e.get("label") in names]
        after = [e for e in evals if not e.get("label")][-1]
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
        error = None
        if self.rank0:
            try:
                checkpoint.save_checkpoint(cfg.job_folder, {
                    "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "schedule": {"base_lr": self.base_lr, "progress": self.epoch + self.images_in_epoch / len(self.train_set)},
                    "scaler": None, "epoch": self.epoch, "images_in_epoch": self.images_in_epoch,
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
