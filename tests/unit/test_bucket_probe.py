"""dptrain.distributed.buckets.probe: what the auto plan's probe records per iteration (single process; the
least over the ranks is tested on 2 gloo ranks in tests/distributed/test_bucket_auto.py)."""
from __future__ import annotations

import math

import pytest
import torch

from dptrain.distributed.buckets.probe import (
    AUTO_DECISION_ITER,
    AUTO_DONE_ITER,
    AUTO_PROBE_ITERS,
    AUTO_WARMUP_ITERS,
    AutoProbe,
    check_line,
    least_over_ranks,
    stretch_estimate,
)


def _probe_iteration(p: AutoProbe, launched, done_us: float, queued: bool = True,
                     backward_end_us: float = 20_000.0) -> bool:
    p.start_backward()
    p.t0_us = 0.0  # backward starts at 0 us in these timelines
    p.ready = {"w": 3.0, "b": 1.0}
    return p.record(launched, 3, backward_end_us=backward_end_us, done_us=done_us, queued=queued)


def _held_iteration(p: AutoProbe, backward_end_us: float = 16_000.0) -> None:
    assert p.holding
    assert not _probe_iteration(p, [(0, backward_end_us, backward_end_us + 5_000.0)], backward_end_us + 6_000.0,
                                backward_end_us=backward_end_us)


class _TwoRanks:
    """Rank 0 of 2; the other rank's tables are given. allreduce_sum_ adds them in its row."""

    rank, world_size, device = 0, 2, torch.device("cpu")

    def __init__(self, *other: list[list[float]]) -> None:
        self.other, self.calls = list(other), 0

    def allreduce_sum_(self, t: torch.Tensor) -> None:
        t[1] += torch.tensor(self.other[self.calls], dtype=t.dtype)
        self.calls += 1


def test_service_time_starts_when_the_channel_is_free_and_unmeasured_buckets_are_inf():
    p = AutoProbe()
    # bucket 0 launched at 0 ends at 10 ms; a collective that is no bucket (launched behind it: the order
    # exercises the accounting) ends at 12 ms; bucket 1 launched at 2 ms waits for both, ends at 15 ms; bucket 2 launched at 20 ms on an
    # idle channel ends at 26 ms
    launched = [(0, 0.0, 10_000.0), (None, 1_000.0, 12_000.0), (1, 2_000.0, 15_000.0), (2, 20_000.0, 26_000.0)]
    for _ in range(AUTO_WARMUP_ITERS):
        assert not _probe_iteration(p, launched, 26_500.0)
    assert p.service == [] and p.exposed_ms == []  # warm-up iterations are not kept
    assert not p.holding and not _probe_iteration(p, launched, 26_500.0)
    assert p.service == [[10.0, 3.0, 6.0]]
    assert p.exposed_ms == [6.5] and p.backward_ms == [20.0] and p.ready_ms == {"w": [3.0], "b": [1.0]}
    _held_iteration(p)  # every other probe iteration holds its allreduces: only its backward is kept
    assert p.held_backward_ms == [16.0] and len(p.service) == 1 and p.exposed_ms == [6.5]
    # bucket 0 not stamped, bucket 2 stamped before bucket 1 (gloo's worker threads), bucket 1 never launched
    assert not _probe_iteration(p, [(0, 0.0, None), (2, 1_000.0, 4_000.0), (1, 2_000.0, 3_000.0)], 26_000.0)
    assert p.service[-1] == [math.inf, math.inf, 3.0]  # 1: no positive service time, so no measurement
    _held_iteration(p, 17_000.0)
    # CUDA (queued=False): only collectives launched on an idle channel are priced
    assert not _probe_iteration(p, launched, 26_500.0, queued=False)
    assert p.service[-1] == [10.0, math.inf, 6.0]
    _held_iteration(p, 18_000.0)
    # overlapped backward 20 ms each time, held 16, 17, 18 ms: the pairs' stretch 4, 3, 2 ms
    assert p.decision_due and p.stretch_pairs_ms() == pytest.approx([4.0, 3.0, 2.0])
    # mean 3 ms; standard deviation 1 ms over 3 pairs: noise 2 / sqrt(3) ms
    assert stretch_estimate(p.stretch_pairs_ms()) == pytest.approx((3.0, 2 / math.sqrt(3)))
    assert stretch_estimate([5.0]) == (5.0, math.inf) and stretch_estimate([]) == (0.0, math.inf)


def test_the_statistics_launched_before_backward_occupy_the_channel_but_are_not_priced():
    # the running statistics go out when backward starts (0.5 ms) and end at 4 ms; bucket 0, launched at
    # 2 ms, is served from 4 ms to 10 ms; bucket 1 after it until 13 ms; bucket 2 on an idle channel
    launched = [(None, 500.0, 4_000.0), (0, 2_000.0, 10_000.0), (1, 3_000.0, 13_000.0), (2, 20_000.0, 26_000.0)]
    for queued, expect in ((True, [6.0, 3.0, 6.0]), (False, [math.inf, math.inf, 6.0])):
        p = AutoProbe()
        for _ in range(AUTO_WARMUP_ITERS):
            _probe_iteration(p, launched, 26_500.0, queued=queued)
        _probe_iteration(p, launched, 26_500.0, queued=queued)
        assert p.service == [expect], queued  # CUDA (queued=False): bucket 0 was queued behind the statistics


