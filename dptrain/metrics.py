"""metrics.jsonl: one JSON object per display step or test phase, appended by rank 0."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends JSON lines and flushes each one, so a crash loses at most the line in flight."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._file = None

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (no-op on ranks other than 0); the file is created on first use."""
        if self._path is None:
            return
        if self._file is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self._path, "a", buffering=1)
        self._file.write(json.dumps(record) + "\n")

    def drop_after(self, iteration: int) -> int:
        """Remove the records of iterations after ``iteration`` (a resumed run writes them again);
        returns how many went. The file is rewritten atomically. No-op on other ranks."""
        if self._path is None or not self._path.is_file():
            return 0
        self.close()
        records = read_metrics(self._path)
        keep = [r for r in records if r.get("iter", 0) <= iteration]
        if len(keep) < len(records):
            tmp = self._path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            os.replace(tmp, self._path)
        return len(records) - len(keep)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
