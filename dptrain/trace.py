"""Chrome-trace timeline of one solver: forward, backward, each bucket's allreduce, update.

Events use host wall-clock microseconds. On CUDA the trainer synchronises at phase
boundaries only while tracing, so traced phases are device times; an untraced run pays
nothing (:class:`NullTracer`). Load the JSON in chrome://tracing or Perfetto.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def now_us() -> float:
    return time.perf_counter_ns() / 1000.0


class Tracer:
    """Collects trace events in memory; thread-safe (hooks and comm callbacks add events)."""

    enabled = True

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def complete(self, name: str, start_us: float, end_us: float, tid: str = "compute", **args: Any) -> None:
        """A span from ``start_us`` to ``end_us`` ("ph": "X")."""
        ev = {"ph": "X", "name": name, "ts": start_us, "dur": max(0.0, end_us - start_us),
              "pid": self.rank, "tid": tid, "args": args}
        with self._lock:
            self.events.append(ev)

    def instant(self, name: str, tid: str = "compute", ts_us: float | None = None, **args: Any) -> None:
        """A point in time ("ph": "i")."""
        ev = {"ph": "i", "name": name, "ts": now_us() if ts_us is None else ts_us, "pid": self.rank,
              "tid": tid, "s": "t", "args": args}
        with self._lock:
            self.events.append(ev)

    @contextmanager
    def span(self, name: str, tid: str = "compute", **args: Any) -> Iterator[None]:
        start = now_us()
        try:
            yield
        finally:
            self.complete(name, start, now_us(), tid, **args)

    def save(self, path: str | Path) -> Path:
        """Write ``<path>.rank<r>.json`` atomically; return its path."""
        out = Path(f"{path}.rank{self.rank}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".json.tmp")
        with self._lock:
            tmp.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
        os.replace(tmp, out)
        return out


class NullTracer(Tracer):
    """Records nothing; the default when no --trace is given."""

    enabled = False

    def __init__(self, rank: int = 0) -> None:
        super().__init__(rank)

    def complete(self, name: str, start_us: float, end_us: float, tid: str = "compute", **args: Any) -> None:
        return None

    def instant(self, name: str, tid: str = "compute", ts_us: float | None = None, **args: Any) -> None:
        return None
