"""The measuring side of ``reducer.bucket_mb = "auto"``: what the Reducer's probe records, and
how the ranks' records become the planner's inputs (:mod:`dptrain.distributed.buckets.planner` plans).

After ``AUTO_WARMUP_ITERS`` synced iterations, ``2 * AUTO_PROBE_ITERS`` more run with one
bucket per parameter, alternately overlapped and held (the 1st, 3rd, ... probe iteration
overlaps; with one warm-up iteration these are the run's iterations 2, 4 and 6).

An overlapped iteration launches each allreduce as its gradient is ready, and the probe
records when each gradient is ready and how long each allreduce is served (from its launch,
or from the end of the one before it on the channel, to its end). On the rank that launched
a collective last that is its cost alone; on the others it also holds their wait for that
rank, so the ranks keep the least over them (:func:`least_over_ranks`). Likewise the least
wait after backward over the ranks is the communication left after the slowest rank's
backward, which is what the overlap model predicts.

A held iteration launches nothing until backward has ended, and only its backward time is
kept. Each overlapped iteration's backward less that of the held one after it is the
backward time the overlap added (its stretch); the mean over every rank's pairs is the
stretch the planner's contention is fitted on (:func:`stretch_estimate`). Pairing adjacent
iterations lets a drift of the host's speed cancel. The stretch also holds the host's cost
of each launch (the probe launches the most allreduces any plan can), so it leans high.

Rank 0 fits ``alpha + beta * bytes`` to the median service time per size, the overlap rate
on the least wait, and the contention on the stretch (0 when the stretch does not exceed
twice its standard error), plans the bucket boundaries over its median ready times and
broadcasts the gradient order and the cuts; every rank re-lays out its buffers at the same
iteration (as ``replan`` does) and the plan digests are compared again. The next
``2 * AUTO_PROBE_ITERS`` iterations check the chosen plan, again alternately overlapped and
held: its exposed communication and (where the host times it: on the CPU) its stretch are
logged beside the predictions.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import fmean, median, stdev

import torch

from dptrain.distributed.buckets.planner import AutoDecision, decide_plan
from dptrain.distributed.comm import Communicator
from dptrain.observe.trace import now_us

AUTO_WARMUP_ITERS = 1
"""Synced iterations the auto plan ignores: the first pays allocator and kernel-selection costs no later one pays."""
AUTO_PROBE_ITERS = 3
"""Synced iterations timed per kind of the auto plan's iterations (probe and check, each overlapped
and held); medians over them."""
AUTO_DECISION_ITER = AUTO_WARMUP_ITERS + 2 * AUTO_PROBE_ITERS
"""The synced iteration at whose end the plan is decided and applied."""
AUTO_DONE_ITER = AUTO_DECISION_ITER + 2 * AUTO_PROBE_ITERS
"""The synced iteration at whose end the chosen plan has been checked (``BucketTuner.report``, :mod:`.auto`)."""
PROBE_CAP_MB = 1e-9
"""Caps below any parameter's size: one bucket per parameter while probing, so every gradient's
ready time and a spread of message sizes (biases to the largest weight) are measured."""


@dataclass
class AutoProbe:
    """Measurements of the auto plan's probe and check phases (see the module docstring)."""

    synced: int = 0
    phase: str = "probe"  # -> "check" -> "done"
    t0_us: float = 0.0
    ready: dict[str, float] = field(default_factory=dict)  # this iteration: name -> ms after backward start
    ready_ms: dict[str, list[float]] = field(default_factory=dict)
    service: list[list[float]] = field(default_factory=list)  # per probe iteration, per bucket: service ms
    backward_ms: list[float] = field(default_factory=list)
    held_backward_ms: list[float] = field(default_factory=list)  # the iterations that held their allreduces
    exposed_ms: list[float] = field(default_factory=list)
    decision: AutoDecision | None = None

    @property
    def probing(self) -> bool:
        return self.phase == "probe"

    @property
    def decision_due(self) -> bool:
        """The probe has all its iterations: the plan is decided now (collective)."""
        return self.probing and self.synced == AUTO_DECISION_ITER

    @property
    def holding(self) -> bool:
        """The coming synced iteration launches no allreduce before its backward ends (every other
        iteration of the probe and of the check)."""
        if self.phase == "done":
            return False
        t = self.synced + 1 - (AUTO_WARMUP_ITERS if self.probing else AUTO_DECISION_ITER)  # its number in the phase
        return t >= 1 and t % 2 == 0

    def start_backward(self) -> None:
        self.ready, self.t0_us = {}, now_us()

    def gradient_ready(self, name: str) -> None:
        self.ready[name] = (now_us() - self.t0_us) / 1e3

    def record(self, launched: Sequence[tuple[int | None, float, float | None]], n_buckets: int,
               backward_end_us: float, done_us: float, queued: bool = True) -> bool:
        """Keep this synced iteration's timeline (after the warm-up ones); True when the check phase
        has all its iterations.

        ``launched``: (bucket index, launch us, end us) of each collective in launch order; index None
        for one that is not a bucket (the running statistics), which occupies the channel but is not
        priced; end None when it was not stamped. A bucket's service time runs from its launch, or
        the end of the one before it, to its end; ``queued=False`` keeps only those launched on an
        idle channel (CUDA: the completion watcher's stamps are a poll apart, too coarse for the
        gap between two queued ones). A bucket without a positive service time gets ``inf``: no
        measurement, so another rank's value is the least (gloo's worker threads may end two
        collectives out of order). A held iteration keeps only its backward time."""
        held = self.holding
        self.synced += 1
        if self.synced <= AUTO_WARMUP_ITERS:
            return False
        backward_ms = (backward_end_us - self.t0_us) / 1e3
        if held:
            self.held_backward_ms.append(backward_ms)
            return not self.probing and len(self.held_backward_ms) == AUTO_PROBE_ITERS  # the check's last
        self.exposed_ms.append((done_us - backward_end_us) / 1e3)
        self.backward_ms.append(backward_ms)
        if not self.probing:
            return False
        for name, t in self.ready.items():
            self.ready_ms.setdefault(name, []).append(t)
        service, prev_end = [math.inf] * n_buckets, 0.0
        for index, start, end in launched:  # one channel: a collective is served after the one before it
            if end is None:
                continue
            ms = (end - max(start, prev_end)) / 1e3
            if index is not None and ms > 0 and (queued or start >= prev_end):
                service[index] = ms
            prev_end = max(prev_end, end)
        self.service.append(service)
        return False

    def stretch_pairs_ms(self) -> list[float]:
        """This rank's backward stretch per pair: each overlapped iteration's backward less that of the
        held iteration after it (adjacent, so a drift of the host's speed mostly cancels)."""
        return [o - h for o, h in zip(self.backward_ms, self.held_backward_ms, strict=True)]

    def _waits(self, comm: Communicator) -> tuple[list[float], float, float]:
        """The least wait after backward over the ranks per iteration, and the stretch over every
        rank's pairs with its noise (:func:`stretch_estimate`; collective)."""
        n = len(self.exposed_ms)
        t = gather_over_ranks(comm, [[*self.exposed_ms, *self.stretch_pairs_ms()]])[:, 0]
        return t[:, :n].min(dim=0).values.tolist(), *stretch_estimate(t[:, n:].flatten().tolist())

    def gathered(self, comm: Communicator,
                 nbytes: Sequence[int]) -> tuple[list[tuple[int, float]], list[float], float, float]:
        """(bytes, service ms) of every probed collective and the probe's wait after backward per
        iteration, each the least over the ranks, and the backward stretch over the ranks with its
        noise (collective); ``nbytes`` per probe bucket."""
        service = least_over_ranks(comm, self.service)
        collectives = [(b, t) for row in service for b, t in zip(nbytes, row, strict=True) if math.isfinite(t)]
        return collectives, *self._waits(comm)

    def decide(self, order: Sequence[str], size_of: dict[str, int], collectives: list[tuple[int, float]],
               after_slowest: list[float], stretch_ms: float, stretch_noise_ms: float = 0.0) -> AutoDecision:
        """Rank 0's plan: its own ready times and backward, the ranks' least costs and waits, their
        backward stretch."""
        return decide_plan(order, size_of, self.ready_ms, self.backward_ms, collectives, after_slowest, stretch_ms,
                           stretch_noise_ms)

    def switch(self, decision: AutoDecision) -> None:
        """The plan is applied: measure it next."""
        self.phase, self.decision = "check", decision
        self.exposed_ms, self.backward_ms, self.held_backward_ms = [], [], []

    def report(self, comm: Communicator, plan_text: str, buckets: int, timed: bool) -> dict[str, float | int | str | None]:
        """The check phase's outcome (collective when ``timed``: on CUDA wait() does not block the host,
        so it times nothing there)."""
        self.phase = "done"
        d = self.decision
        assert d is not None
        measured = least = stretch = None
        if timed:
            waits, stretch, _ = self._waits(comm)
            measured, least = median(self.exposed_ms), median(waits)
        return {"plan": plan_text, "buckets": buckets,
                "alpha_ms": round(d.cost.alpha_ms, 4), "beta_ms_per_mb": round(d.cost.beta_ms_per_mb, 4),
                "overlap_rate": d.overlap_rate, "contention": round(d.contention, 3),
                "contention_weighed": round(min(d.contention, d.overlap_rate), 3), "contention_note": d.contention_note,
                "probe_stretch_ms": None if d.stretch_ms is None else round(d.stretch_ms, 3),
                "probe_stretch_noise_ms": round(d.stretch_noise_ms, 3),
                "predicted_exposed_ms": round(d.predicted_exposed_ms, 3),
                "predicted_contention_ms": round(d.predicted_contention_ms, 3),
                "measured_contention_ms": None if stretch is None else round(stretch, 3),
                "measured_exposed_ms": None if measured is None else round(measured, 3),
                "measured_after_slowest_ms": None if least is None else round(least, 3),
                "probe_exposed_ms": round(d.probe_exposed_ms, 3)}


