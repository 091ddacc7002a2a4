"""The run's ``metrics.jsonl``: one strict JSON object per line (RFC 8259: a non-finite number is
written as ``null``, never as a bare ``NaN``/``Infinity``), written by rank 0 alone."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from fixres_dist.finite import json_safe
from fixres_dist.io import write_private

METRICS_FILE = "metrics.jsonl"


def json_line(event: dict) -> str:
    """``event`` as one line of strict JSON (non-finite floats become null) with its newline."""
    return json.dumps(json_safe(event), allow_nan=False) + "\n"


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl``; a no-op on ranks other than 0."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = Path(path), enabled

    @staticmethod
    def event(event: str, **fields) -> dict:
        """``{"event": event, "time": seconds since the epoch, **fields}``: one entry of the history."""
        return {"event": event, "time": round(time.time(), 3), **fields}

    def write(self, event: str | dict, **fields) -> None:
        """Append ``event`` (an :meth:`event` dict, or its name and fields)."""
        if not self.enabled:
            return
        entry = event if isinstance(event, dict) else self.event(event, **fields)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(json_line(entry))

    def rewrite(self, events: list[dict]) -> None:
        """Replace the file, atomically, by ``events`` (the history a resumed checkpoint holds)."""
        if not self.enabled:
            return
        write_private(self.path, "".join(json_line(e) for e in events))
