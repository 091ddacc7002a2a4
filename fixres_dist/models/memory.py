"""Will it fit: the peak memory of one rank in a training step, estimated on the CPU before any rank starts.

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

A fake process group lives in its process until destroyed, and the launcher must keep none: the
preflight (:func:`check_budget`) runs every estimate that needs one in a short-lived child process
(``python -m fixres_dist.models.memory --serve``). ``python -m fixres_dist.models.memory
--architecture resnet50 --input-size 224 --batch 64 --num-tasks 8`` prints the estimates of several
choices as a table (:func:`main`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import attrs

from fixres_dist.config import OPTIMIZERS, TrainerConfig
from fixres_dist.errors import FixresError, first_line, say

GIB = 2 ** 30
METHOD = "torch's MemTracker/FSDPMemTracker on fake tensors"
MODULE = "fixres_dist.models.memory"
CHILD_TIMEOUT_S = 600  # the child process of the preflight's estimates
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
    if config.shard_group_size:
        return config.shard_group_size
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "").split("(")[0].split(",")[0]
        if value.isdigit() and int(value) >= 1 and config.num_tasks % int(value) == 0:
            return int(value)
    return config.num_tasks


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
def fake_process_group(world: int):
    """A fake process group of ``world`` ranks (torch's ``fake`` backend: no communication; this
    process is rank 0), destroyed on exit, with ``sys.excepthook`` as it was. Raises RuntimeError when
    this process has a process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("this process already has a process group; estimate in a child process")
    excepthook = sys.excepthook  # init_process_group prefixes uncaught tracebacks with the rank, for good
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
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

    from fixres_dist.distributed import sharding
    from fixres_dist.training import engine

    size = train_size(config)

    def batch():  # as the loader hands it over: uint8 images, int64 labels
        return torch.zeros(config.batch, 3, size, size, dtype=torch.uint8), torch.zeros(config.batch, dtype=torch.long)
    # On the CPU the step uses the loader's batch (made before the tracker: not counted); on CUDA it
    # copies it to the GPU first (made under the tracker: counted).
    images, labels = batch()
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # fp16's loss scale: a scalar
    no_sync = (lambda: sharding.gradient_sync_off(model)) if needs_process_group(config) else None
    def forward(part):
        tracker.reset_mod_stats()  # the trackers record one forward per module (a micro-batch each); the peak stays
        return model(part)

    with tracker:
        if config.device == "cuda":
            images, labels = batch()
        for _ in range(STEPS):
            engine.train_step(forward, optimizer, scaler, images, labels, device=torch.device("cpu"),
                              world=config.num_tasks, amp=engine.AMP_DTYPES[config.amp],
                              channels_last=config.channels_last, label_smoothing=config.label_smoothing,
                              accumulation=config.grad_accum_steps, no_sync=no_sync,
                              clip_grad_norm=config.clip_grad_norm)
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


