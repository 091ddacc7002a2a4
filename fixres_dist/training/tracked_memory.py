"""The tracked route of the memory estimate: training steps of a model each rank holds whole (one rank,
DDP) or sharded (FSDP2 full or hybrid), run on *fake* tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and devices, no data, no memory) under
torch's memory trackers: ``torch.distributed._tools.mem_tracker.MemTracker`` for a whole model,
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` for a sharded one, which then runs as a
rank of ``--num-tasks`` on a fake process group. A tracker sees every tensor the step creates, each
rounded up to 512 bytes as the CUDA caching allocator rounds it, and keeps the peak of their sum with
its breakdown at that moment. :func:`tracked_steps` is what
:func:`fixres_dist.training.memory_estimate.estimate` runs for a layout that does not split the model.

The model is prepared as a run prepares it (:class:`~fixres_dist.training.network.Network`): built by
:func:`~fixres_dist.models.architectures.build_model` at the training resolution (pixels), the
finetune's frozen layers (:func:`~fixres_dist.fixres.finetuning.freeze_for_finetune`), activation
checkpointing and sharding by :func:`~fixres_dist.distributed.sharding.checkpoint_activations` and
:func:`~fixres_dist.distributed.sharding.shard`, the optimizer by
:func:`~fixres_dist.training.optim.build_optimizer`, and each step is the run's own
:func:`~fixres_dist.training.engine.train_step` (autocast for ``--amp``, micro-batches for
``--grad-accum-steps``, clipping). On CUDA the optimizer runs its foreach implementation, as torch
picks it there (its temporaries are a copy of the gradients).

Added by arithmetic, as the trackers cannot see them: DDP's gradient buckets on more than one rank
(a second copy of the trainable parameters' gradients), the EMA's copy of the weights
(``--model-ema``); with ``--cpu-offload`` the sharded parameters, gradients and optimizer state at
the peak are taken off (they stay on the host).
"""
from __future__ import annotations

import contextlib

import attrs

from fixres_dist.config import TrainerConfig

STEPS = 2  # the second step runs with the optimizer's state
# The trackers' categories (their enum values) -> the parts of MemoryEstimate; the rest (Activation,
# Temp, Inputs, Other) are activations and temporaries.
PARTS = {"Parameter": "parameters", "Buffer": "parameters", "Sharded Param": "parameters",
         "Unsharded Param": "parameters", "All Gather": "parameters", "Gradient": "gradients",
         "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "Reduce Scatter": "gradients",
         "Optstate": "optimizer", "OptState": "optimizer"}
OFFLOADED = ("Sharded Param", "Sharded Grad", "OptState")  # on the host with --cpu-offload


def tracked_steps(config: TrainerConfig, num_classes: int, size: int, sharded: bool,
                  group: int | None) -> tuple[int, dict[str, int]]:
    """(peak bytes, parts: ``parameters``, ``gradients``, ``optimizer``, ``activations``) of :data:`STEPS`
    training steps of ``config`` with ``num_classes`` classes at ``size`` pixels on fake tensors;
    ``sharded``: on this process' (fake) process group, hybrid shard groups of ``group`` ranks. Raises
    whatever the fake route raises (a model it cannot run)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from fixres_dist.distributed import sharding

    built = attrs.evolve(config, cpu_offload=False,  # offload: taken off afterwards (see the module docstring)
                         shard_group_size=group if config.sharding == "hybrid" else None)
    mesh = sharding.device_mesh(built, torch.device("cpu")) if sharded else None  # real: outside fake mode
    with FakeTensorMode(), _propagation_apart():
        model = _prepared_model(built, num_classes, size, mesh)
        optimizer = _optimizer(config, model)
        tracker = FSDPMemTracker(model, optimizer) if sharded else MemTracker()
        if not sharded:
            tracker.track_external(model, optimizer)
            _frozen_without_hooks(tracker, model)
        snapshot = _run_steps(config, size, sharded, model, optimizer, tracker)
        held = _held_apart(config, model)
    totals: dict[str, int] = {}
    for category, size in snapshot.items():
        name = getattr(category, "value", category)
        if name != "Total":
            totals[name] = totals.get(name, 0) + size
    if config.cpu_offload and sharded:
        for name in OFFLOADED:
            totals[name] = 0
    parts = {"parameters": 0, "gradients": 0, "optimizer": 0, "activations": 0}
    for name, size in totals.items():
        parts[PARTS.get(name, "activations")] += size
    for name, size in held.items():
        parts[name] += size
    return sum(parts.values()), parts


@contextlib.contextmanager
def _propagation_apart():
    """DTensor derives each new op's output shape by running it on tensors of the *global* shape in
    the fake mode it finds active, ours here, whose tensors the tracker would count (the optimizer's
    step on sharded parameters would seem to hold whole copies). Meanwhile it finds none and makes
    its own, whose tensors the tracker leaves out, as it does outside fake mode."""
    from torch.distributed.tensor import _sharding_prop

    saved = getattr(_sharding_prop, "detect_fake_mode", None)
    if saved is None:  # another torch: nothing to set apart
        yield
        return
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = saved


def _fake_model(config: TrainerConfig, num_classes: int, size: int):
    """``config``'s model with fake parameters (call under FakeTensorMode): built directly, or, for a
    builder that needs real numbers (timm reads values with ``.item()``) and for ``--channels-last``
    (``Module.to`` cannot swap fake parameters), on the meta device, then given fake tensors of the
    same shapes (4-D ones channels-last, as ``Module.to(memory_format=torch.channels_last)`` makes them)."""
    import torch

    from fixres_dist.models import architectures, resolutions

    if not config.channels_last:
        try:
            return architectures.build_model(config.architecture, num_classes, image_size=size,
                                             low_res_stem=config.low_res_stem)
        except Exception:  # any builder failure on fake tensors: build on the meta device instead
            pass
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        model = resolutions.build_on_meta(config.architecture, num_classes, size, config.low_res_stem)

    def fake(t):
        if config.channels_last and t.dim() == 4:
            return torch.empty(t.size(), dtype=t.dtype, device="cpu", memory_format=torch.channels_last)
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")
    return model._apply(fake)


class _NoHook:
    def remove(self) -> None:
        pass


def _frozen_without_hooks(tracker, model) -> None:
    """MemTracker hooks every parameter's gradient, and a frozen one (the finetune's) refuses a hook:
    mark those as hooked already."""
    for param in model.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())


def _prepared_model(config: TrainerConfig, num_classes: int, size: int, mesh):
    """The model as a run trains it (:class:`~fixres_dist.training.network.Network`): built at the
    training size, channels-last, the finetune's scope trainable, checkpointed and sharded."""

    from fixres_dist.distributed import sharding
    from fixres_dist.fixres import finetuning
    from fixres_dist.training.engine import AMP_DTYPES

    model = _fake_model(config, num_classes, size)
    if config.mode == "finetune":
        finetuning.freeze_for_finetune(model, size, config.finetune_scope, config.last_norm)
    finetuning.set_train_mode(model)
    if config.activation_checkpointing:
        sharding.checkpoint_activations(model)
    if mesh is not None:
        sharding.shard([model], mesh, config, AMP_DTYPES[config.amp], values=False)
    return model


