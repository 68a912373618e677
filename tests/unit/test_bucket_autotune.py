"""dptrain.distributed.buckets.planner: the cost fit, the overlap model and the planner (pure functions);
explicit cuts in build_bucket_plan; the config's "auto" values. Expected values are worked out
by hand in the comments; the planner is also checked against brute force."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from dptrain.config import load_config
from dptrain.distributed.buckets import planner as bucket_autotune
from dptrain.distributed.buckets.plan import GroupSpec, SegmentSpec, build_bucket_plan
from dptrain.distributed.buckets.planner import (
    LinearCost,
    buckets_of,
    comm_cost_ms,
    decide_plan,
    expected_max_normal,
    finish_ms,
    fit_linear_cost,
    plan_cuts,
    simulate_overlap,
)
from dptrain.errors import ConfigError


def test_linear_cost_fit_recovers_alpha_and_beta():
    truth = LinearCost(0.25, 0.5)  # 0.25 ms + 0.5 ms per MB
    sizes = [40, 4_000, 400_000, 4_000_000, 40_000_000]
    for relative in (True, False):
        fit = fit_linear_cost(sizes, [truth(s) for s in sizes], relative=relative)
        assert fit.alpha_ms == pytest.approx(0.25) and fit.beta_ms_per_mb == pytest.approx(0.5)


def test_linear_cost_fit_clamps_a_negative_latency_and_names_bad_input():
    # through the origin: t = 1 ms per MB exactly, plus noise that makes the intercept negative
    fit = fit_linear_cost([1e6, 2e6, 4e6], [0.9, 2.0, 4.0])
    assert fit.alpha_ms == 0.0 and 0.9 < fit.beta_ms_per_mb < 1.05
    with pytest.raises(ValueError, match="at least 2 distinct message sizes"):
        fit_linear_cost([1e6, 1e6], [1.0, 1.1])
    with pytest.raises(ValueError, match="do not grow with size"):
        fit_linear_cost([1e3, 1e6], [2.0, 1.0])


def test_simulate_overlap_by_hand():
    # comm 1 ms per MB; backward 20 ms; buckets (ready, MB): (5, 4) (8, 8) (25 -> clamped to 20, 2)
    # 5 -> 9; max(8, 9) = 9 -> 17; 20 -> 22: exposed 2, busy 14; overlapped 4 + 8 + 0 = 12
    o = simulate_overlap([5.0, 8.0, 25.0], [4e6, 8e6, 2e6], 20.0, LinearCost(0.0, 1.0))
    assert (o.comm_end_ms, o.exposed_ms, o.busy_ms, o.overlapped_ms) == pytest.approx((22, 2, 14, 12))


def test_plan_cuts_by_hand():
    # 4 gradients of 1 MB ready at 1, 2, 3, 10 ms; cost 2 ms + 1 ms/MB.
    # one bucket: 10 + 6 = 16. [0..2] at 3 -> 8, [3] at 10 -> 13. per gradient: 1 -> 4, 4 -> 7, 7 -> 10,
    # 10 -> 13 (4 buckets). [0..1] at 2 -> 6, [2] 6 -> 9, [3] 10 -> 13 (3 buckets). Best end 13; fewest: 2 buckets.
    ready, mb = [1.0, 2.0, 3.0, 10.0], [1e6] * 4
    cost = LinearCost(2.0, 1.0)
    cuts = plan_cuts(ready, mb, cost)
    assert cuts == (0, 3)
    assert buckets_of(ready, mb, cuts) == ([3.0, 10.0], [3e6, 1e6])
    assert simulate_overlap(*buckets_of(ready, mb, cuts), 10.0, cost).comm_end_ms == pytest.approx(13.0)
    # latency-free: cutting never costs, so the earliest end is per gradient... as early as one bucket at the end
    assert plan_cuts([0.0, 0.0], [1e6, 1e6], LinearCost(0.0, 1.0)) == (0,)
    with pytest.raises(ValueError, match="one ready time per gradient"):
        plan_cuts([1.0], [], cost)


def test_contention_weighs_the_overlap_against_the_exposed_communication():
    # test_plan_cuts_by_hand's timeline, backward ends at 10 ms. [0..2] 3 -> 8, [3] 10 -> 13: exposed 3,
    # overlapped 5, so 3 + 5 kappa. One bucket 10 -> 16: exposed 6, nothing overlapped. A bucket per gradient:
    # exposed 3, overlapped 9. Two buckets win while 3 + 5 kappa < 6, i.e. kappa < 0.6.
    ready, mb, cost = [1.0, 2.0, 3.0, 10.0], [1e6] * 4, LinearCost(2.0, 1.0)
    assert plan_cuts(ready, mb, cost, 10.0, 1.0, 0.0) == plan_cuts(ready, mb, cost, 10.0, 1.0, 0.5) == (0, 3)
    assert plan_cuts(ready, mb, cost, 10.0, 1.0, 0.8) == (0,)
    o = simulate_overlap(*buckets_of(ready, mb, (0, 3)), 10.0, cost)
    assert comm_cost_ms(o, 10.0, 0.5) == pytest.approx(5.5)
    # contention at the overlap rate: an overlapped ms costs what it saves, so the least total allreduce
    # time wins (one bucket, 6 ms); above the rate the planner caps it there (a plan cannot hold launches)
    assert plan_cuts(ready, mb, cost, 10.0, 1.0, 1.0) == plan_cuts(ready, mb, cost, 10.0, 1.0, 3.0) == (0,)
    # no finite backward: nothing is exposed, so contention is not weighed
    assert plan_cuts(ready, mb, cost, math.inf, 1.0, 0.8) == plan_cuts(ready, mb, cost)


def _brute_force_cost(ready: list[float], nbytes: list[float], cost: LinearCost, backward: float, rate: float,
                      kappa: float) -> tuple[float, int]:
    """The least cost over every plan, and the fewest buckets of a plan within 1e-9 ms of it."""
    n, plans = len(ready), []
    for mask in itertools.product([False, True], repeat=n - 1):
        cuts = [0, *(i + 1 for i, cut in enumerate(mask) if cut)]
        o = simulate_overlap(*buckets_of(ready, nbytes, cuts), backward, cost, rate)
        plans.append((comm_cost_ms(o, backward, min(kappa, rate)), len(cuts)))
    least = min(c for c, _ in plans)
    return least, min(k for c, k in plans if c <= least + 1e-9)


@pytest.mark.parametrize("seed", range(16))
def test_plan_cuts_with_contention_matches_brute_force_on_random_timelines(seed):
    # also: one gradient, empty tensors, ready times out of order or past the end of backward
    rng = random.Random(100 + seed)
    n = rng.randint(1, 9)
    ready = [rng.uniform(0, 20) for _ in range(n)]
    if seed % 2:
        ready.sort()
    backward = max(ready) + rng.choice([-3.0, 0.0, 5.0])
    nbytes = [rng.choice([0.0, 4e2, 4e4, 1e6, 4e6, 1.6e7]) for _ in range(n)]
    cost = LinearCost(rng.choice([0.0, 0.05, 0.5, 3.0]), rng.choice([0.1, 0.5, 2.0]))
    rate, kappa = rng.choice([1.0, 0.5, 0.1]), rng.choice([0.05, 0.15, 0.4, 0.9])
    cuts = plan_cuts(ready, nbytes, cost, backward, rate, kappa)
    o = simulate_overlap(*buckets_of(ready, nbytes, cuts), backward, cost, rate)
    least, fewest = _brute_force_cost(ready, nbytes, cost, backward, rate, kappa)
    assert comm_cost_ms(o, backward, min(kappa, rate)) == pytest.approx(least, abs=1e-9)
    assert len(cuts) == fewest  # of the plans that cost the least, one with the fewest buckets


def test_a_thinned_front_still_gives_a_valid_plan(monkeypatch):
    monkeypatch.setattr(bucket_autotune, "FRONT_CAP", 3)  # thinned at every prefix
    rng = random.Random(7)
    for _ in range(20):
        n = rng.randint(4, 9)
        ready = sorted(rng.uniform(0, 20) for _ in range(n))
        nbytes = [rng.choice([4e4, 1e6, 4e6, 1.6e7]) for _ in range(n)]
        cost, rate, kappa = LinearCost(0.5, 0.5), rng.choice([1.0, 0.5, 0.1]), 0.05
        cuts = plan_cuts(ready, nbytes, cost, max(ready), rate, kappa)
        assert cuts[0] == 0 and list(cuts) == sorted(set(cuts)) and cuts[-1] < n
        o = simulate_overlap(*buckets_of(ready, nbytes, cuts), max(ready), cost, rate)
        assert comm_cost_ms(o, max(ready), kappa) >= _brute_force_cost(ready, nbytes, cost, max(ready), rate,
                                                                       kappa)[0] - 1e-9


def test_a_latency_free_cost_still_merges_when_splitting_gains_nothing():
    # 6 gradients of 1 MB ready at 1..6 ms, 1 ms per MB and no latency, backward ends at 20 ms: every plan
    # ends inside backward and costs 0.1 * 6 ms of overlap alike; the fewest buckets win the tie
    assert plan_cuts([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [1e6] * 6, LinearCost(0.0, 1.0), 20.0, 1.0, 0.1) == (0,)


def test_finish_at_a_lower_rate_while_backward_runs():
    # rate 0.5 until backward ends at 10 ms: 4 ms of work from 2 ms: 8 ms of wall time fit -> ends at 10;
    # 6 ms of work: 4 done by 10, 2 more at full speed -> 12; after backward: full speed
    assert finish_ms(2.0, 4.0, 10.0, 0.5) == pytest.approx(10.0)
    assert finish_ms(2.0, 6.0, 10.0, 0.5) == pytest.approx(12.0)
    assert finish_ms(12.0, 3.0, 10.0, 0.5) == pytest.approx(15.0)
    assert finish_ms(2.0, 6.0, 10.0) == 8.0 and finish_ms(2.0, 0.0, 10.0, 0.0) == pytest.approx(2.0)
    assert finish_ms(2.0, 6.0, 10.0, 0.0) == pytest.approx(16.0)  # nothing moves until backward ends


def _brute_force_end(ready: list[float], nbytes: list[float], cost: LinearCost,
                     rate: float = 1.0) -> tuple[float, int]:
    n, best = len(ready), (math.inf, 0)
    for mask in itertools.product([False, True], repeat=n - 1):
        cuts = [0, *(i + 1 for i, cut in enumerate(mask) if cut)]
        end = simulate_overlap(*buckets_of(ready, nbytes, cuts), max(ready), cost, rate).comm_end_ms
        best = min(best, (round(end, 9), len(cuts)))
    return best


@pytest.mark.parametrize("seed", range(10))
def test_plan_cuts_matches_brute_force_on_random_timelines(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    ready = sorted(rng.uniform(0, 20) for _ in range(n))
    nbytes = [rng.choice([4e2, 4e4, 1e6, 4e6, 1.6e7]) for _ in range(n)]
    cost = LinearCost(rng.choice([0.05, 0.5, 3.0]), rng.choice([0.1, 0.5, 2.0]))
    rate = rng.choice([1.0, 0.5, 0.1])
    cuts = plan_cuts(ready, nbytes, cost, max(ready), rate)
    end = simulate_overlap(*buckets_of(ready, nbytes, cuts), max(ready), cost, rate).comm_end_ms
    assert (round(end, 9), len(cuts)) == _brute_force_end(ready, nbytes, cost, rate)


def test_decide_plan_from_a_synthetic_probe():
    # 4 parameters of 1 MB ready at 1, 2, 3, 10 ms (medians of 3 probe iterations), "unused" never ready;
    # collectives measured exactly on 2 ms + 1 ms/MB: the fit recovers it and the plan is test_plan_cuts_by_hand's,
    # with "unused" (ready at the end of backward, 10 ms) joining the last bucket: [a b c] [d unused]
    order = ["a", "b", "c", "d", "unused"]
    nbytes = {n: 1_000_000 for n in order}
    ready = {"a": [1.0, 0.9, 1.1], "b": [2.0, 2.0, 2.2], "c": [3.0, 2.9, 3.0], "d": [10.0, 9.0, 11.0]}
    comm = [(b, 2.0 + b / 1e6) for b in (40, 4_000, 1_000_000, 2_000_000)]
    comm.append((3_000_000, 0.0))  # no time: left out
    comm += [(4_000, 50.0), (4_000, 2.004)]  # one long wait for a slow rank: the median per size holds
    d = decide_plan(order, nbytes, ready, [10.0, 9.5, 10.5], comm, [4.0, 5.0, 6.0])
    assert d.cuts == [0, 3] and d.order == order and d.fit_note == ""
    assert (d.cost.alpha_ms, d.cost.beta_ms_per_mb) == pytest.approx((2.0, 1.0))
    # [a b c] ready 3: 3 -> 8; [d unused] ready 10: 10 -> 14; exposed 14 - 10 = 4
    assert (d.backward_ms, d.predicted_exposed_ms, d.probe_exposed_ms, d.collectives) == pytest.approx((10, 4, 5, 6))
    # one message size only: priced at the median time, so one bucket at the end of backward
    one = decide_plan(order, nbytes, ready, [10.0], [(1000, 0.5), (1000, 0.7), (1000, 0.6)], [1.0])
    assert one.cuts == [0] and "at least 2 distinct message sizes" in one.fit_note
    assert one.predicted_exposed_ms == pytest.approx(0.6)
    # a probe whose allreduces barely moved during backward (exposed 14.5 ms measured; at rate 1 the
    # model says 6) fits a low overlap rate, and the plan then merges what would only wait anyway
    slow = decide_plan(order, nbytes, ready, [10.0], comm, [14.5])
    assert slow.overlap_rate < 0.2 and len(slow.cuts) <= 2
    assert slow.contention == 0.0 and slow.predicted_contention_ms == 0.0  # no backward stretch measured


def test_decide_plan_fits_the_contention_on_the_backward_stretch():
    # test_decide_plan_from_a_synthetic_probe's probe: rate 1 (a bucket per parameter at 3 ms each: 1 -> 4,
    # 4 -> 7, 7 -> 10, then 10 -> 16 after backward; exposed 6 is the closest to the measured 5), so the
    # probe overlapped 9 ms. A backward stretch of 4.5 ms: contention 0.5, and [a b c] [d unused] still wins
    # (exposed 4 + 0.5 * 5 overlapped = 6.5 ms; one bucket 10 -> 17: 7 ms), predicting 2.5 ms of stretch
    order = ["a", "b", "c", "d", "unused"]
    nbytes = {n: 1_000_000 for n in order}
    ready = {"a": [1.0], "b": [2.0], "c": [3.0], "d": [10.0]}
    comm = [(b, 2.0 + b / 1e6) for b in (40, 4_000, 1_000_000, 2_000_000)]
    d = decide_plan(order, nbytes, ready, [10.0], comm, [5.0], stretch_ms=4.5)
    assert d.overlap_rate == 1.0 and d.contention == pytest.approx(0.5) and d.cuts == [0, 3]
    assert (d.predicted_exposed_ms, d.predicted_contention_ms) == pytest.approx((4.0, 2.5))
    # a stretch of 9 ms: every overlapped ms cost a backward ms, so one bucket after backward
    d = decide_plan(order, nbytes, ready, [10.0], comm, [5.0], stretch_ms=9.0)
    assert d.contention == pytest.approx(1.0) and d.cuts == [0] and d.predicted_contention_ms == 0.0
    # backward ran faster with the overlap (noise): no contention
    assert decide_plan(order, nbytes, ready, [10.0], comm, [5.0], stretch_ms=-2.0).contention == 0.0
    # a stretch that does not exceed its noise (twice its standard error) is taken as 0
    d = decide_plan(order, nbytes, ready, [10.0], comm, [5.0], stretch_ms=9.0, stretch_noise_ms=9.5)
    assert d.contention == 0.0 and d.cuts == [0, 3] and "does not exceed its noise" in d.contention_note
    assert (d.stretch_ms, d.stretch_noise_ms) == (9.0, 9.5)


def test_expected_max_of_normals():
    # E[max of 2] = 1/sqrt(pi); E[max of 8] = 1.4236 (order-statistics tables)
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-4)
    assert expected_max_normal(8) == pytest.approx(1.4236, abs=1e-3)


def test_build_bucket_plan_with_cuts_cuts_every_group_at_the_same_positions():
    # global ready order: a0 b1 a2 a3 b4; cuts at positions 0 and 3 -> windows {0,1,2} {3,4}
    fp16 = GroupSpec("float16", 2, (SegmentSpec("a0", 0, 8, 0), SegmentSpec("a2", 8, 8, 2), SegmentSpec("a3", 16, 8, 3)))
    fp32 = GroupSpec("float32", 4, (SegmentSpec("b1", 0, 8, 1), SegmentSpec("b4", 8, 8, 4)))
    plan = build_bucket_plan([fp16, fp32], 25.0, 1.0, cuts=[0, 3])
    assert [b.names for b in plan.buckets] == [("b1",), ("a0", "a2"), ("a3",), ("b4",)]  # sorted by last position
    assert [(b.group, b.start, b.stop) for b in plan.buckets] == [(1, 0, 8), (0, 0, 16), (0, 16, 24), (1, 8, 16)]


def test_config_accepts_auto_and_rejects_a_bad_bucket_size():
    cfg = load_config(None, ["reducer.bucket_mb=auto", "model.channels_last=auto"])
    assert cfg.reducer.bucket_mb == "auto" and cfg.model.channels_last == "auto"
    assert load_config(None, ["reducer.bucket_mb=5"]).reducer.bucket_mb == 5.0
    assert load_config(None, []).model.channels_last == "auto"
    with pytest.raises(ConfigError, match=r"^reducer.bucket_mb must be float or one of \('auto',\), got 'big'$"):
        load_config(None, ["reducer.bucket_mb=big"])
    with pytest.raises(ConfigError, match=r"reducer.bucket_mb must be > 0, got -1.0"):
        load_config(None, ["reducer.bucket_mb=-1"])
    with pytest.raises(ConfigError, match=r"^model.channels_last must be bool or one of \('auto',\), got 1$"):
        load_config(None, ["model.channels_last=1"])
