"""dptrain.bucket_probe: what the auto plan's probe records per iteration (single process; the
least over the ranks is tested on 2 gloo ranks in tests/dist/test_bucket_auto.py)."""
from __future__ import annotations

import math

import pytest

from dptrain.bucket_probe import AUTO_PROBE_ITERS, AUTO_WARMUP_ITERS, AutoProbe


def _probe_iteration(p: AutoProbe, launched, done_us: float) -> bool:
    p.start_backward()
    p.t0_us = 0.0  # backward starts at 0 us in these timelines
    p.ready = {"w": 3.0, "b": 1.0}
    return p.record(launched, 3, backward_end_us=20_000.0, done_us=done_us)


def test_service_time_starts_when_the_channel_is_free_and_missing_buckets_are_inf():
    p = AutoProbe()
    # bucket 0 launched at 0 ends at 10 ms; bucket 1 launched at 2 ms waits for it, ends at 15 ms;
    # bucket 2 launched at 20 ms on an idle channel, its end not stamped: the iteration's end (26 ms)
    launched = [(0, 0.0, 10_000.0), (1, 2_000.0, 15_000.0), (2, 20_000.0, None)]
    for _ in range(AUTO_WARMUP_ITERS):
        assert not _probe_iteration(p, launched, 26_000.0)
    assert p.service == [] and p.exposed_ms == []  # warm-up iterations are not kept
    assert not _probe_iteration(p, launched, 26_000.0)
    assert p.service == [[10.0, 5.0, 6.0]]
    assert p.exposed_ms == [6.0] and p.backward_ms == [20.0] and p.ready_ms == {"w": [3.0], "b": [1.0]}
    assert not _probe_iteration(p, [(1, 0.0, 4_000.0)], 26_000.0)  # buckets 0 and 2 not launched
    assert p.service[-1][1] == 4.0 and math.isinf(p.service[-1][0]) and math.isinf(p.service[-1][2])


def test_the_decision_is_due_after_the_probe_and_the_check_ends_after_as_many_iterations():
    p = AutoProbe()
    launched = [(0, 0.0, 1_000.0)]
    for _ in range(AUTO_WARMUP_ITERS + AUTO_PROBE_ITERS - 1):
        _probe_iteration(p, launched, 21_000.0)
        assert not p.decision_due
    _probe_iteration(p, launched, 21_000.0)
    assert p.decision_due
    d = p.decide(["w", "b"], {"w": 4_000_000, "b": 1_000}, [(4_000_000, 4.0), (1_000, 0.1), (4_000_000, 4.2)],
                 [1.0] * AUTO_PROBE_ITERS)
    assert d.order == ["w", "b"] and d.cuts[0] == 0 and d.collectives == 3
    assert d.cost.beta_ms_per_mb == pytest.approx(1.0, rel=0.1)  # 4 MB in ~4 ms
    p.switch(d)
    assert not p.probing and not p.decision_due and p.exposed_ms == []
    ends = [p.record([], 3, 20_000.0, 22_000.0) for _ in range(AUTO_PROBE_ITERS)]
    assert ends == [False] * (AUTO_PROBE_ITERS - 1) + [True] and p.exposed_ms == [2.0] * AUTO_PROBE_ITERS
