"""Will it fit: the estimate of the peak memory of the most loaded rank in a training step of any
layout, on the CPU before any rank starts (:func:`estimate`, its :class:`MemoryEstimate` in bytes),
the one estimate that the preflight's budget (:mod:`fixres_dist.training.memory_budget`), the table of
several choices (:mod:`fixres_dist.training.memory_table`) and the dry run of a layout
(:mod:`fixres_dist.training.dry_run`) all use.

Two routes, by layout. A model each rank holds whole or sharded (one rank, DDP, FSDP2 full or hybrid):
the run's own training step on fake tensors under torch's memory trackers
(:mod:`~fixres_dist.training.tracked_memory`: everything the step allocates, to within 1 % of a real
step's tensors). A model split over ranks (``--tensor-parallel``, ``--pipeline-stages``): each pipeline
stage's rank counted on the meta device (:mod:`~fixres_dist.training.split_memory`: parameters,
gradients and optimizer state exact, activations an upper bound), and the most loaded stage taken.
Either runs on a fake process group of the layout's ranks
(:func:`~fixres_dist.distributed.fake_group.fake_process_group`) when there is more than one and the
model is sharded or split. Seconds on a CPU, for any model size.

Not counted: what is no tensor (the CUDA context, allocator fragmentation: ``nvidia-smi`` shows more
than ``torch.cuda.max_memory_allocated``), communication libraries' own buffers (gloo's), and
``--compile``, ``--sync-bn`` and MixUp/CutMix, which change little. ``benchmarks/memory_estimate.py`` and
``tests/training/test_memory_of_layouts.py`` compare the estimate with measured peaks (docs/sharding.md).

A fake process group lives in its process until destroyed (:func:`fake_process_group` raises
RuntimeError in a process that has a process group); :func:`estimate` creates and destroys one unless
this process has one.
"""
from __future__ import annotations

import warnings

import attrs

from fixres_dist.config import TrainerConfig
from fixres_dist.distributed import layout
from fixres_dist.distributed.fake_group import fake_process_group
from fixres_dist.errors import first_line
from fixres_dist.training import split_memory, tracked_memory

__all__ = ["GIB", "METHOD", "MemoryEstimate", "estimate", "fake_process_group", "gib", "needs_process_group",
           "setting_line", "setting_words", "split_estimates", "split_step"]

GIB = 2 ** 30
METHOD = "torch's MemTracker/FSDPMemTracker on fake tensors, or on the meta device for a split model"


def number(size: float) -> str:
    """``size`` bytes as a number of GiB, three significant digits: ``"5.37"``, ``"0.0139"``, ``"140"``;
    below 0.001 GiB with its unit, where GiB would round it away: ``"0.977 MiB"``, below a MiB
    ``"524 bytes"`` (exact)."""
    value = size / GIB
    if value == 0:
        return "0"
    if value < 0.001:
        return f"{size / 2 ** 20:.3g} MiB" if size >= 2 ** 20 else f"{int(size):,} bytes"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def gib(size: float) -> str:
    """``size`` bytes in GiB, for messages: ``"5.37 GiB"`` (below 0.001 GiB: :func:`number`'s MiB or bytes)."""
    found = number(size)
    return found if found.endswith(("MiB", "bytes")) else f"{found} GiB"


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
        """``"parameters 0.10, gradients 0.10, optimizer state 0.10, activations 5.07 GiB"``; each with its
        unit where one is below 0.001 GiB (``"parameters 0.977 MiB, gradients 0.977 MiB, ..., activations
        0.012 GiB"``)."""
        parts = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer state", self.optimizer),
                 ("activations", self.activations)]
        if all(size == 0 or size >= GIB / 1000 for _, size in parts):
            return ", ".join(f"{name} {number(size)}" for name, size in parts) + " GiB"
        return ", ".join(f"{name} {gib(size)}" for name, size in parts)

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
    """Whether estimating ``config`` needs a (fake) process group: sharded or split on more than one rank."""
    return config.num_tasks > 1 and (config.sharding != "ddp" or layout.of(config).split)


def shard_group(config: TrainerConfig) -> int:
    """``--sharding hybrid``'s shard group (ranks): ``--shard-group-size``, else the ranks on a node
    as the launcher knows them (``LOCAL_WORLD_SIZE``, ``SLURM_NTASKS_PER_NODE``), else all ranks."""
    return config.shard_group_size or layout.ranks_per_node_hint(config.num_tasks)


