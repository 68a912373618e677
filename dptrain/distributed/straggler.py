"""Which rank is slow: per-step compute and wait times per rank, gathered at each display.

Each rank times its own steps (:class:`StepClock`): **compute**, from the step's first batch
being ready to the end of its backward (every bucket launched), and **wait**, the time the
step then stands waiting for the reducer's collectives. A rank that computes longer than the
others makes them wait: its compute is high and its wait low. On CUDA both come from events
on the compute stream, kept in a small ring and read once they have completed, so timing
adds no host sync; on the CPU they are host times.

At each display the per-rank means are summed into one small vector over the ranks (one
collective per display, not per step), and :class:`StragglerMonitor` names the slowest rank
and its gap to the median. When the same rank is the slowest by more than
``train.straggler_warn`` of the median for :data:`STRAGGLER_DISPLAYS` displays in a row,
rank 0 logs one line naming it, its host, and what it costs the global rate.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dptrain.distributed.comm import Communicator

log = logging.getLogger(__name__)

STRAGGLER_DISPLAYS = 3
"""Consecutive displays the same rank must be the slowest before the warning."""
RING_SLOTS = 4
"""Steps of CUDA events in flight; a slot is read back when the step using it comes round again,
by then three steps old and long complete, so reading never waits for the device."""


@dataclass
class _Slot:
    events: list[torch.cuda.Event]
    used: bool = False


class StepClock:
    """This rank's compute and wait time per step (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._compute_ms = self._wait_ms = 0.0
        self._steps = 0
        self._marks: dict[str, float] = {}
        self._slots = [_Slot([torch.cuda.Event(enable_timing=True) for _ in range(4)]) for _ in range(RING_SLOTS)] \
            if self._cuda else []
        self._slot = 0
        self._open = False
        self.host_marks: list[tuple[float, float]] | None = None
        """When a list (CPU only): each step appends its (backward end, wait end) host times, in
        seconds, for :meth:`StragglerMonitor.line_up`."""

    def _mark(self, i: int, name: str) -> None:
        if self._cuda:
            self._slots[self._slot].events[i].record(torch.cuda.current_stream(self.device))
        else:
            self._marks[name] = time.perf_counter()

    def batch_ready(self) -> None:
        """The step's first batch is on the device: compute starts (later micro-batches keep the start)."""
        if self._open:
            return
        self._open = True
        if self._cuda:
            self._harvest(self._slots[self._slot])  # RING_SLOTS steps old: complete
        self._mark(0, "start")

    def backward_done(self) -> None:
        self._mark(1, "backward")

    def wait_start(self) -> None:
        self._mark(2, "wait0")

    def wait_done(self) -> None:
        """The step's collectives are waited for; the step's times are booked (CPU) or queued (CUDA)."""
        self._mark(3, "wait1")
        self._open = False
        if self._cuda:
            self._slots[self._slot].used = True
            self._slot = (self._slot + 1) % RING_SLOTS
        else:
            m = self._marks
            self._book((m["backward"] - m["start"]) * 1e3, (m["wait1"] - m["wait0"]) * 1e3)
            if self.host_marks is not None:
                self.host_marks.append((m["backward"], m["wait1"]))

    def _book(self, compute_ms: float, wait_ms: float) -> None:
        self._compute_ms += compute_ms
        self._wait_ms += wait_ms
        self._steps += 1

    def _harvest(self, slot: _Slot) -> None:
        if not slot.used:
            return
        start, backward, wait0, wait1 = slot.events
        wait1.synchronize()
        self._book(start.elapsed_time(backward), wait0.elapsed_time(wait1))
        slot.used = False

    def take(self) -> tuple[float, float, int]:
        """(mean compute ms, mean wait ms, steps) since the last take; waits for the queued events."""
        for slot in self._slots:
            self._harvest(slot)
        n = self._steps
        out = (self._compute_ms / n if n else 0.0, self._wait_ms / n if n else 0.0, n)
        self._compute_ms = self._wait_ms = 0.0
        self._steps = 0
        return out


