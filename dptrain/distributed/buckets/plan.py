"""BucketPlan: flat gradient buffers -> ordered buckets. Pure: no process group, no CUDA.

Rule (identical on every rank): within each flat group (one dtype), walk the parameters
in layout order (reverse registration order, ~ the order backward produces gradients)
and close a bucket when adding the next parameter would exceed the cap. The first bucket
of each group uses ``first_bucket_mb`` so communication starts early in backward (DDP
uses 1 MiB). A parameter is never split; one larger than the cap gets a bucket of its
own. A bucket never crosses groups, so it is one contiguous slice of one flat buffer.
With explicit ``cuts`` (the auto plan, ``dptrain.distributed.buckets.planner``) the caps give way to
cut positions in the global ready order: a bucket closes where the next parameter lies
past a cut, so every group is cut at the same points in time.

Launch order: buckets of all groups are sorted by the ready position of their *last*
parameter, i.e. by when the bucket is expected to be complete. (Sorting by the first
parameter would let an fp32 island bucket spread over the whole network, e.g. all
BatchNorm parameters, hold back every later fp16 bucket until the end of backward.)
"""
from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True)
class SegmentSpec:
    """One parameter's place in a flat group, with its position in the global ready order."""

    name: str
    offset: int
    padded_numel: int
    order: int


@dataclass(frozen=True)
class GroupSpec:
    """One flat group (one dtype): its segments in layout order."""

    dtype: str
    elem_size: int
    segments: tuple[SegmentSpec, ...]


@dataclass(frozen=True)
class Bucket:
    """A contiguous element range [start, stop) of group ``group``'s flat gradient buffer."""

    index: int
    group: int
    dtype: str
    start: int
    stop: int
    names: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    """Buckets in launch order; ``buckets[i].index == i``."""

    buckets: tuple[Bucket, ...]

    def digest(self) -> str:
        """Stable hash of the plan (groups, ranges, names, order), compared across ranks."""
        h = hashlib.sha256()
        for b in self.buckets:
            h.update(f"{b.group}:{b.dtype}:{b.start}:{b.stop}:{','.join(b.names)};".encode())
        return h.hexdigest()[:16]

    def describe(self) -> str:
        """One line for logs and errors: bucket count, sizes in MiB, first parameter."""
        sizes = [round(b.nbytes / MIB, 3) for b in self.buckets]
        shown = sizes if len(sizes) <= 8 else [*sizes[:4], "...", *sizes[-2:]]
        first = self.buckets[0].names[0] if self.buckets else "-"
        return f"{len(self.buckets)} buckets, MiB {shown}, first parameter {first}"

    def bucket_of(self) -> dict[str, int]:
        """Parameter name -> bucket index."""
        return {n: b.index for b in self.buckets for n in b.names}


def build_bucket_plan(groups: list[GroupSpec], bucket_mb: float, first_bucket_mb: float,
                      cuts: Sequence[int] | None = None) -> BucketPlan:
    """Cut each group's layout into buckets capped at ``bucket_mb`` (first: ``first_bucket_mb``),
    or, with ``cuts`` (sorted ready positions where a bucket starts), at those positions."""
    if bucket_mb <= 0 or first_bucket_mb <= 0:
        raise RuntimeError(f"bucket caps must be > 0 MiB, got bucket_mb={bucket_mb}, first_bucket_mb={first_bucket_mb}")
    raw: list[tuple[int, Bucket]] = []  # (ready position of the last parameter, bucket with index -1)
    for gi, g in enumerate(groups):
        _check_contiguous(gi, g)
        cap, cur, cur_bytes = first_bucket_mb * MIB, [], 0
        for seg in g.segments:
            seg_bytes = seg.padded_numel * g.elem_size
            if cuts is not None:
                closes = bool(cur) and bisect.bisect_right(cuts, seg.order) != bisect.bisect_right(cuts, cur[0].order)
            else:
                closes = bool(cur) and cur_bytes + seg_bytes > cap
            if closes:
                raw.append(_close(gi, g, cur))
                cap, cur, cur_bytes = bucket_mb * MIB, [], 0
            cur.append(seg)
            cur_bytes += seg_bytes
        if cur:
            raw.append(_close(gi, g, cur))
    raw.sort(key=lambda r: r[0])
    return BucketPlan(tuple(Bucket(i, b.group, b.dtype, b.start, b.stop, b.names, b.nbytes)
                            for i, (_, b) in enumerate(raw)))


