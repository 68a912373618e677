"""The sharded step (``reducer.shard = "optimizer"``, ZeRO-1; ``dptrain/distributed/shards.py``) priced
beside the unsharded one, per GPU count, with the memory per GPU of each.

A sharded step, as dptrain runs it:

- **backward**: each bucket, padded to a multiple of N x 64 elements, is reduce-scattered instead of
  allreduced, launched in plan order when ready on one channel: the overlap model of the allreduce
  (``dptrain.distributed.buckets.planner.simulate_overlap``) with the reduce-scatter's cost
  (:func:`benchmarks.scaling.allreduce.scatter_gather_cost`: a ring's n - 1 steps, half an allreduce's
  bytes at the same bus bandwidth);
- **the norm collective**: one allreduce of a few fp32 partial sums (the overflow flag and the clipping
  norm, :data:`NORM_BYTES`), after the last reduce-scatter and before the update, so wholly exposed; it
  runs when loss scaling or clipping is on, as in both reference recipes;
- **the update** on each solver's 1/N slice: memory-bound, so the unsharded update time x (padded
  elements / N) / elements;
- **the all-gathers** of the updated weights, launched after the update first layers first (reverse plan
  order) on one channel. With ``gather_wait = "forward"`` a forward pre-hook waits for a bucket's gather
  before the first layer holding its parameters runs: bucket k is needed at ``need_k`` ms into forward,
  taken from the backward timeline under the profile's own assumption that a layer's forward and
  backward times are in proportion (``need_k = forward_ms x (1 - ready_k / backward_ms)``: the layer
  whose gradient is ready last in backward runs first in forward). Forward then stalls
  ``max(0, max_k(end_k - need_k))`` in all (each stall pushes the later layers, and their gathers are
  already running), and the rest of the gathers overlap it. With ``gather_wait = "step"`` all of them
  are waited for before forward: the whole gather time is exposed.

The machine's contention is charged on the reduce-scatters that overlap backward and the gathers that
overlap forward, as on the allreduce; jitter, the host floor and the input ceilings are the unsharded
step's (:func:`benchmarks.scaling.simulation.simulate_step`). Weak-scaling efficiency = T_1 / T_N with
the same one-GPU T_1, so a sharded run that saves more update time than its collectives expose can
come out above the unsharded one.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from benchmarks.scaling.allreduce import Algorithm, comm_fn, scatter_gather_fn
from benchmarks.scaling.machine import Machine
from benchmarks.scaling.memory import memory_per_gpu, padded_numel
from benchmarks.scaling.profile import Profile, rebucket
from benchmarks.scaling.simulation import Terms, input_ms, one_solver_ms, simulate_step
from dptrain.distributed.buckets.planner import Overlap, expected_max_normal, simulate_overlap

GatherWait = Literal["forward", "step"]
NORM_BYTES = 16
"""The sharded run's per-step allreduce of fp32 partial sums (the overflow flag, a norm per parameter
group; ``dptrain.distributed.shards.Shards.sum_``): latency only at any size this small."""


@dataclass(frozen=True)
class GatherOverlap:
    """The updated weights' all-gathers against the next forward."""

    end_ms: float
    """End of the last gather, ms after the update ends."""
    exposed_ms: float
    """How long forward waits for gathers in all."""
    busy_ms: float


def simulate_gathers(need_ms: Sequence[float], cost_ms: Sequence[float], wait: GatherWait = "forward") -> GatherOverlap:
    """Gathers launched together at 0 in the given order (first layers first) on one channel; gather k
    must end before forward reaches ``need_ms[k]`` (pushed by the earlier stalls). See the module docstring."""
    end = stall = 0.0
    for need, c in zip(need_ms, cost_ms, strict=True):
        end += c
        stall = max(stall, end - max(need, 0.0))
    busy = float(sum(cost_ms))
    return GatherOverlap(end, end if wait == "step" else stall, busy)


def forward_need_ms(p: Profile) -> list[float]:
    """When forward first needs each bucket's weights, ms after it starts, in plan order (module docstring)."""
    if p.backward_ms <= 0:
        return [0.0 for _ in p.buckets]
    return [p.forward_ms * (1.0 - min(max(b.ready_ms, 0.0), p.backward_ms) / p.backward_ms) for b in p.buckets]


