"""Collective times on a machine: the alpha-beta models of the allreduce (ring, tree, hierarchical and
NVLS; the package docstring gives the formulas and their sources), the fastest per message as NCCL's tuner
takes it, the reduce-scatter and all-gather of a sharded run (:func:`scatter_gather_cost`), the bytes each
collective puts on the wire, and the alpha-beta fit of measured times."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from benchmarks.scaling.machine import GB, Machine
from dptrain.distributed.buckets.planner import fit_linear_cost

Algorithm = Literal["ring", "tree", "hierarchical", "nvls", "best"]
Collective = Literal["allreduce", "reduce_scatter", "all_gather"]


@dataclass(frozen=True)
class Cost:
    latency_ms: float
    transfer_ms: float
    algorithm: str

    @property
    def total_ms(self) -> float:
        return self.latency_ms + self.transfer_ms


def ring_allreduce(nbytes: float, n: int, alpha_us: float, busbw_gbs: float) -> Cost:
    """Flat ring on one link type: 2(n-1) alpha + 2(n-1)/n * S/B."""
    if n <= 1:
        return Cost(0.0, 0.0, "ring")
    return Cost(2 * (n - 1) * alpha_us / 1e3, 2 * (n - 1) / n * nbytes / (busbw_gbs * GB) * 1e3, "ring")


def tree_allreduce(nbytes: float, n: int, alpha_us: float, busbw_gbs: float) -> Cost:
    """Binary tree on one link type: 2 ceil(log2 n) alpha + 2 S/B."""
    if n <= 1:
        return Cost(0.0, 0.0, "tree")
    return Cost(2 * math.ceil(math.log2(n)) * alpha_us / 1e3, 2 * nbytes / (busbw_gbs * GB) * 1e3, "tree")


def _gpus_per_node(m: Machine, nodes: int, gpus_per_node: int | None) -> int:
    """The GPUs per node a collective runs on (``m``'s unless given); more than one node needs ``m``'s
    network entry."""
    if nodes > 1 and m.network is None:
        raise ValueError(f"machine {m.name!r} has no network entry; it can only be modelled as one node")
    return gpus_per_node or m.gpus_per_node


def allreduce_cost(nbytes: float, m: Machine, nodes: int, algorithm: Algorithm = "best",
                   gpus_per_node: int | None = None) -> Cost:
    """Allreduce time of ``nbytes`` on ``nodes`` x ``gpus_per_node`` GPUs of machine ``m``."""
    g = _gpus_per_node(m, nodes, gpus_per_node)
    n, nv, launch = nodes * g, m.nvlink, m.launch_us / 1e3
    if n <= 1:
        return Cost(0.0, 0.0, "none")
    cands: dict[str, Cost] = {}
    if nodes == 1:
        r, t = ring_allreduce(nbytes, n, nv.alpha_us, nv.busbw_gbs), tree_allreduce(nbytes, n, nv.alpha_us, nv.busbw_gbs)
        cands["ring"] = Cost(launch + r.latency_ms, r.transfer_ms, "ring")
        cands["tree"] = Cost(launch + 2 * (g - 1) * nv.alpha_us / 1e3, t.transfer_ms, "tree")  # a chain in a node
        if m.nvls is not None:
            cands["nvls"] = Cost(m.nvls.alpha_us / 1e3, 2 * (n - 1) / n * nbytes / (m.nvls.busbw_gbs * GB) * 1e3, "nvls")
    else:
        net = m.network
        bw = min(nv.busbw_gbs, net.busbw_gbs)
        inter = min(2 * nodes, 2 * (n - 1))  # NCCL: a ring crosses every node boundary once per pass
        cands["ring"] = Cost(launch + ((2 * (n - 1) - inter) * nv.alpha_us + inter * net.alpha_us) / 1e3,
                             2 * (n - 1) / n * nbytes / (bw * GB) * 1e3, "ring")
        cands["tree"] = Cost(launch + 2 * ((g - 1) * nv.alpha_us + math.ceil(math.log2(nodes)) * net.alpha_us) / 1e3,
                             2 * nbytes / (bw * GB) * 1e3, "tree")
        rs = ring_allreduce(nbytes, g, nv.alpha_us, nv.busbw_gbs)  # RS + AG together = one intra-node ring
        x = ring_allreduce(nbytes / g, nodes, net.alpha_us, net.busbw_gbs / g)  # each GPU's rail carries S/g
        cands["hierarchical"] = Cost(launch + rs.latency_ms + x.latency_ms, rs.transfer_ms + x.transfer_ms,
                                     "hierarchical")
    if algorithm == "best":
        return min(cands.values(), key=lambda c: c.total_ms)
    if algorithm not in cands:
        raise ValueError(f"algorithm {algorithm!r} does not apply to {nodes} node(s) of {m.name}; "
                         f"choose from {sorted(cands)} or 'best'")
    return cands[algorithm]


def wire_bytes(kind: Collective, nbytes: float, n: int) -> float:
    """Bytes each of ``n`` ranks sends for one collective over a buffer of ``nbytes`` (the whole bucket),
    bandwidth-optimal (ring) algorithms: allreduce 2(n-1)/n S, reduce-scatter and all-gather (n-1)/n S each
    (Patarasuk & Yuan 2009; nccl-tests doc/PERFORMANCE.md's busbw factors), so a reduce-scatter plus an
    all-gather put an allreduce's bytes on the wire."""
    if n <= 1:
        return 0.0
    return (2 if kind == "allreduce" else 1) * (n - 1) / n * nbytes


def ring_scatter_gather(nbytes: float, n: int, alpha_us: float, busbw_gbs: float) -> Cost:
    """Reduce-scatter or all-gather on a flat ring: (n-1) alpha + (n-1)/n * S/B, half a ring allreduce."""
    if n <= 1:
        return Cost(0.0, 0.0, "ring")
    return Cost((n - 1) * alpha_us / 1e3, (n - 1) / n * nbytes / (busbw_gbs * GB) * 1e3, "ring")


def scatter_gather_cost(nbytes: float, m: Machine, nodes: int, algorithm: Algorithm = "best",
                        gpus_per_node: int | None = None) -> Cost:
    """One reduce-scatter or all-gather of a bucket of ``nbytes`` (the whole bucket, each rank keeping or
    giving 1/n of it) on ``nodes`` x ``gpus_per_node`` GPUs of ``m``.

    NCCL runs them as rings (src/graph/tuning.cc: reduce-scatter and all-gather take the ring, and NVLS on
    one NVSwitch node; no tree): n - 1 steps, of which nodes - 1 cross the network, at the bus bandwidth
    the allreduce gets, plus the launch; on one node with NVLS, NVLS's latency once and (n-1)/n S over its
    bus bandwidth, half the NVLS allreduce (which is a reduce-scatter and an all-gather through the
    switch). ``algorithm``: "ring" or "nvls" where it applies, else the fastest of these (an allreduce
    algorithm with no reduce-scatter, tree or hierarchical, leaves NCCL the ring)."""
    g = _gpus_per_node(m, nodes, gpus_per_node)
    n, nv, launch = nodes * g, m.nvlink, m.launch_us / 1e3
    if n <= 1:
        return Cost(0.0, 0.0, "none")
    if nodes == 1:
        r = ring_scatter_gather(nbytes, n, nv.alpha_us, nv.busbw_gbs)
        cands = {"ring": Cost(launch + r.latency_ms, r.transfer_ms, "ring")}
        if m.nvls is not None:
            cands["nvls"] = Cost(m.nvls.alpha_us / 1e3, (n - 1) / n * nbytes / (m.nvls.busbw_gbs * GB) * 1e3, "nvls")
    else:
        net = m.network
        inter = nodes - 1  # tuning.cc: nInterSteps = nNodes - 1 for reduce-scatter and all-gather
        cands = {"ring": Cost(launch + ((n - 1 - inter) * nv.alpha_us + inter * net.alpha_us) / 1e3,
                              (n - 1) / n * nbytes / (min(nv.busbw_gbs, net.busbw_gbs) * GB) * 1e3, "ring")}
    if algorithm in cands:
        return cands[algorithm]
    return min(cands.values(), key=lambda c: c.total_ms)


def scatter_gather_fn(m: Machine, nodes: int, algorithm: Algorithm = "best",
                      gpus_per_node: int | None = None) -> Callable[[float], float]:
    """Bucket bytes -> ms of one reduce-scatter or all-gather (:func:`scatter_gather_cost`)."""
    return lambda nbytes: scatter_gather_cost(nbytes, m, nodes, algorithm, gpus_per_node).total_ms


def comm_fn(m: Machine, nodes: int, algorithm: Algorithm = "best", gpus_per_node: int | None = None) -> Callable[[int], float]:
    return lambda nbytes: allreduce_cost(nbytes, m, nodes, algorithm, gpus_per_node).total_ms


def fit_alpha_beta(sizes_bytes: list[float], times_s: list[float], n: int, relative: bool = True) -> tuple[float, float]:
    """Least-squares (alpha_us, busbw_gbs) of the ring model T = 2(n-1) alpha + 2(n-1)/n * S/B.

    Fits T = a + b S (``dptrain.distributed.buckets.planner.fit_linear_cost``, the Reducer's fit), then
    alpha = a / (2(n-1)) and B = 2(n-1)/n / b.
    """
    if n < 2:
        raise ValueError(f"calibration needs >= 2 ranks, got {n}")
    c = fit_linear_cost(sizes_bytes, [t * 1e3 for t in times_s], relative=relative)
    return c.alpha_ms * 1e3 / (2 * (n - 1)), 2 * (n - 1) / n / (c.beta_ms_per_mb / 1e3 / 1e6) / GB
