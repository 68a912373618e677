"""``reducer.bucket_mb = "auto"`` as an observer of the Reducer: it watches the probe and check
iterations, holds their allreduces every other iteration, and has the Reducer adopt the plan it
chooses. The Reducer itself only moves gradients (as DDP keeps its Logger and Timer beside its
reducer): what is measured and decided is here, :mod:`.probe` (the records) and :mod:`.planner`
(the cost model and the boundaries).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from dptrain.distributed.buckets.plan import order_from_ready
from dptrain.distributed.buckets.probe import AutoProbe, check_line
from dptrain.distributed.reducer import Launched, Reducer, group_specs
from dptrain.observe.trace import now_us

log = logging.getLogger(__name__)

PROBE_SETTLE_S = 1.0
"""CUDA probe: how long to wait for the completion watcher to stamp collectives the device has finished."""


def attach_bucket_tuner(reducer: Reducer) -> BucketTuner | None:
    """The planner of ``reducer.bucket_mb = "auto"``, watching ``reducer``; None for a fixed plan or one solver."""
    if reducer.cfg.bucket_mb != "auto" or reducer.world_size <= 1:
        return None
    plan = BucketTuner(reducer)
    reducer.observers.append(plan)
    return plan


class BucketTuner:
    """Drives ``reducer.bucket_mb = "auto"`` as a :class:`~dptrain.distributed.reducer.ReducerObserver` (see
    :mod:`.probe` for the iterations and what they measure)."""

    def __init__(self, reducer: Reducer) -> None:
        self.reducer = reducer
        self.probe = AutoProbe()
        self.report: dict[str, float | int | str | None] = {}
        """The chosen plan, its fitted cost, overlap rate and contention, and its predicted and measured
        exposed communication and backward stretch (once the check has run)."""
        self._ready: list[str] = []

    @property
    def timing(self) -> bool:
        return self.probe.probing

    @property
    def pending(self) -> bool:
        """The plan is not yet chosen and checked (``report`` is empty)."""
        return self.probe.phase != "done"

    def begin(self) -> bool:
        if not self.pending:
            return False
        self._ready = []
        self.probe.start_backward()
        return self.probe.holding

    def ready(self, name: str) -> None:
        self._ready.append(name)
        if self.probe.probing:
            device = self.reducer.comm.device
            if device.type == "cuda":  # probe only: host time = device time, at one sync per hook
                torch.cuda.current_stream(device).synchronize()
            self.probe.gradient_ready(name)

    def completed(self, launched: Sequence[Launched], backward_end_us: float) -> None:
        if not self.pending:
            return
        r = self.reducer
        if self.probe.probing and not r.host_completion:
            _settle(r.comm.device, launched)
        timeline = sorted(((x.bucket.index if x.bucket is not None else None, x.start_us,
                            x.end_us[0] if x.end_us else None) for x in launched), key=lambda x: x[1])
        if self.probe.record(timeline, len(r.plan.buckets), backward_end_us, now_us(), queued=r.host_completion):
            self.report = self.probe.report(r.comm, r.plan.describe(), len(r.plan.buckets), r.host_completion)
            if r.comm.rank == 0:
                log.info("reducer auto plan: %s", check_line(self.report))

    def after_wait(self) -> None:
        if self.probe.decision_due:
            self._decide()

    @property
    def accepts_plan(self) -> bool:
        """Before its own plan is chosen, a snapshot's chosen plan stands in for a new probe."""
        return self.probe.probing

    def plan_adopted(self) -> None:
        self.probe.phase = "done"

    def _decide(self) -> None:
        """Rank 0 plans from the probe's timeline; every rank applies it now (collective)."""
        r, a = self.reducer, self.probe
        collectives, after_slowest, stretch, noise = a.gathered(r.comm, [b.nbytes for b in r.plan.buckets])
        decision = None
        if r.comm.rank == 0:
            size_of = {s.name: s.padded_numel * g.elem_size for g in group_specs(r.flat) for s in g.segments}
            decision = a.decide(order_from_ready(r.flat.layout_order, list(self._ready)), size_of, collectives,
                                after_slowest, stretch, noise)
            if decision.fit_note:
                log.warning("rank 0: reducer auto plan: %s; priced every bucket at the median allreduce time",
                            decision.fit_note)
            if decision.contention_note:
                log.info("reducer auto plan: %s; contention taken as 0", decision.contention_note)
        decision = r.comm.broadcast_object(decision, src=0)
        old = r.plan.describe()
        r.adopt_ready_order(decision.order, decision.cuts)
        a.switch(decision)
        if r.comm.rank == 0:
            log.info("reducer auto plan: %s", decision.describe(r.plan.describe(), old))


def _settle(device: torch.device, launched: Sequence[Launched]) -> None:
    """CUDA probe iterations only: sync the device and let the completion watcher stamp every
    collective, so the probe's exposed communication and service times are device times."""
    torch.cuda.synchronize(device)
    deadline = time.perf_counter() + PROBE_SETTLE_S
    while any(not rec.end_us for rec in launched) and time.perf_counter() < deadline:
        time.sleep(1e-4)
