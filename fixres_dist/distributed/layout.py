"""The parallel layout of a job, as one validated object: how many ranks replicate the data-parallel
model, shard it (FSDP2), split its matrices (tensor parallelism) and cut it into stages (pipeline
parallelism); each rank's place in it, its one device mesh with named axes, and its description.

A :class:`Layout` is four sizes whose product is the world size. Ranks are numbered with the tensor
axis innermost: ``rank = ((data x shard + shard index) x pipeline + stage) x tensor + tensor index``,
so a tensor group and a pipeline are consecutive ranks (as ``--tensor-parallel`` and
``--pipeline-stages`` promise) and a hybrid-shard group is consecutive data-parallel indexes. The
mesh's axes, outermost first, are :data:`AXES`: ``data`` (the replicas: DDP's ranks, or HSDP's
replicate groups), ``shard``, ``stage`` and ``tensor``; an axis of size 1 is kept, so that every
sub-mesh the strategies ask for exists. Importing this module does not import torch.
"""
from __future__ import annotations

import os

import attrs

from fixres_dist.errors import FixresError

AXES = ("data", "shard", "stage", "tensor")  # the device mesh's axes, outermost first
FIELDS = ("replicate", "shard", "pipeline", "tensor")  # the sizes of AXES' axes, in the same order
LAYOUT_KEY = "layout"  # a checkpoint's entry: Layout.to_dict (older checkpoints: read from their config)


def _size(instance, attribute, value) -> None:
    if type(value) is not int or value < 1:
        raise FixresError(f"Layout: {attribute.name} must be a whole number >= 1, not {value!r}")


@attrs.frozen
class Coordinates:
    """Where one rank sits: its index on each axis of the mesh (``data``: its replica, ``shard``: its
    place in a shard group, ``stage``: its pipeline stage, ``tensor``: its place in a tensor group), and
    ``data_rank``, which share of the data it reads (0 .. data-parallel size - 1)."""

    data: int
    shard: int
    stage: int
    tensor: int
    data_rank: int


