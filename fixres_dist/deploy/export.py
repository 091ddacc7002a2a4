"""The export folder: a checkpoint's network, ready to run elsewhere at its test resolution.

``python -m fixres_dist.deploy.export CHECKPOINT OUT [--weight-key model|model_ema]`` (or
:func:`export_folder`; ``--export`` of the scripts after a run) reads any checkpoint the project writes
(one file, DDP's; a ``--sharding full/hybrid`` pair of ``.pth`` and shards folder, read whole in this
process; tensor-parallel and pipeline runs write one file of whole tensors already) and writes the new
folder ``OUT`` with four files:

* ``model.safetensors``: the network's ``state_dict`` (parameters and persistent buffers; floating
  tensors float32), with exactly the keys of ``build_model(**json["build"])``
  (:func:`fixres_dist.models.architectures.build_model`): for torchvision and timm architectures those of
  ``torchvision.models.get_model(name, num_classes=N)`` / ``timm.create_model(name, num_classes=N)``.
  BatchNorm statistics are the average over the ranks (:func:`fixres_dist.training.checkpoint.rank_buffers`).
* ``model.json`` (UTF-8, indent 2): what the weights need: architecture and build arguments, class
  names in the classifier's row order (:mod:`fixres_dist.models.class_names`), the test resolution
  (``input_size``: the run's ``--test-size``, else its training resolution, as its evaluation used), the
  test transform's ``resize_size``, ``crop_ratio``, ``interpolation``, ``mean``/``std`` on 0-1 pixel values
  (:func:`fixres_dist.models.preprocessing.resolve`, as the run resolved them), the train-resolution
  lineage (:mod:`fixres_dist.models.lineage`), which weights, the source checkpoint, and each file's
  SHA-256. The test transform it describes is :func:`fixres_dist.data.pipeline.test_transform` then
  :func:`fixres_dist.data.pipeline.normalize`: shorter side to ``resize_size``, centre crop
  ``input_size``, 0-1 floats, ``(x - mean) / std``.
* ``model.onnx``: input ``images`` (B, 3, input_size, input_size) float32, normalised; output ``logits``
  (B, num_classes) float32; the batch axis dynamic (``batch``), the spatial size fixed. Written by
  ``torch.onnx.export(..., dynamo=True)`` from the same ``torch.export`` program as ``model.pt2`` (one
  trace for both; the TorchScript exporter is deprecated): one self-contained file (no external data,
  so a model under protobuf's 2 GiB).
* ``model.pt2``: :func:`torch.export.save` of the eval-mode network, batch dynamic (1 or more), the
  same input and output (:func:`torch.export.load`, then ``.module()``).

Atomic: everything is written into a hidden sibling ``.OUT.<host>.<pid>.partial`` and renamed to ``OUT``
once complete; on any failure (a full disk mid-ONNX included) the partial folder is removed, so ``OUT``
is whole or absent (each file is serialised in memory, then written by :func:`fixres_dist.io.write_private`,
so a full disk is one OSError whichever file it hits); partial folders of ``OUT`` that a killed export of
this host left (their process gone) are removed by the next export to ``OUT``. Ctrl-C (SIGINT) is one
line, exit status 130, nothing written. ``OUT`` existing is refused, never overwritten. Owner-only, as
every file the project writes. Bad input (not a checkpoint of this project, a torch.export program, no
``model_ema`` when asked, an incomplete sharded checkpoint, ``OUT`` empty, existing or its folder unwritable)
is one :class:`~fixres_dist.errors.FixresError` line.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import sys
import warnings
import zipfile
from io import BytesIO
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import attrs
import torch

from fixres_dist import arguments, io
from fixres_dist.data import pipeline
from fixres_dist.data.shards import sha256
from fixres_dist.distributed import checkpoint_shards
from fixres_dist.errors import FixresError, FixresWarning, first_line
from fixres_dist.models import architectures, lineage, preprocessing, weights
from fixres_dist.training import checkpoint

FORMAT, VERSION = "fixres_dist.export", 1
WEIGHTS_FILE, DESCRIPTION_FILE, ONNX_FILE, PROGRAM_FILE = "model.safetensors", "model.json", "model.onnx", "model.pt2"
ENTRIES = ("model", "model_ema")  # --weight-key: the trained weights, or their moving average (--model-ema)
INPUT_NAME, OUTPUT_NAME, BATCH_AXIS = "images", "logits", "batch"
PARTIAL = ".partial"
PREPROCESSING_FIELDS = ("mean", "std", "crop_ratio", "interpolation")  # a run's overrides (None: not given)
RUN_FOLDER = "export"  # --export: the export folder in the job folder, written after the run ends
EXAMPLE_BATCH = 2  # the traced batch: torch.export specialises a batch of 1
ZIP_MAGIC = b"PK\x03\x04"  # how every file torch.save writes begins (its zip format, torch 1.6 on)
PROGRAM_MARKER = "/archive_format"  # an entry of every torch.export.save archive, of no torch.save file
INTERRUPTED = 130  # the exit status of a command stopped by SIGINT (128 + 2), as a shell reports it


@attrs.frozen
class Exportable:
    """A checkpoint's network as the folder holds it: ``model`` (eval mode, float32, built by
    ``build_model(**build)`` and loaded strictly) and ``description`` (model.json without ``files``)."""

    model: torch.nn.Module
    build: dict
    description: dict


def _weights(path: Path, state: dict, key: str) -> dict[str, torch.Tensor]:
    """``state``'s ``key`` weights with the ranks' BatchNorm statistics averaged, floating tensors float32."""
    found = state.get(key)
    if found is None:
        raise FixresError(f"{path} has no {key} weights (a run without --model-ema keeps none)" if key == "model_ema"
                          else f"{path} has no {key} entry")
    if key == "model_ema" and (state.get("model_ema_state") or {}).get("updates") == 0:
        raise FixresError(f"{path}'s model_ema was never updated (the run trained fewer than --model-ema-steps "
                          "steps): it holds the starting weights; export its trained weights (--weight-key model)")
    per_rank = "ema_buffers" if key == "model_ema" else "buffers"
    ranks = state.get("ranks") or []
    averaged = checkpoint.rank_buffers(ranks, None, per_rank) if ranks and all(per_rank in r for r in ranks) else {}
    return {name: t.float() if t.is_floating_point() else t for name, t in {**found, **averaged}.items()}


def _weights_run_config(config: dict, warn: Callable[[str], None]) -> dict | None:
    """The configuration of the checkpoint a run started from (``--weight-path``), whose preprocessing
    overrides the run inherited (:func:`fixres_dist.models.preprocessing.resolve`), or None. ``warn``s when
    that file is gone and the run left a preprocessing field to it."""
    source = config.get("weight_path")
    if not isinstance(source, str):
        return None
    try:
        saved = io.safe_load(source, "weight file")
    except FixresError as exc:
        open_fields = [f for f in PREPROCESSING_FIELDS if config.get(f) is None]
        if open_fields:
            warn(f"{', '.join(open_fields)}: the architecture's, as the run's --weight-path {source}, whose "
                 f"overrides it would have inherited, cannot be read ({first_line(exc)})")
        return None
    return saved.get("config") if isinstance(saved, dict) and isinstance(saved.get("config"), dict) else None


def _sizes(path: Path, state: dict, config: dict) -> tuple[int, int]:
    """``(trained at, test resolution)`` in pixels: the checkpoint's training resolution, and ``--test-size``
    or else that (as the run's evaluation, :meth:`fixres_dist.training.state.TrainState.eval_size`)."""
    trained = state.get("input_size") or config.get("input_size")
    if not isinstance(trained, int) or isinstance(trained, bool):
        raise FixresError(f"{path} records no training resolution (input_size {trained!r})")
    return trained, config.get("test_size") or trained


def _check_format(path: Path) -> None:
    """A file that is not a PyTorch zip file (safetensors, ONNX, ...): FixresError before torch reads it;
    a truncated or damaged checkpoint is left to :func:`fixres_dist.training.checkpoint.load_checkpoint`."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(ZIP_MAGIC))
    except OSError:  # missing, a folder: load_checkpoint says which
        return
    if head and head != ZIP_MAGIC:
        raise FixresError(f"{path} is not a fixres_dist checkpoint: another format (a checkpoint is a PyTorch zip "
                          "file, as torch.save writes it)")
    if head and _is_program(path):
        raise FixresError(f"{path} is a torch.export program (an export's {PROGRAM_FILE}), not a fixres_dist "
                          "checkpoint: export the checkpoint it came from")


def _is_program(path: Path) -> bool:
    """Whether the zip file at ``path`` is a :func:`torch.export.save` archive (its ``archive_format`` entry)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith(PROGRAM_MARKER) for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):  # truncated or damaged: load_checkpoint says so
        return False