def stretch_estimate(pairs_ms: Sequence[float]) -> tuple[float, float]:
    """(mean, noise) of paired backward stretches: the noise is twice the mean's standard error, so
    a stretch that does not exceed it is not told apart from zero (one pair: infinite noise)."""
    if len(pairs_ms) < 2:
        return (pairs_ms[0] if pairs_ms else 0.0), math.inf
    return fmean(pairs_ms), 2.0 * stdev(pairs_ms) / math.sqrt(len(pairs_ms))


def check_line(r: dict[str, float | int | str | None]) -> str:
    """One log line: the check phase's measurements (:meth:`AutoProbe.report`) beside the predictions."""
    def ms(key: str) -> str:
        return "-" if r[key] is None else f"{r[key]:.2f}"

    return (f"exposed comm measured {ms('measured_exposed_ms')} ms on rank 0, {ms('measured_after_slowest_ms')} ms "
            f"after the slowest rank's backward vs predicted {ms('predicted_exposed_ms')} ms; backward stretch "
            f"measured {ms('measured_contention_ms')} ms vs predicted {ms('predicted_contention_ms')} ms (medians "
            f"of {AUTO_PROBE_ITERS} iterations)")


def gather_over_ranks(comm: Communicator, rows: list[list[float]]) -> torch.Tensor:
    """[world size, rows, columns]: every rank's table of the same shape (collective; on the host)."""
    t = torch.zeros(comm.world_size, len(rows), len(rows[0]) if rows else 0, dtype=torch.float64, device=comm.device)
    t[comm.rank] = torch.tensor(rows, dtype=torch.float64).reshape(t.shape[1:])
    comm.allreduce_sum_(t)  # each rank fills its own row, zeros elsewhere: an all-gather
    return t.cpu()


def least_over_ranks(comm: Communicator, rows: list[list[float]]) -> list[list[float]]:
    """Element by element, the least value over the ranks of a table every rank holds in the same
    shape (collective; ``inf`` marks a missing value)."""
    return gather_over_ranks(comm, rows).min(dim=0).values.tolist()