@dataclass
class StragglerMonitor:
    """Gathers every rank's step times at a display and says which rank the others wait for."""

    comm: Communicator
    warn_fraction: float
    hosts: list[str]
    _streak: tuple[int, int] = field(default=(-1, 0))  # (rank, consecutive displays it was too slow)

    def gather(self, clock: StepClock) -> dict[str, Any]:
        """The display's straggler fields (a collective: every rank calls it at the same display)."""
        compute, wait, steps = clock.take()
        w = self.comm.world_size
        vec = torch.zeros(2 * w, dtype=torch.float64, device=self.comm.device)  # [compute..., wait...] per rank
        vec[self.comm.rank] = compute
        vec[w + self.comm.rank] = wait
        self.comm.allreduce_sum_(vec)
        per_rank = [round(x, 3) for x in vec[:w].tolist()]
        median = statistics.median(per_rank)
        slowest = max(range(w), key=lambda r: per_rank[r])
        return {"compute_ms_per_rank": per_rank, "wait_ms_per_rank": [round(x, 3) for x in vec[w:].tolist()],
                "slowest_rank": slowest, "straggler_gap_ms": round(per_rank[slowest] - median, 3)}

    def judge(self, rec: dict[str, Any], step_ms: float) -> str | None:
        """The warning line once one rank has been too slow for STRAGGLER_DISPLAYS displays, else None.

        ``step_ms`` is the measured time per step; the cost is the share of it the others spend
        waiting for the straggler beyond the median rank's compute.
        """
        per_rank, slowest, gap = rec["compute_ms_per_rank"], rec["slowest_rank"], rec["straggler_gap_ms"]
        median = statistics.median(per_rank)
        too_slow = len(per_rank) > 1 and median > 0 and gap > self.warn_fraction * median
        rank, count = self._streak
        self._streak = (slowest, count + 1 if rank == slowest else 1) if too_slow else (-1, 0)
        if not too_slow or self._streak[1] != STRAGGLER_DISPLAYS:
            return None
        cost = min(1.0, gap / step_ms) if step_ms > 0 else 0.0
        return (f"rank {slowest} (host {self.hosts[slowest]}) has been the slowest for {STRAGGLER_DISPLAYS} displays: "
                f"{per_rank[slowest]:.1f} ms of compute per step against a median of {median:.1f} ms "
                f"(+{100 * gap / median:.0f}%); every other rank waits for it, which costs about {100 * cost:.0f}% of "
                f"the global rate. Check that host's load, thermals or input pipeline "
                f"(train.straggler_warn = {self.warn_fraction})")

    def line_up(self, marks: list[tuple[float, float]]) -> dict[str, float | None]:
        """Split rank 0's wait after backward into the slowest rank's lateness and the communication
        left after it (a collective; every rank passes its :attr:`StepClock.host_marks` of the same steps).

        The collectives end at about the same moment on every rank, so the rank that ended
        backward last waits least, and its wait is the exposed cost of the communication itself:
        per step, ``comm_after_slowest`` is the smallest wait over the ranks and ``backward_skew``
        rank 0's wait beyond it (its wait for the slowest rank). Waits are per-rank durations, so
        no clock is shared between hosts. Medians over the steps; None with no steps (CUDA keeps
        no host marks).
        """
        w, n = self.comm.world_size, len(marks)
        if n == 0:
            return {"backward_skew_ms": None, "comm_after_slowest_ms": None}
        waits = torch.zeros(w, n, dtype=torch.float64, device=self.comm.device)
        waits[self.comm.rank] = torch.tensor([(end - backward) * 1e3 for backward, end in marks], dtype=torch.float64)
        self.comm.allreduce_sum_(waits)
        least = waits.min(dim=0).values
        return {"backward_skew_ms": round(float((waits[0] - least).median()), 3),
                "comm_after_slowest_ms": round(float(least.median()), 3)}
