"""Bucket cost model and planner: the one implementation behind ``reducer.bucket_mb = "auto"``
and the scaling model in ``benchmarks/scaling/``. Pure: no torch, no process group. Times in ms, sizes in bytes.

Overlap model (one communication channel; buckets launch strictly in plan order, as the
Reducer launches them):

    start_k = max(ready_k, end_{k-1});   end_k = finish(start_k, cost(bytes_k))
    exposed = max(0, end_last - backward_ms)

where ``ready_k`` is when bucket k's last gradient is ready, in ms after backward starts
(clamped to [0, backward_ms]). ``cost`` is any non-decreasing function of the bytes: a
:class:`LinearCost` ``alpha + beta * bytes`` fitted from measured collectives (the
Reducer's auto plan), or the NCCL ring/tree/NVLS model of the scaling model. ``finish``
runs an allreduce at ``overlap_rate`` of its full speed while backward still computes and
at full speed after it (:func:`finish_ms`). On a GPU NCCL has SMs of its own (rate 1); on a
CPU host without a spare core the gloo threads get little time until backward ends (the
Reducer fits the rate on its probe's communication left after the slowest rank's backward,
:mod:`dptrain.distributed.buckets.probe`).

Planner (:func:`plan_cuts`): over the gradients in ready order, choose where buckets start
so that the last allreduce ends as early as possible (which minimises exposed
communication), fewest buckets on a tie. Dynamic programme over O(n^2) cost evaluations
for n gradients (then one O(n^2) level per bucket of the answer, for the fewest buckets): ``f(j) = min_i finish(max(R_j, f(i-1)), cost(S_j - S_{i-1}))`` with R_j the
latest ready time among the first j gradients and S_j their bytes. It is exact for this
model: a bucket's end is non-decreasing in the previous bucket's end, so the earliest end
of each prefix is all a later choice needs.

Contention: an allreduce that overlaps backward also takes from it (NCCL's kernels take SMs
and HBM bandwidth; gloo's threads take the cores of a CPU host). With ``contention`` kappa > 0
the planner minimises what the communication adds to the step, as the scaling model adds it:
``exposed + kappa * overlapped`` (:func:`comm_cost_ms`). Where kappa reaches the overlap rate
an overlapped millisecond costs backward as much as it moves the allreduce, and the plan with
the least total allreduce time (fewest buckets) is best; the Reducer's probe measures kappa
as the backward time its overlap adds.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median

import numpy as np

CostFn = Callable[[float], float]
"""Milliseconds one allreduce of that many bytes takes."""
FRONT_CAP = 512
"""Most states the contention planner keeps per prefix (:func:`_plan_with_contention`)."""
OVERLAP_RATES = tuple(i / 50 for i in range(1, 51))
"""Overlap rates the auto plan tries (0.02 .. 1): the one whose prediction of the probe's exposed
communication is closest to the measurement is kept."""


@dataclass(frozen=True)
class LinearCost:
    """``alpha_ms + beta_ms_per_mb * bytes / 1e6``: one allreduce, latency plus bytes over bandwidth."""

    alpha_ms: float
    beta_ms_per_mb: float

    def __call__(self, nbytes: float) -> float:
        return self.alpha_ms + self.beta_ms_per_mb * nbytes / 1e6


def fit_linear_cost(sizes_bytes: Sequence[float], times_ms: Sequence[float], relative: bool = True) -> LinearCost:
    """Least-squares ``alpha + beta * bytes`` through measured (bytes, ms) points.

    ``relative`` weights each point by 1/time (minimises relative error), so the small
    messages pin down alpha instead of being swamped by the large ones. Raises ValueError
    with fewer than 2 distinct sizes or a fitted time per byte <= 0. A negative intercept
    (noise on a latency of a few us) is clamped to 0 and beta refitted through the origin.
    """
    s, t = np.asarray(sizes_bytes, dtype=float), np.asarray(times_ms, dtype=float)
    if s.shape != t.shape or len(set(s.tolist())) < 2:
        raise ValueError("calibration needs times for at least 2 distinct message sizes")
    w = 1.0 / np.maximum(t, 1e-9) if relative else np.ones_like(t)
    (a, b), *_ = np.linalg.lstsq(np.stack([w, w * s], axis=1), w * t, rcond=None)
    if b <= 0:
        raise ValueError(f"fitted time per byte is {b:.3g} ms (<= 0): the measurements do not grow with size; "
                         "measure larger messages or more iterations")
    if a < 0:
        a, b = 0.0, float(np.sum(w * w * s * t) / np.sum(w * w * s * s))
    if not b > 0:
        raise ValueError(f"fitted time per byte through the origin is {b:.3g} ms (<= 0); the measured times are "
                         "not positive")
    return LinearCost(float(a), float(b) * 1e6)


def finish_ms(start, cost_ms, backward_ms: float, overlap_rate: float = 1.0):
    """End of an allreduce of ``cost_ms`` (at full speed) started at ``start``: it progresses at
    ``overlap_rate`` until ``backward_ms`` and at full speed after. Floats or numpy arrays."""
    if overlap_rate >= 1.0:
        return start + cost_ms
    inside = np.maximum(backward_ms - start, 0.0) * overlap_rate  # full-speed ms done before backward ends
    with np.errstate(divide="ignore", invalid="ignore"):
        early = start + np.where(cost_ms > 0, cost_ms / max(overlap_rate, 1e-12), 0.0)
    out = np.where(cost_ms <= inside, early, np.maximum(start, backward_ms) + cost_ms - inside)
    return float(out) if np.ndim(out) == 0 else out


@dataclass(frozen=True)
class Overlap:
    """What the overlap model predicts for one backward."""

    comm_end_ms: float
    """End of the last allreduce, ms after backward starts."""
    exposed_ms: float
    busy_ms: float
    """Sum of all allreduce times."""
    overlapped_ms: float
    """The part of ``busy_ms`` that runs while backward still computes."""


def simulate_overlap(ready_ms: Sequence[float], nbytes: Sequence[float], backward_ms: float,
                     cost: CostFn, overlap_rate: float = 1.0) -> Overlap:
    """Run the buckets through one in-order channel (see the module docstring)."""
    end = busy = overlapped = 0.0
    for r, b in zip(ready_ms, nbytes, strict=True):
        c = cost(b)
        start = max(min(max(r, 0.0), backward_ms), end)
        end = finish_ms(start, c, backward_ms, overlap_rate)
        busy += c
        overlapped += max(0.0, min(end, backward_ms) - start)
    return Overlap(end, max(0.0, end - backward_ms), busy, overlapped)


def plan_cuts(ready_ms: Sequence[float], nbytes: Sequence[float], cost: CostFn, backward_ms: float = math.inf,
              overlap_rate: float = 1.0, contention: float = 0.0) -> tuple[int, ...]:
    """Indices where buckets start (the first is 0) over gradients in ready order; see the module docstring.

    Without contention: two passes over the cost matrix ``C[i, j] = cost(bytes of gradients
    i..j-1)``: the earliest end E over any bucket count, then levels ``f_k`` (earliest end of
    each prefix with exactly k buckets, exact by the same argument) until ``f_k(n)`` reaches E:
    the fewest buckets that do. With ``contention`` > 0 (and a finite backward) the objective
    is the step time the communication costs, :func:`comm_cost_ms` (:func:`_plan_with_contention`).
    """
    n = len(ready_ms)
    if n == 0 or len(nbytes) != n:
        raise ValueError(f"plan_cuts needs one ready time per gradient, got {n} times and {len(nbytes)} sizes")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(nbytes, dtype=float))])
    ready = np.maximum.accumulate(np.maximum(np.asarray(ready_ms, dtype=float), 0.0))
    c = np.full((n + 1, n + 1), np.inf)  # c[i, j]: one bucket of gradients i..j-1
    for i in range(n):
        c[i, i + 1:] = [cost(prefix[j] - prefix[i]) for j in range(i + 1, n + 1)]
    if contention > 0 and math.isfinite(backward_ms):
        return _plan_with_contention(np.minimum(ready, backward_ms), c, backward_ms, overlap_rate,
                                     min(contention, overlap_rate))
    best = np.zeros(n + 1)  # earliest end of each prefix, any bucket count
    for j in range(1, n + 1):
        best[j] = np.min(finish_ms(np.maximum(ready[j - 1], best[:j]), c[:j, j], backward_ms, overlap_rate))
    target = best[n] + 1e-9 * max(1.0, abs(best[n]))
    levels = [np.concatenate([[0.0], np.full(n, np.inf)])]  # f_0: only the empty prefix
    starts: list[np.ndarray] = []
    while levels[-1][n] > target:
        prev = levels[-1]
        ends = finish_ms(np.maximum(ready[None, :], prev[:, None]), c[:, 1:], backward_ms, overlap_rate)  # [i, j-1]
        starts.append(np.argmin(ends, axis=0))
        levels.append(np.concatenate([[np.inf], ends[starts[-1], np.arange(n)]]))
    cuts, j = [], n
    for k in range(len(starts) - 1, -1, -1):
        j = int(starts[k][j - 1])
        cuts.append(j)
    return tuple(reversed(cuts))


def comm_cost_ms(o: Overlap, backward_ms: float, contention: float) -> float:
    """What the communication adds to a step: the exposed part plus the backward time the
    overlapped part takes (``contention`` ms per ms of overlap), as ``scaling_model.simulate_step``
    adds them."""
    return max(0.0, o.comm_end_ms - backward_ms) + contention * o.overlapped_ms


def _plan_with_contention(ready: np.ndarray, c: np.ndarray, backward_ms: float, rate: float,
                          kappa: float) -> tuple[int, ...]:
    """Cuts that minimise :func:`comm_cost_ms`; of the plans that do, the fewest buckets, then the
    earliest end.

    Exactness: the rest of a plan after a prefix depends on the prefix only through the time
    ``e`` its channel is free, and the rest's least cost is non-decreasing in ``e`` when
    ``kappa <= rate`` (the caller caps it there: above it an overlapped ms costs backward more
    than it moves, and a plan can only cut, not hold a launch back, so the best it can do is the
    least total allreduce time, which the cap gives). For a fixed rest that starts before
    backward ends (B): once every gradient is ready the channel runs without a gap, so with end
    ``E >= B``, ``exposed = W - rate * O`` (W: its allreduce time at full speed, O: its
    overlapped wall time) and its cost is ``(kappa / rate) * W + (1 - kappa / rate) * (E - B)``;
    it is ``kappa * W / rate`` when it ends inside backward; and ``e - B + W`` when it starts
    after B. E is non-decreasing in e (:func:`finish_ms` is monotone in its start), so all three
    are. Hence a prefix state that another ends no earlier than and overlaps no less than can be
    dropped: the dynamic programme over each prefix's non-dominated (end, overlapped ms) states
    is exact in cost (``tests/unit/test_bucket_autotune.py`` checks it against brute force).

    Two refinements keep it exact and small. Every bucket costs 1e-12 of the largest cost more,
    so a plan that is as good but for more buckets (a latency-free cost) no longer dominates the
    merged one, and the fewest buckets win the tie. And of a prefix's states that end by the
    time the next bucket is ready, only the one that overlapped least can start a better plan
    (all of them start that bucket at its ready time).

    Size: a prefix can keep many states where the allreduces barely fit behind backward. Past
    ``FRONT_CAP`` they are thinned to ends evenly spaced in time, and the plan is no longer
    exact. The cap sits above the states a prefix of the reference profile (ResNet-50's gradients)
    keeps, so its plan stays exact; a much longer timeline is thinned, and its plan comes within a
    fraction of a percent of the exact plan's cost in a fraction of the time
    (measurements: docs/measurements.md#bucket-plan-search).
    """
    n = len(ready)
    c = c + 1e-12 * (1.0 + float(np.max(c[np.isfinite(c)])))
    # every kept state of every prefix so far, each prefix's run sorted by end (its overlapped time falls)
    end, over = np.zeros(1), np.zeros(1)
    buckets, length, parent = np.zeros(1, dtype=int), np.zeros(1, dtype=int), np.full(1, -1)
    for j in range(1, n + 1):  # the states of prefix j: one more bucket after a state of a shorter prefix
        idle = end <= ready[j - 1]  # free before the bucket is ready: it starts at its ready time anyway
        cand = np.flatnonzero(~(idle & np.r_[idle[1:] & (length[1:] == length[:-1]), False]))
        start = np.maximum(ready[j - 1], end[cand])
        e = np.asarray(finish_ms(start, c[length[cand], j], backward_ms, rate), dtype=float).reshape(-1)
        o = over[cand] + np.maximum(0.0, np.minimum(e, backward_ms) - start)
        keep = _non_dominated(e, o, buckets[cand] + 1)
        if len(keep) > FRONT_CAP:  # thinned to evenly spaced ends (and the least overlap), by end time
            grid = np.linspace(e[keep[0]], e[keep[-1]], FRONT_CAP)
            keep = keep[np.unique(np.r_[np.searchsorted(e[keep], grid), len(keep) - 1].clip(0, len(keep) - 1))]
        end, over = np.concatenate([end, e[keep]]), np.concatenate([over, o[keep]])
        buckets = np.concatenate([buckets, buckets[cand[keep]] + 1])
        length = np.concatenate([length, np.full(len(keep), j)])
        parent = np.concatenate([parent, cand[keep]])
    last = np.flatnonzero(length == n)
    objective = np.maximum(0.0, end[last] - backward_ms) + kappa * over[last]
    near = objective <= np.min(objective) + 1e-9 * max(1.0, float(np.min(objective)))
    s = int(last[np.lexsort((end[last], buckets[last], ~near))[0]])
    cuts = []
    while parent[s] >= 0:
        s = int(parent[s])
        cuts.append(int(length[s]))
    return tuple(reversed(cuts))


def _non_dominated(end: np.ndarray, overlapped: np.ndarray, buckets: np.ndarray) -> np.ndarray:
    """Indices, by end, of the states that no other state beats or equals in both end and
    overlapped time (of equal ones, the one with the fewest buckets)."""
    order = np.lexsort((buckets, overlapped, end))
    o = overlapped[order]
    run = np.minimum.accumulate(o)
    return order[np.r_[True, o[1:] < run[:-1]]]


def buckets_of(ready_ms: Sequence[float], nbytes: Sequence[float],
               cuts: Sequence[int]) -> tuple[list[float], list[float]]:
    """(ready ms, bytes) per bucket when gradients in ready order are cut at ``cuts``."""
    bounds = [*cuts, len(ready_ms)]
    ready = [max(ready_ms[: bounds[k + 1]]) for k in range(len(cuts))]
    size = [float(sum(nbytes[bounds[k]: bounds[k + 1]])) for k in range(len(cuts))]
    return ready, size


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1), by numerical integration.

    Used for the slowest rank setting the pace: with per-rank step times ~ N(mu, sigma),
    a synchronous step waits ``sigma * expected_max_normal(n)`` past the mean.
    """
    if n <= 1:
        return 0.0
    x = np.linspace(-8.0, 8.0, 4001)
    phi = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    return float(np.trapezoid(x * n * phi * cdf ** (n - 1), x))


@dataclass(frozen=True)
class AutoDecision:
    """The auto plan: what rank 0 decides from its probe and broadcasts to every rank."""

    order: list[str]
    """Gradient-ready order, then the parameters that got no gradient: the new layout order."""
    cuts: list[int]
    """Positions in ``order`` where a bucket starts."""
    cost: LinearCost
    collectives: int
    """How many measured allreduces the cost was fitted on."""
    backward_ms: float
    predicted_exposed_ms: float
    probe_exposed_ms: float
    """Measured exposed communication of the probe plan (a bucket per parameter); the Reducer gives the
    least wait over the ranks, the communication left after the slowest rank's backward."""
    fit_note: str = ""
    """Why the fit fell back to the median allreduce time ("" when it did not)."""
    overlap_rate: float = 1.0
    """Fitted so the model reproduces the probe's measured exposed communication (see the module docstring)."""
    contention: float = 0.0
    """Backward ms lost per ms of overlapped allreduce: the probe's backward stretch over the overlap the
    model gives the probe plan (0 without a measured stretch); the planner weighs it up to ``overlap_rate``."""
    predicted_contention_ms: float = 0.0
    """``contention`` times the chosen plan's overlapped allreduce time."""
    contention_note: str = ""
    """Why the contention was taken as 0 ("" when it was fitted)."""
    stretch_ms: float | None = None
    """The probe's measured backward stretch (mean over the ranks' pairs) the contention came from."""
    stretch_noise_ms: float = 0.0
    """Twice its standard error: a stretch that does not exceed it is taken as noise."""

    def describe(self, plan: str, probe_plan: str) -> str:
        """One log line: the plan, what it was fitted on and what it predicts."""
        c = self.cost
        return (f"{plan} (probe: {probe_plan}); allreduce cost {c.alpha_ms:.3f} ms + {c.beta_ms_per_mb:.3f} ms/MB "
                f"fitted on {self.collectives} collectives, overlap rate {self.overlap_rate:.2f}, contention "
                f"{self.contention:.2f}; backward {self.backward_ms:.2f} ms; predicted exposed comm "
                f"{self.predicted_exposed_ms:.2f} ms (probe plan measured {self.probe_exposed_ms:.2f} ms after the "
                f"slowest rank's backward) and backward stretch {self.predicted_contention_ms:.2f} ms")


def decide_plan(order: Sequence[str], nbytes: dict[str, int], ready_ms: dict[str, list[float]],
                backward_ms: Sequence[float], collectives: Sequence[tuple[int, float]],
                probe_exposed_ms: Sequence[float], stretch_ms: float | None = None,
                stretch_noise_ms: float = 0.0) -> AutoDecision:
    """The auto plan from probe measurements: medians over the probe iterations, a cost fit, the cuts.

    ``order``: every parameter, ready ones first; ``ready_ms``: per parameter, its ready time
    (ms after backward starts) in each probe iteration (none: ready at the end of backward);
    ``collectives``: (bytes, ms) of each measured allreduce (the Reducer gives the least service
    time over the ranks: a rank that launched it early also waits for the last one); the fit takes
    the median time per size (a long tail on a shared host), and a time <= 0 is left out;
    ``probe_exposed_ms``: the probe plan's exposed communication per iteration, which the
    overlap rate is fitted to reproduce. If the cost fit fails (fewer than two sizes, or times
    that do not grow with size), every bucket is priced at the median allreduce time, which
    merges buckets as far as the timeline allows.

    ``stretch_ms``: how much longer backward took with the probe's allreduces overlapped than
    with them held until it ended; the contention is that over the overlapped time the model
    gives the probe plan. It is taken as 0 when not measured (None) or not above
    ``stretch_noise_ms`` (the Reducer gives twice its standard error): on a noisy host a chance
    stretch would otherwise merge every bucket. Approximation: the timeline planned on
    (ready times, backward) is the overlapped iterations', whose backward already holds the probe
    plan's stretch, so a plan that overlaps less than the probe is charged a little twice.
    """
    bwd = median(backward_ms)
    ready = [median(ready_ms[n]) if ready_ms.get(n) else bwd for n in order]
    sizes = [nbytes[n] for n in order]
    note, timed, by_size = "", [(b, t) for b, t in collectives if t > 0], {}
    for b, t in timed:
        by_size.setdefault(b, []).append(t)
    try:
        cost = fit_linear_cost(list(by_size), [median(v) for v in by_size.values()])
    except ValueError as e:
        cost, note = LinearCost(median(t for _, t in timed) if timed else 0.0, 0.0), str(e)
    measured = median(probe_exposed_ms)
    probe = ready, [float(b) for b in sizes]  # the probe plan: a bucket per parameter
    rate = min(OVERLAP_RATES, key=lambda r: abs(simulate_overlap(*probe, bwd, cost, r).exposed_ms - measured))
    overlapped = simulate_overlap(*probe, bwd, cost, rate).overlapped_ms
    kappa, kappa_note = 0.0, ""
    if stretch_ms is None:
        kappa_note = "no backward stretch measured"
    elif stretch_ms <= stretch_noise_ms:
        kappa_note = f"backward stretch {stretch_ms:.2f} ms does not exceed its noise ({stretch_noise_ms:.2f} ms)"
    elif overlapped > 0:
        kappa = min(1.0, stretch_ms / overlapped)
    cuts = plan_cuts(ready, sizes, cost, bwd, rate, kappa)
    pred = simulate_overlap(*buckets_of(ready, sizes, cuts), bwd, cost, rate)
    return AutoDecision(list(order), list(cuts), cost, len(timed), bwd, pred.exposed_ms, measured, note, rate,
                        kappa, kappa * pred.overlapped_ms, kappa_note, stretch_ms, stretch_noise_ms)
