"""The predicted step: buckets overlapped with backward (``dptrain.distributed.buckets.planner``'s model)
plus the per-step terms a real step pays (:class:`Terms`), the weak and strong efficiencies, and the
bucket plans (fixed caps and the auto plan) ranked by what the communication adds to the step."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from benchmarks.scaling.profile import BucketTiming, Profile, rebucket
from dptrain.distributed.buckets.planner import buckets_of, expected_max_normal, plan_cuts, simulate_overlap


@dataclass(frozen=True)
class Terms:
    """The per-step costs beyond the overlap model (the package docstring); zero: the plain overlap model."""

    contention: float = 0.0
    jitter_cv: float = 0.0
    input_images_per_s_per_node: float = 0.0
    """0: the input pipeline is not modelled (synthetic data, or an input path with no rate)."""
    input_images_per_s_per_process: float = 0.0
    """One solver process's own input ceiling (0: none)."""
    stats_bytes: int = 0
    stats_exposed: bool = False
    """True for DDP (buffers broadcast before forward); dptrain overlaps the statistics' allreduce."""
    host_ms_per_step: float = 0.0
    overlap_rate: float = 1.0
    """Speed of an allreduce while backward runs, relative to after it (1: NCCL on its own SMs; a
    CPU host without a spare core: much less; ``dptrain.distributed.buckets.planner.finish_ms``)."""
    world_size: int = 1
    gpus_per_node: int = 1


@dataclass(frozen=True)
class StepPrediction:
    step_ms: float
    exposed_ms: float
    comm_end_ms: float
    """End of the last allreduce, ms after backward start."""
    comm_busy_ms: float
    contention_ms: float = 0.0
    jitter_ms: float = 0.0
    input_ms: float = 0.0
    """The input pipeline's time per step at its ceiling (0: not modelled)."""


def input_ms(batch: float, solvers_on_node: int, t: Terms) -> float:
    """The input pipeline's time for one solver's batch when ``solvers_on_node`` solvers share the
    node's ceiling, or its own process ceiling binds first; 0 when neither is modelled."""
    node = solvers_on_node * batch / t.input_images_per_s_per_node * 1e3 if t.input_images_per_s_per_node else 0.0
    own = batch / t.input_images_per_s_per_process * 1e3 if t.input_images_per_s_per_process else 0.0
    return max(node, own)


def one_solver_ms(p: Profile, t: Terms = Terms()) -> float:
    """T_1: one solver, no communication, the whole node's input pipeline."""
    return max(max(p.compute_ms, t.host_ms_per_step), input_ms(p.batch_size, 1, t))


def simulate_step(p: Profile, comm_ms: Callable[[float], float], t: Terms = Terms()) -> StepPrediction:
    """T_N for ``t.world_size`` solvers (the package docstring); the overlap is ``dptrain.distributed.buckets.planner``'s."""
    o = simulate_overlap([b.ready_ms for b in p.buckets], [b.nbytes for b in p.buckets], p.backward_ms, comm_ms,
                         t.overlap_rate)
    compute = max(p.compute_ms, t.host_ms_per_step)
    stats = comm_ms(t.stats_bytes) if (t.stats_exposed and t.stats_bytes and t.world_size > 1) else 0.0
    contention = t.contention * o.overlapped_ms
    jitter = t.jitter_cv * compute * expected_max_normal(t.world_size)
    feed = input_ms(p.batch_size, min(t.world_size, t.gpus_per_node), t)
    step = max(compute + contention + o.exposed_ms + stats + jitter, feed)
    return StepPrediction(step, o.exposed_ms, o.comm_end_ms, o.busy_ms, contention, jitter, feed)


def weak_efficiency(p: Profile, pred: StepPrediction, t: Terms = Terms()) -> float:
    """T_1 / T_N at a fixed per-solver batch (one solver needs no allreduce)."""
    return one_solver_ms(p, t) / pred.step_ms


def strong_efficiency(p_full: Profile, pred: StepPrediction, world_size: int) -> float:
    """T_1(G) / (N * T_N(G / N)), where ``p_full`` is the one-solver profile at the global batch G."""
    return p_full.compute_ms / (world_size * pred.step_ms)


def auto_plan(p: Profile, comm: Callable[[float], float], t: Terms = Terms()) -> Profile:
    """``p`` cut where ``reducer.bucket_mb = "auto"`` would cut it (``dptrain.distributed.buckets.planner.plan_cuts``),
    weighing ``t``'s contention and overlap rate as the Reducer weighs its measured ones."""
    ready, nbytes = [b.ready_ms for b in p.buckets], [b.nbytes for b in p.buckets]
    r, s = buckets_of(ready, nbytes, plan_cuts(ready, nbytes, comm, p.backward_ms, t.overlap_rate, t.contention))
    return replace(p, buckets=tuple(BucketTiming(int(b), t) for t, b in zip(r, s, strict=True)), granularity="bucket")


def comm_step_ms(pred: StepPrediction) -> float:
    """What the communication adds to the step: exposed plus contention (the auto plan's objective)."""
    return pred.exposed_ms + pred.contention_ms


def sweep_bucket_sizes(p: Profile, comm: Callable[[int], float], caps_mb: list[float],
                       first_bucket_mb: float | None = None,
                       t: Terms = Terms()) -> list[tuple[float, int, StepPrediction]]:
    """(cap MiB, bucket count, prediction) for each cap, best first: least :func:`comm_step_ms`, then
    earliest end."""
    rows = []
    for cap in caps_mb:
        q = rebucket(p, cap, min(first_bucket_mb, cap) if first_bucket_mb else None)
        rows.append((cap, len(q.buckets), simulate_step(q, comm, t)))
    return sorted(rows, key=lambda r: (round(comm_step_ms(r[2]), 6), r[2].comm_end_ms))