@dataclass(frozen=True)
class ShardedStep:
    """One sharded step's prediction; ``exposed_ms`` is what its collectives add beyond compute."""

    step_ms: float
    scatter_exposed_ms: float
    scatter_busy_ms: float
    norm_ms: float
    gather_exposed_ms: float
    gather_busy_ms: float
    update_ms: float
    contention_ms: float = 0.0
    jitter_ms: float = 0.0
    input_ms: float = 0.0
    padding_bytes: int = 0
    """The buckets' padding to N x 64 elements, in gradient bytes (each also carries it on the wire)."""

    @property
    def exposed_ms(self) -> float:
        return self.scatter_exposed_ms + self.norm_ms + self.gather_exposed_ms


def simulate_sharded_step(p: Profile, scatter_ms: Callable[[float], float], t: Terms | None = None, *,
                          norm_ms: float = 0.0, elem_bytes: int = 2, gather_wait: GatherWait = "forward",
                          gather_ms: Callable[[float], float] | None = None) -> ShardedStep:
    """T_N of a sharded run on ``t.world_size`` solvers (module docstring). ``scatter_ms``: one reduce-scatter
    of a padded bucket's bytes; ``gather_ms``: one all-gather (default: the same cost); ``norm_ms``: the norm
    allreduce; ``elem_bytes``: gradient bytes per element, for the padding; ``t``: the per-step terms
    (default: none, one solver)."""
    t = t or Terms()
    if t.stats_exposed:
        raise ValueError("stats_exposed prices DDP's buffer broadcast before forward; dptrain overlaps the running "
                         "statistics' allreduce, sharded or not: leave it False for a sharded run")
    n = max(t.world_size, 1)
    gather_ms = gather_ms or scatter_ms
    numel = [b.nbytes // elem_bytes for b in p.buckets]
    padded = [padded_numel(e, n) * elem_bytes for e in numel]
    if n == 1:  # one solver: no collective at all
        rs, ag, norm_ms = Overlap(0.0, 0.0, 0.0, 0.0), GatherOverlap(0.0, 0.0, 0.0), 0.0
    else:
        rs = simulate_overlap([b.ready_ms for b in p.buckets], padded, p.backward_ms, scatter_ms, t.overlap_rate)
        order = list(range(len(padded)))[::-1]  # launched first layers first: reverse plan order
        need = forward_need_ms(p)
        ag = simulate_gathers([need[i] for i in order], [gather_ms(padded[i]) for i in order], gather_wait)
    update_ms = p.update_ms * sum(padded) / max(sum(b.nbytes for b in p.buckets), 1) / n
    compute = max(p.forward_ms + p.backward_ms + update_ms, t.host_ms_per_step)
    overlapped = rs.overlapped_ms + (ag.busy_ms - ag.exposed_ms if gather_wait == "forward" else 0.0)
    contention = t.contention * overlapped
    jitter = t.jitter_cv * compute * expected_max_normal(t.world_size)
    feed = input_ms(p.batch_size, min(t.world_size, t.gpus_per_node), t)
    step = max(compute + contention + rs.exposed_ms + norm_ms + ag.exposed_ms + jitter, feed)
    return ShardedStep(step, rs.exposed_ms, rs.busy_ms, norm_ms, ag.exposed_ms, ag.busy_ms, update_ms, contention,
                       jitter, feed, sum(padded) - sum(b.nbytes for b in p.buckets))


def gpu_counts(m: Machine, nodes_list: Sequence[int]) -> list[int]:
    """1, 2, 4, ... up to the largest GPU count of ``nodes_list`` (the counts below a node on one node)."""
    top = max(nodes_list) * m.gpus_per_node
    return [2**k for k in range(top.bit_length()) if 2**k <= top]


def _placement(m: Machine, gpus: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of ``gpus`` GPUs: one node below a full one, whole nodes above."""
    if gpus <= m.gpus_per_node:
        return 1, gpus
    if gpus % m.gpus_per_node:
        raise ValueError(f"{gpus} GPUs is not a whole number of {m.name}'s {m.gpus_per_node}-GPU nodes")
    return gpus // m.gpus_per_node, m.gpus_per_node


def compare_rows(p: Profile, m: Machine, gpus_list: Sequence[int], algorithm: Algorithm,
                 terms: Callable[[int], Terms], *, elem_bytes: int = 2, shard: bool = True,
                 gather_wait: GatherWait = "forward") -> list[dict[str, Any]]:
    """Per GPU count: the unsharded prediction and (``shard``) the sharded one, with their efficiencies
    and the memory per GPU of each; ``terms``: node count -> the per-step terms (world size set here)."""
    t1 = replace(terms(1), world_size=1, gpus_per_node=1)
    base = one_solver_ms(p, t1)
    numel = [b.nbytes // elem_bytes for b in p.buckets]
    rows = []
    for gpus in gpus_list:
        nodes, g = _placement(m, gpus)
        t = replace(terms(nodes), world_size=gpus, gpus_per_node=g)
        allreduce = comm_fn(m, nodes, algorithm, g)
        un = simulate_step(p, allreduce, t)
        row: dict[str, Any] = {
            "gpus": gpus, "nodes": nodes,
            "unsharded": {"step_ms": un.step_ms, "efficiency": base / un.step_ms, "exposed_ms": un.exposed_ms,
                          "update_ms": p.update_ms,
                          "memory": {o: memory_per_gpu(numel, gpus, shard=False, optimizer=o, weight_bytes=elem_bytes)
                                     for o in ("sgd", "adam")}}}
        if shard:
            sh = simulate_sharded_step(p, scatter_gather_fn(m, nodes, algorithm, g), t,
                                       norm_ms=allreduce(NORM_BYTES), elem_bytes=elem_bytes,
                                       gather_wait=gather_wait)
            row["sharded"] = {"step_ms": sh.step_ms, "efficiency": base / sh.step_ms, "exposed_ms": sh.exposed_ms,
                              "scatter_exposed_ms": sh.scatter_exposed_ms, "norm_ms": sh.norm_ms,
                              "gather_exposed_ms": sh.gather_exposed_ms, "update_ms": sh.update_ms,
                              "padding_bytes": sh.padding_bytes,
                              "memory": {o: memory_per_gpu(numel, gpus, shard=True, optimizer=o, weight_bytes=elem_bytes)
                                         for o in ("sgd", "adam")}}
        rows.append(row)
    return rows


def sweep_caps(raw: Profile, m: Machine, gpus: int, caps_mb: Sequence[float], first_bucket_mb: float | None,
               algorithm: Algorithm, terms: Callable[[int], Terms], *, elem_bytes: int = 2,
               gather_wait: GatherWait = "forward") -> list[dict[str, Any]]:
    """Per bucket cap (MiB; the first bucket min(cap, ``first_bucket_mb``)): the bucket count and the step
    sharded and unsharded on ``gpus`` GPUs. Each reduce-scatter and all-gather pays a ring's n - 1 steps of
    latency, so at scale fewer, larger buckets can win where the allreduce (a tree across nodes) did not."""
    nodes, g = _placement(m, gpus)
    t = replace(terms(nodes), world_size=gpus, gpus_per_node=g)
    allreduce = comm_fn(m, nodes, algorithm, g)
    out = []
    for cap in caps_mb:
        q = rebucket(raw, cap, min(first_bucket_mb, cap) if first_bucket_mb else None)
        sh = simulate_sharded_step(q, scatter_gather_fn(m, nodes, algorithm, g), t, norm_ms=allreduce(NORM_BYTES),
                                   elem_bytes=elem_bytes, gather_wait=gather_wait)
        out.append({"cap_mb": cap, "buckets": len(q.buckets), "sharded_step_ms": sh.step_ms,
                    "unsharded_step_ms": simulate_step(q, allreduce, t).step_ms})
    return out


def rows_to_json(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`compare_rows` as plain JSON values, the memory in GB per part."""
    out = []
    for r in rows:
        j: dict[str, Any] = {"gpus": r["gpus"], "nodes": r["nodes"]}
        for mode in ("unsharded", "sharded"):
            if mode in r:
                j[mode] = {k: ({o: mem.gb() for o, mem in v.items()} if k == "memory" else v)
                           for k, v in r[mode].items()}
        out.append(j)
    return out