def _warning(line: str) -> None:
    warnings.warn(line, FixresWarning, stacklevel=4)


def read_exportable(path: str | Path, weight_key: str = "model", warn: Callable[[str], None] = _warning) -> Exportable:
    """The network of the checkpoint at ``path`` (one file or sharded), its ``weight_key`` weights loaded,
    at its test resolution, and what model.json says of it (the module docstring). Raises
    :class:`FixresError` for a file that is not a complete checkpoint of this project, an incomplete or
    damaged sharded one, no ``weight_key`` weights, no class names (written before checkpoints recorded
    them), or weights that do not fit the architecture it names. ``warn``: what to do with a warning line
    (default: a :class:`~fixres_dist.errors.FixresWarning`)."""
    path = Path(path)
    if weight_key not in ENTRIES:
        raise FixresError(f"--weight-key {weight_key!r}: use one of {', '.join(ENTRIES)}")
    _check_format(path)
    state = checkpoint_shards.with_full_tensors(path, checkpoint.load_checkpoint(path))
    config = state["config"]
    state_dict = _weights(path, state, weight_key)
    classes = state.get("classes")
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
        raise FixresError(f"{path} records no class names (written by an older fixres_dist): an export names the "
                          "class of each output; finetune or evaluate it with this version first")
    trained, size = _sizes(path, state, config)
    build = {"name": config["architecture"], "num_classes": len(classes), "image_size": trained,
             "low_res_stem": bool(config.get("low_res_stem"))}
    model = architectures.build_model(**build)
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as exc:
        raise FixresError(f"{path}'s {weight_key} weights do not fit a {build['name']} of {len(classes)} classes: "
                          f"{first_line(exc)}") from None
    if architectures.for_resolution(model, size) is not model:  # a torchvision ViT: its embedding resampled
        resampled = architectures.for_resolution(model, size).state_dict()
        build["image_size"] = size
        model = architectures.build_model(**build)
        model.load_state_dict(resampled)
    fields = SimpleNamespace(**{f: config.get(f) for f in ("architecture", *PREPROCESSING_FIELDS)})
    prep = preprocessing.resolve(fields, _weights_run_config(config, warn))
    record = weights.WeightFile(str(path), {}, weight_key, config=config, lineage=state.get("lineage"))
    origin = lineage.of_weights(record)  # its record, or for older checkpoints what their configurations say
    description = {
        "format": FORMAT, "version": VERSION, "architecture": build["name"], "num_classes": len(classes),
        "build": build, "class_names": list(classes), "input_size": size,
        "resize_size": pipeline.resize_size(size, prep.crop_ratio), "crop_ratio": float(prep.crop_ratio),
        "interpolation": prep.interpolation, "mean": [float(v) for v in prep.mean], "std": [float(v) for v in prep.std],
        "lineage": origin.record(), "weights": weight_key,
        "source": {"checkpoint": str(path.resolve()), "job_id": config.get("job_id"), "epoch": state.get("epoch")}}
    return Exportable(model.eval(), build, description)


