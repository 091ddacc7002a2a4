"""The Trainer: one rank's part of a job, from rendezvous to the last checkpoint.

``Trainer(config)()`` runs the job in this process. The story, in :meth:`Trainer._run`:
meet the other ranks; build data, model and optimizer; (finetune: measure top-1 before); train
epoch by epoch, averaging BatchNorm statistics over ranks, evaluating exactly, checkpointing;
(finetune: print the FixRes table). Rank 0 alone logs, shows progress and writes files.
"""
from __future__ import annotations

import math
import os
import time

import attrs
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from . import data, distributed, fixres, models
from .checkpoint import CHECKPOINT_FILE, save_checkpoint
from .config import CONFIG_FILE, TrainerConfig
from .errors import FixresError
from .metrics import METRICS_FILE, EvalResult, MetricsLog, evaluate

REFERENCE_BATCH = 256


def scaled_learning_rate(base_lr: float, batch_per_rank: int, num_tasks: int) -> float:
    """Linear scaling rule: ``base_lr x (batch_per_rank x num_tasks) / 256``.

    ``base_lr`` is the rate for a global batch of 256 images (Goyal et al., "Accurate, Large
    Minibatch SGD: Training ImageNet in 1 Hour", arXiv 1706.02677, section 2.1).
    """
    return base_lr * batch_per_rank * num_tasks / REFERENCE_BATCH


