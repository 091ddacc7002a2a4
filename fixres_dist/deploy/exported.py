"""A trained model ready to run: an export folder, or a project checkpoint read the same way.

An export folder (written by ``python -m fixres_dist.deploy.export CHECKPOINT OUT``) holds

* ``model.safetensors``: the network's state_dict (parameters and persistent buffers), exactly the keys
  of ``fixres_dist.models.architectures.build_model(**build)``;
* ``model.json`` (UTF-8): ``format`` (``fixres_dist.export``), ``version`` (1), ``architecture``,
  ``num_classes``, ``build`` (``build_model``'s keyword arguments but ``device``), ``class_names`` (the
  classifier's row order), ``input_size`` (the test resolution: the side of the centre crop, pixels),
  ``resize_size`` (the shorter side before the crop, pixels), ``crop_ratio``, ``interpolation``, ``mean``
  and ``std`` (3 floats each, on 0-1 pixel values), ``lineage`` (:mod:`fixres_dist.models.lineage`'s
  record), ``weights`` (``model`` or ``model_ema``), ``source`` (``checkpoint``, ``job_id``, ``epoch``)
  and ``files`` (file name -> SHA-256 hex of each file of the folder);
* ``model.onnx`` and ``model.pt2`` (the ONNX model and ``torch.export`` program; listed in ``files``).

:func:`read_export` checks a folder (its format and version, every file listed present, the safetensors'
SHA-256, its keys and shapes against the architecture's) and :func:`from_checkpoint` reads the same from
a checkpoint of this project (one file or sharded; its configuration gives the architecture, the test
resolution (``--test-size``, else the resolution it trained at) and the preprocessing, as the run
resolved them (:func:`fixres_dist.models.preprocessing.resolve`, with the configuration of its
``--weight-path`` file when that file is still there); the checkpoint records its class names and
lineage). Both return an :class:`ExportedModel`; :func:`open_model` takes either path.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
from torch import nn

from fixres_dist.config import INTERPOLATIONS
from fixres_dist.data import pipeline
from fixres_dist.data.shards import sha256
from fixres_dist.deploy import export
from fixres_dist.deploy.export import DESCRIPTION_FILE as METADATA_FILE
from fixres_dist.deploy.export import FORMAT, VERSION, WEIGHTS_FILE
from fixres_dist.errors import FixresError, first_line
from fixres_dist.models import architectures

# model.json's entries and their JSON types (bool is refused where int is wanted: see _check_types)
FIELDS = {"format": str, "version": int, "architecture": str, "num_classes": int, "build": dict,
          "class_names": list, "input_size": int, "resize_size": int, "crop_ratio": (int, float),
          "interpolation": str, "mean": list, "std": list, "lineage": dict, "weights": str, "source": dict,
          "files": dict}


@attrs.frozen
class ExportedModel:
    """A model and what its weights need (module docstring; the fields are ``model.json``'s, ``build_args``
    its ``build``). ``origin``: the folder or checkpoint it was read from, for messages; ``state_dict``:
    name -> CPU tensor, loaded by :meth:`build`."""

    architecture: str
    num_classes: int
    build_args: dict
    class_names: list[str]
    input_size: int
    resize_size: int
    crop_ratio: float
    interpolation: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    lineage: dict
    weights: str
    source: dict
    files: dict
    origin: str
    state_dict: dict = attrs.field(repr=False, eq=False)

    @property
    def normalization(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """``(mean, std)`` as :func:`fixres_dist.data.pipeline.normalize` takes it."""
        return self.mean, self.std

    def transform(self):
        """The test transform evaluation uses at :attr:`input_size`: resize the shorter side to
        :attr:`resize_size`, centre-crop :attr:`input_size`, to a uint8 (3, H, W) tensor
        (:func:`fixres_dist.data.pipeline.test_transform`); then :func:`fixres_dist.data.pipeline.normalize`
        with :attr:`normalization` on the batch."""
        return pipeline.test_transform(self.input_size, self.crop_ratio, self.interpolation)

    def build(self) -> nn.Module:
        """The network in eval mode on the CPU with these weights (``load_state_dict(strict=True)``), for
        :attr:`input_size` as evaluation runs it (a torchvision ViT built for another size gets its position
        embedding interpolated: :func:`fixres_dist.models.architectures.for_resolution`): float32
        normalised (B, 3, H, W) in, (B, num_classes) logits out. Raises :class:`FixresError` for weights that
        do not fit the architecture."""
        model = architectures.build_model(**self.build_args)
        try:
            model.load_state_dict(self.state_dict, strict=True)
        except RuntimeError as exc:
            raise FixresError(f"{self.origin}: the weights do not fit {self.architecture}: {first_line(exc)}") from None
        return architectures.for_resolution(model, self.input_size).eval()

    def metadata(self) -> dict:
        """``model.json``'s content (without ``files`` when none are recorded)."""
        entries = {name: getattr(self, "build_args" if name == "build" else name) for name in FIELDS
                   if name not in ("format", "version")}
        entries.update(mean=list(self.mean), std=list(self.std))
        return {"format": FORMAT, "version": VERSION, **entries}