def program(model: torch.nn.Module, size: int) -> torch.export.ExportedProgram:
    """``torch.export.export`` of eval-mode ``model`` on (B, 3, ``size``, ``size``) float32 images, B dynamic."""
    example = torch.zeros(EXAMPLE_BATCH, 3, size, size)
    with torch.no_grad():
        return torch.export.export(model, (example,), dynamic_shapes=({0: torch.export.Dim(BATCH_AXIS, min=1)},))


def _onnx_bytes(exported: torch.export.ExportedProgram, size: int) -> bytes:
    """``exported`` as one serialised ONNX model (no external data): input ``images``, output ``logits``,
    batch axis ``batch``."""
    try:
        import onnx_ir
    except ImportError:
        raise FixresError("the ONNX export needs onnx and onnxscript: pip install -e .[deploy]") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onnx_program = torch.onnx.export(exported, (torch.zeros(EXAMPLE_BATCH, 3, size, size),), None,
                                         input_names=[INPUT_NAME], output_names=[OUTPUT_NAME], dynamo=True,
                                         external_data=False, verbose=False)
    graph = onnx_program.model.graph
    for value in (graph.inputs[0], graph.outputs[0]):
        value.shape = onnx_ir.Shape([BATCH_AXIS, *value.shape[1:]])  # the exporter's own name: s0, s77, ...
    return onnx_ir.to_proto(onnx_program.model).SerializeToString()


