"""The network a run trains or evaluates: built (on the meta device where its strategy fills it from rank
0's), its weights loaded, prepared for training. :class:`Network` holds the classifier (``model``: evaluation
and checkpoints use it), the module training runs (``wrapped``), the forward training calls (``--compile``:
compiled at its first call, uncompiled if that fails), the preprocessing its weights expect
(:mod:`fixres_dist.models.preprocessing`) and their lineage (:mod:`fixres_dist.models.lineage`). Every act that
depends on how the ranks hold the model is its ``strategy``'s (:mod:`fixres_dist.distributed.strategy`).
"""
from __future__ import annotations

from typing import Callable

import torch

from fixres_dist.config import TrainerConfig
from fixres_dist.distributed import layout, sharding, strategies
from fixres_dist.errors import first_line
from fixres_dist.fixres import finetuning
from fixres_dist.models import architectures, batchnorm, lineage, preprocessing, resolutions, weights
from fixres_dist.models.ema import ModelEMA
from fixres_dist.training import optim
from fixres_dist.training.engine import AMP_DTYPES


class Network:
    """Build ``config.architecture`` for ``classes`` (the data's class names, in label order) at ``size``
    pixels on ``device``, with ``found`` (the ``--weight-path`` file read, or None) loaded, its head's
    rows following the class names it records (:mod:`fixres_dist.models.class_names`); ``log``/``warn``:
    rank 0's log. ``train_size``: the resolution (pixels) the weights were trained at from scratch, None when
    unknown. Raises :class:`~fixres_dist.errors.FixresError` for weights that do not fit the model."""

    def __init__(self, config: TrainerConfig, classes: list[str], size: int, found: weights.WeightFile | None,
                 device: torch.device, log: Callable[[str], None], warn: Callable[[str], None]):
        self.config, self.device, self.log, self.warn = config, device, log, warn
        self.layout = layout.of(config)  # the ranks' parallel layout: sizes, this rank's place, its description
        self.classes = list(classes)  # the class of each of the head's rows: every checkpoint records them
        self.strategy = strategies.strategy_for(  # every act that depends on how the ranks hold the model
            self.layout, config, device, amp=AMP_DTYPES[config.amp], log=log, warn=warn,
            parameter_groups=lambda whole: optim.parameter_groups(whole, config.weight_decay, config.norm_weight_decay))
        on_meta = self.strategy.builds_from_rank0 and config.global_rank != 0  # its shards come from rank 0's
        with torch.random.fork_rng(devices=[]):  # built on the meta device or not, the RNG streams go on alike
            model = architectures.build_model(config.architecture, len(classes), image_size=size,
                                              low_res_stem=config.low_res_stem, device="meta" if on_meta else None)
        self.new_head = None  # (classes, the weight file's head's classes) when the weights got a new head
        if found is not None:
            log(found.describe())
            loaded = weights.load_weights(model, found, classes=self.classes)
            for say, line in ((log, loaded.note), (warn, loaded.warning)):
                if line:
                    say(line)
            self.new_head = (len(classes), loaded.new_head_from) if loaded.new_head_from is not None else None
        self.preprocessing = preprocessing.resolve(config, found.config if found else None)
        log(self.preprocessing.describe())
        self.weights_lineage = lineage.for_run(config, found)
        self.train_size = self.weights_lineage.train_size
        if config.eval_only:
            log(f"evaluating weights: {self.weights_lineage.describe()}")
        self.model = self.wrapped = self.forward = model.to(None if on_meta else device, memory_format=(
            torch.channels_last if config.channels_last else torch.preserve_format))
        self.laid_out = False  # lay_out() ran: prepared, averaged and wrapped
        self.average: ModelEMA | None = None  # --model-ema's average of the weights (lay_out makes it)
        self._compile_checked = True

    @staticmethod
    def build_size(config: TrainerConfig, input_size: int) -> int:
        """The size (pixels) to build at: the training resolution ``input_size`` (resumed: the size
        trained at), or with ``--eval-only`` the first size evaluated."""
        return resolutions.build_size(config) if config.eval_only else input_size

    def lineage_at(self, input_size: int) -> lineage.Lineage:
        """The lineage of the network this run reports on and checkpoints (:func:`.lineage.trained`)."""
        return lineage.trained(self.config, self.weights_lineage, input_size)

    def lay_out(self, input_size: int, trains: bool) -> None:
        """Once, for a run that ``trains`` at ``input_size`` pixels: :meth:`prepare_for_training`, ``--model-ema``'s
        :attr:`average` (a copy: a sharded module cannot be copied), :meth:`wrap`; only the last to evaluate."""
        if self.laid_out:
            return
        if trains:
            self.prepare_for_training(input_size)
            if self.config.model_ema:
                self.average = ModelEMA(self.model, self.config.model_ema_decay, self.config.model_ema_steps)
        self.wrap(input_size)

    def prepare_for_training(self, input_size: int) -> None:
        """Finetune (FixRes): train only ``--finetune-scope`` at ``input_size``, the rest frozen, trainable
        BatchNorms over all data-parallel ranks' images. Then ``--sync-bn``. Before the optimizer is
        built: both may replace BatchNorm modules."""
        cfg, group, ranks = self.config, self.strategy.data_group, self.layout.data_ranks_words()
        if cfg.mode == "finetune":
            self.model = architectures.for_resolution(self.model, input_size)  # ViT: position embeddings
            trainable = finetuning.freeze_for_finetune(self.model, input_size, cfg.finetune_scope, cfg.last_norm)
            count, whole = [sum(p.numel() for p in self.model.parameters() if p.requires_grad or not only)
                            for only in (True, False)]  # trained, all
            self.log(f"finetuning ({cfg.finetune_scope}) {count:,} of {whole:,} parameters in {len(trainable)} "
                     f"tensors: {', '.join(trainable)}")
            norms = [name for name, m in self.model.named_modules() if isinstance(m, finetuning.NORM_TYPES)
                     and any(p.requires_grad for p in m.parameters(recurse=False))]
            synchronised = batchnorm.synchronise(self.model, norms, self.device.type, group) \
                if cfg.data_parallel_size > 1 else []
            if synchronised:
                self.log(f"BatchNorm statistics over all {ranks}' images: {', '.join(synchronised)}")
        if cfg.sync_bn and cfg.data_parallel_size > 1:
            synchronised = batchnorm.synchronise(self.model, None, self.device.type, group)
            self.log(f"--sync-bn: {len(synchronised)} BatchNorm layers synchronised over {ranks}")

    def warn_below_train_size(self, input_size: int) -> None:
        """A finetune at ``input_size`` pixels below the weights' train resolution: warned
        (:func:`~fixres_dist.fixres.finetuning.finetune_resolution_warning`)."""
        below = self.config.mode == "finetune" and finetuning.finetune_resolution_warning(self.train_size, input_size)
        if below:
            self.warn(below)

    def wrap(self, size: int | None = None) -> None:
        """Wrap for training by the strategy (DDP, sharded, split by tensors or cut into stages balanced at
        ``size`` pixels), ``--activation-checkpointing`` per block, :attr:`average`'s module alike (the one it
        returns); ``--compile``: the forward compiled at its first call. Build the optimizer after wrapping."""
        cfg, self.laid_out = self.config, True
        if cfg.activation_checkpointing and not cfg.eval_only:  # no backward: nothing to recompute
            blocks = sharding.checkpoint_activations(self.model)
            if blocks:
                self.log(f"activation checkpointing: {blocks} blocks recompute their forward in the backward")
            else:
                self.warn(f"--activation-checkpointing: no known blocks in {cfg.architecture}; nothing is recomputed")
        average = self.average.module if self.average is not None else None
        self.model, self.wrapped, average = self.strategy.wrap(self.model, average, size or resolutions.build_size(cfg))
        if self.average is not None:
            self.average.module = average
        self.layout = self.strategy.laid_out(self.layout)  # a hybrid shard group: a node's ranks, as they met
        self.forward = torch.compile(self.wrapped, backend=cfg.compile) if cfg.compile else self.wrapped
        self._compile_checked = not cfg.compile

    def evaluated(self, module: torch.nn.Module, size: int) -> torch.nn.Module:
        """What evaluation runs at ``size`` pixels: ``module`` (:attr:`model` or its EMA) at that resolution
        (:func:`~fixres_dist.models.architectures.for_resolution`), or the strategy's own (a pipeline's)."""
        return self.strategy.evaluated(module, size, len(self.classes), architectures.for_resolution)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """The training forward. Compilation happens at the first call; if it fails, the run warns with
        the cause and goes on uncompiled (same results, eager speed) rather than losing the job to it."""
        if self._compile_checked:
            return self.forward(images)
        try:
            logits = self.forward(images)
        except Exception as exc:  # any compiler failure; a genuine error recurs below, uncompiled
            self.warn(f"--compile {self.config.compile} failed ({type(exc).__name__}: {first_line(exc)}); "
                      "continuing uncompiled")
            self.forward, self._compile_checked = self.wrapped, True
            return self.wrapped(images)
        self._compile_checked = True
        return logits
