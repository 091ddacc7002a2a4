"""The datasets and loaders of one rank's run: ``train/`` and ``val/`` of the data folder, made
from its file index (:mod:`fixres_dist.data.file_index`), or the train and val shards of packed data
(:mod:`fixres_dist.data.shards`), and each loader giving this rank's share
(:class:`~fixres_dist.data.samplers.ExactBatchSampler`)."""
from __future__ import annotations

import os
from typing import Callable

import torch

from fixres_dist.config import TrainerConfig
from fixres_dist.data import pipeline
from fixres_dist.distributed import layout
from fixres_dist.distributed.preemption import stop_signals
from fixres_dist.errors import FixresError


class JobData:
    """The train and val datasets of ``inputs`` (:class:`~fixres_dist.training.inputs.JobInputs`) and
    their loaders on ``device``; ``log``: rank 0's log.

    ``train_loader``: given (benchmarks: one fixed in-memory batch, yielding ``(images, labels,
    unreadable count)`` with an :class:`~fixres_dist.data.samplers.ExactBatchSampler`) or made by
    :meth:`train`; ``val_loaders``: one per test resolution (pixels), kept (persistent workers).
    Raises :class:`~fixres_dist.errors.FixresError` for fewer than 2 training images per rank.
    """

    def __init__(self, config: TrainerConfig, inputs, device: torch.device, log: Callable[[str], None],
                 train_loader=None):
        self.config, self.device = config, device
        root = inputs.root
        self.train_set, self.val_set = inputs.index.dataset("train"), inputs.index.dataset("val")
        self.classes = list(self.train_set.classes)
        hidden = [*self.train_set.hidden, *self.val_set.hidden]
        if hidden:
            shown = ", ".join(os.path.relpath(p, root) for p in hidden[:3]) + (", ..." if len(hidden) > 3 else "")
            log(f"data: skipped {len(hidden)} hidden files and folders ({shown}); hidden names are never "
                "classes or images")
        if len(self.train_set) < 2 * config.data_parallel_size:
            raise FixresError(f"{len(self.train_set)} training images are too few for {config.data_parallel_size} "
                              "data-parallel ranks")
        self.train_loader = train_loader
        self.val_loaders: dict[int, object] = {}

    @property
    def images_per_epoch(self) -> int:
        """Training images per epoch (the x axis of the TensorBoard curves counts images trained on)."""
        return self.train_loader.batch_sampler.dataset_size if self.train_loader is not None else len(self.train_set)

    def loader(self, dataset, transform, training: bool):
        """A loader of this rank's share: shuffled with training semantics (an optimizer step's share:
        ``--grad-accum-steps`` micro-batches, or a global batch kept from another world size; ``--ra-sampler``'s
        repeats), or in order (evaluation)."""
        cfg = self.config
        return pipeline.make_loader(dataset, transform,
                                    batch_size=cfg.batch * (cfg.accumulation if training else 1),
                                    global_batch=cfg.global_batch if training else None,
                                    tail_ranks=cfg.global_batch_ranks if training else None,
                                    accumulation=cfg.accumulation if training else 1,
                                    reps=cfg.ra_reps if training else 1, world_size=cfg.data_parallel_size,
                                    rank=layout.of(cfg).data_rank(cfg.global_rank), shuffle=training, seed=cfg.seed,
                                    workers=cfg.workers,
                                    pin_memory=self.device.type == "cuda", skip_bad_images=cfg.skip_bad_images,
                                    training=training, ignored_signals=stop_signals(cfg.preempt_signal),
                                    jpeg_decode=cfg.jpeg_decode)

    def train(self, size: int, preprocessing) -> None:
        """The training loader at ``size`` pixels, unless one was given: RandomResizedCrop and the
        ``--auto-augment``/``--random-erase`` policies from scratch, ``--finetune-augmentation`` for a
        finetune (FixRes); ``preprocessing``: the weights' (:mod:`fixres_dist.models.preprocessing`)."""
        cfg, prep = self.config, preprocessing
        if self.train_loader is None:
            transform = pipeline.train_transform(size, prep.interpolation, cfg.auto_augment, cfg.random_erase,
                                                 prep.normalization[0]) if cfg.mode == "scratch" else \
                pipeline.finetune_transform(size, cfg.finetune_augmentation, prep.crop_ratio, prep.interpolation)
            self.train_loader = self.loader(self.train_set, transform, training=True)

    def val_loader(self, size: int, transform):
        """The val loader at ``size`` pixels (made at its first use with ``transform``)."""
        if size not in self.val_loaders:
            self.val_loaders[size] = self.loader(self.val_set, transform, training=False)
        return self.val_loaders[size]

    def close(self) -> None:
        """Stop the loaders' worker processes."""
        for loader in (self.train_loader, *self.val_loaders.values()):
            pipeline.close_loader(loader)
