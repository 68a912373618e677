"""BucketPlan: flat gradient buffers -> ordered buckets. Pure: no process group, no CUDA.

Rule (identical on every rank): within each flat group (one dtype), walk the parameters
in layout order (reverse registration order, ~ the order backward produces gradients)
and close a bucket when adding the next parameter would exceed the cap. The first bucket
of a group uses ``first_bucket_mb`` so communication starts early in backward (DDP uses
1 MiB). A parameter is never split; one larger than the cap gets a bucket of its own. A
bucket never crosses groups. Buckets of all groups are then ordered by the position of
their first parameter in the global layout order, which is the launch order.
"""
from __future__ import annotations

import hashlib
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
    dtype: str
    elem_size: int
    segments: tuple[SegmentSpec, ...]


@dataclass(frozen=True)
class Bucket:
    """A contiguous element range [start, stop) of group ``group``'s flat gradient buffer."""

    index: int
    group: int
    start: int
    stop: int
    names: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    buckets: tuple[Bucket, ...]

    def digest(self) -> str:
        """Stable hash of the plan, compared across ranks at startup."""
        h = hashlib.sha256()
        for b in self.buckets:
            h.update(f"{b.group}:{b.start}:{b.stop}:{','.join(b.names)};".encode())
        return h.hexdigest()[:16]

    def describe(self) -> str:
        sizes = [round(b.nbytes / MIB, 2) for b in self.buckets]
        shown = sizes if len(sizes) <= 8 else [*sizes[:4], "...", *sizes[-2:]]
        first = self.buckets[0].names[0] if self.buckets else "-"
        return f"{len(self.buckets)} buckets, MiB {shown}, first parameter {first}"

    def bucket_of(self) -> dict[str, int]:
        """Parameter name -> bucket index."""
        return {n: b.index for b in self.buckets for n in b.names}


def build_bucket_plan(groups: list[GroupSpec], bucket_mb: float, first_bucket_mb: float) -> BucketPlan:
    """Cut each group's layout into buckets capped at ``bucket_mb`` (first: ``first_bucket_mb``)."""
    if bucket_mb <= 0 or first_bucket_mb <= 0:
        raise ValueError(f"bucket caps must be > 0 MiB, got {bucket_mb} and {first_bucket_mb}")
    raw: list[tuple[int, int, int, int, list[str], int]] = []  # (order, group, start, stop, names, nbytes)
    for gi, g in enumerate(groups):
        cap = first_bucket_mb * MIB
        cur: list[SegmentSpec] = []
        for seg in g.segments:
            seg_bytes = seg.padded_numel * g.elem_size
            cur_bytes = sum(s.padded_numel for s in cur) * g.elem_size
            if cur and cur_bytes + seg_bytes > cap:
                raw.append(_close(gi, g, cur))
                cur, cap = [], bucket_mb * MIB
            cur.append(seg)
        if cur:
            raw.append(_close(gi, g, cur))
    raw.sort(key=lambda r: r[0])
    return BucketPlan(tuple(Bucket(i, gi, s, e, tuple(n), nb) for i, (_, gi, s, e, n, nb) in enumerate(raw)))


def _close(gi: int, g: GroupSpec, segs: list[SegmentSpec]) -> tuple[int, int, int, int, list[str], int]:
    start = segs[0].offset
    stop = segs[-1].offset + segs[-1].padded_numel
    return (min(s.order for s in segs), gi, start, stop, [s.name for s in segs], (stop - start) * g.elem_size)