def setting_words(config: TrainerConfig) -> str:
    """How ``config`` holds the model, in words: ``"full shard over 8 ranks and activation checkpointing"``."""
    ranks = config.num_tasks
    if ranks == 1:
        how = "the whole model on 1 rank"
    elif layout.of(config).split:
        how = f"the layout {layout.of(config).describe()}"
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


def split_step(config: TrainerConfig, num_classes: int) -> split_memory.SplitStep:
    """The step of ``config`` (a layout that splits the model) as :mod:`~fixres_dist.training.split_memory`
    estimates it: micro-batches of a pipeline (``--pipeline-microbatches``, default one per stage, virtual
    stages counted, as the run's) or of ``--grad-accum-steps``, the cut, the optimizer, a finetune's frozen
    layers, ``--model-ema``'s copy; CUDA's foreach step."""
    from fixres_dist.distributed.pipeline import virtual_stages

    found = layout.of(config)
    staged = found.pipeline_enabled
    frozen = (config.finetune_scope, config.last_norm) if config.mode == "finetune" else None
    return split_memory.SplitStep(
        found, config.architecture, num_classes, train_size(config), config.batch,
        microbatches=(config.pipeline_microbatches or found.pipeline * virtual_stages(config.pipeline_schedule))
        if staged else config.grad_accum_steps,
        schedule=config.pipeline_schedule if staged else "1f1b", cut=config.pipeline_split, opt=config.opt,
        momentum=config.momentum, frozen=frozen,
        foreach=config.device == "cuda", low_res_stem=config.low_res_stem,
        activation_checkpointing=config.activation_checkpointing, model_ema=config.model_ema)


def split_estimates(step: split_memory.SplitStep, setting: str) -> list[MemoryEstimate]:
    """One estimate (bytes per rank) for a rank of each pipeline stage of ``step`` (one, unstaged), each
    named ``"<the stage and its micro-batches in flight>; <setting>"``, counted on the meta device
    (:mod:`~fixres_dist.training.split_memory`). Needs this process' process group (a fake one) to have
    the layout's ranks: it builds the layout's mesh. Raises :class:`~fixres_dist.errors.FixresError` for a
    model that cannot be split so."""
    import torch

    mesh = step.layout.mesh("cpu")
    states = split_memory.states_per_parameter(step.opt, step.momentum)
    with torch.device("meta"):
        cut = split_memory.bounds(step)
        found = [split_memory.stage_parts(step, mesh, cut, stage, states) for stage in range(step.layout.pipeline)]
    return [MemoryEstimate("; ".join(filter(None, (where, setting))), sum(parts.values()), **parts)
            for where, parts in found]


def most_loaded(estimates: list[MemoryEstimate]) -> MemoryEstimate:
    """The estimate of the rank that needs the most (of one per pipeline stage)."""
    return max(estimates, key=lambda found: found.peak)


def estimate(config: TrainerConfig, num_classes: int) -> MemoryEstimate:
    """The peak memory (bytes) of the most loaded rank in a training step of ``config`` with
    ``num_classes`` classes, estimated in this process (module docstring): a layout that splits the model
    on the meta device, stage by stage (:func:`split_estimates`, the largest), any other by torch's
    trackers on fake tensors (:func:`~fixres_dist.training.tracked_memory.tracked_steps`). On more than
    one rank, when sharded or split, on a fake process group, created and destroyed here unless this
    process has one. Never raises for the model: a failure is an estimate without a peak, with the reason."""
    import torch.distributed as dist

    if needs_process_group(config) and not dist.is_initialized():
        with fake_process_group(config.num_tasks):
            return estimate(config, num_classes)
    label = setting_line(config)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if layout.of(config).split:
                largest = most_loaded(split_estimates(split_step(config, num_classes), ""))
                return attrs.evolve(largest, setting=f"{label}; the most loaded rank: {largest.setting}")
            peak, parts = tracked_memory.tracked_steps(config, num_classes, train_size(config),
                                                       needs_process_group(config), shard_group(config))
    except Exception as exc:  # any failure of the estimate: the job still starts, without one
        return MemoryEstimate(label, None, reason=f"{type(exc).__name__}: {first_line(exc)}"[:300])
    return MemoryEstimate(label, peak, **parts)