@attrs.frozen
class Layout:
    """Ranks as ``replicate`` x ``shard`` data-parallel ranks (DDP: ``replicate`` = all of them; FSDP2
    full shard: ``shard`` = all of them; hybrid: both above 1), each holding a model split over
    ``tensor`` ranks (tensor parallelism) and cut into ``pipeline`` stages; every size a whole number
    >= 1 (else :class:`FixresError`). :meth:`of_world` builds one from the command line's flags and
    checks it against a world size."""

    replicate: int = attrs.field(default=1, validator=_size)
    shard: int = attrs.field(default=1, validator=_size)
    tensor: int = attrs.field(default=1, validator=_size)
    pipeline: int = attrs.field(default=1, validator=_size)

    @classmethod
    def of_world(cls, world: int, *, sharding: str = "ddp", shard_group: int | None = None, tensor: int = 1,
                 pipeline: int = 1) -> "Layout":
        """The layout of ``world`` ranks under ``--sharding`` (``ddp``, ``full`` or ``hybrid`` in shard
        groups of ``shard_group`` ranks, None: all of them), ``--tensor-parallel tensor`` and
        ``--pipeline-stages pipeline``. Raises a one-line :class:`FixresError` naming the flags when
        they do not divide ``world``."""
        if tensor < 1 or world % tensor:
            raise FixresError(f"--tensor-parallel {tensor} must divide the number of ranks ({world})")
        if pipeline < 1 or world % pipeline:
            raise FixresError(f"--pipeline-stages {pipeline} must divide the number of ranks ({world})")
        if world % (tensor * pipeline):
            raise FixresError(f"--tensor-parallel {tensor} x --pipeline-stages {pipeline} ({tensor * pipeline} ranks "
                              f"per model) must divide the number of ranks ({world})")
        data = world // (tensor * pipeline)
        if sharding == "ddp":
            return cls(replicate=data, tensor=tensor, pipeline=pipeline)
        if sharding == "full":
            return cls(shard=data, tensor=tensor, pipeline=pipeline)
        if sharding != "hybrid":
            raise FixresError(f"--sharding {sharding}: use ddp, full or hybrid")
        group = data if shard_group is None else shard_group
        if group < 1 or data % group:
            raise FixresError(f"--sharding hybrid: {data} data-parallel ranks do not split into shard groups of "
                              f"{group} (--shard-group-size, default the ranks per node)")
        return cls(replicate=data // group, shard=group, tensor=tensor, pipeline=pipeline)

    @property
    def world(self) -> int:
        """The number of ranks: the product of the four sizes."""
        return self.replicate * self.shard * self.tensor * self.pipeline

    @property
    def data_parallel_size(self) -> int:
        """How many ranks read different images (``replicate`` x ``shard``): the batch arithmetic's ranks."""
        return self.replicate * self.shard

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The device mesh's shape, axes :data:`AXES`."""
        return tuple(getattr(self, name) for name in FIELDS)

    @property
    def replicate_enabled(self) -> bool:
        return self.replicate > 1

    @property
    def shard_enabled(self) -> bool:
        return self.shard > 1

    @property
    def data_parallel_enabled(self) -> bool:
        return self.data_parallel_size > 1

    @property
    def tensor_enabled(self) -> bool:
        return self.tensor > 1

    @property
    def pipeline_enabled(self) -> bool:
        return self.pipeline > 1

    @property
    def split(self) -> bool:
        """Whether a rank holds less than the model's blocks whole (tensor or pipeline parallel)."""
        return self.tensor_enabled or self.pipeline_enabled

    def coordinates(self, rank: int) -> Coordinates:
        """``rank``'s :class:`Coordinates` (0 <= ``rank`` < :attr:`world`, else :class:`FixresError`)."""
        if not 0 <= rank < self.world:
            raise FixresError(f"rank {rank} is not one of the {self.world} ranks of {self.describe()}")
        rest, tensor = divmod(rank, self.tensor)
        data_rank, stage = divmod(rest, self.pipeline)
        data, shard = divmod(data_rank, self.shard)
        return Coordinates(data, shard, stage, tensor, data_rank)

    def data_rank(self, rank: int) -> int:
        """Which share of the data ``rank`` reads: the same for the ranks of one split model."""
        return self.coordinates(rank).data_rank

    def stage(self, rank: int) -> int:
        """``rank``'s pipeline stage (0 .. ``pipeline`` - 1)."""
        return self.coordinates(rank).stage

    def tensor_rank(self, rank: int) -> int:
        """``rank``'s place in its tensor group (0 .. ``tensor`` - 1)."""
        return self.coordinates(rank).tensor

    def counts_metrics(self, rank: int) -> bool:
        """Whether ``rank``'s sums (losses, hits, images) count in the job's totals: the first rank of its
        tensor group (the others computed the same) on the last stage of its pipeline (the others have no
        logits)."""
        where = self.coordinates(rank)
        return where.tensor == 0 and where.stage == self.pipeline - 1

    @property
    def totals_rank(self) -> int:
        """The first rank whose sums count (:meth:`counts_metrics`): it carries a resumed epoch's totals."""
        return (self.pipeline - 1) * self.tensor

    def rank_name(self, rank: int) -> str:
        """``rank R``, and where a split model puts it: ``rank 3 (stage 1 of pipeline 1)``,
        ``rank 2 (tensor group 1)``, or both."""
        where = self.coordinates(rank)
        parts = [f"stage {where.stage} of pipeline {where.data_rank}"] if self.pipeline_enabled else []
        if self.tensor_enabled:
            group = rank // self.tensor
            parts.append(f"tensor group {group}" if not parts else f"tensor rank {where.tensor}")
        return f"rank {rank} ({', '.join(parts)})" if parts else f"rank {rank}"

    def describe(self) -> str:
        """One phrase for log and failure lines: ``"4 ranks = 2 data x 2 tensor"``, ``"8 ranks = 2
        replicate x 4 shard"``, ``"1 rank"`` (the replicas are called ``data`` unless they also shard)."""
        if self.world == 1:
            return "1 rank"
        names = ("replicate" if self.shard_enabled else "data", "shard", "stage", "tensor")
        parts = [f"{size:,} {name}" for size, name in zip(self.shape, names) if size > 1]
        return f"{self.world:,} ranks = {' x '.join(parts)}"

    def data_ranks_words(self) -> str:
        """The ranks a gradient or a BatchNorm statistic is averaged over: ``"4 ranks"``, or ``"2
        data-parallel ranks"`` where the model is split."""
        return f"{self.data_parallel_size} {'data-parallel ' if self.data_parallel_size < self.world else ''}ranks"

    def split_words(self) -> str:
        """How the ranks split the model, for a resume line: ``" (2 ranks per tensor group)"``,
        ``" (2 pipeline stages)"``, both, or nothing."""
        parts = [f"{self.tensor} ranks per tensor group"] if self.tensor_enabled else []
        parts += [f"{self.pipeline} pipeline stages"] if self.pipeline_enabled else []
        return f" ({', '.join(parts)})" if parts else ""

    def same_roles(self, other: "Layout") -> bool:
        """Whether every rank of ``other`` has the same part here: as many ranks, the same tensor groups and
        pipeline stages (each rank then continues its own RNG streams and BatchNorm buffers). Sharding does
        not matter: every strategy's checkpoint holds the whole model."""
        return (self.world, self.tensor, self.pipeline) == (other.world, other.tensor, other.pipeline)

    def compare(self, before: "Layout") -> str | None:
        """None when ``before`` (a checkpoint's layout) is this one; else one line saying what changed,
        with both descriptions: ``"layout 4 ranks = 2 data x 2 tensor -> 2 ranks = 2 data: the same 2
        data-parallel ranks"``."""
        if before == self:
            return None
        data = (f"the same {before.data_parallel_size} data-parallel ranks"
                if before.data_parallel_size == self.data_parallel_size else
                f"data-parallel ranks {before.data_parallel_size} -> {self.data_parallel_size}")
        roles = "" if self.same_roles(before) else ", ranks in new roles"
        return f"layout {before.describe()} -> {self.describe()}: {data}{roles}"

    def to_dict(self) -> dict:
        """``{"replicate", "shard", "tensor", "pipeline"}``: what a checkpoint records (:data:`LAYOUT_KEY`)."""
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Layout":
        return cls(**{name: data[name] for name in FIELDS})

    @classmethod
    def saved(cls, recorded: dict | None, config: dict, ranks: int) -> "Layout":
        """The layout of the run that wrote a checkpoint: the ``recorded`` one (its :data:`LAYOUT_KEY`
        entry), or for a checkpoint written before there was one (``recorded`` None), rebuilt from its
        ``config`` (a dict: fields absent there take their defaults) and its number of ``ranks`` (a hybrid
        shard group not recorded: all ranks)."""
        if recorded:
            return cls.from_dict(recorded)
        return cls.of_world(ranks, sharding=config.get("sharding", "ddp") if ranks > 1 else "ddp",
                            shard_group=config.get("shard_group_size"), tensor=config.get("tensor_parallel", 1),
                            pipeline=config.get("pipeline_stages", 1))

    def mesh(self, device_type: str):
        """The job's one device mesh (``torch.distributed.device_mesh.DeviceMesh``) of shape :attr:`shape`,
        axes :data:`AXES`; the strategies take sub-meshes of it (e.g. ``mesh["data", "tensor"]``). A
        collective: every rank of the default process group (of :attr:`world` ranks) calls it."""
        from fixres_dist.distributed import collectives

        return collectives.device_mesh(device_type, self.shape, AXES)


def of(config, ranks_per_node: int | None = None) -> Layout:
    """The layout of a :class:`~fixres_dist.config.TrainerConfig`: its ``num_tasks``, ``--sharding``,
    ``--tensor-parallel`` and ``--pipeline-stages``. A hybrid shard group not given
    (``--shard-group-size``) is a node's ranks: ``ranks_per_node`` when known (the ranks have met), else as
    the launcher tells (:func:`ranks_per_node_hint`). One rank: nothing is sharded. Raises as
    :meth:`Layout.of_world`."""
    sharding, group = config.sharding if config.num_tasks > 1 else "ddp", config.shard_group_size
    if sharding == "hybrid" and group is None:
        group = ranks_per_node or ranks_per_node_hint(config.num_tasks)
    return Layout.of_world(config.num_tasks, sharding=sharding, shard_group=group, tensor=config.tensor_parallel,
                           pipeline=config.pipeline_stages)


def ranks_per_node_hint(world: int) -> int:
    """The ranks on a node as the launcher knows them before the ranks meet (``LOCAL_WORLD_SIZE``,
    ``SLURM_NTASKS_PER_NODE``; one that does not divide ``world`` is ignored), else all ``world`` ranks."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "").split("(")[0].split(",")[0]
        if value.isdigit() and int(value) >= 1 and world % int(value) == 0:
            return int(value)
    return world
