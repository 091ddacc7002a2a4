"""Evaluation: exact top-1/top-5 on the whole validation set at any test resolution, the sweep
report, and feature extraction.

Exact: every validation image counted once over all ranks (:mod:`fixres_dist.data.samplers`), the
sums all-reduced (:func:`fixres_dist.training.engine.evaluate`). The test preprocessing is the
weights' (crop ratio, interpolation: :mod:`fixres_dist.models.preprocessing`): resize the shorter side to
size / crop ratio, centre crop ``size`` (FixRes, Touvron et al. 2019, section 3).
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch

from fixres_dist import finite
from fixres_dist.config import TrainerConfig
from fixres_dist.data import pipeline
from fixres_dist.data.job_data import JobData
from fixres_dist.distributed import sharding
from fixres_dist.fixres import finetuning
from fixres_dist.models import architectures
from fixres_dist.reporting import progress, reports
from fixres_dist.reporting.run_log import RunLog
from fixres_dist.training import checkpoint, engine, extraction
from fixres_dist.training.engine import EvalResult
from fixres_dist.training.network import Network


class Evaluator:
    """Evaluates ``network``'s weights (or another module of the same inputs: its EMA) on ``data``'s
    val set; records each result in ``run_log``; ``clock`` measures the rates; ``after_batch`` runs
    after every batch (the stop agreement); ``postfix(bar, size)``: the bar's remaining-time text;
    ``show_progress``: whether this process draws bars."""

    def __init__(self, config: TrainerConfig, data: JobData, network: Network, run_log: RunLog,
                 clock: progress.JobClock, after_batch: Callable[[], None],
                 postfix: Callable[[progress.Bar, int], str], show_progress: bool):
        self.config, self.data, self.network, self.run_log, self.clock = config, data, network, run_log, clock
        self.after_batch, self.postfix, self.show_progress = after_batch, postfix, show_progress

    def test_transform(self, size: int):
        """The test preprocessing at ``size`` pixels with the weights' crop ratio and interpolation."""
        prep = self.network.preprocessing
        return pipeline.test_transform(size, prep.crop_ratio, prep.interpolation)

    def evaluate(self, epoch: int, size: int, label: str = "", what: str = "",
                 ema: torch.nn.Module | None = None) -> EvalResult:
        """Exact top-1/top-5 (percent) at test resolution ``size`` (pixels); recorded as an ``eval``
        event, or with ``ema`` (the weights' moving average) as an ``ema_eval`` event. ``what``: where
        it stands in the job, for the progress bar (``"epoch 2/6"``, ``"2/3 of the sweep ..."``).
        Raises :class:`~fixres_dist.finite.NonFiniteLoss` on every rank if the outputs are not
        finite."""
        cfg, tag = self.config, " EMA" if ema is not None else ""
        started = time.perf_counter()
        bar = progress.Bar(len(self.data.val_set), f"eval{tag} {size} px" + (f" ({what})" if what else ""),
                           enabled=self.show_progress, postfix=lambda b: self.postfix(b, size))
        model = self.network.evaluated(ema if ema is not None else self.network.model, size)
        loader = self.data.val_loader(size, self.test_transform(size))
        try:
            result = engine.evaluate(model, loader, self.network.device, engine.AMP_DTYPES[cfg.amp], cfg.channels_last,
                                     self.network.preprocessing.normalization, after_batch=self.after_batch,
                                     progress_bar=bar if bar.enabled else None,
                                     forwards=sharding.forwards_to_match(model, loader.batch_sampler), size=size,
                                     counted=self.network.layout.counts_metrics(cfg.global_rank))
        finally:
            bar.close()
        self.clock.add_evaluation(result.images, size, time.perf_counter() - started)
        if not math.isfinite(result.loss):  # all-reduced: every rank raises together
            raise finite.NonFiniteLoss(f"non-finite outputs (NaN or infinity) evaluating at {size} px"
                                       f"{f' after epoch {epoch}' if epoch else ''}: the weights diverged or "
                                       "overflow; nothing more is written")
        self.run_log.record("ema_eval" if ema is not None else "eval", epoch=epoch, resolution=size, top1=result.top1,
                            top5=result.top5, loss=result.loss, images=result.images,
                            **({"label": label} if label else {}))
        self.run_log.log(f"eval{tag}{' ' + label if label else ''} @{size}px: top-1 {result.top1:.2f} %, "
                         f"top-5 {result.top5:.2f} %, loss {result.loss:.4f} ({result.images} images)")
        return result

    def report_sweep(self, network_lineage, images_seen: int) -> None:
        """Table and plot of the sweeps so far (resolution_sweep.md/.png); names the best resolution."""
        cfg = self.config
        title = f"top-1 against test resolution: {cfg.architecture}, {cfg.run_name}\njob {cfg.job_id}"
        text, fields = reports.sweep_report(self.run_log.history, network_lineage, title,
                                            cfg.job_folder if cfg.global_rank == 0 else None,
                                            on_figure=lambda figure: self.run_log.figure("resolution_sweep", figure,
                                                                                         images_seen))
        self.run_log.record("sweep", run=cfg.run_name, **fields)
        self.run_log.log("\n" + text + f"\nplot: {cfg.job_folder / reports.PLOT_FILE}")

    def extract_features(self, size: int) -> None:
        """Logits, embeddings and labels of ``--extract-split`` at ``size`` pixels
        (:mod:`fixres_dist.training.extraction`)."""
        cfg = self.config
        dataset = self.data.val_set if cfg.extract_split == "val" else self.data.train_set
        loader = self.data.loader(dataset, self.test_transform(size), training=False)
        model = architectures.for_resolution(self.network.model, size)
        head, _ = finetuning.find_head_and_last_norm(model, size)
        source = cfg.weight_path if cfg.eval_only else str(cfg.job_folder / checkpoint.CHECKPOINT_FILE)
        info = extraction.extract(model, head, loader, self.network.device, cfg.extract_features, size,
                                  {"split": cfg.extract_split, "architecture": cfg.architecture,
                                   "weights": source, "classes": self.data.classes}, cfg.global_rank == 0,
                                  engine.AMP_DTYPES[cfg.amp], cfg.channels_last,
                                  self.network.preprocessing.normalization,
                                  forwards=sharding.forwards_to_match(model, loader.batch_sampler))
        self.run_log.record("features", folder=str(cfg.extract_features),
                            **{k: v for k, v in info.items() if k != "classes"})
        self.run_log.log(f"features of {info['images']} {cfg.extract_split} images at {size} px: logits "
                         f"{info['num_classes']}, embeddings {info['embedding_dim']} wide, in {cfg.extract_features}")
