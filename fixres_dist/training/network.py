"""The network a run trains or evaluates: built, its weights loaded, prepared for training.

:class:`Network` holds the classifier (``model``: evaluation and checkpoints use it; sharded in place
with ``--sharding full/hybrid``), the one training runs (``wrapped``: DDP's wrapper, or the sharded
model itself: :mod:`fixres_dist.distributed.sharding`), the forward that training calls
(``--compile``: compiled at its first call, uncompiled if compilation fails), the preprocessing its weights expect
(:mod:`fixres_dist.models.preprocessing`) and the lineage of those weights
(:mod:`fixres_dist.models.lineage`: the resolution they were trained at from scratch).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fixres_dist.config import TrainerConfig
from fixres_dist.distributed import layout, pipeline, pipeline_state, sharding, tensor_parallel
from fixres_dist.distributed.collectives import BUFFER_SYNC
from fixres_dist.errors import first_line
from fixres_dist.fixres import finetuning
from fixres_dist.models import architectures, batchnorm, lineage, preprocessing, resolutions, weights
from fixres_dist.models.ema import ModelEMA
from fixres_dist.training import optim
from fixres_dist.training.engine import AMP_DTYPES

LAST_GRADIENTS = 4  # parameters whose gradients, the last of a backward, mark DDP's last bucket (step times)


class Network:
    """Build ``config.architecture`` for ``classes`` (the data's class names, in label order) at ``size``
    pixels on ``device``, with ``found`` (the ``--weight-path`` file read, or None) loaded, its head's
    rows following the class names it records (:mod:`fixres_dist.models.class_names`); ``log``/``warn``:
    rank 0's log.

    ``new_head``: ``(classes, the weight file's head's classes)`` when the weights got a new head (another
    class count, or no class name shared), else None; ``train_size``: the resolution (pixels) the
    weights were trained at from scratch, None when unknown. Raises
    :class:`~fixres_dist.errors.FixresError` for weights that do not fit the model.
    """

    def __init__(self, config: TrainerConfig, classes: list[str], size: int, found: weights.WeightFile | None,
                 device: torch.device, log: Callable[[str], None], warn: Callable[[str], None]):
        self.config, self.device, self.log, self.warn = config, device, log, warn
        self.layout = layout.of(config)  # the ranks' parallel layout: sizes, this rank's place, its description
        self.classes = list(classes)  # the class of each of the head's rows: every checkpoint records them
        model = architectures.build_model(config.architecture, len(classes), image_size=size,
                                          low_res_stem=config.low_res_stem)
        self.new_head = None
        if found is not None:
            log(found.describe())
            loaded = weights.load_weights(model, found, classes=self.classes)
            if loaded.note:
                log(loaded.note)
            if loaded.warning:
                warn(loaded.warning)
            if loaded.new_head_from is not None:
                self.new_head = (len(classes), loaded.new_head_from)
        self.preprocessing = preprocessing.resolve(config, found.config if found else None)
        log(self.preprocessing.describe())
        self.weights_lineage = lineage.for_run(config, found)
        self.train_size = self.weights_lineage.train_size
        if config.eval_only:
            log(f"evaluating weights: {self.weights_lineage.describe()}")
        if config.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model.to(device)
        self.wrapped = self.forward = self.model
        self.sharded = False  # parameters sharded over the ranks (FSDP2): every forward is a collective
        self.tensor_mesh = None  # --tensor-parallel: the data x tensor mesh (every forward is a collective)
        self.pipeline: pipeline.Pipeline | None = None  # --pipeline-stages: this rank's stages and their schedules
        self.whole_groups: list[list[str]] | None = None  # the unsplit model's optimizer numbering (pipeline_state)
        self._stage_mesh = None
        self.laid_out = False  # lay_out() ran: prepared, averaged and wrapped
        self.average: ModelEMA | None = None  # --model-ema's average of the weights (lay_out makes it)
        self._compile_checked = True

    @staticmethod
    def build_size(config: TrainerConfig, input_size: int) -> int:
        """The size (pixels) to build at: the training resolution ``input_size`` (resumed: the size
        trained at), or with ``--eval-only`` the first size evaluated."""
        return resolutions.build_size(config) if config.eval_only else input_size

    def lineage_at(self, input_size: int) -> lineage.Lineage:
        """The lineage of the network this run reports on and checkpoints: the weights evaluated
        (``--eval-only``), those trained from scratch here at ``input_size``, or those finetuned here at
        ``input_size`` from weights trained at :attr:`train_size`."""
        if self.config.eval_only:
            return self.weights_lineage
        if self.config.mode == "scratch":
            return lineage.Lineage(input_size)
        return lineage.Lineage(self.train_size, input_size)

    @property
    def shards_before_evaluating(self) -> bool:
        """Whether the model is laid out (prepared, then sharded: :meth:`wrap`) before its first
        evaluation: with ``--sharding full/hybrid`` on more than one rank, so that every evaluation
        (``--eval-only``, a finetune's before finetuning) runs on the shards, never the whole model
        on one device. DDP wraps at the start of training (evaluations use the unwrapped model)."""
        cfg = self.config
        return (cfg.sharding != "ddp" or self.layout.split) and cfg.num_tasks > 1

    def lay_out(self, input_size: int, trains: bool) -> None:
        """Once, for a run that ``trains`` at ``input_size`` pixels: :meth:`prepare_for_training`, then
        ``--model-ema``'s :attr:`average` (a copy: before sharding, which cannot be copied), then
        :meth:`wrap`. DDP at the start of training; a sharded run before its first evaluation
        (:attr:`shards_before_evaluating`). An evaluation-only run is wrapped only."""
        if self.laid_out:
            return
        if trains:
            self.prepare_for_training(input_size)
            if self.config.model_ema:
                self.average = ModelEMA(self.model, self.config.model_ema_decay, self.config.model_ema_steps)
        self.wrap(self.average.module if self.average else None, input_size)

    def prepare_for_training(self, input_size: int) -> None:
        """Finetune (FixRes): train only ``--finetune-scope`` at ``input_size``, the rest frozen. Then
        ``--sync-bn``. Before the optimizer is built: both may replace BatchNorm modules."""
        cfg = self.config
        if cfg.mode == "finetune":
            self._freeze_for_finetune(input_size)
        if cfg.sync_bn and cfg.data_parallel_size > 1:
            synchronised = batchnorm.synchronise(self.model, None, self.device.type, self.data_group)
            self.log(f"--sync-bn: {len(synchronised)} BatchNorm layers synchronised over {self._data_ranks()}")

    def _freeze_for_finetune(self, input_size: int) -> None:
        """The scope's parameters train; trainable BatchNorms see the union of all ranks' images."""
        cfg = self.config
        self.model = architectures.for_resolution(self.model, input_size)  # ViT: position embeddings
        trainable = finetuning.freeze_for_finetune(self.model, input_size, cfg.finetune_scope, cfg.last_norm)
        count = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.log(f"finetuning ({cfg.finetune_scope}) {count:,} of {sum(p.numel() for p in self.model.parameters()):,} "
                 f"parameters in {len(trainable)} tensors: {', '.join(trainable)}")
        if cfg.data_parallel_size > 1:
            norms = [name for name, m in self.model.named_modules() if isinstance(m, finetuning.NORM_TYPES)
                     and any(p.requires_grad for p in m.parameters(recurse=False))]
            synchronised = batchnorm.synchronise(self.model, norms, self.device.type, self.data_group)
            if synchronised:
                self.log(f"BatchNorm statistics over all {self._data_ranks()}' images: {', '.join(synchronised)}")

    def _data_ranks(self) -> str:
        cfg = self.config
        return f"{cfg.data_parallel_size} {'data-parallel ' if cfg.data_parallel_size < cfg.num_tasks else ''}ranks"

    def warn_below_train_size(self, input_size: int) -> None:
        """A finetune at ``input_size`` pixels below the weights' train resolution: warned
        (:func:`~fixres_dist.fixres.finetuning.finetune_resolution_warning`)."""
        below = self.config.mode == "finetune" and finetuning.finetune_resolution_warning(self.train_size, input_size)
        if below:
            self.warn(below)

    def wrap(self, average: nn.Module | None = None, size: int | None = None) -> None:
        """Wrap for training with ``--sharding``: DDP (world size > 1), or the model sharded in place
        (full, hybrid), with ``--activation-checkpointing`` per block either way; ``average``: the EMA's
        copy of the model (made before: a sharded module cannot be copied), sharded alike; or cut into
        ``--pipeline-stages`` balanced at ``size`` pixels. With ``--compile``, the forward to compile at its
        first call. The optimizer is built after this: sharding replaces the parameters."""
        cfg, model = self.config, self.model
        self.laid_out = True
        if cfg.activation_checkpointing and not cfg.eval_only:  # no backward: nothing to recompute
            blocks = sharding.checkpoint_activations(model)
            if blocks:
                self.log(f"activation checkpointing: {blocks} blocks recompute their forward in the backward")
            else:
                self.warn(f"--activation-checkpointing: no known blocks in {cfg.architecture}; nothing is recomputed")
        if cfg.num_tasks == 1:
            if cfg.sharding != "ddp":
                self.log(f"--sharding {cfg.sharding} on 1 rank: nothing to shard; the model trains whole")
        elif self.layout.tensor_enabled:
            self._split_tensors()
        elif self.layout.pipeline_enabled:
            self._split_stages(size or resolutions.build_size(cfg))
        elif cfg.sharding != "ddp":
            self._shard([model] + ([average] if average is not None else []))
        else:
            self.wrapped = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda"
                                                   else None, **{BUFFER_SYNC: cfg.dist_bn == "broadcast"})
        self.forward = torch.compile(self.wrapped, backend=cfg.compile) if cfg.compile else self.wrapped
        self._compile_checked = not cfg.compile

    def time_gradient_reduction(self, bucket_ready: Callable[[], None]) -> bool:
        """Under DDP: call ``bucket_ready()`` as the gradients of the model's first :data:`LAST_GRADIENTS`
        trainable parameters (in module order) are accumulated: the last gradients of a backward, whose
        bucket DDP hands to its all-reduce last. Post-accumulate-grad hooks, run by autograd where the
        backward runs; DDP keeps its own C++ all-reduce. (A Python communication hook would run its
        ``Future.then`` callback in gloo's threads, each making and deleting a Python thread state, and
        a loader worker forked meanwhile can deadlock in CPython 3.11's after-fork.) Returns whether it
        could (not with one rank or a sharded model)."""
        if not isinstance(self.wrapped, DistributedDataParallel):
            return False
        for parameter in [p for p in self.model.parameters() if p.requires_grad][:LAST_GRADIENTS]:
            parameter.register_post_accumulate_grad_hook(lambda _: bucket_ready())
        return True

    def _shard(self, modules: list[nn.Module]) -> None:
        cfg = self.config
        mesh = sharding.device_mesh(cfg, self.device)
        self.layout = layout.of(cfg, mesh.size(-1))  # recorded as built: a hybrid group is a node's ranks as met
        blocks = sharding.shard(modules, mesh, cfg, AMP_DTYPES[cfg.amp])
        self.sharded = True
        shape = " x ".join(f"{size} {'replicate' if name == 'data' else name}"  # the replicas: mesh axis data
                          for size, name in zip(mesh.shape, mesh.mesh_dim_names))
        per_rank = sum(p.to_local().numel() for p in self.model.parameters())
        self.log(f"--sharding {cfg.sharding}: {blocks or 'no'} blocks and the root sharded over a mesh of {shape} "
                 f"ranks; {per_rank:,} of {sum(p.numel() for p in self.model.parameters()):,} parameters on this rank"
                 + ("" if cfg.reshard_after_forward else ", kept gathered from forward to backward")
                 + (", offloaded to the CPU" if cfg.cpu_offload else ""))
        if not blocks:
            self.warn(f"--sharding {cfg.sharding}: no known blocks in {cfg.architecture}; the whole model is one "
                      "unit, gathered at once on every rank (no memory saved while it runs)")

    def _split_tensors(self) -> None:
        """--tensor-parallel: rank 0's weights everywhere, then each block split over its tensor group."""
        cfg = self.config
        self.tensor_mesh = tensor_parallel.tensor_mesh(self.device, cfg.num_tasks, self.layout.tensor)
        sharding.start_from_rank0(self.model)
        mlps, attentions = tensor_parallel.parallelize(self.model, self.tensor_mesh["tensor"], cfg.architecture)
        self.log(f"--tensor-parallel {self.layout.tensor}: {mlps} MLPs"
                 + (f" and {attentions} attentions (by heads)" if attentions else " (attention whole)")
                 + f" split over tensor groups of {self.layout.tensor} ranks, {cfg.data_parallel_size} data-parallel "
                 f"group(s); {tensor_parallel.local_parameters(self.model):,} of "
                 f"{sum(p.numel() for p in self.model.parameters()):,} parameters on this rank")

    @property
    def data_group(self):
        """The process group of the ranks that hold the same layers and see different images: a pipeline
        stage's data-parallel ranks (the mesh made at the first call: a collective); None (all ranks) otherwise."""
        return self._pipeline_mesh().get_group("data") if self.layout.pipeline_enabled else None

    def _pipeline_mesh(self):
        if self._stage_mesh is None:
            self._stage_mesh = pipeline.pipeline_mesh(self.device, self.config.num_tasks, self.layout.pipeline)
        return self._stage_mesh

    def _split_stages(self, size: int) -> None:
        """--pipeline-stages: rank 0's weights everywhere, the unsplit optimizer's numbering kept, then cut."""
        cfg = self.config
        sharding.start_from_rank0(self.model)
        names = {param: name for name, param in self.model.named_parameters()}
        self.whole_groups = [[names[p] for p in group["params"]] for group in
                             optim.parameter_groups(self.model, cfg.weight_decay, cfg.norm_weight_decay)]
        self.pipeline = pipeline.Pipeline(
            self.model, self._pipeline_mesh(), size=size, schedule=cfg.pipeline_schedule,
            microbatches=cfg.pipeline_microbatches, virtual=pipeline.virtual_stages(cfg.pipeline_schedule),
            starts=list(cfg.pipeline_split) if cfg.pipeline_split else None,
            architecture=cfg.architecture, summed=True, label_smoothing=cfg.label_smoothing, buffer_sync=False)
        self.model = self.wrapped = self.pipeline.module
        self.log(f"--pipeline-stages {self.layout.pipeline}: {self.pipeline.describe()}; "
                 f"{sum(p.numel() for p in self.model.parameters()):,} parameters on this rank")

    @property
    def reduce_gradients(self) -> Callable[[], None] | None:
        """What averages the gradients after the backward where no DDP does: a tensor-parallel model's
        average over the data-parallel groups; None otherwise."""
        if self.tensor_mesh is None:
            return None
        return lambda: tensor_parallel.average_gradients(self.model, self.tensor_mesh)

    def clip_grad_norm(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the gradients of ``parameters`` to L2 norm ``max_norm`` (all of them together): torch's
        ``clip_grad_norm_``, or for a tensor-parallel model its own (split and whole gradients together)."""
        if self.tensor_mesh is not None:
            return tensor_parallel.clip_grad_norm(self.model, max_norm)
        if self.pipeline is not None:
            return self.pipeline.clip_grad_norm(max_norm)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def full_tensors(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """All ranks (a collective): a tensor-parallel model's and ``optimizer``'s state gathered whole,
        as a one-file checkpoint holds them (:func:`~fixres_dist.distributed.sharding.full_state_dicts`);
        None for another model (rank 0 holds it whole already, or it is written as shards)."""
        if self.pipeline is not None:
            return pipeline_state.gather_whole(self.pipeline, optimizer, self.whole_groups)
        return sharding.full_state_dicts(self.model, optimizer) if self.tensor_mesh is not None else None

    @property
    def no_sync(self):
        """Gradient accumulation without reducing each micro-batch: DDP's ``no_sync``, a sharded
        model's :func:`~fixres_dist.distributed.sharding.gradient_sync_off`; None on one rank."""
        if self.sharded:
            return lambda: sharding.gradient_sync_off(self.model)
        return self.wrapped.no_sync if self.wrapped is not self.model else None

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full state_dict (every rank holds it), sharded or not; a pipeline rank its stages' part."""
        if self.pipeline is not None:
            state = {key: value for key, value in state.items() if key in self.model.state_dict()}
        sharding.load_state_dict(self.model, state)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load an unsplit optimizer's ``state`` (numbered over the whole model) into ``optimizer`` (over
        :attr:`model`): sharded, split by tensors, a pipeline rank's stages' part, or neither."""
        if self.pipeline is not None:
            optimizer.load_state_dict(pipeline_state.own_optimizer_state(self.model, optimizer, state,
                                                                         self.whole_groups))
        else:
            sharding.load_optimizer_state_dict(self.model, optimizer, state)

    def evaluated(self, module: nn.Module, size: int) -> nn.Module:
        """What evaluation runs at ``size`` pixels: ``module`` (:attr:`model` or its EMA) at that resolution
        (:func:`~fixres_dist.models.architectures.for_resolution`), or a pipeline's schedule."""
        if self.pipeline is not None:
            return self.pipeline.evaluator(len(self.classes))
        return architectures.for_resolution(module, size)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """The training forward. Compilation happens at the first call; if it fails, the run warns
        with the cause and goes on uncompiled (same results, eager speed) rather than losing the job
        to a compiler problem."""
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