def _optimizer(config: TrainerConfig, model):
    """The run's optimizer (:mod:`fixres_dist.training.optim`); on CUDA its foreach implementation,
    which torch picks for CUDA tensors (on the fake CPU tensors it would loop per tensor)."""
    from fixres_dist.training import optim

    lr = optim.scaled_learning_rate(config.learning_rate, config.batch, config.num_tasks, config.grad_accum_steps)
    optimizer = optim.build_optimizer(config.opt, optim.parameter_groups(model, config.weight_decay,
                                                                         config.norm_weight_decay),
                                      lr, config.momentum)
    if config.device == "cuda":
        for group in optimizer.param_groups:
            group["foreach"] = True
    return optimizer


def _run_steps(config: TrainerConfig, size: int, sharded: bool, model, optimizer, tracker) -> dict:
    """:data:`STEPS` steps of :func:`fixres_dist.training.engine.train_step` under ``tracker``; its
    peak snapshot (category -> bytes) on the device where it was largest."""
    import torch

    from fixres_dist.distributed.fsdp_strategy import FullySharded
    from fixres_dist.distributed.strategy import SINGLE
    from fixres_dist.training import engine

    def batch():  # as the loader hands it over: uint8 images, int64 labels
        return torch.zeros(config.batch, 3, size, size, dtype=torch.uint8), torch.zeros(config.batch, dtype=torch.long)
    # On the CPU the step uses the loader's batch (made before the tracker: not counted); on CUDA it
    # copies it to the GPU first (made under the tracker: counted).
    images, labels = batch()
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # fp16's loss scale: a scalar
    strategy = FullySharded.of(model) if sharded else SINGLE
    settings = engine.StepSettings(torch.device("cpu"), world=config.num_tasks, amp=engine.AMP_DTYPES[config.amp],
                                   channels_last=config.channels_last, label_smoothing=config.label_smoothing,
                                   accumulation=config.grad_accum_steps, clip_grad_norm=config.clip_grad_norm)
    def forward(part):
        tracker.reset_mod_stats()  # the trackers record one forward per module (a micro-batch each); the peak stays
        return model(part)

    with tracker:
        if config.device == "cuda":
            images, labels = batch()
        for _ in range(STEPS):
            engine.train_step(forward, optimizer, scaler, images, labels, settings, strategy=strategy)
    peaks = tracker.get_tracker_snapshot("peak")
    return max(peaks.values(), key=lambda snapshot: snapshot.get("Total", 0)) if peaks else {}


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
    return local.numel() * local.element_size()


def _held_apart(config: TrainerConfig, model) -> dict[str, int]:
    """Bytes the trackers do not see, held through the whole step: DDP's gradient buckets (more than
    one rank: a copy of every trainable parameter's gradient) and the EMA's copy of the weights."""
    held = {"parameters": 0, "gradients": 0}
    if config.sharding == "ddp" and config.num_tasks > 1:
        held["gradients"] = sum(_local_bytes(p) for p in model.parameters() if p.requires_grad)
    if config.model_ema:
        held["parameters"] = sum(_local_bytes(t) for t in (*model.parameters(), *model.buffers()))
    return held
