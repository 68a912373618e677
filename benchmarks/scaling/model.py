"""Scaling model: predicted step time and scaling efficiency of dptrain on N GPUs and nodes.

Inputs: one solver's profile (forward, backward and update time; per bucket its bytes and
the time its last gradient is ready, relative to backward start), taken from a
``--trace`` (:func:`profile_from_trace`) or a JSON profile, and an alpha-beta model of the
allreduce on a machine from :data:`MACHINES`.

Allreduce of S bytes on n ranks, alpha = per-step latency, B = bus bandwidth in the
nccl-tests sense (busbw = algbw * 2(n-1)/n, nvidia/nccl-tests doc/PERFORMANCE.md):
- ring:  2(n-1) alpha + 2(n-1)/n * S/B   (reduce-scatter + allgather; Patarasuk & Yuan 2009)
- tree:  2 ceil(log2 n) alpha + 2 S/B    (reduce up a pipelined binary tree, broadcast down)
Multi-node (N nodes of g GPUs, n = N g), following NCCL's own tuning model
(src/graph/tuning.cc, ncclTopoTuneModel): ring latency counts 2N network hops and the rest
NVLink hops, bandwidth min(NVLink busbw, node network bandwidth); tree latency
2((g-1) alpha_nvlink + ceil(log2 N) alpha_net), bandwidth term 2 S/B (NCCL's tree algbw is
busbw/2); hierarchical = NVLink reduce-scatter, per-rail ring allreduce of S/g across nodes,
NVLink allgather. ``best`` takes the fastest per message, as NCCL's tuner does.

Overlap: buckets launch in plan order when ready and run one at a time on one channel;
exposed comm = max(0, end of the last allreduce - end of backward) (``dptrain.distributed.buckets.planner``,
the cost model the Reducer's ``bucket_mb = "auto"`` plans with). The costs a real step pays
beyond that (:class:`Terms`, each documented with its source in the profile files):

    compute = forward + backward + update, at least host_ms_per_step (launch + host loop)
    T_N = max(compute + contention * overlapped comm + exposed + stats + jitter_cv * compute * E[max of N normals],
              N_node * batch / input_images_per_s_per_node, batch / input_images_per_s_per_process)

and an allreduce progresses at overlap_rate of its speed while backward runs (1 on GPUs).

contention: NCCL kernels take SMs and HBM from the backward they overlap; stats: the running
statistics' allreduce where it is not overlapped; jitter: the slowest of N ranks sets the pace;
the input pipeline's ceilings, per node and per solver process. Weak-scaling efficiency = T_1 / T_N.

The input ceilings are stated, never fitted to a scaling result: an input path
(``benchmarks/scaling/profiles/inputs.toml``, :class:`InputPath`) gives a cited rate per node, or what
``dptrain data-bench`` measures (CPU ms per image, one process's ceiling), which
:func:`input_rates` turns into a node's rate with the machine's CPU cores. A path with no rate is
not modelled, and a prediction made with it says so (compute and communication only).

Machines (``benchmarks/scaling/profiles/machines/*.toml``: GPUs per node, HBM, NVLink/NVSwitch, NIC,
contention) and workloads (``benchmarks/scaling/profiles/workloads/*.toml``: one-GPU rate, batch,
gradient bytes, jitter, input path per machine) are data files to copy and edit for your
cluster. ``benchmarks/scaling/scaling_validate.py`` checks the model against published tables.

    python -m benchmarks.scaling.model                     # DGX H100, reference ResNet-50 profile
    python -m benchmarks.scaling --profile runs/t.rank0.json --profile-batch 32 --machines dgx-h100,dgx-a100
    python -m benchmarks.scaling --calibrate           # gloo alpha/beta on this machine, 2 processes
    python -m benchmarks.scaling --calibrate --measured-bench bench2.jsonl --bench-profile t.rank0.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import tomllib

from dptrain.distributed.buckets.planner import (
    buckets_of,
    expected_max_normal,
    fit_linear_cost,
    plan_cuts,
    simulate_overlap,
)

PROFILES = Path(__file__).resolve().parent / "profiles"
GB = 1e9  # bandwidths are in GB/s = 1e9 bytes/s, as nccl-tests reports them
MIB = 1024 * 1024
Algorithm = Literal["ring", "tree", "hierarchical", "nvls", "best"]
EFFICIENCY_FLOOR = 0.8
"""Below this efficiency we say scaling has broken down."""
DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB = 25.0, 1.0
"""dptrain's reducer.bucket_mb / first_bucket_mb defaults (as DDP), used to plan a per-parameter profile."""


# ---------------------------------------------------------------------------------------- profile

@dataclass(frozen=True)
class BucketTiming:
    nbytes: int
    ready_ms: float
    """When the bucket's last gradient is ready, in ms after backward starts."""


@dataclass(frozen=True)
class Profile:
    """One solver's step: compute phases and the gradient-ready timeline, in plan order."""

    forward_ms: float
    backward_ms: float
    update_ms: float
    buckets: tuple[BucketTiming, ...]
    batch_size: int = 0
    """Per-solver batch the profile was taken at (0: unknown; then no images/s or strong scaling)."""
    granularity: Literal["bucket", "parameter"] = "bucket"
    """"parameter": one entry per parameter, never split when re-bucketing; "bucket": a coarse
    plan, split with gradient bytes assumed to become ready linearly within each bucket."""
    source: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms + self.update_ms


