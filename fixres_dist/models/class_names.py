"""Class identity: the class names weights were trained on, compared with the data's, and the
classifier's rows mapped by name.

Every checkpoint records the class names of its training data in label order (``classes``), so
the row of the classifier that scores a class travels with that class's name. When weights that
record them are loaded for data with other names or another order (:func:`map_head_rows`), the
head's rows follow the names: a class of both keeps its row, a class new to the weights gets the
model's own freshly initialised row, a class of the weights absent from the data is dropped; no
shared name at all is a new task, and the model keeps its fresh head. An evaluation needs a row for
every class of its data (:func:`check_evaluable`); a resumed run the same classes
(:func:`check_resumable`). Weights that record no names (torchvision's, timm's, older checkpoints)
are loaded as before.
"""
from __future__ import annotations

from typing import Sequence

import attrs
import torch

from fixres_dist.errors import FixresError

SHOWN = 3  # class names a message lists before "and N more"


def some(names: Sequence[str], most: int = SHOWN) -> str:
    """``"a, b, c and 4 more"``: the first ``most`` of ``names`` and how many others, for messages."""
    shown = ", ".join(names[:most])
    return f"{shown} and {len(names) - most} more" if len(names) > most else shown


@attrs.frozen
class ClassMatch:
    """The class names of some weights (``trained``, in their label order) against the data's
    (``data``, in its label order)."""

    trained: tuple[str, ...] = attrs.field(converter=tuple)
    data: tuple[str, ...] = attrs.field(converter=tuple)

    @property
    def same(self) -> bool:
        return self.trained == self.data

    @property
    def kept(self) -> list[str]:
        """The data's classes that the weights have a row for, in the data's order."""
        trained = set(self.trained)
        return [name for name in self.data if name in trained]

    @property
    def new(self) -> list[str]:
        """The data's classes that the weights have no row for."""
        trained = set(self.trained)
        return [name for name in self.data if name not in trained]

    @property
    def dropped(self) -> list[str]:
        """The weights' classes that the data does not have."""
        data = set(self.data)
        return [name for name in self.trained if name not in data]

    def differences(self) -> list[str]:
        """What differs, e.g. ``["1 new (sneaker)", "1 dropped (sandal)"]``, and whether the shared
        classes come in another order."""
        parts = [f"{len(names)} {what} ({some(names)})" for what, names in (("new", self.new),
                                                                           ("dropped", self.dropped)) if names]
        data = set(self.data)
        if [name for name in self.trained if name in data] != self.kept:
            parts.append("the shared classes in another order")
        return parts

    def rows(self) -> list[int | None]:
        """For each class of the data, in its order, the index of its row in the weights' head, or None."""
        index = {name: i for i, name in enumerate(self.trained)}
        return [index.get(name) for name in self.data]


@attrs.frozen
class Mapped:
    """What :func:`map_head_rows` did: ``note`` for the log (rows kept, new, dropped) or None;
    ``warning`` when no class name is shared (a new task: a fresh head), else None."""

    note: str | None = None
    warning: str | None = None

    @property
    def fresh_head(self) -> bool:
        return self.warning is not None


def map_head_rows(state: dict, own: dict, head: str | None, match: ClassMatch, source: str) -> Mapped:
    """Replace the rows of ``state``'s classifier ``head`` (``<head>.weight``, ``<head>.bias``: the
    weights, keyed as the model's ``own`` state_dict is) by rows in the data's class order: each class
    of both keeps its trained row, the others take ``own``'s (the model's fresh initialisation); with
    no shared class, all of them (a new head). ``state`` is changed in place; nothing is done when the
    lists are the same or ``state`` has no such head (the loader then reports what is missing).

    Raises :class:`FixresError` when the class lists differ and the model has no ``nn.Linear`` head
    (``head`` None) whose rows could follow them, or when the weights' head has another number of
    rows than the weights name classes (names that cannot be trusted).
    """
    if match.same:
        return Mapped()
    if head is None:
        raise FixresError(f"weights in {source} were trained on other classes than the data's "
                          f"({', '.join(match.differences())}), and this model has no nn.Linear classifier whose "
                          "rows could follow the class names")
    keys = [key for key in (f"{head}.weight", f"{head}.bias") if key in state and key in own]
    if f"{head}.weight" not in keys or state[f"{head}.weight"].dim() != 2:
        return Mapped()
    rows = state[f"{head}.weight"].shape[0]
    if rows != len(match.trained):
        raise FixresError(f"weights in {source} name {len(match.trained)} classes but their classifier {head} has "
                          f"{rows} rows: their class names do not describe their head")
    if not match.kept:
        for key in keys:
            state[key] = own[key].detach().clone()
        return Mapped(warning=f"the weights in {source} share no class name with the data (theirs: "
                      f"{some(match.trained)}; the data's: {some(match.data)}): a new task, so {head} is a fresh "
                      f"{len(match.data)}-class head{numbered_hint(match.data)}")
    picked = match.rows()
    have = torch.tensor([i is not None for i in picked])
    taken = torch.tensor([i for i in picked if i is not None])
    for key in keys:
        rows_of = own[key].detach().clone()
        rows_of[have] = state[key][taken].to(rows_of.dtype)
        state[key] = rows_of
    return Mapped(note=f"classifier rows of {head} mapped by class name: "
                       f"{', '.join([f'{len(match.kept)} kept', *match.differences()])}")


def numbered_hint(data: Sequence[str]) -> str:
    """For data whose classes are only numbers (shards indexed without ``--classes``): how to name them."""
    if data and all(name.isdigit() for name in data):
        return ("; the data's classes are numbers only: shards indexed without --classes (python -m "
                "fixres_dist.data.packing index FOLDER --classes FILE names them)")
    return ""


def check_evaluable(trained: Sequence[str] | None, data: Sequence[str], source: str) -> None:
    """``--eval-only``: every class of the data must have a row in the weights' head (a subset, or
    another order, is fine: the rows are picked by name). Nothing to check when the weights record
    no class names (``trained`` None). Raises a one-line :class:`FixresError` naming the data's classes
    the weights lack."""
    if trained is None:
        return
    missing = ClassMatch(trained, data).new
    if missing:
        raise FixresError(f"--eval-only: the weights in {source} have no classifier row for {len(missing)} of the "
                          f"data's {len(data)} classes ({some(missing)}); they were trained on {some(list(trained))}: "
                          f"evaluate them on data of their classes (or finetune them on these){numbered_hint(data)}")


def check_resumable(saved: Sequence[str] | None, data: Sequence[str], path, root) -> None:
    """A resumed run must see the classes its checkpoint at ``path`` was trained on, in the same order.
    Nothing to check when the checkpoint records none (``saved`` None: an older fixres_dist). Raises a
    one-line :class:`FixresError` naming the classes that differ in ``root``, the data folder."""
    if saved is None or tuple(saved) == tuple(data):
        return
    raise FixresError(f"{path} was trained on other classes than {root} holds now "
                      f"({', '.join(ClassMatch(saved, data).differences())}): "
                      "a resumed run must see the same data; restore the class folders, or start a new job from its "
                      f"weights with another --job-id and --weight-path {path}")