def _serialised(what: str, serialise: Callable[[], bytes]) -> bytes:
    """``serialise()``'s bytes, made in memory so that only the package's own writer touches the disk (a full
    disk is then one OSError: torch's zip writer and safetensors raise their own types, or abort)."""
    try:
        return serialise()
    except Exception as exc:
        raise FixresError(f"cannot serialise {what}: {type(exc).__name__}: {first_line(exc)}") from None


def _program_bytes(exported: torch.export.ExportedProgram) -> bytes:
    buffer = BytesIO()
    torch.export.save(exported, buffer)
    return buffer.getvalue()


def _write(exportable: Exportable, folder: Path) -> None:
    """The four files into ``folder`` (the partial one), each serialised in memory first and written by
    :func:`fixres_dist.io.write_private`. Raises OSError (a full disk included), FixresError."""
    from safetensors.torch import save

    model, size = exportable.model, exportable.description["input_size"]
    tensors = {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()}
    io.write_private(folder / WEIGHTS_FILE, _serialised(WEIGHTS_FILE, lambda: save(tensors, metadata={"format": "pt"})))
    try:
        exported = program(model, size)
    except Exception as exc:  # torch.export raises many types for what it cannot trace
        raise FixresError(f"torch.export cannot trace {exportable.build['name']}: {type(exc).__name__}: "
                          f"{first_line(exc)}") from None
    io.write_private(folder / PROGRAM_FILE, _serialised(PROGRAM_FILE, lambda: _program_bytes(exported)))
    try:
        onnx = _onnx_bytes(exported, size)
    except FixresError:
        raise
    except Exception as exc:  # the exporter's own failures: unsupported operators, ...
        raise FixresError(f"cannot export {exportable.build['name']} to ONNX: {type(exc).__name__}: "
                          f"{first_line(exc)}") from None
    io.write_private(folder / ONNX_FILE, onnx)
    files = {name: sha256(folder / name) for name in (WEIGHTS_FILE, ONNX_FILE, PROGRAM_FILE)}
    io.write_private(folder / DESCRIPTION_FILE, json.dumps({**exportable.description, "files": files}, indent=2,
                                                           ensure_ascii=False) + "\n")


