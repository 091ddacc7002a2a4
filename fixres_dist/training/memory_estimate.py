"""Will it fit: the estimator of the peak memory of one rank in a training step, on the CPU before any
rank starts (:func:`estimate`, its :class:`MemoryEstimate` in bytes, and the fake process group a
sharded estimate runs on). The preflight's check against a memory budget is
:mod:`fixres_dist.training.memory_budget`, the table of several choices :mod:`fixres_dist.training.memory_table`.

:func:`estimate` runs two training steps (forward, backward and optimizer step, so that the
optimizer's state exists in the second) of a run's model on *fake* tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and devices, no data, no memory)
under torch's memory trackers: ``torch.distributed._tools.mem_tracker.MemTracker`` for a model each
rank holds whole (DDP, or one rank), ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``
for a sharded one, which then runs as rank 0 of ``--num-tasks`` ranks on a fake process group
(torch's ``fake`` backend, ``torch.testing._internal.distributed.fake_pg``: collectives that move
nothing). A tracker sees every tensor the step creates, each rounded up to 512 bytes as the CUDA
caching allocator rounds it, and keeps the peak of their sum with its breakdown at that moment.
Seconds on a CPU, for any model size.

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
the peak are taken off (they stay on the host). Not counted: what is no tensor (the CUDA context,
allocator fragmentation: ``nvidia-smi`` shows more than ``torch.cuda.max_memory_allocated``), and
``--compile``, ``--sync-bn`` and MixUp/CutMix, which change little. Fake tensors follow the CPU's
kernels and autocast lists; ``benchmarks/memory_estimate.py`` compares the estimate with measured
peaks.

A fake process group lives in its process until destroyed (:func:`fake_process_group` raises
RuntimeError in a process that has a process group); :func:`estimate` creates and destroys one for a
sharded estimate unless this process has one.
"""
from __future__ import annotations

import contextlib
import sys
import warnings

import attrs

from fixres_dist.config import TrainerConfig
from fixres_dist.errors import first_line

GIB = 2 ** 30
METHOD = "torch's MemTracker/FSDPMemTracker on fake tensors"
STEPS = 2  # the second step runs with the optimizer's state
# The trackers' categories (their enum values) -> the parts of MemoryEstimate; the rest (Activation,
# Temp, Inputs, Other) are activations and temporaries.
PARTS = {"Parameter": "parameters", "Buffer": "parameters", "Sharded Param": "parameters",
         "Unsharded Param": "parameters", "All Gather": "parameters", "Gradient": "gradients",
         "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "Reduce Scatter": "gradients",
         "Optstate": "optimizer", "OptState": "optimizer"}
OFFLOADED = ("Sharded Param", "Sharded Grad", "OptState")  # on the host with --cpu-offload


def number(size: float) -> str:
    """``size`` bytes as a number of GiB, three significant digits: ``"5.37"``, ``"0.0139"``, ``"140"``;
    ``"<0.001"`` for less than a MiB."""
    value = size / GIB
    if value == 0:
        return "0"
    if value < 0.001:
        return "<0.001"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def gib(size: float) -> str:
    """``size`` bytes in GiB, for messages: ``"5.37 GiB"``."""
    return f"{number(size)} GiB"


@attrs.frozen
class MemoryEstimate:
    """The estimated peak memory of one rank in a training step of ``setting`` (a line: batch, sharding,
    checkpointing), in bytes, with its breakdown at that peak; or no estimate (``peak`` None) and
    ``reason``. Estimated with torch's MemTracker/FSDPMemTracker on fake tensors (module docstring).

    ``parameters``: parameters and buffers (sharded: this rank's shards, the blocks gathered at that
    moment and the all-gather buffers; with ``--model-ema`` the average's copy); ``gradients``
    (sharded: with the reduce-scatter buffers; DDP: with its gradient buckets); ``optimizer``: the
    optimizer's state and step temporaries; ``activations``: what the forward keeps for the backward,
    and the temporaries of both (the input batch, gradients of activations, recomputed blocks).
    """

    setting: str
    peak: int | None
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    reason: str | None = None

    @property
    def known(self) -> bool:
        return self.peak is not None

    def fits(self, budget: int) -> bool:
        """Whether there is an estimate and it is at most ``budget`` bytes."""
        return self.peak is not None and self.peak <= budget

    def breakdown(self) -> str:
        """``"parameters 0.10, gradients 0.10, optimizer state 0.10, activations 5.07 GiB"``."""
        parts = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer state", self.optimizer),
                 ("activations", self.activations)]
        return ", ".join(f"{name} {number(size)}" for name, size in parts) + " GiB"

    def describe(self) -> str:
        """One line: the peak in GiB per rank and its breakdown, or why there is no estimate."""
        if self.peak is None:
            return f"no memory estimate for {self.setting} ({self.reason})"
        return f"{gib(self.peak)} per rank at its peak ({self.breakdown()}) for {self.setting}"

    def to_dict(self) -> dict:
        return attrs.asdict(self)


def train_size(config: TrainerConfig) -> int:
    """The training resolution (pixels) to estimate at: ``--input-size``; with ``auto``, the largest
    of ``--test-sizes`` (any of them may be chosen)."""
    return max(config.test_sizes) if config.input_size == "auto" else config.input_size


def needs_process_group(config: TrainerConfig) -> bool:
    """Whether estimating ``config`` needs a (fake) process group: sharded on more than one rank."""
    return config.sharding != "ddp" and config.num_tasks > 1