def _check_contiguous(gi: int, g: GroupSpec) -> None:
    """Segments must tile the buffer in order, or a bucket slice would cover foreign data."""
    expect = 0
    for s in g.segments:
        if s.offset != expect:
            raise RuntimeError(f"group {gi} ({g.dtype}): segment {s.name} at offset {s.offset}, expected {expect}; "
                             "segments must be listed in layout order and tile the buffer")
        expect += s.padded_numel


def _close(gi: int, g: GroupSpec, segs: list[SegmentSpec]) -> tuple[int, Bucket]:
    start, stop = segs[0].offset, segs[-1].offset + segs[-1].padded_numel
    bucket = Bucket(-1, gi, g.dtype, start, stop, tuple(s.name for s in segs), (stop - start) * g.elem_size)
    return max(s.order for s in segs), bucket


def order_from_ready(layout_order: list[str], ready_order: list[str]) -> list[str]:
    """A new global layout order: the observed gradient-ready order, then every parameter
    that produced no gradient (unused in forward), in its old layout order."""
    known = set(layout_order)
    unknown = [n for n in ready_order if n not in known]
    if unknown or len(set(ready_order)) != len(ready_order):
        raise RuntimeError(f"ready order has unknown or repeated parameters (unknown: {unknown[:5]}); "
                         "it must come from this model's gradient hooks")
    seen = set(ready_order)
    return [*ready_order, *(n for n in layout_order if n not in seen)]


def plan_from_ready_order(groups: list[GroupSpec], ready_order: list[str], bucket_mb: float,
                          first_bucket_mb: float, cuts: Sequence[int] | None = None) -> tuple[list[list[str]], BucketPlan]:
    """Re-plan from an observed gradient-ready order (``reducer.replan``).

    Returns each group's new parameter order (to re-lay out its flat buffers with) and
    the plan over that new layout. Offsets are recomputed by tiling the same padded
    sizes in the new order, which is what ``FlatGroup.relayout`` does.
    """
    layout = [s.name for s in sorted((s for g in groups for s in g.segments), key=lambda s: s.order)]
    order = order_from_ready(layout, ready_order)
    rank_of = {n: i for i, n in enumerate(order)}
    new_groups, names_per_group = [], []
    for g in groups:
        segs = sorted(g.segments, key=lambda s: rank_of[s.name])
        offset, tiled = 0, []
        for s in segs:
            tiled.append(SegmentSpec(s.name, offset, s.padded_numel, rank_of[s.name]))
            offset += s.padded_numel
        new_groups.append(GroupSpec(g.dtype, g.elem_size, tuple(tiled)))
        names_per_group.append([s.name for s in segs])
    return names_per_group, build_bucket_plan(new_groups, bucket_mb, first_bucket_mb, cuts)


def explain_difference(mine: BucketPlan, theirs: BucketPlan, my_rank: int, their_rank: int) -> str:
    """Where two plans first differ, for the plan-mismatch error."""
    if len(mine.buckets) != len(theirs.buckets):
        head = f"rank {my_rank} has {len(mine.buckets)} buckets, rank {their_rank} has {len(theirs.buckets)}"
    else:
        head = "same bucket count"
    for a, b in zip(mine.buckets, theirs.buckets, strict=True):
        if (a.group, a.dtype, a.start, a.stop, a.names) != (b.group, b.dtype, b.start, b.stop, b.names):
            return (f"{head}; first difference at bucket {a.index}: rank {my_rank} has {_show(a)}, "
                    f"rank {their_rank} has {_show(b)}")
    return head


def _show(b: Bucket) -> str:
    names = list(b.names) if len(b.names) <= 3 else [*b.names[:3], f"... ({len(b.names)} in all)"]
    return f"group {b.group} ({b.dtype}) [{b.start}, {b.stop}) {b.nbytes} B {names}"
