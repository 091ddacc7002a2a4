"""The strategy benchmark's parallel layouts as short strings: ``ddp``, ``full``,
``hybrid:G`` (shard groups of G ranks: bare ``hybrid``, the Trainer's a node's ranks, would be ``full`` on
one machine, and is refused), ``tensor:N``, ``pipeline:N``, and combinations joined by ``+`` (``full+tensor:2``; the
Trainer refuses the ones it cannot run yet, and the benchmark shows why); each one's ``TrainerConfig``
fields (``--sharding``, ``--shard-group-size``, ``--tensor-parallel``, ``--pipeline-stages``), whether it
divides a number of ranks, and the :class:`~fixres_dist.distributed.layout.Layout` of those ranks (its
data-parallel ranks, its mesh in words). Nothing here imports torch."""
from __future__ import annotations

import argparse

import attrs

from fixres_dist.distributed.layout import Layout
from fixres_dist.errors import FixresError

GRAMMAR = "ddp, full, hybrid:G, tensor:N, pipeline:N, or several joined by + (e.g. full+tensor:2)"


@attrs.frozen
class BenchLayout:
    """One layout: ``sharding`` (``ddp``, ``full``, ``hybrid``), ``shard_group_size`` (hybrid's ranks per
    shard group; None for the others), ``model`` (the ranks of one model: a :class:`Layout` of its tensor
    group x its pipeline's stages, 1 x 1 for none); ``text``: its name in the table, as given. On a number of
    ranks, it is the :class:`Layout` :meth:`layout`."""

    text: str
    sharding: str = "ddp"
    shard_group_size: int | None = None
    model: Layout = Layout()

    def fields(self) -> dict:
        """The ``TrainerConfig`` fields that make this layout."""
        return {"sharding": self.sharding, "shard_group_size": self.shard_group_size,
                "tensor_parallel": self.model.tensor, "pipeline_stages": self.model.pipeline}

    def layout(self, ranks: int) -> Layout:
        """This layout on ``ranks`` ranks (:meth:`check` them first: :meth:`Layout.of_world` says why not in
        the Trainer's words, its flags')."""
        return Layout.of_world(ranks, sharding=self.sharding, shard_group=self.shard_group_size,
                               tensor=self.model.tensor, pipeline=self.model.pipeline)

    def data_parallel(self, ranks: int) -> int:
        """Ranks that see different images: ``ranks`` over those of one tensor group and pipeline."""
        return self.layout(ranks).data_parallel_size

    def check(self, ranks: int) -> None:
        """Raises :class:`FixresError` in one line where the layout's sizes do not divide ``ranks``."""
        if ranks % self.model.world:
            sizes = " x ".join(f"{n} {what}" for n, what, split in (
                (self.model.tensor, "tensor", self.model.tensor_enabled),
                (self.model.pipeline, "stages", self.model.pipeline_enabled)) if split)
            raise FixresError(f"--layouts {self.text}: {sizes} does not divide --ranks {ranks}")
        group = self.shard_group_size
        data = Layout.of_world(ranks, tensor=self.model.tensor, pipeline=self.model.pipeline).data_parallel_size
        if group is not None and data % group:
            raise FixresError(f"--layouts {self.text}: shard groups of {group} do not divide the "
                              f"{data} data-parallel ranks of --ranks {ranks}")

    def mesh(self, ranks: int) -> str:
        """The ranks' mesh in the words of the Trainer's logs, checkpoints and dry run
        (:meth:`fixres_dist.distributed.layout.Layout.describe`, less its ``"N ranks = "``): ``"2 data"``,
        ``"2 replicate x 2 shard"``, ``"2 data x 2 tensor"``, ``"2 stage"`` (an axis of 1 is left out)."""
        words = self.layout(ranks).describe()
        return words.partition(" = ")[2] or words


def _size(part: str, text: str) -> int:
    kind, _, number = part.partition(":")
    try:
        value = int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {kind} needs a whole number of ranks, as {kind}:2") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: {kind}:{value} must be at least 2 ({kind}:1 is ddp)")
    return value


def parse_layout(text: str) -> BenchLayout:
    """A :class:`BenchLayout` from its string; raises ``argparse.ArgumentTypeError`` (one line) for
    anything else."""
    fields: dict = {}
    for part in text.split("+"):
        kind = part.partition(":")[0]
        key = {"ddp": "sharding", "full": "sharding", "hybrid": "sharding", "tensor": "tensor",
               "pipeline": "pipeline"}.get(kind)
        if key is None or (kind in ("ddp", "full") and part != kind):
            raise argparse.ArgumentTypeError(f"unknown layout {text!r}: expected {GRAMMAR}")
        if key in fields:
            raise argparse.ArgumentTypeError(f"{text!r}: two {'shardings' if key == 'sharding' else kind + 's'}")
        if key == "sharding":
            fields["sharding"] = kind
            if kind == "hybrid" and part == kind:  # the Trainer's default, a node's ranks: all of them here
                raise argparse.ArgumentTypeError(f"{text!r}: give hybrid's shard group size, as hybrid:2 (its "
                                                 "default, a node's ranks, is every local rank here: that is full)")
            if kind == "hybrid":
                fields["shard_group_size"] = _size(part, text)
        else:
            fields[key] = _size(part, text)
    model = Layout(tensor=fields.pop("tensor", 1), pipeline=fields.pop("pipeline", 1))
    return BenchLayout(text, model=model, **fields)


def parse_layouts(text: str) -> list[BenchLayout]:
    """An argparse type: a comma-separated list of layouts, each once, in the order given."""
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise argparse.ArgumentTypeError("an empty list")
    if not all(items):
        raise argparse.ArgumentTypeError(f"{text!r}: an empty layout between commas")
    names = list(dict.fromkeys(items))
    return [parse_layout(name) for name in names]