def shard_group(config: TrainerConfig) -> int:
    """``--sharding hybrid``'s shard group (ranks): ``--shard-group-size``, else the ranks on a node
    as the launcher knows them (``LOCAL_WORLD_SIZE``, ``SLURM_NTASKS_PER_NODE``), else all ranks."""
    from fixres_dist.distributed.layout import ranks_per_node_hint

    return config.shard_group_size or ranks_per_node_hint(config.num_tasks)


def setting_words(config: TrainerConfig) -> str:
    """How ``config`` holds the model, in words: ``"full shard over 8 ranks and activation checkpointing"``."""
    ranks = config.num_tasks
    if ranks == 1:
        how = "the whole model on 1 rank"
    elif config.sharding == "ddp":
        how = f"DDP on {ranks} ranks"
    elif config.sharding == "full":
        how = f"full shard over {ranks} ranks"
    else:
        how = f"hybrid shard over {ranks} ranks in groups of {shard_group(config)}"
    extras = [name for name, on in (("activation checkpointing", config.activation_checkpointing),
                                    ("CPU offload", config.cpu_offload and ranks > 1),
                                    ("no reshard after forward", not config.reshard_after_forward and ranks > 1))
              if on]
    return " and ".join([how, *extras])


def setting_line(config: TrainerConfig) -> str:
    """``"resnet50 at 224 px, batch 64 per rank, DDP on 8 ranks, sgd, amp off"``."""
    return (f"{config.architecture} at {train_size(config)} px, batch {config.batch} per rank, "
            f"{setting_words(config)}, {config.opt}, amp {config.amp}")


@contextlib.contextmanager
def fake_process_group(world: int, rank: int = 0):
    """A fake process group of ``world`` ranks (torch's ``fake`` backend: no communication; this
    process is rank ``rank``), destroyed on exit, with ``sys.excepthook`` as it was. Raises RuntimeError
    when this process has a process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("this process already has a process group; estimate in a child process")
    excepthook = sys.excepthook  # init_process_group prefixes uncaught tracebacks with the rank, for good
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


def estimate(config: TrainerConfig, num_classes: int) -> MemoryEstimate:
    """The peak memory per rank (bytes) of a training step of ``config`` with ``num_classes`` classes,
    estimated in this process with torch's MemTracker/FSDPMemTracker on fake tensors (module
    docstring). A sharded ``config`` on more than one rank runs on a fake process group, created
    and destroyed here unless this process has one. Never raises for the model: a failure of the
    fake route is an estimate without a peak, with the reason."""
    import torch.distributed as dist

    if needs_process_group(config) and not dist.is_initialized():
        with fake_process_group(config.num_tasks):
            return estimate(config, num_classes)
    label = setting_line(config)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peak, parts = _tracked_steps(config, num_classes)
    except Exception as exc:  # any failure of the fake route: the job still starts, without an estimate
        return MemoryEstimate(label, None, reason=f"{type(exc).__name__}: {first_line(exc)}"[:300])
    return MemoryEstimate(label, peak, **parts)


def _tracked_steps(config: TrainerConfig, num_classes: int) -> tuple[int, dict[str, int]]:
    """(peak bytes, parts) of :data:`STEPS` training steps of ``config`` on fake tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from fixres_dist.distributed import sharding

    sharded = needs_process_group(config)
    built = attrs.evolve(config, cpu_offload=False,  # offload: taken off afterwards (see the module docstring)
                         shard_group_size=shard_group(config) if config.sharding == "hybrid" else None)
    mesh = sharding.device_mesh(built, torch.device("cpu")) if sharded else None  # real: outside fake mode
    with FakeTensorMode(), _propagation_apart():
        model = _prepared_model(built, num_classes, mesh)
        optimizer = _optimizer(config, model)
        tracker = FSDPMemTracker(model, optimizer) if sharded else MemTracker()
        if not sharded:
            tracker.track_external(model, optimizer)
            _frozen_without_hooks(tracker, model)
        snapshot = _run_steps(config, model, optimizer, tracker)
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


def _prepared_model(config: TrainerConfig, num_classes: int, mesh):
    """The model as a run trains it (:class:`~fixres_dist.training.network.Network`): built at the
    training size, channels-last, the finetune's scope trainable, checkpointed and sharded."""

    from fixres_dist.distributed import sharding
    from fixres_dist.fixres import finetuning
    from fixres_dist.training.engine import AMP_DTYPES

    size = train_size(config)
    model = _fake_model(config, num_classes, size)
    if config.mode == "finetune":
        finetuning.freeze_for_finetune(model, size, config.finetune_scope, config.last_norm)
    finetuning.set_train_mode(model)
    if config.activation_checkpointing:
        sharding.checkpoint_activations(model)
    if mesh is not None:
        sharding.shard([model], mesh, config, AMP_DTYPES[config.amp])
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


def _run_steps(config: TrainerConfig, model, optimizer, tracker) -> dict:
    """:data:`STEPS` steps of :func:`fixres_dist.training.engine.train_step` under ``tracker``; its
    peak snapshot (category -> bytes) on the device where it was largest."""
    import torch

    from fixres_dist.distributed.fsdp_strategy import FullySharded
    from fixres_dist.distributed.strategy import SINGLE
    from fixres_dist.training import engine

    size = train_size(config)

    def batch():  # as the loader hands it over: uint8 images, int64 labels
        return torch.zeros(config.batch, 3, size, size, dtype=torch.uint8), torch.zeros(config.batch, dtype=torch.long)
    # On the CPU the step uses the loader's batch (made before the tracker: not counted); on CUDA it
    # copies it to the GPU first (made under the tracker: counted).
    images, labels = batch()
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # fp16's loss scale: a scalar
    strategy = FullySharded.of(model) if needs_process_group(config) else SINGLE
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