def warmup_cosine(total_steps: int, warmup_steps: int):
    """LR factor per optimizer step: linear warmup (Goyal et al., section 2.2), then half a cosine to 0."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


class Trainer:
    """Train (``mode="scratch"``) or FixRes-finetune (``mode="finetune"``) one classifier with DDP.

    Callable: ``Trainer(config)()`` runs this rank's part and returns a dict with the final
    evaluation (``top1``, ``top5`` in percent, ``loss``, ``images``, ``resolution`` in pixels).
    Raises :class:`FixresError` for bad input or peers that never arrive.
    """

    def __init__(self, config: TrainerConfig):
        self.config = config
        self.rank0 = config.global_rank == 0
        self.device = torch.device("cpu")

    # ----------------------------------------------------------------- the story
    def __call__(self) -> dict:
        self._setup_process_group()
        try:
            return self._run()
        finally:
            distributed.destroy_process_group()

    def _run(self) -> dict:
        cfg = self.config
        self._prepare_job_folder()
        self._build_data()
        self._build_model()
        self._build_optimizer()
        before = self._evaluate_before_finetune() if cfg.mode == "finetune" else []
        result = None
        for epoch in range(cfg.epochs):
            self._train_one_epoch(epoch)
            if cfg.dist_bn == "reduce":
                distributed.average_batchnorm_statistics(self.model)
            result = self._evaluate(epoch + 1, cfg.eval_size)
            self._save_checkpoint(epoch + 1, result)
        if cfg.mode == "finetune":
            self._print_finetune_table(before, result)
        distributed.barrier()
        return {"rank": cfg.global_rank, "resolution": cfg.eval_size, "top1": result.top1,
                "top5": result.top5, "loss": result.loss, "images": result.images}

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
            cfg.job_folder.mkdir(parents=True, exist_ok=True, mode=0o700)  # holds the rendezvous file
        distributed.init_process_group(cfg.dist_backend, cfg.dist_url, cfg.global_rank, cfg.num_tasks,
                                       cfg.dist_timeout)
        job_id = distributed.broadcast_object(cfg.job_id)  # torchrun without a run id: rank 0's
        if job_id != cfg.job_id:
            self.config = cfg = attrs.evolve(cfg, job_id=job_id)
        cfg.job_folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        torch.manual_seed(cfg.seed + cfg.global_rank)

    def _prepare_job_folder(self) -> None:
        cfg = self.config
        self.metrics = MetricsLog(cfg.job_folder / METRICS_FILE, self.rank0)
        if self.rank0:
            (cfg.job_folder / CONFIG_FILE).write_text(cfg.to_json() + "\n")
            self.log(f"job {cfg.job_id}: {cfg.mode} {cfg.architecture}, {cfg.num_tasks} rank(s) on "
                     f"{self.device.type}, folder {cfg.job_folder}")
        self.metrics.write("start", mode=cfg.mode, num_tasks=cfg.num_tasks, architecture=cfg.architecture)

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
                                pin_memory=self.device.type == "cuda")

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
        lr = scaled_learning_rate(cfg.learning_rate, cfg.batch, cfg.num_tasks)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        steps = len(self.train_loader)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(cfg.epochs * steps, round(cfg.warmup_epochs * steps)))
        self.log(f"lr {lr:g} = {cfg.learning_rate:g} x {cfg.batch} x {cfg.num_tasks} / {REFERENCE_BATCH} "
                 f"(linear scaling rule), {steps} steps per epoch")

    # --------------------------------------------------------------- training
    def _train_one_epoch(self, epoch: int) -> None:
        cfg = self.config
        fixres.set_train_mode(self.ddp)
        self.train_loader.batch_sampler.set_epoch(epoch)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, images
        bar = tqdm(total=len(self.train_set), unit="img", unit_scale=True, leave=False,
                   desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=not (self.rank0 and cfg.progress))
        start = time.perf_counter()
        for step, (images, labels) in enumerate(self.train_loader):
            loss = self._train_step(images, labels)
            sums += torch.stack([loss.double() * labels.numel(),
                                 torch.tensor(labels.numel(), dtype=torch.float64, device=self.device)])
            bar.update(labels.numel() * cfg.num_tasks)
            if self.rank0 and cfg.progress and step % 20 == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.close()
        seconds = time.perf_counter() - start
        loss_sum, images = distributed.all_reduce_sum(sums).tolist()
        lr = self.optimizer.param_groups[0]["lr"]
        self.metrics.write("train", epoch=epoch + 1, loss=loss_sum / images, lr=lr, img_per_s=images / seconds)
        self.log(f"epoch {epoch + 1}/{cfg.epochs}: train loss {loss_sum / images:.4f}, lr {lr:.4g}, "
                 f"{images / seconds:,.0f} img/s")

    def _train_step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One optimizer step on a uint8 (B, 3, H, W) batch; returns the detached mean loss."""
        images = data.normalize(images.to(self.device, non_blocking=True))
        labels = labels.to(self.device, non_blocking=True)
        loss = F.cross_entropy(self.ddp(images), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return loss.detach()

    # ------------------------------------------------------------- evaluation
    def _evaluate(self, epoch: int, size: int, label: str = "") -> EvalResult:
        if size not in self.val_loaders:
            self.val_loaders[size] = self._loader(self.val_set, data.test_transform(size), shuffle=False)
        result = evaluate(self.model, self.val_loaders[size], self.device)
        self.metrics.write("eval", epoch=epoch, resolution=size, top1=result.top1, top5=result.top5,
                           loss=result.loss, images=result.images, **({"label": label} if label else {}))
        self.log(f"eval{' ' + label if label else ''} @{size}px: top-1 {result.top1:.2f} %, "
                 f"top-5 {result.top5:.2f} %, loss {result.loss:.4f} ({result.images} images)")
        return result

    def _evaluate_before_finetune(self) -> list[tuple[str, int, EvalResult]]:
        cfg = self.config
        rows = []
        train_size = cfg.train_size or (self.weight_config or {}).get("input_size")
        if train_size:
            rows.append(("train resolution, no finetuning", train_size,
                         self._evaluate(0, train_size, "train-resolution")))
        rows.append(("test resolution, no finetuning", cfg.input_size, self._evaluate(0, cfg.input_size, "before")))
        return rows

    def _print_finetune_table(self, before, after: EvalResult) -> None:
        rows = before + [("test resolution, FixRes finetuned", self.config.input_size, after)]
        lines = ["", f"FixRes finetune of {self.config.architecture} ({self.config.num_tasks} rank(s), "
                     f"{after.images} validation images)",
                 f"| {'evaluation':<36} | resolution | top-1 % | top-5 % |",
                 f"|{'-' * 38}|------------|---------|---------|"]
        lines += [f"| {name:<36} | {size:>7} px | {r.top1:7.2f} | {r.top5:7.2f} |" for name, size, r in rows]
        gains = [f"{after.top1 - r.top1:+.2f} top-1 points over the {name.split(',')[0]} ({size} px)"
                 for name, size, r in before]
        lines.append("finetuning at the test resolution bought " + "; ".join(gains))
        self.log("\n".join(lines))

    # ------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, epoch: int, result: EvalResult) -> None:
        if not self.rank0:
            return
        save_checkpoint(self.config.job_folder / CHECKPOINT_FILE, {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "epoch": epoch, "config": self.config.to_dict(),
            "metrics": {"top1": result.top1, "top5": result.top5, "loss": result.loss,
                        "resolution": self.config.eval_size}})

    def log(self, message: str) -> None:
        if self.rank0:
            tqdm.write(message)