def partial_name(out: Path) -> Path:
    """The hidden sibling folder ``out`` is written in before its rename."""
    return out.with_name(f".{out.name}.{socket.gethostname()}.{os.getpid()}{PARTIAL}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process, alive
        return True
    return True


def remove_stale_partials(out: Path) -> None:
    """Remove the partial folders of ``out`` (:func:`partial_name`) that a killed export of this host left:
    those whose process is gone. Other hosts' (a shared folder) are left, their processes unknown here."""
    prefix = f".{out.name}.{socket.gethostname()}."
    for found in out.parent.glob(f".{glob.escape(out.name)}.*{PARTIAL}"):
        pid = found.name[len(prefix):-len(PARTIAL)] if found.name.startswith(prefix) else ""
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(found, ignore_errors=True)


def export_folder(checkpoint_path: str | Path, out: str | Path, weight_key: str = "model",
                  warn: Callable[[str], None] = _warning) -> Path:
    """Write the export folder ``out`` (the module docstring) of the checkpoint at ``checkpoint_path``,
    its ``weight_key`` weights (``model``, or ``model_ema``: their moving average); returns ``out``.
    ``warn``: what to do with a warning line (:func:`read_exportable`).

    Raises :class:`FixresError` (one line) when ``out`` exists, its folder is missing or cannot be written,
    or for the checkpoint's bad input (:func:`read_exportable`); nothing of ``out`` is left then.
    """
    if not str(out).strip():
        raise FixresError("the export folder is empty: give a path to write (a new folder)")
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise FixresError(f"{out} exists; export writes a new folder (remove it or give another path)")
    if not out.parent.is_dir():
        raise FixresError(f"cannot write {out}: its folder {out.parent} does not exist")
    remove_stale_partials(out)
    partial = partial_name(out)
    try:
        partial.mkdir(mode=0o700)
    except OSError as exc:
        raise FixresError(f"cannot write {out}: {exc.strerror or exc}") from None
    try:
        _write(read_exportable(checkpoint_path, weight_key, warn), partial)
        if out.exists() or out.is_symlink():  # made meanwhile by someone else: theirs stays
            raise FixresError(f"{out} appeared while it was written; export writes a new folder")
        os.rename(partial, out)
        io.fsync_folder(out.parent)
    except OSError as exc:
        raise FixresError(f"cannot write {out}: {exc.strerror or exc}; nothing written") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone after the rename; else the failure's remains
    return out


def main(argv: list[str] | None = None) -> int:
    """The command; returns its exit status (1 after one ``fixres_dist: ...`` line on stderr)."""
    parser = arguments.OneLineParser(prog="python -m fixres_dist.deploy.export", formatter_class=arguments.Formatter,
                                     description="write a checkpoint's network as an export folder: safetensors "
                                                 "weights, model.json (test resolution, preprocessing, class names, "
                                                 "lineage), ONNX and a torch.export program (docs/models.md)")
    parser.add_argument("checkpoint", help="a fixres_dist checkpoint .pth (one file, or a sharded one's .pth)")
    parser.add_argument("out", help="the folder to write (must not exist)")
    parser.add_argument("--weight-key", choices=ENTRIES, default="model",
                        help="the weights to export: the trained ones, or their moving average (default model)")
    args = parser.parse_args(argv)
    try:
        out = export_folder(args.checkpoint, args.out, args.weight_key,
                            warn=lambda line: print(f"fixres_dist: warning: {line}", file=sys.stderr))
    except FixresError as exc:
        print(f"fixres_dist: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the partial folder already removed (export_folder's finally)
        print("fixres_dist: export stopped by SIGINT; nothing written", file=sys.stderr)
        return INTERRUPTED
    print(describe(out))
    return 0


def describe(out: Path) -> str:
    """One line on the export folder ``out``: ``OUT: resnet18 at 48 px, 10 classes, model weights of CHECKPOINT
    (model.safetensors, model.onnx, model.pt2, model.json)``."""
    described = json.loads((Path(out) / DESCRIPTION_FILE).read_text(encoding="utf-8"))
    return (f"{out}: {described['architecture']} at {described['input_size']} px, {described['num_classes']} classes, "
            f"{described['weights']} weights of {described['source']['checkpoint']} "
            f"({', '.join(described['files'])}, {DESCRIPTION_FILE})")


if __name__ == "__main__":
    sys.exit(main())