def _median(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else 0.0


def profile_from_trace(trace: dict[str, Any], *, batch_size: int = 0, source: str = "") -> Profile:
    """Median per-step profile from a dptrain Chrome trace (``--trace PATH`` -> PATH.rank<r>.json).

    A step runs from one ``forward`` event to the next. Bucket i's ready time is its
    ``bucket_ready`` instant minus the step's ``backward`` start; a bucket with no instant
    (no gradient this step) is ready at the end of backward. Bytes come from the event args.
    """
    events = sorted(trace.get("traceEvents", []), key=lambda e: e.get("ts", 0.0))
    starts = [e["ts"] for e in events if e.get("ph") == "X" and e.get("name") == "forward"]
    if not starts:
        raise ValueError("trace has no 'forward' events; record it with `dptrain bench|train --trace PATH`")
    steps: list[dict[str, Any]] = []
    for i, t0 in enumerate(starts):
        t1 = starts[i + 1] if i + 1 < len(starts) else math.inf
        evs = [e for e in events if t0 <= e.get("ts", 0.0) < t1]
        span = {e["name"]: e for e in evs if e.get("ph") == "X" and e["name"] in ("forward", "backward", "update")}
        if len(span) == 3:
            steps.append({"span": span, "evs": evs})
    if not steps:
        raise ValueError("trace has no complete step (forward, backward and update events)")
    nbytes: dict[int, int] = {}
    ready: dict[int, list[float]] = {}
    for s in steps:
        bwd = s["span"]["backward"]
        for e in s["evs"]:
            if e.get("name") in ("bucket_ready", "allreduce") and "bucket" in e.get("args", {}):
                nbytes[int(e["args"]["bucket"])] = int(e["args"]["bytes"])
            if e.get("name") == "bucket_ready" and e.get("ph") == "i":
                ready.setdefault(int(e["args"]["bucket"]), []).append(min(e["ts"] - bwd["ts"], bwd["dur"]) / 1e3)
    if not nbytes:
        raise ValueError("trace has no 'bucket_ready' or 'allreduce' events; record it with "
                         "`dptrain bench --trace PATH` (any world size)")
    bwd_ms = _median([s["span"]["backward"]["dur"] / 1e3 for s in steps])
    buckets = tuple(BucketTiming(nbytes[i], max(0.0, _median(ready[i])) if i in ready else bwd_ms)
                    for i in sorted(nbytes))
    return Profile(forward_ms=_median([s["span"]["forward"]["dur"] / 1e3 for s in steps]), backward_ms=bwd_ms,
                   update_ms=_median([s["span"]["update"]["dur"] / 1e3 for s in steps]), buckets=buckets,
                   batch_size=batch_size, granularity="bucket", source=source or f"trace, {len(steps)} steps")


def profile_to_json(p: Profile) -> dict[str, Any]:
    return {"forward_ms": p.forward_ms, "backward_ms": p.backward_ms, "update_ms": p.update_ms,
            "batch_size": p.batch_size, "granularity": p.granularity, "source": p.source,
            "buckets": [{"bytes": b.nbytes, "ready_ms": b.ready_ms} for b in p.buckets]}


def profile_from_json(d: dict[str, Any]) -> Profile:
    """Inverse of :func:`profile_to_json`; raises ValueError naming a missing key."""
    try:
        return Profile(forward_ms=float(d["forward_ms"]), backward_ms=float(d["backward_ms"]),
                       update_ms=float(d["update_ms"]), batch_size=int(d.get("batch_size", 0)),
                       granularity=d.get("granularity", "bucket"), source=str(d.get("source", "")),
                       buckets=tuple(BucketTiming(int(b["bytes"]), float(b["ready_ms"])) for b in d["buckets"]))
    except KeyError as e:
        raise ValueError(f"profile JSON lacks key {e}; expected forward_ms, backward_ms, update_ms and "
                         "buckets: [{bytes, ready_ms}, ...]") from e


def load_profile(path: str | Path, batch_size: int = 0) -> Profile:
    """A profile from a trace file (has traceEvents) or a profile JSON file."""
    d = json.loads(Path(path).read_text())
    if "traceEvents" in d:
        return profile_from_trace(d, batch_size=batch_size, source=str(path))
    p = profile_from_json(d)
    return replace(p, batch_size=batch_size) if batch_size else p


def scale_compute(p: Profile, factor: float) -> Profile:
    """The profile at ``factor`` x the per-solver batch: forward, backward and ready times scale
    linearly (optimistic below full GPU occupancy); update and bytes do not depend on the batch."""
    return replace(p, forward_ms=p.forward_ms * factor, backward_ms=p.backward_ms * factor,
                   buckets=tuple(replace(b, ready_ms=b.ready_ms * factor) for b in p.buckets),
                   batch_size=round(p.batch_size * factor))


@dataclass(frozen=True)
class BatchCost:
    """One solver's step time in its batch b: ``fixed_ms + b * per_image_ms``.

    ``fixed_ms`` is what does not shrink with the batch (kernel launches, batch norm and the update
    over small tensors, the host loop, the input pipeline's per-batch work): at a small per-GPU
    batch, as strong scaling gives, a step costs more than its share of images. Fitted by least
    squares from ``dptrain bench`` at 3 or more per-solver batches of one model on one device
    (:func:`fit_batch_cost`)."""

    fixed_ms: float
    per_image_ms: float
    points: tuple[tuple[int, float], ...] = ()
    """(batch, step ms) the fit came from."""
    source: str = ""

    def ms(self, batch: float) -> float:
        return self.fixed_ms + batch * self.per_image_ms

    @property
    def max_error(self) -> float:
        """The fit's largest relative error over its own points."""
        return max((abs(self.ms(b) - t) / t for b, t in self.points), default=0.0)


def fit_batch_cost(points: list[tuple[int, float]], source: str = "") -> BatchCost:
    """Least-squares ``step = fixed + b * per_image`` through (batch, step ms) points at >= 3
    batches; a negative fixed part (noise at a step that is all per-image work) is fitted as 0."""
    batches = sorted({b for b, _ in points})
    if len(batches) < 3:
        raise ValueError(f"fitting step(b) needs bench at 3 or more batch sizes, got {batches}")
    b = np.array([x for x, _ in points], dtype=float)
    t = np.array([y for _, y in points], dtype=float)
    per_image, fixed = np.polyfit(b, t, 1)
    if fixed < 0:
        fixed, per_image = 0.0, float((b * t).sum() / (b * b).sum())
    if per_image <= 0:
        raise ValueError(f"step time does not grow with the batch in {sorted(points)}: nothing to fit")
    return BatchCost(float(fixed), float(per_image), tuple(sorted(points)), source)


def json_lines(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, one per line that starts with "{" (a command's JSON output among its log)."""
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip().startswith("{")]


def last_json_line(path: str | Path, keys: tuple[str, ...], what: str) -> dict[str, Any]:
    """The last JSON line of ``path`` that has every one of ``keys``; ``what`` names it in the error."""
    recs = [r for r in json_lines(path) if all(k in r for k in keys)]
    if not recs:
        raise ValueError(f"{path}: no {what} JSON line (with {' and '.join(keys)})")
    return recs[-1]


def batch_points(path: str | Path) -> list[tuple[int, float]]:
    """(batch_size, step_ms_median) of every one-solver ``dptrain bench`` JSON line in ``path``, all of
    one model, precision and device."""
    out, kinds = [], set()
    for r in json_lines(path):
        if r.get("world_size", 1) != 1:
            raise ValueError(f"{path}: a step(b) fit needs one-solver bench lines; one has world_size "
                             f"{r['world_size']}")
        kinds.add((r.get("model"), r.get("precision"), r.get("device")))
        out.append((int(r["batch_size"]), float(r["step_ms_median"])))
    if len(kinds) > 1:
        raise ValueError(f"{path}: the bench lines mix models, precisions or devices {sorted(map(str, kinds))}; "
                         "fit one at a time")
    return out


def scale_to_batch(p: Profile, batch: float, cost: BatchCost | None = None) -> Profile:
    """The profile at per-solver batch ``batch``: linear in the batch without ``cost``
    (:func:`scale_compute`), else forward, backward and ready times scaled by the fitted step's
    ratio less the update, which the fit includes and the profile keeps apart:
    ``(cost.ms(batch) - update) / (cost.ms(p.batch_size) - update)``; the fixed part stays when the
    batch falls."""
    if cost is None:
        return scale_compute(p, batch / p.batch_size)
    base = cost.ms(p.batch_size) - p.update_ms
    if base <= 0:
        raise ValueError(f"the fitted step at batch {p.batch_size} ({cost.ms(p.batch_size):.2f} ms) is not longer "
                         f"than the profile's update ({p.update_ms:.2f} ms): the fit and the profile disagree")
    f = max(cost.ms(batch) - p.update_ms, 0.0) / base
    return replace(p, forward_ms=p.forward_ms * f, backward_ms=p.backward_ms * f,
                   buckets=tuple(replace(b, ready_ms=b.ready_ms * f) for b in p.buckets), batch_size=round(batch))


def rebucket(p: Profile, bucket_mb: float, first_bucket_mb: float | None = None) -> Profile:
    """The profile re-cut into buckets of ``bucket_mb`` MiB (the first: ``first_bucket_mb``).

    Parameter granularity follows dptrain's rule (buckets.py): close a bucket when the next
    parameter would overflow it; a bucket is ready when its last parameter is. Bucket
    granularity is split at exact byte offsets, bytes becoming ready linearly in time
    between the previous bucket's ready time (0 for the first) and this bucket's.
    """
    if bucket_mb <= 0 or (first_bucket_mb is not None and first_bucket_mb <= 0):
        raise ValueError(f"bucket sizes must be > 0 MiB, got {bucket_mb} and {first_bucket_mb}")
    caps = (first_bucket_mb or bucket_mb) * MIB, bucket_mb * MIB
    out: list[BucketTiming] = []
    if p.granularity == "parameter":
        cur_bytes, cur_ready = 0, 0.0
        for b in p.buckets:
            if cur_bytes and cur_bytes + b.nbytes > caps[bool(out)]:
                out.append(BucketTiming(cur_bytes, cur_ready))
                cur_bytes, cur_ready = 0, 0.0
            cur_bytes, cur_ready = cur_bytes + b.nbytes, max(cur_ready, b.ready_ms)
        if cur_bytes:
            out.append(BucketTiming(cur_bytes, cur_ready))
        return replace(p, buckets=tuple(out), granularity="bucket")
    total = sum(b.nbytes for b in p.buckets)
    sizes, start = [], 0
    while start < total:
        sizes.append(min(total - start, int(caps[bool(sizes)])))
        start += sizes[-1]
    return recut(p, sizes)


def recut(p: Profile, sizes_bytes: list[int]) -> Profile:
    """The profile cut into buckets of exactly ``sizes_bytes`` (in ready order, e.g. a run's own plan
    as its trace records it), bytes becoming ready linearly in time between the profile's knots."""
    cum, t_prev, pts = 0, 0.0, [(0, 0.0)]  # (cumulative bytes, time) knots of the ready curve
    for b in p.buckets:
        t_prev = max(t_prev, b.ready_ms)
        cum += b.nbytes
        pts.append((cum, t_prev))
    out: list[BucketTiming] = []
    start = 0
    for size in sizes_bytes:
        end = min(cum, start + int(size))
        k = next(i for i in range(1, len(pts)) if pts[i][0] >= end)
        (c0, t0), (c1, t1) = pts[k - 1], pts[k]
        out.append(BucketTiming(end - start, t0 + (end - c0) / (c1 - c0) * (t1 - t0)))
        start = end
    return replace(p, buckets=tuple(out), granularity="bucket")


# ---------------------------------------------------------------------------------------- machines

@dataclass(frozen=True)
class Link:
    busbw_gbs: float
    """Bus bandwidth B (GB/s) in the nccl-tests sense; for a network, the node's NICs together."""
    alpha_us: float
    """Latency per algorithm step (one hop of a chunk)."""
    source: str


@dataclass(frozen=True)
class Machine:
    name: str
    gpus_per_node: int
    nvlink: Link
    network: Link | None
    nvls: Link | None = None
    """NVLink SHARP (single node only): alpha_us is paid once, not per step."""
    launch_us: float = 0.0
    """Fixed cost per collective (NCCL baseLat, ring/Simple)."""
    hbm_gbs: float = 0.0
    contention: float = 0.0
    """Fraction of the communication time that overlaps backward which backward loses to it."""
    sources: tuple[tuple[str, str], ...] = ()
    cpu_cores: int = 0
    """Physical CPU cores per node, for an input path priced in CPU time per image (0: unknown)."""


def _link(d: dict[str, Any] | None) -> Link | None:
    return Link(float(d["busbw_gbs"]), float(d["alpha_us"]), str(d["source"])) if d else None


def load_machine(path: Path) -> Machine:
    """A machine profile from its TOML file (see benchmarks/scaling/profiles/machines/dgx-h100.toml)."""
    try:
        d = tomllib.loads(path.read_text())
        return Machine(str(d["name"]), int(d["gpus_per_node"]), _link(d["nvlink"]), _link(d.get("network")),
                       _link(d.get("nvls")), float(d.get("launch_us", 0.0)), float(d["hbm_gbs"]),
                       float(d.get("contention", 0.0)),
                       tuple((k, str(v)) for k, v in d.items() if k.endswith("_source")), int(d.get("cpu_cores", 0)))
    except (KeyError, TypeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: not a machine profile ({e!r}); start from machines/dgx-h100.toml") from e


MACHINES: dict[str, Machine] = {p.stem: load_machine(p) for p in sorted((PROFILES / "machines").glob("*.toml"))}


# ---------------------------------------------------------------------------------------- input paths

@dataclass(frozen=True)
class InputPath:
    """An input pipeline's rate, stated with its source (``benchmarks/scaling/profiles/inputs.toml``): a
    cited rate per node, or ``dptrain data-bench``'s measurement on one node (CPU ms per image over
    all its threads, and one process's own ceiling, the GIL's). Never fitted from a scaling row."""

    name: str
    images_per_s_per_node: float = 0.0
    """A cited or measured rate for a whole node (0: derive it from the CPU time, if any)."""
    cpu_ms_per_image: float = 0.0
    """Host CPU time per image, all threads together (``data-bench``'s ``cpu_ms_per_image``)."""
    process_images_per_s: float = 0.0
    """One solver process's ceiling, whatever the cores (1 / the GIL held per image; 0: none)."""
    source: str = ""

    @property
    def stated(self) -> bool:
        """Whether the path has any rate; without one a prediction is compute and communication only."""
        return bool(self.images_per_s_per_node or self.cpu_ms_per_image or self.process_images_per_s)


def input_rates(path: InputPath | None, cpu_cores: int) -> tuple[float, float]:
    """(images/s per node, images/s per solver process) of ``path`` on a node of ``cpu_cores``
    physical cores; 0 where nothing bounds it. A node's rate is the stated one, else
    cores x 1000 / CPU ms per image (every core decoding, at the measuring host's speed per core)."""
    if path is None:
        return 0.0, 0.0
    node = path.images_per_s_per_node
    if not node and path.cpu_ms_per_image and cpu_cores:
        node = cpu_cores * 1e3 / path.cpu_ms_per_image
    return node, path.process_images_per_s


def input_path_from_data_bench(path: str | Path) -> InputPath:
    """dptrain's input path as ``dptrain data-bench`` measured it on one node of the machine being
    predicted (its last JSON line in ``path``): CPU ms per image, and images/s of one solver process
    at the defaults as that process's ceiling. Measured elsewhere, the per-process rate is that
    host's, not the target's: run it on the node."""
    r = last_json_line(path, ("cpu_ms_per_image", "images_per_s"), "`dptrain data-bench`")
    return InputPath("data-bench", cpu_ms_per_image=float(r["cpu_ms_per_image"]),
                     process_images_per_s=float(r["images_per_s"]),
                     source=f"{path}: dptrain data-bench, {r['images_per_s']:,.0f} img/s per process at "
                            f"{r['cpu_ms_per_image']} CPU ms per image on a host of {r.get('host_cores', '?')} cores")


def load_inputs(path: Path = PROFILES / "inputs.toml") -> dict[str, InputPath]:
    """The input paths of ``path`` by name ([paths.<name>] tables)."""
    try:
        d = tomllib.loads(Path(path).read_text())["paths"]
        return {k: InputPath(k, float(v.get("images_per_s_per_node", 0.0)), float(v.get("cpu_ms_per_image", 0.0)),
                             float(v.get("process_images_per_s", 0.0)), str(v["source"])) for k, v in d.items()}
    except (KeyError, TypeError, AttributeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: not an input-paths file ({e!r}); each [paths.NAME] needs a source") from e


INPUTS: dict[str, InputPath] = load_inputs()


# ---------------------------------------------------------------------------------------- collectives

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


def allreduce_cost(nbytes: float, m: Machine, nodes: int, algorithm: Algorithm = "best",
                   gpus_per_node: int | None = None) -> Cost:
    """Allreduce time of ``nbytes`` on ``nodes`` x ``gpus_per_node`` GPUs of machine ``m``."""
    g = gpus_per_node or m.gpus_per_node
    n, nv, launch = nodes * g, m.nvlink, m.launch_us / 1e3
    if n <= 1:
        return Cost(0.0, 0.0, "none")
    if nodes > 1 and m.network is None:
        raise ValueError(f"machine {m.name!r} has no network entry; it can only be modelled as one node")
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


# ---------------------------------------------------------------------------------------- overlap

@dataclass(frozen=True)
class Terms:
    """The per-step costs beyond the overlap model (module docstring); zero: the plain overlap model."""

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
    """T_N for ``t.world_size`` solvers (module docstring); the overlap is ``dptrain.distributed.buckets.planner``'s."""
    o = simulate_overlap([b.ready_ms for b in p.buckets], [b.nbytes for b in p.buckets], p.backward_ms, comm_ms,
                         t.overlap_rate)
    compute = max(p.compute_ms, t.host_ms_per_step)
    stats = comm_ms(t.stats_bytes) if (t.stats_exposed and t.stats_bytes and t.world_size > 1) else 0.0
    contention = t.contention * o.overlapped_ms
    jitter = t.jitter_cv * compute * expected_max_normal(t.world_size)
    feed = input_ms(p.batch_size, min(t.world_size, t.gpus_per_node), t)
    step = max(compute + contention + o.exposed_ms + stats + jitter, feed)
    return StepPrediction(step, o.exposed_ms, o.comm_end_ms, o.busy_ms, contention, jitter, feed)


def comm_fn(m: Machine, nodes: int, algorithm: Algorithm = "best", gpus_per_node: int | None = None) -> Callable[[int], float]:
    return lambda nbytes: allreduce_cost(nbytes, m, nodes, algorithm, gpus_per_node).total_ms


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


# ---------------------------------------------------------------------------------------- calibration

def fit_alpha_beta(sizes_bytes: list[float], times_s: list[float], n: int, relative: bool = True) -> tuple[float, float]:
    """Least-squares (alpha_us, busbw_gbs) of the ring model T = 2(n-1) alpha + 2(n-1)/n * S/B.

    Fits T = a + b S (``dptrain.distributed.buckets.planner.fit_linear_cost``, the Reducer's fit), then
    alpha = a / (2(n-1)) and B = 2(n-1)/n / b.
    """
    if n < 2:
        raise ValueError(f"calibration needs >= 2 ranks, got {n}")
    c = fit_linear_cost(sizes_bytes, [t * 1e3 for t in times_s], relative=relative)
    return c.alpha_ms * 1e3 / (2 * (n - 1)), 2 * (n - 1) / n / (c.beta_ms_per_mb / 1e3 / 1e6) / GB


# ---------------------------------------------------------------------------------------- reference profile

@dataclass(frozen=True)
class Workload:
    """A workload profile (benchmarks/scaling/profiles/workloads/*.toml): the model and, per machine, its
    one-GPU rate, batch, gradient bytes and input path (a name in inputs.toml), with the per-step terms."""

    model: str
    update_bytes_per_param: int
    stats_bytes: int
    jitter_cv: float
    host_ms_per_step: float
    machines: dict[str, dict[str, Any]]

    def batch_cost(self, key: str) -> BatchCost | None:
        """step(b) on machine ``key``'s GPU: its ``step_fixed_ms`` (fitted by scaling_validate.py on
        published strong-scaling rows) + b x per_image, through the one-GPU rate at its batch; None
        when the file states no fixed cost (compute linear in the batch)."""
        w = self.machines.get(key, {})
        if "step_fixed_ms" not in w:
            return None
        fixed, batch = float(w["step_fixed_ms"]), int(w["batch_size"])
        step = batch / float(w["images_per_s"]) * 1e3
        return BatchCost(fixed, (step - fixed) / batch, source=str(w.get("step_fixed_source", "workload file")))

    def input_path(self, key: str) -> InputPath | None:
        """The machine's input path (its ``input`` name in inputs.toml), None when it names none."""
        name = self.machines.get(key, {}).get("input")
        if name is not None and name not in INPUTS:
            raise ValueError(f"workload machine {key}: input = {name!r} is not in {PROFILES / 'inputs.toml'} "
                             f"({sorted(INPUTS)})")
        return INPUTS.get(name) if name else None

    def terms(self, key: str, nodes: int, stats_exposed: bool = False, synthetic: bool = False,
              path: InputPath | None = None) -> Terms:
        """The per-step terms on ``nodes`` nodes of machine ``key``; the input ceilings from ``path``
        (default: the machine's input path), none when ``synthetic``."""
        m = MACHINES[key]
        node, process = (0.0, 0.0) if synthetic else input_rates(path or self.input_path(key), m.cpu_cores)
        return Terms(contention=m.contention, jitter_cv=self.jitter_cv, stats_bytes=self.stats_bytes,
                     stats_exposed=stats_exposed, host_ms_per_step=self.host_ms_per_step,
                     input_images_per_s_per_node=node, input_images_per_s_per_process=process,
                     world_size=nodes * m.gpus_per_node, gpus_per_node=m.gpus_per_node)


def load_workload(path: Path = PROFILES / "workloads" / "resnet50.toml") -> Workload:
    """A workload profile; every machine's ``input`` names a path in inputs.toml (checked here)."""
    d = tomllib.loads(Path(path).read_text())
    try:
        wl = Workload(str(d["model"]), int(d["update_bytes_per_param"]), int(d["stats_bytes"]),
                      float(d["jitter_cv"]), float(d["host_ms_per_step"]), dict(d["machines"]))
    except KeyError as e:
        raise ValueError(f"{path}: workload profile lacks {e}; start from workloads/resnet50.toml") from e
    for key, w in wl.machines.items():
        if "input_images_per_s_per_node" in w:
            raise ValueError(f"{path}: [machines.{key}] input_images_per_s_per_node is no longer read (an input "
                             f"ceiling is never a number fitted per machine): name an input path instead, "
                             f"input = \"<a [paths.NAME] of {PROFILES / 'inputs.toml'}>\"")
        wl.input_path(key)  # raises on a name inputs.toml lacks
    return wl


UPDATE_BYTES_PER_PARAM = 20
"""Master SGD traffic per parameter: fp32 master and momentum read+write (16 B), fp16 grad read and weight write (4 B)."""


def resnet50_params() -> list[tuple[str, int, int]]:
    """(name, numel, forward MACs of its layer or 0) of torchvision ResNet-50 v1.5 at 224x224, registration order."""
    out: list[tuple[str, int, int]] = []

    def conv(name: str, cin: int, cout: int, k: int, side: int) -> None:
        out.append((f"{name}.weight", cin * cout * k * k, cin * cout * k * k * side * side))

    def bn(name: str, c: int) -> None:
        out.extend([(f"{name}.weight", c, 0), (f"{name}.bias", c, 0)])

    conv("conv1", 3, 64, 7, 112)
    bn("bn1", 64)
    cin = 64
    for li, (width, blocks, side) in enumerate([(64, 3, 56), (128, 4, 28), (256, 6, 14), (512, 3, 7)], 1):
        for bi in range(blocks):
            name, side_in = f"layer{li}.{bi}", side * 2 if (bi == 0 and li > 1) else side
            conv(f"{name}.conv1", cin, width, 1, side_in)  # v1.5: the stride sits on conv2
            bn(f"{name}.bn1", width)
            conv(f"{name}.conv2", width, width, 3, side)
            bn(f"{name}.bn2", width)
            conv(f"{name}.conv3", width, 4 * width, 1, side)
            bn(f"{name}.bn3", 4 * width)
            if bi == 0:
                conv(f"{name}.downsample.0", cin, 4 * width, 1, side)
                bn(f"{name}.downsample.1", 4 * width)
            cin = 4 * width
    out.extend([("fc.weight", 2048 * 1000, 2048 * 1000), ("fc.bias", 1000, 0)])
    return out


def reference_profile(machine: str, batch_size: int | None = None, *, images_per_s: float | None = None,
                      grad_bytes: int | None = None, workload: Workload | None = None) -> Profile:
    """A per-parameter ResNet-50 profile for ``machine`` from the workload file, derived, not measured.

    The one-GPU rate, batch and gradient bytes come from the workload's entry for the machine
    unless given (the validation passes a published row's).

    Step time = batch / images_per_s; update = params x 20 B / HBM bandwidth; the rest splits
    forward:backward = 1:2 (backward computes data and weight gradients). Backward visits
    layers in reverse; a parameter is ready when its layer's backward is done, time
    proportional to cumulative MACs (BatchNorm counted as free, so its parameters are ready
    with the next layer backward reaches).
    """
    w = (workload or load_workload()).machines.get(machine, {})
    rate = images_per_s or float(w["images_per_s"])
    batch_size = batch_size or int(w["batch_size"])
    grad_bytes = grad_bytes or int(w["grad_bytes_per_param"])
    why = w.get("rate_source", f"{rate:g} img/s on one GPU") if images_per_s is None else f"{rate:g} img/s on one GPU"
    params = resnet50_params()
    n_params = sum(n for _, n, _ in params)
    update_ms = n_params * UPDATE_BYTES_PER_PARAM / (MACHINES[machine].hbm_gbs * GB) * 1e3
    fwd_ms = (batch_size / rate * 1e3 - update_ms) / 3
    total_macs, cum, buckets = sum(m for _, _, m in params), 0, []
    for _, numel, macs in reversed(params):
        cum += macs
        buckets.append(BucketTiming(numel * grad_bytes, 2 * fwd_ms * cum / total_macs))
    return Profile(forward_ms=fwd_ms, backward_ms=2 * fwd_ms, update_ms=update_ms, buckets=tuple(buckets),
                   batch_size=batch_size, granularity="parameter",
                   source=f"reference ResNet-50 v1.5, {grad_bytes} B gradients, {n_params:,} parameters, batch "
                          f"{batch_size}: {why}; update at {MACHINES[machine].hbm_gbs:g} GB/s HBM")


# ---------------------------------------------------------------------------------------- reports

def _pow2_up_to(limit: int) -> list[int]:
    return [2**k for k in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def explain(p: Profile, pred: StepPrediction, m: Machine, nodes: int, algorithm: Algorithm,
            cost: BatchCost | None = None) -> str:
    """Why the efficiency is what it is: exposed comm, latency vs bandwidth, replicated update, and
    with ``cost`` the part of the step that does not shrink with the batch."""
    costs = [allreduce_cost(b.nbytes, m, nodes, algorithm) for b in p.buckets]
    lat, xfer = sum(c.latency_ms for c in costs), sum(c.transfer_ms for c in costs)
    bound = "latency-bound" if lat > xfer else "bandwidth-bound"
    return (f"exposed comm {pred.exposed_ms:.2f} ms = {pred.exposed_ms / pred.step_ms:.0%} of the {pred.step_ms:.2f} ms "
            f"step; {len(costs)} allreduces take {lat + xfer:.2f} ms per step against {p.backward_ms:.2f} ms of "
            f"backward, {lat:.2f} ms of it latency ({bound}); the update ({p.update_ms:.2f} ms, "
            f"{p.update_ms / pred.step_ms:.0%}) runs on every GPU and does not shrink with more GPUs"
            + (f"; the step's fixed part ({cost.fixed_ms:.2f} ms, {cost.fixed_ms / pred.step_ms:.0%} of the step) "
               "does not shrink with the batch" if cost else ""))


TermsFn = Callable[[int], Terms]
"""Node count -> the per-step terms at that scale."""


def plain_terms(m: Machine) -> TermsFn:
    """The overlap model alone (no contention, jitter, input ceiling or host floor)."""
    return lambda nodes: Terms(world_size=nodes * m.gpus_per_node, gpus_per_node=m.gpus_per_node)


def weak_rows(p: Profile, m: Machine, nodes_list: list[int], algorithm: Algorithm,
              terms: TermsFn | None = None) -> list[dict[str, Any]]:
    terms = terms or plain_terms(m)
    rows = []
    for nodes in nodes_list:
        t = terms(nodes)
        pred = simulate_step(p, comm_fn(m, nodes, algorithm), t)
        biggest = max(p.buckets, key=lambda b: b.nbytes)
        c = allreduce_cost(biggest.nbytes, m, nodes, algorithm)
        n = nodes * m.gpus_per_node
        rows.append({"nodes": nodes, "gpus": n, "pred": pred, "eff": weak_efficiency(p, pred, t),
                     "ips": n * p.batch_size / pred.step_ms * 1e3 if p.batch_size else None,
                     "big": f"{biggest.nbytes / MIB:.1f} MiB: {c.total_ms:.3f} ms ({c.algorithm})"})
    return rows


def strong_rows(p: Profile, m: Machine, nodes_list: list[int], global_batch: int, algorithm: Algorithm,
                terms: TermsFn | None = None, cost: BatchCost | None = None) -> list[dict[str, Any]]:
    """Rows for every node count whose per-GPU batch G / (nodes g) is a whole number >= 1; compute
    scales with the per-GPU batch as ``cost`` says (None: linearly)."""
    terms = terms or plain_terms(m)
    full = scale_to_batch(p, global_batch, cost)
    t1 = one_solver_ms(full, replace(terms(1), world_size=1))
    rows = []
    for nodes in nodes_list:
        n = nodes * m.gpus_per_node
        if global_batch % n:
            continue
        q = scale_to_batch(p, global_batch / n, cost)
        pred = simulate_step(q, comm_fn(m, nodes, algorithm), terms(nodes))
        rows.append({"nodes": nodes, "gpus": n, "batch": global_batch // n, "pred": pred, "q": q,
                     "eff": t1 / (n * pred.step_ms), "ips": global_batch / pred.step_ms * 1e3})
    return rows


def report_predictions(raw: Profile, key: str, nodes_list: list[int], *, bucket_mb: float | None,
                       first_bucket_mb: float, global_batch: int, sweep_mb: list[float], algorithm: Algorithm,
                       terms: TermsFn | None = None, real_data: TermsFn | None = None,
                       cost: BatchCost | None = None, input_name: str = "the input path") -> str:
    """Markdown: weak scaling at ``nodes_list``, bucket sweep, strong scaling and where scaling breaks.

    ``raw`` is re-bucketed to ``bucket_mb`` (None: keep its plan); the sweep re-buckets ``raw``.
    ``terms``: the per-step terms with synthetic data; ``real_data``: with the input ceiling too;
    ``cost``: the step time in the batch for strong scaling (None: compute linear in the batch).
    """
    m = MACHINES[key]
    terms = terms or plain_terms(m)
    p = rebucket(raw, bucket_mb, first_bucket_mb) if bucket_mb else raw
    real = {r["nodes"]: r for r in weak_rows(p, m, nodes_list, algorithm, real_data)} if real_data else {}
    out = [f"### {m.name}", "", f"Profile: {p.source}. Forward {p.forward_ms:.2f} ms, backward {p.backward_ms:.2f} ms, "
           f"update {p.update_ms:.2f} ms, {p.total_bytes / MIB:.1f} MiB of gradients in {len(p.buckets)} buckets; "
           f"algorithm {algorithm}.", "",
           "| nodes | GPUs | largest bucket allreduce | comm busy ms | exposed ms | contention ms | jitter ms | step ms "
           f"| weak efficiency, synthetic data | fed by {input_name} | images/s (synthetic) |",
           "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in weak_rows(p, m, nodes_list, algorithm, terms):
        ips = f"{r['ips']:,.0f}" if r["ips"] else "-"
        pr = r["pred"]
        ceiling = f"{real[r['nodes']]['eff']:.3f}" if r["nodes"] in real else "-"
        out.append(f"| {r['nodes']} | {r['gpus']} | {r['big']} | {pr.comm_busy_ms:.3f} | {pr.exposed_ms:.3f} | "
                   f"{pr.contention_ms:.3f} | {pr.jitter_ms:.2f} | {pr.step_ms:.2f} | {r['eff']:.3f} | {ceiling} | {ips} |")
    out += ["", "What the communication adds to a step, exposed + contention (ms), by bucket cap (MiB; first bucket "
            f"min(cap, {first_bucket_mb:g} MiB)) and with the auto plan (`reducer.bucket_mb = \"auto\"`, planned on "
            "this timeline with the machine's contention), best cap in bold:",
            "", "| case | " + " | ".join(f"{c:g}" for c in sweep_mb) + " | auto |", "|---|" + "---:|" * (len(sweep_mb) + 1)]
    cases = [(nodes_list[0], raw), (nodes_list[-1], raw)]
    if raw.batch_size >= 8:
        cases.append((nodes_list[-1], scale_to_batch(raw, raw.batch_size / 8, cost)))
    for nodes, q in cases:
        comm, t = comm_fn(m, nodes, algorithm), terms(nodes)
        sw = {cap: pred for cap, _, pred in sweep_bucket_sizes(q, comm, sweep_mb, first_bucket_mb, t)}
        best = min(sw, key=lambda c: (round(comm_step_ms(sw[c]), 6), sw[c].comm_end_ms))
        cells = [f"**{comm_step_ms(sw[c]):.3f}**" if c == best else f"{comm_step_ms(sw[c]):.3f}" for c in sweep_mb]
        auto = auto_plan(q, comm, t) if q.granularity == "parameter" else None
        cells.append(f"{comm_step_ms(simulate_step(auto, comm, t)):.3f} ({len(auto.buckets)} buckets)" if auto else "-")
        out.append(f"| {nodes} node(s), batch {q.batch_size or '?'}/GPU | " + " | ".join(cells) + " |")
    out += ["", *breakdown_lines(p, m, global_batch, algorithm, terms, cost)]
    return "\n".join(out) + "\n"


def breakdown_lines(p: Profile, m: Machine, global_batch: int, algorithm: Algorithm,
                    terms: TermsFn | None = None, cost: BatchCost | None = None) -> list[str]:
    """Where efficiency first falls below EFFICIENCY_FLOOR: nodes (weak), per-GPU batch, nodes (strong)."""
    terms = terms or plain_terms(m)
    out = []
    weak = weak_rows(p, m, _pow2_up_to(1024), algorithm, terms)
    bad = next((r for r in weak if r["eff"] < EFFICIENCY_FLOOR), None)
    out.append(f"- Weak scaling at batch {p.batch_size or '?'}/GPU: " + (
        f"efficiency falls below {EFFICIENCY_FLOOR} at {bad['nodes']} nodes ({bad['gpus']} GPUs, {bad['eff']:.2f}): "
        + explain(p, bad["pred"], m, bad["nodes"], algorithm) if bad else
        f"efficiency stays >= {EFFICIENCY_FLOOR} up to 1024 nodes ({1024 * m.gpus_per_node} GPUs; "
        f"{weak[-1]['eff']:.3f} there): the allreduces hide behind backward."))
    if not p.batch_size:
        return out + ["- Strong scaling: needs the profile's batch size (--profile-batch)."]
    for b in (p.batch_size // 2**k for k in range(int(math.log2(p.batch_size)) + 1)):
        q = scale_to_batch(p, b, cost)
        pred = simulate_step(q, comm_fn(m, 64, algorithm), terms(64))
        if weak_efficiency(q, pred, terms(64)) < EFFICIENCY_FLOOR:
            out.append(f"- At 64 nodes, weak scaling falls below {EFFICIENCY_FLOOR} once the per-GPU batch is "
                       f"{b} ({weak_efficiency(q, pred, terms(64)):.2f}): " + explain(q, pred, m, 64, algorithm, cost))
            break
    strong = strong_rows(p, m, _pow2_up_to(max(1, global_batch // m.gpus_per_node)), global_batch, algorithm, terms,
                         cost)
    bad = next((r for r in strong if r["eff"] < EFFICIENCY_FLOOR), None)
    out.append(f"- Strong scaling at global batch {global_batch}: " + ", ".join(
        f"{r['nodes']} nodes (batch {r['batch']}/GPU) {r['eff']:.2f}" for r in strong) + ". " + (
        f"Below {EFFICIENCY_FLOOR} from {bad['nodes']} nodes: " + explain(bad["q"], bad["pred"], m, bad["nodes"],
                                                                        algorithm, cost) if bad else ""))
    return out


def calibration_report(points: list[tuple[int, float]], n: int, alpha_us: float, busbw_gbs: float,
                       bench: dict[str, Any] | None = None, profile: Profile | None = None) -> str:
    """Markdown: fitted alpha/beta, model vs measurement per size, and predicted vs measured step."""
    out = [f"Fitted ring model on {n} gloo processes: alpha = {alpha_us:.1f} us per step, B = {busbw_gbs:.3f} GB/s "
           f"(beta = 1/B = {1e3 / busbw_gbs:.1f} us/MB); T = {2 * (n - 1)}*alpha + {2 * (n - 1)}/{n}*S/B.", "",
           "| bytes | measured ms | model ms | error |", "|---:|---:|---:|---:|"]
    for nbytes, t in points:
        pred = ring_allreduce(nbytes, n, alpha_us, busbw_gbs).total_ms
        out.append(f"| {nbytes:,} | {t * 1e3:.3f} | {pred:.3f} | {(pred - t * 1e3) / (t * 1e3):+.0%} |")
    if bench is not None and profile is not None:
        local = Machine("this host (gloo)", n, Link(busbw_gbs, alpha_us, "calibrated"), None)
        pred = simulate_step(profile, comm_fn(local, 1, "ring"))
        out += ["", f"Step at world size {bench.get('world_size')} ({bench.get('model')}, batch {bench.get('batch_size')}"
                f"/solver, profile: {profile.source}):", "",
                "| | step ms | exposed comm ms |", "|---|---:|---:|",
                f"| predicted | {pred.step_ms:.2f} | {pred.exposed_ms:.2f} |",
                f"| measured (bench: step median; phase-timed exposed) | {bench['step_ms_median']:.2f} | "
                f"{bench.get('exposed_comm_ms', float('nan')):.2f} |"]
    return "\n".join(out) + "\n"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machines", default="dgx-h100", help=f"comma-separated from {sorted(MACHINES)} "
                    "(benchmarks/scaling/profiles/machines/<key>.toml; add your own file there)")
    ap.add_argument("--profile", help="trace (PATH.rank0.json) or profile JSON; default: the reference ResNet-50")
    ap.add_argument("--profile-batch", type=int, default=0, help="per-solver batch of --profile")
    ap.add_argument("--workload", default=str(PROFILES / "workloads" / "resnet50.toml"),
                    help="workload profile: one-GPU rates, jitter, input ceilings (benchmarks/scaling/profiles/workloads/)")
    ap.add_argument("--bucket-mb", type=float, help="re-bucket the profile (default: its own plan; "
                                                     f"{DEFAULT_BUCKET_MB:g} for a per-parameter profile)")
    ap.add_argument("--first-bucket-mb", type=float, default=DEFAULT_FIRST_BUCKET_MB)
    ap.add_argument("--nodes", default="1,4,16,64")
    ap.add_argument("--global-batch", type=int, default=8192, help="strong scaling (Goyal et al. 2017's largest)")
    ap.add_argument("--batch-points", help="one-solver `dptrain bench` JSON lines at >= 3 batch sizes of the profiled "
                    "model: strong scaling uses the fitted step(b) = fixed + b x per_image instead of a step linear "
                    "in the batch")
    ap.add_argument("--input-bench", help="a `dptrain data-bench` JSON line measured on one node of the machine: "
                    "the real-data column uses it (CPU ms per image x the machine's cores; images/s per process) "
                    "instead of the workload's input path")
    ap.add_argument("--sweep-mb", default="1,2,5,10,25,50,100,200")
    ap.add_argument("--algorithm", default="best", choices=("best", "ring", "tree", "hierarchical"))
    ap.add_argument("--calibrate", action="store_true", help="measure gloo allreduce with 2 local processes and fit")
    ap.add_argument("--sizes", default="4096,65536,262144,1048576,4194304,16777216", help="calibration bytes")
    ap.add_argument("--iters", type=int, default=20, help="calibration repetitions per size")
    ap.add_argument("--measured-bench", help="with --calibrate: file with a 2-process `dptrain bench` JSON line")
    ap.add_argument("--bench-profile", help="trace or profile JSON of the --measured-bench run, for its predicted step")
    ap.add_argument("--write-profile", help="also write the profile used for the first machine as JSON here")
    ap.add_argument("--out", help="write the report to OUT/scaling_model_<yyyymmdd>.md")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        keys = [k.strip() for k in args.machines.split(",") if k.strip()]
        unknown = [k for k in keys if k not in MACHINES]
        if unknown:
            raise ValueError(f"--machines: unknown {unknown}; choose from {sorted(MACHINES)}")
        nodes = sorted({int(x) for x in args.nodes.split(",")})
        sweep = [float(x) for x in args.sweep_mb.split(",")]
        if bool(args.measured_bench) != bool(args.bench_profile):
            raise ValueError("--measured-bench and --bench-profile go together (a bench JSON line and its trace)")
        given = load_profile(args.profile, args.profile_batch) if args.profile else None
        wl = load_workload(Path(args.workload))
        bench_profile = load_profile(args.bench_profile) if args.bench_profile else None
        cost = fit_batch_cost(batch_points(args.batch_points), args.batch_points) if args.batch_points else None
        measured = input_path_from_data_bench(args.input_bench) if args.input_bench else None
    except (ValueError, OSError) as e:
        print(f"scaling_model.py: error: {e}", file=sys.stderr)
        return 2
    md = [f"## Scaling model predictions ({datetime.date.today():%Y-%m-%d})", "",
          "Terms beyond the overlap model: contention and host floor from the machine and workload files, "
          f"jitter_cv {wl.jitter_cv:g} (fit, benchmarks/scaling/scaling_validate.py); the input ceilings of the machine's "
          "input path (benchmarks/scaling/profiles/inputs.toml: stated or measured, never fitted). The validated error of "
          "these predictions is in benchmarks/results/scaling_validation_*.md.", "",
          (f"Strong scaling: step(b) = {cost.fixed_ms:.2f} ms + b x {cost.per_image_ms:.3f} ms, fitted from "
           f"{len(cost.points)} bench runs ({cost.source}; largest error {cost.max_error:.1%})" if cost else
           "Strong scaling: step(b) = the workload file's fixed step cost per machine + b x per image, where it "
           "states one (fitted on a published strong-scaling row by scaling_validate.py), else compute linear in "
           "the per-GPU batch (optimistic at small batches)."), ""]
    for i, key in enumerate(keys):
        raw = given or reference_profile(key, workload=wl)
        if args.write_profile and i == 0:
            Path(args.write_profile).write_text(json.dumps(profile_to_json(raw), indent=1))
        plan_mb = args.bucket_mb or (DEFAULT_BUCKET_MB if raw.granularity == "parameter" else None)
        path = measured or wl.input_path(key)
        has_ceiling = bool(path and path.stated)
        md.append(report_predictions(raw, key, nodes, bucket_mb=plan_mb, first_bucket_mb=args.first_bucket_mb,
                                     global_batch=args.global_batch, sweep_mb=sweep, algorithm=args.algorithm,
                                     terms=lambda n, key=key: wl.terms(key, n, synthetic=True),
                                     real_data=(lambda n, key=key, path=path: wl.terms(key, n, path=path))
                                     if has_ceiling else None,
                                     cost=cost or (None if given else wl.batch_cost(key)),
                                     input_name=f"{path.name}'s input path" if has_ceiling else "the input path"))
    if args.calibrate:
        from benchmarks.scaling.collective_bench import measure_allreduce

        points = measure_allreduce([int(s) for s in args.sizes.split(",")], world_size=2, iters=args.iters)
        alpha_us, busbw = fit_alpha_beta([s for s, _ in points], [t for _, t in points], 2)
        bench = last_json_line(args.measured_bench, ("step_ms_median",), "dptrain bench") if args.measured_bench else None
        import platform

        import torch

        md += ["### Calibration on this machine", "",
               f"Host {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, shared with other jobs), torch "
               f"{torch.__version__}, gloo over a file:// rendezvous; median of {args.iters} timed calls per size.", "",
               calibration_report(points, 2, alpha_us, busbw, bench, bench_profile)]
    emit_report("\n".join(md), args.out, "scaling_model")
    return 0


def emit_report(text: str, out: str | None, stem: str) -> None:
    """Print a markdown report and, with ``out``, write it to OUT/<stem>_<yyyymmdd>.md."""
    print(text)
    if out:
        path = Path(out) / f"{stem}_{datetime.date.today():%Y%m%d}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