def _in_child(request: dict) -> dict:
    """``request`` answered by ``python -m fixres_dist.models.memory --serve`` (JSON in, JSON out), or
    ``{"error": line}``. The child sees no GPU: everything it runs is fake."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    try:
        done = subprocess.run([sys.executable, "-m", MODULE, "--serve"], input=json.dumps(request), env=env,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"the estimate took more than {CHILD_TIMEOUT_S} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the estimating process failed (exit status {done.returncode}): {tail}"[:300]}
    return json.loads(lines[-1])


def serve() -> None:
    """The child process of :func:`check_run`: one JSON request on stdin (a configuration, its number of
    classes and a budget in bytes), the :class:`Check` as one JSON line on stdout."""
    request = json.loads(sys.stdin.read())
    config = TrainerConfig.from_dict(request["config"])
    with fake_process_group(config.num_tasks):
        found = checked(config, request["num_classes"], request["budget"])
    sys.stdout.write(json.dumps(found.to_dict()) + "\n")


@attrs.frozen
class Fit:
    """The cheapest change of a run that fits a memory budget: ``change`` (its flags, e.g.
    ``--activation-checkpointing``) and ``estimate`` (what it needs); or ``change`` None and in
    ``estimate`` the least that was found, ``at`` that setting in words (``"batch 2 with full shard
    over 4 ranks and activation checkpointing"``), or None when nothing could be estimated."""

    change: str | None
    estimate: MemoryEstimate | None
    at: str = ""

    @classmethod
    def from_dict(cls, data: dict) -> "Fit":
        return cls(data["change"], MemoryEstimate(**data["estimate"]) if data["estimate"] else None, data["at"])


@attrs.frozen
class Check:
    """What the preflight found: ``first``, the estimate of the run as asked, and when that exceeds the
    budget, ``fit`` (:func:`find_fit`)."""

    first: MemoryEstimate
    fit: Fit | None = None

    def to_dict(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Check":
        return cls(MemoryEstimate(**data["first"]), Fit.from_dict(data["fit"]) if data["fit"] else None)


def alternatives(config: TrainerConfig) -> list[tuple[str, TrainerConfig]]:
    """The changes that lower the memory without changing the training, cheapest first, with their
    flags: activation checkpointing, full sharding (more than one rank), both; those the
    configuration refuses (e.g. a torchvision ViT sharded) are left out."""
    changes = []
    if not config.activation_checkpointing:
        changes.append(("--activation-checkpointing", {"activation_checkpointing": True}))
    if config.num_tasks > 1 and config.sharding != "full":
        changes.append(("--sharding full", {"sharding": "full", "shard_group_size": None}))
        if not config.activation_checkpointing:
            changes.append(("--sharding full --activation-checkpointing",
                            {"sharding": "full", "shard_group_size": None, "activation_checkpointing": True}))
    found = []
    for flags, fields in changes:
        with contextlib.suppress(FixresError):
            found.append((flags, attrs.evolve(config, **fields)))
    return found


def find_fit(config: TrainerConfig, num_classes: int, budget: int, first: MemoryEstimate) -> Fit:
    """The cheapest change of ``config`` (whose estimate ``first`` exceeds ``budget`` bytes) that fits:
    the :func:`alternatives` in order, then halving the batch with the one that needed the least
    memory (a batch whose estimate, predicted from the activations' share, is still too large is
    not estimated; batch 2 always is). In this process: a sharded alternative on more than one rank
    needs its fake process group (:func:`fake_process_group`)."""
    least, least_flags, least_config = first, "", config
    for flags, candidate in alternatives(config):
        found = estimate(candidate, num_classes)
        if found.fits(budget):
            return Fit(flags, found)
        if found.known and (not least.known or found.peak < least.peak):
            least, least_flags, least_config = found, flags, candidate
    if not least.known:
        return Fit(None, None)
    fixed = least.parameters + least.gradients + least.optimizer
    per_image = least.activations / least_config.batch
    batch = least_config.batch // 2
    while batch >= 2:
        if batch == 2 or fixed + per_image * batch <= budget:
            least = estimate(attrs.evolve(least_config, batch=batch), num_classes)
            if least.fits(budget):
                return Fit(" ".join([f"--batch {batch}", least_flags]).strip(), least)
            least_config = attrs.evolve(least_config, batch=batch)
        batch //= 2
    return Fit(None, least, f"batch {least_config.batch} with {setting_words(least_config)}")


def checked(config: TrainerConfig, num_classes: int, budget: int) -> Check:
    """Estimate ``config``; when it exceeds ``budget`` bytes, :func:`find_fit`. In this process (see there)."""
    first = estimate(config, num_classes)
    if not first.known or first.fits(budget):
        return Check(first)
    return Check(first, find_fit(config, num_classes, budget, first))


def check_run(config: TrainerConfig, num_classes: int, budget: int) -> Check:
    """:func:`checked`, leaving this process without a process group: on one rank here; on more, where
    the run or the search for a change needs a fake process group, in a short-lived child process
    (a DDP run that fits is estimated here). A child that fails gives an estimate without a peak,
    with the reason."""
    if config.num_tasks == 1:
        return checked(config, num_classes, budget)
    if not needs_process_group(config):
        first = estimate(config, num_classes)
        if not first.known or first.fits(budget):
            return Check(first)
    answer = _in_child({"config": config.to_dict(), "num_classes": num_classes, "budget": budget})
    if "error" in answer:
        return Check(MemoryEstimate(setting_line(config), None, reason=answer["error"]))
    return Check.from_dict(answer)


def budget_bytes(config: TrainerConfig) -> tuple[int, str] | None:
    """The memory a rank may use (bytes) and its source in words: ``--memory-budget`` (GiB), else on
    CUDA the GPU's memory (``torch.cuda.get_device_properties(device).total_memory``), else None (a
    CPU run without ``--memory-budget`` is not checked)."""
    if config.memory_budget is not None:
        return int(config.memory_budget * GIB), f"the budget of {config.memory_budget:g} GiB per rank (--memory-budget)"
    if config.device != "cuda":
        return None
    import torch

    from fixres_dist.distributed import placement

    device = placement.cuda_device(config.local_rank)
    properties = torch.cuda.get_device_properties(device)
    return properties.total_memory, f"the {gib(properties.total_memory)} of {device} ({properties.name})"


def check_budget(config: TrainerConfig, num_classes: int) -> MemoryEstimate | None:
    """The preflight's check: estimate a training run of ``config`` against :func:`budget_bytes` (None,
    and nothing estimated, for ``--eval-only`` or a CPU run without ``--memory-budget``). Says the
    estimate in one line on stderr; raises a one-line :class:`FixresError` when it exceeds the budget,
    naming the cheapest change that fits (:func:`find_fit`) or saying that none does. Without an
    estimate (the fake route failed), says why and lets the run start."""
    budget = None if config.eval_only else budget_bytes(config)
    if budget is None:
        return None
    limit, source = budget
    found = check_run(config, num_classes, limit)
    first, fit = found.first, found.fit
    if not first.known:
        say(f"fixres_dist: warning: {first.describe()}; starting without checking {source}")
        return first
    if fit is None:
        say(f"fixres_dist: memory: an estimated {first.describe()}, within {source} ({METHOD})")
        return first
    needs = f"{config.architecture} needs an estimated {gib(first.peak)} per rank ({first.breakdown()}) " \
            f"at batch {config.batch} with {setting_words(config)}"
    if fit.change is not None:
        raise FixresError(f"{needs}, more than {source}; the cheapest change that fits: {fit.change} "
                          f"({gib(fit.estimate.peak)} per rank; {METHOD})")
    if fit.estimate is None or not fit.estimate.known:
        raise FixresError(f"{needs}, more than {source}; no other setting could be estimated")
    raise FixresError(f"no change of batch, sharding or checkpointing meets {source}: {needs}, and still "
                      f"{gib(fit.estimate.peak)} even at {fit.at} ({METHOD}); give it more memory, more ranks to "
                      "shard over or a smaller --input-size")


PROG = f"python -m {MODULE}"


class OneLineParser(argparse.ArgumentParser):
    """argparse with a usage error in one line on stderr, ``<prog>: error: <message>``, exit status 2."""

    def error(self, message: str):
        say(f"{self.prog}: error: {message}")
        raise SystemExit(2)


def count(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="The estimated peak memory per rank (GiB) of a training step, for DDP, "
                      "full and hybrid sharding, with and without activation checkpointing: torch's MemTracker/"
                      "FSDPMemTracker on fake tensors, in seconds on a CPU (docs/sharding.md, 'Will it fit').")
    p.add_argument("--architecture", help="model name, as main_scratch.py's --architecture (required)")
    p.add_argument("--input-size", type=count, metavar="PX", help="training resolution in pixels (required)")
    p.add_argument("--batch", type=count, default=64, help="images per rank per step (default: %(default)s)")
    p.add_argument("--num-tasks", type=count, default=1, help="ranks (default: %(default)s)")
    p.add_argument("--num-classes", type=count, default=1000, help="classes (default: %(default)s)")
    p.add_argument("--amp", choices=("bf16", "fp16", "off"), default="off", help="mixed precision (default: off)")
    p.add_argument("--opt", choices=OPTIMIZERS, default="sgd", help="optimizer (default: sgd)")
    p.add_argument("--shard-group-size", type=count, metavar="N",
                   help="also a row for hybrid sharding in groups of N ranks")
    p.add_argument("--low-res-stem", action="store_true", help="torchvision ResNets' 3x3 stride-1 stem")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help="the device trained on: on cuda the optimizer is torch's foreach one (default: cuda when "
                        "available, else cpu)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the preflight's child process
    return p


def table_rows(args: argparse.Namespace) -> list[tuple[str, TrainerConfig | str]]:
    """(label, configuration or why the configuration refuses it) for each row of the table. Raises
    :class:`FixresError` for bad input: an unknown architecture, a size it cannot train at, a batch
    or group size that cannot be."""
    from fixres_dist.models import architectures, resolutions

    architectures.check_architecture(args.architecture, args.low_res_stem)
    architectures.check_resolution(args.architecture, args.input_size)
    if args.shard_group_size and args.num_tasks % args.shard_group_size:
        raise FixresError(f"--shard-group-size {args.shard_group_size} does not divide --num-tasks {args.num_tasks}")
    base = TrainerConfig(architecture=args.architecture, input_size=args.input_size, batch=args.batch,
                         num_tasks=args.num_tasks, amp=args.amp, opt=args.opt, device=args.device,
                         low_res_stem=args.low_res_stem)
    probe = resolutions.Probe(args.architecture, args.num_classes, args.input_size, low_res_stem=args.low_res_stem,
                              batch=args.batch)
    resolutions.check_sizes(probe, [args.input_size], [])
    choices = [("ddp", {}), ("ddp + AC", {"activation_checkpointing": True})]
    if args.num_tasks > 1:
        choices += [("full", {"sharding": "full"}),
                    ("full + AC", {"sharding": "full", "activation_checkpointing": True})]
    if args.shard_group_size and args.num_tasks > 1:
        choices.append((f"hybrid ({args.shard_group_size})", {"sharding": "hybrid",
                                                               "shard_group_size": args.shard_group_size}))
    rows: list[tuple[str, TrainerConfig | str]] = []
    for label, fields in choices:
        try:
            rows.append((label, attrs.evolve(base, **fields)))
        except FixresError as exc:
            rows.append((label, str(exc)))
    return rows


def table(args: argparse.Namespace, rows: list[tuple[str, TrainerConfig | str]]) -> str:
    """The estimates of ``rows`` (:func:`table_rows`) as a text table, GiB per rank."""
    ranks = f"{args.num_tasks} ranks" if args.num_tasks > 1 else "1 rank (nothing to shard)"
    lines = [f"{args.architecture} at {args.input_size} px, batch {args.batch} per rank, {ranks}, {args.opt}, "
             f"amp {args.amp}, {args.num_classes} classes, on {args.device}: peak memory per rank in GiB ({METHOD})",
             f"{'choice':<14}{'peak':>8}{'params':>9}{'grads':>9}{'optim':>9}{'activ':>9}"]
    for label, config in rows:
        found = estimate(config, args.num_classes) if isinstance(config, TrainerConfig) else None
        if found is not None and found.known:
            sizes = (found.peak, found.parameters, found.gradients, found.optimizer, found.activations)
            lines.append(f"{label:<14}{sizes[0] / GIB:>8.3f}" + "".join(f"{s / GIB:>9.3f}" for s in sizes[1:]))
        else:
            lines.append(f"{label:<14}  no estimate: {found.reason if found is not None else config}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m fixres_dist.models.memory``: the table of :func:`table` on stdout; bad input in one
    line on stderr (exit status 2 for a usage error, 1 for a model or size that cannot be)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return
    if not args.architecture or args.input_size is None:
        parser.error("--architecture and --input-size are required")
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        rows = table_rows(args)
    except FixresError as exc:
        say(f"{PROG}: {exc}")
        raise SystemExit(1) from None
    print(table(args, rows), flush=True)


if __name__ == "__main__":
    main()
