"""One solver's step as the model takes it: compute phases and the gradient-ready timeline (``Profile``),
from a ``--trace``, a JSON profile or a derived reference, and its step time in the batch (``BatchCost``,
fitted from ``dptrain bench`` JSON lines); re-cut into other bucket plans and scaled to other batches."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

MIB = 1024 * 1024


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
