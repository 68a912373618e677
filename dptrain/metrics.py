"""metrics.jsonl: one JSON object per display step or test phase, appended by rank 0."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends JSON lines and flushes each one, so a crash loses at most the line in flight."""

    def __init__(self, path: Path | None) -> None:
        self._file = open(path, "a", buffering=1) if path is not None else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=False) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