def _check_types(entries: dict, where: str) -> None:
    missing = [name for name in FIELDS if name not in entries]
    if missing:
        raise FixresError(f"{where} lacks {', '.join(missing)}; export the checkpoint again")
    for name, kind in FIELDS.items():
        value = entries[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise FixresError(f"{where}: {name} is {value!r}, not a JSON {getattr(kind, '__name__', 'number')}")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_values(entries: dict, origin: str) -> None:
    """``model.json``'s preprocessing values, each usable: ``mean`` and ``std`` 3 finite numbers (``std``
    above 0), ``crop_ratio`` in (0, 1], ``input_size`` and ``resize_size`` at least 1, a known
    ``interpolation``. (``input_size`` has no upper bound: a FixRes test resolution may be any multiple of
    the training one, and a network runs at any size its memory allows.)"""
    for name in ("mean", "std"):
        values = entries[name]
        if len(values) != 3 or not all(_number(v) for v in values):
            raise FixresError(f"{origin}: {name} is {values!r}, not 3 finite numbers (one per RGB channel)")
    if not all(v > 0 for v in entries["std"]):
        raise FixresError(f"{origin}: std is {entries['std']!r}: each must be above 0 (images are divided by it)")
    if not (_number(entries["crop_ratio"]) and 0 < entries["crop_ratio"] <= 1):
        raise FixresError(f"{origin}: crop_ratio is {entries['crop_ratio']!r}, not in (0, 1]")
    for name in ("input_size", "resize_size"):
        if entries[name] < 1:
            raise FixresError(f"{origin}: {name} is {entries[name]!r}, not a size in pixels (at least 1)")
    if entries["interpolation"] not in INTERPOLATIONS:
        raise FixresError(f"{origin}: interpolation {entries['interpolation']!r} is none of "
                          f"{', '.join(INTERPOLATIONS)}")


def _model(entries: dict, state_dict: dict, origin: str) -> ExportedModel:
    """An :class:`ExportedModel` of ``model.json``'s ``entries``, checked against each other and against
    the architecture's keys and shapes (built on the meta device)."""
    if len(entries["class_names"]) != entries["num_classes"]:
        raise FixresError(f"{origin}: {len(entries['class_names'])} class names for {entries['num_classes']} classes")
    _check_values(entries, origin)
    if entries["resize_size"] != round(entries["input_size"] / entries["crop_ratio"]):
        raise FixresError(f"{origin}: resize_size {entries['resize_size']} is not input_size / crop_ratio "
                          f"({entries['input_size']} / {entries['crop_ratio']:g}, rounded)")
    build_args = {**entries["build"], "device": None}
    expected = {k: tuple(v.shape) for k, v in architectures.build_model(**{**build_args, "device": "meta"})
                .state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state_dict.items()}
    if expected != found:
        missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        other = [k for k in expected if k in found and expected[k] != found[k]]
        what = (f"missing {missing[0]}" if missing else f"unexpected {extra[0]}" if extra else
                f"{other[0]} has shape {found[other[0]]}, not {expected[other[0]]}")
        raise FixresError(f"{origin}: the weights do not fit {entries['architecture']} ({what})")
    values = {name: entries[name] for name in FIELDS if name not in ("format", "version", "build")}
    values.update(build_args={k: v for k, v in build_args.items() if k != "device"},
                  mean=tuple(entries["mean"]), std=tuple(entries["std"]), crop_ratio=float(entries["crop_ratio"]))
    return ExportedModel(**values, origin=origin, state_dict=state_dict)


def read_export(folder: str | Path) -> ExportedModel:
    """Read and check the export folder ``folder`` (module docstring). Raises :class:`FixresError` in one
    line for a missing folder or file, a ``model.json`` that is not one of this format and version, a
    SHA-256 that differs from the recorded one, values that cannot be used (:func:`_check_values`), or
    weights that do not fit the architecture."""
    folder = Path(folder)
    meta = folder / METADATA_FILE
    if not meta.is_file():
        raise FixresError(f"{folder} is not an export folder: it has no {METADATA_FILE}")
    try:
        entries = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FixresError(f"cannot read {meta}: {first_line(exc)}") from None
    if not isinstance(entries, dict) or entries.get("format") != FORMAT:
        found = entries.get("format") if isinstance(entries, dict) else type(entries).__name__
        raise FixresError(f"{meta} is not a {FORMAT} file (format {found!r})")
    if entries.get("version") != VERSION:
        raise FixresError(f"{meta} has {FORMAT} version {entries.get('version')!r}; this fixres_dist reads "
                          f"version {VERSION} (upgrade fixres_dist, or export again)")
    _check_types(entries, str(meta))
    listed = dict(entries["files"])
    if WEIGHTS_FILE not in listed:
        raise FixresError(f"{meta} lists no {WEIGHTS_FILE} among its files")
    absent = [name for name in listed if not (folder / name).is_file()]
    if absent:
        raise FixresError(f"export folder {folder} is missing {', '.join(absent)} (listed in {METADATA_FILE}); "
                          "export the checkpoint again")
    digest = sha256(folder / WEIGHTS_FILE)
    if digest != listed[WEIGHTS_FILE]:
        raise FixresError(f"{folder / WEIGHTS_FILE} has SHA-256 {digest[:12]}..., not the {listed[WEIGHTS_FILE][:12]}"
                          f"... {METADATA_FILE} records: changed or damaged since the export")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        state_dict = load_file(folder / WEIGHTS_FILE)
    except (SafetensorError, OSError) as exc:
        raise FixresError(f"cannot read {folder / WEIGHTS_FILE}: {first_line(exc)}") from None
    return _model(entries, state_dict, str(folder))


def from_checkpoint(path: str | Path, key: str = "model") -> ExportedModel:
    """A checkpoint of this project (one file or sharded) as an :class:`ExportedModel`: its ``key`` weights
    (``model``, or ``model_ema``), what an export of it holds (``files`` empty), read as the exporter reads
    it (:func:`fixres_dist.deploy.export.read_exportable`). Raises :class:`FixresError` for a file that is
    not such a checkpoint, one without ``key``, or one that records no class names (written before they
    were recorded)."""
    found = export.read_exportable(path, key)
    return _model({**found.description, "files": {}}, found.model.state_dict(), str(path))


def open_model(path: str | Path, key: str = "model") -> ExportedModel:
    """:func:`read_export` for a folder, :func:`from_checkpoint` (``key``'s weights) for a file. Raises
    :class:`FixresError` for a path that is neither, in one line."""
    path = Path(path)
    if path.is_dir():
        return read_export(path)
    if path.is_file():
        return from_checkpoint(path, key)
    raise FixresError(f"model {path} does not exist (give an export folder or a fixres_dist checkpoint)")

