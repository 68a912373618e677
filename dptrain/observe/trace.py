"""Timing one solver's step: phase totals (:class:`PhaseTimer`) and a Chrome-trace timeline
(:class:`Tracer`: forward, backward, each bucket's allreduce, update).

Trace events use host wall-clock microseconds; an untraced run pays nothing
(:class:`NullTracer`). Load the JSON in chrome://tracing or Perfetto. Phase totals on CUDA
come from events on the compute stream, with no host sync, so timing a phase does not
disturb the overlap it measures.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


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


HOST_PHASES = ("data_wait",)
"""Phases that are host waits (for the input pipeline), timed on the host on every device."""


class PhaseTimer:
    """Totals per phase of the steps timed while :attr:`active` (free when inactive).

    CPU: host wall time (gloo collectives block the host, so ``exposed_comm``, the time
    ``reducer.wait()`` takes, is the communication left after backward). CUDA: a pair of
    events per phase on the compute stream, read in :meth:`totals_ms` (one sync, when the
    figures are wanted): ``backward`` is the compute stream's own work and ``exposed_comm``
    the time that stream stands waiting for the reducer's collectives, while the collectives
    themselves overlap backward undisturbed. Host phases (:data:`HOST_PHASES`) are host
    times everywhere.
    """

    def __init__(self, device: torch.device, tracer: Tracer, active: bool) -> None:
        self.device, self.tracer, self.active = device, tracer, active
        self._host_ms: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def reset(self) -> None:
        self._host_ms.clear()
        self._events.clear()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.active:
            yield
            return
        on_device = self.device.type == "cuda" and name not in HOST_PHASES
        if on_device:
            start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_ev.record(torch.cuda.current_stream(self.device))
        start = now_us()
        yield
        end = now_us()
        if on_device:
            end_ev.record(torch.cuda.current_stream(self.device))
            self._events.append((name, start_ev, end_ev))
        else:
            self._host_ms[name] += (end - start) / 1000.0
        self.tracer.complete(name, start, end)

    def totals_ms(self) -> dict[str, float]:
        """Milliseconds per phase over the timed steps (waits for the device's timed events)."""
        totals = defaultdict(float, self._host_ms)
        for name, start_ev, end_ev in self._events:
            end_ev.synchronize()
            totals[name] += start_ev.elapsed_time(end_ev)
        return dict(totals)
