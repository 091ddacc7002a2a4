"""The run's ``metrics.jsonl``: one strict JSON object per line, written by rank 0 alone."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .io import write_private

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl``; a no-op on ranks other than 0."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = Path(path), enabled

    def write(self, event: str, **fields) -> None:
        if not self.enabled:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")

    def rewrite(self, events: list[dict]) -> None:
        """Replace the file, atomically, by ``events`` (the history a resumed checkpoint holds)."""
        if not self.enabled:
            return
        write_private(self.path, "".join(json.dumps(e) + "\n" for e in events))
