"""metrics.jsonl: one JSON object per display step or test phase, appended by rank 0; and,
with ``train.tensorboard``, the same figures as TensorBoard scalars."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError, RunDirError

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends JSON lines and flushes each one, so a crash loses at most the line in flight."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._file = None

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (no-op on ranks other than 0); the file is created on first use."""
        if self._path is None:
            return
        try:
            if self._file is not None and os.fstat(self._file.fileno()).st_nlink == 0:
                log.warning("%s was deleted during the run; starting a new one", self._path)
                self.close()
            if self._file is None:
                self._path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self._path, "a", buffering=1)
            self._file.write(json.dumps(record) + "\n")
        except OSError as e:
            raise RunDirError(f"cannot append to {str(self._path)!r} ({e.strerror or e}); free space on its "
                             f"filesystem or choose another train.run_dir, then --resume auto") from e

    def drop_after(self, iteration: int) -> int:
        """Remove the records of iterations after ``iteration`` (a resumed run writes them again);
        returns how many went. The file is rewritten atomically. No-op on other ranks."""
        if self._path is None or not self._path.is_file():
            return 0
        self.close()
        lines = [line for line in self._path.read_text(errors="replace").splitlines() if line.strip()]
        records, torn = [], 0
        for line in lines:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # e.g. the line a crash (or a full disk) cut short
                torn += 1
        if torn:
            log.warning("%s: dropping %d unreadable line(s)", self._path, torn)
        keep = [r for r in records if r.get("iter", 0) <= iteration]
        if len(keep) < len(lines):
            tmp = self._path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            os.replace(tmp, self._path)
        return len(lines) - len(keep)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as e:  # the buffered tail of a failed write: the error was already raised
                log.warning("closing %s: %s", self._path, e)
            self._file = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file; ValueError names the file and line of a broken one."""
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise RunDirError(f"{str(path)!r} line {n} is not JSON ({e.msg}); a crash may have cut it "
                                 f"short: delete that line") from e
    return records


TENSORBOARD_TAGS = {
    "loss": "train/loss", "lr": "train/lr", "loss_scale": "train/loss_scale", "images_per_s": "train/images_per_s",
    "skipped_steps": "train/skipped_steps", "test_top1": "test/top1", "test_top5": "test/top5",
    "straggler_gap_ms": "ranks/straggler_gap_ms", "data_wait_ms": "phases/data_wait_ms", "forward_ms": "phases/forward_ms",
    "backward_ms": "phases/backward_ms", "exposed_comm_ms": "phases/exposed_comm_ms", "update_ms": "phases/update_ms",
    "gather_ms": "phases/gather_ms",
}
"""metrics.jsonl keys written as TensorBoard scalars, and their tags."""


class TensorBoardWriter:
    """The records of a run as TensorBoard scalars (``torch.utils.tensorboard``), step = ``iter``.

    Per-rank lists become one scalar per rank (``ranks/compute_ms/rank<r>``).
    """

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError(f"train.tensorboard = true needs the tensorboard package ({e}); pip install "
                              f"'dptrain[tensorboard]' or set train.tensorboard = false") from e
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("iter", 0))
        for key, tag in TENSORBOARD_TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)):
                self._writer.add_scalar(tag, value, step)
        for r, ms in enumerate(record.get("compute_ms_per_rank") or []):
            self._writer.add_scalar(f"ranks/compute_ms/rank{r}", ms, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
