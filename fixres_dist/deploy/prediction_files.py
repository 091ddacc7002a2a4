"""The predictions file: one row per image, in the data's order, as CSV, JSON lines or parquet.

Columns, in order: ``id`` (a string, or an int: a Hugging Face dataset's row number), then for each rank
``r`` from 1 to k ``class_<r>`` (the class name) and ``probability_<r>`` (its softmax probability, float32),
most probable first. CSV and JSON lines write each probability as the shortest decimal that reads back
as the same float32 (``numpy``'s ``str``: e.g. ``0.1``, not ``0.10000000149011612``); parquet stores it as
float32. The file is written atomically and owner-only (:func:`fixres_dist.io.write_private`): a reader
sees the whole file or none; the same rows give the same bytes.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np

from fixres_dist.errors import FixresError
from fixres_dist.io import write_private

FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".parquet": "parquet"}  # OUT's suffix -> its format


def columns(k: int) -> list[str]:
    """The column names for the top ``k``."""
    return ["id"] + [f"{what}_{rank}" for rank in range(1, k + 1) for what in ("class", "probability")]


def format_of(out: Path, given: str | None) -> str:
    """``given`` (``csv``, ``jsonl`` or ``parquet``), else the one ``out``'s suffix names; FixresError when
    neither says."""
    if given is not None:
        return given
    if out.suffix.lower() not in FORMATS:
        raise FixresError(f"cannot tell the format of {out} from its suffix; name it .csv, .jsonl or .parquet, "
                          "or give --format csv|jsonl|parquet")
    return FORMATS[out.suffix.lower()]


def _decimal(value: np.float32) -> float:
    """The float whose shortest repr is the float32 ``value``'s own shortest decimal."""
    return float(str(np.float32(value)))


def _text(fmt: str, ids: list, names: list[list[str]], probabilities: np.ndarray) -> str:
    header = columns(probabilities.shape[1])
    buffer = io.StringIO()
    if fmt == "csv":
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(header)
    for row_id, row_names, row_probabilities in zip(ids, names, probabilities):
        values = [row_id] + [v for pair in zip(row_names, map(_decimal, row_probabilities)) for v in pair]
        if fmt == "csv":
            writer.writerow(values)
        else:
            buffer.write(json.dumps(dict(zip(header, values)), ensure_ascii=False) + "\n")
    return buffer.getvalue()


def _parquet(ids: list, names: list[list[str]], probabilities: np.ndarray):
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = {"id": pa.array(ids)}
    for rank in range(probabilities.shape[1]):
        arrays[f"class_{rank + 1}"] = pa.array([row[rank] for row in names], pa.string())
        arrays[f"probability_{rank + 1}"] = pa.array(probabilities[:, rank], pa.float32())
    table = pa.table(arrays)
    return lambda f: pq.write_table(table, f)


def write(out: str | Path, fmt: str, ids: list, names: list[list[str]], probabilities: np.ndarray) -> None:
    """Write the predictions file ``out`` in ``fmt``: row ``i`` is ``ids[i]``, then ``names[i]`` (k class
    names) and ``probabilities[i]`` (float32 (N, k)) paired (module docstring). Raises :class:`FixresError`
    when ``out`` cannot be written (nothing is left there then)."""
    content = _parquet(ids, names, probabilities) if fmt == "parquet" else _text(fmt, ids, names, probabilities)
    try:
        write_private(out, content)
    except OSError as exc:
        raise FixresError(f"cannot write {out}: {exc.strerror or exc}") from None