def test_the_least_over_the_ranks_drops_a_rank_s_wait_for_the_other_and_ignores_inf():
    rank1 = [[4.0, math.inf, 6.0]]
    assert least_over_ranks(_TwoRanks(rank1), [[60.0, 5.0, math.inf]]) == [[4.0, 5.0, 6.0]]
    p = AutoProbe(service=[[60.0, 2.0], [61.0, math.inf]], exposed_ms=[70.0, 71.0], backward_ms=[30.0, 31.0],
                  held_backward_ms=[28.0, 29.0])
    comm = _TwoRanks([[1.5, math.inf], [1.6, math.inf]], [[9.0, 10.0, 4.0, 6.0]])  # rank 1: its waits, its pairs
    collectives, after_slowest, stretch, noise = p.gathered(comm, [4_000_000, 1_000])
    assert collectives == [(4_000_000, 1.5), (1_000, 2.0), (4_000_000, 1.6)] and after_slowest == [9.0, 10.0]
    assert (stretch, noise) == pytest.approx(stretch_estimate([2.0, 2.0, 4.0, 6.0]))  # every rank's pairs
    assert stretch == pytest.approx(3.5)
    assert comm.calls == 2  # the same two collectives on every rank


def test_the_decision_is_due_after_the_probe_and_the_check_ends_after_as_many_iterations():
    p = AutoProbe()
    launched = [(0, 0.0, 1_000.0)]
    held = []
    for _ in range(AUTO_DECISION_ITER - 1):
        held.append(p.holding)
        _probe_iteration(p, launched, 21_000.0)
        assert not p.decision_due
    held.append(p.holding)
    _probe_iteration(p, launched, 21_000.0)
    assert p.decision_due and not p.holding
    assert held == [False] * AUTO_WARMUP_ITERS + [False, True] * AUTO_PROBE_ITERS  # overlapped, held, ...
    assert len(p.backward_ms) == len(p.held_backward_ms) == len(p.exposed_ms) == AUTO_PROBE_ITERS
    d = p.decide(["w", "b"], {"w": 4_000_000, "b": 1_000}, [(4_000_000, 4.0), (1_000, 0.1), (4_000_000, 4.2)],
                 [1.0] * AUTO_PROBE_ITERS, *stretch_estimate(p.stretch_pairs_ms()))
    assert d.order == ["w", "b"] and d.cuts[0] == 0 and d.collectives == 3
    assert d.cost.beta_ms_per_mb == pytest.approx(1.0, rel=0.1)  # 4 MB in ~4 ms
    p.switch(d)
    assert not p.probing and not p.decision_due and not p.holding
    assert p.exposed_ms == p.backward_ms == p.held_backward_ms == []
    held, ends = [], []
    for _ in range(2 * AUTO_PROBE_ITERS):  # the check: overlapped and held again, ending with a held one
        held.append(p.holding)
        ends.append(p.record([], 3, 20_000.0, 22_000.0))
    assert held == [False, True] * AUTO_PROBE_ITERS and ends == [False] * (2 * AUTO_PROBE_ITERS - 1) + [True]
    assert p.exposed_ms == [2.0] * AUTO_PROBE_ITERS and p.synced == AUTO_DONE_ITER


def test_the_report_gathers_only_where_the_host_timed_the_check():
    p = AutoProbe()
    for _ in range(AUTO_DECISION_ITER):
        _probe_iteration(p, [(0, 0.0, 1_000.0)], 21_000.0, backward_end_us=18_000.0 if p.holding else 20_000.0)
    p.switch(p.decide(["w", "b"], {"w": 4_000_000, "b": 1_000}, [(4_000_000, 4.0), (1_000, 0.1)],
                      [1.0] * AUTO_PROBE_ITERS, *stretch_estimate(p.stretch_pairs_ms())))
    for _ in range(2 * AUTO_PROBE_ITERS):  # the plan's backward: 19 ms overlapped, 18 ms held
        p.start_backward()
        p.t0_us = 0.0
        p.record([], 3, 18_000.0 if p.holding else 19_000.0, 22_000.0)
    comm = _TwoRanks([[1.0] * AUTO_PROBE_ITERS + [3.0] * AUTO_PROBE_ITERS])  # rank 1 waited 1 ms, stretched 3 ms
    r = p.report(comm, "1 bucket", 1, timed=True)
    assert r["measured_exposed_ms"] == 3.0 and r["measured_after_slowest_ms"] == 1.0 and p.phase == "done"
    # the plan's stretch, 1 ms in each of rank 0's pairs, 3 ms in rank 1's: the mean
    assert r["measured_contention_ms"] == pytest.approx(2.0)
    line = check_line(r)
    assert "measured 3.00 ms on rank 0, 1.00 ms after the slowest" in line and "stretch measured 2.00 ms" in line
    assert p.decision.describe("1 bucket", "2 buckets").startswith("1 bucket (probe: 2 buckets); allreduce cost")
    untimed = _TwoRanks()
    r = p.report(untimed, "1 bucket", 1, timed=False)
    assert untimed.calls == 0 and r["measured_exposed_ms"] is None and r["measured_after_slowest_ms"] is None
    assert "measured - ms on rank 0, - ms after" in check_line(r)  # CUDA: the host timed nothing
