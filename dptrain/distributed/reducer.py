"""Reducer: bucketed gradient allreduce, launched during backward, waited for once.

Each parameter has a post-accumulate-grad hook (public autograd API), registered after the
flat buffers' own (``dptrain.flat``: it copies the gradient autograd handed over into the
buffer, so it must run first). In the last micro-batch of an iteration
(``begin(sync=True)``), when a bucket's last gradient is in the flat buffer, the bucket's
async SUM allreduce is launched, strictly in plan order: a bucket that completes early
waits until every earlier bucket has launched, so all ranks issue the same collectives in
the same order. ``wait()`` after backward launches any bucket whose parameters got no
gradient, then waits for all of them: the only point where compute waits on
communication. Micro-batches armed with ``begin(sync=False)`` launch nothing; their
gradients just accumulate (Caffe iter_size).

Loss scaling happens before the reduce: the buckets hold loss-scaled gradients, summed
over ranks. The solver unscales by ``1 / (S * grad_divisor)`` in fp32:

- the gradients' own dtype on the wire (``reducer.dtype`` "auto" with 16-bit storage, or fp32
  gradients reduced in fp32): the SUM runs in place; ``grad_divisor = world_size``. An fp16 sum
  that overflows becomes inf on every rank alike, and the step is skipped everywhere.
- fp32 on the wire for 16-bit gradients (``reducer.dtype = "fp32"``): each bucket is upcast,
  summed in fp32, divided by world_size in fp32 and only then cast back, so the sum itself
  never overflows fp16; ``grad_divisor = 1``.
- 16 bits on the wire for fp32 gradients (``precision.mode = "autocast"``, ``reducer.dtype``
  fp16 or bf16): each bucket of loss-scaled fp32 gradients is cast to the wire's dtype, summed
  there (half the bytes) and cast back to fp32 exactly; ``grad_divisor = world_size``. An fp16
  sum that overflows is inf, as in the first case.
- world_size 1: no collectives, ``grad_divisor = 1``.

Every rank then holds the bit-identical reduced gradient, so the overflow decision taken
on it is identical everywhere without another collective.

The Reducer is mechanism only. Measurement hangs beside it as observers
(:class:`ReducerObserver`: told when a synced backward begins, each gradient is ready, its
collectives completed, and wait() is done; an observer may hold a backward's launches until its
end). ``bucket_mb = "auto"`` is one (:mod:`dptrain.distributed.buckets.tuner`): a probe with a bucket per
parameter measures the gradient-ready times, the collectives' costs and the backward time their
overlap takes, rank 0 plans the boundaries that minimise what the communication adds to the step
(exposed + contention), and every rank adopts them at the same iteration (:meth:`Reducer.adopt_ready_order`,
as ``replan`` does). A snapshot keeps the order and the cuts; a resumed run applies them at once.

Running statistics (BatchNorm's running mean and variance) are averaged over the ranks
once per iteration, by one small allreduce launched in ``begin(sync=True)``: every forward
of the iteration is done by then, so it overlaps the whole backward (a held probe iteration
launches it behind the first bucket instead, after backward, as it launches everything).
Launched behind the first bucket, it was a second collective at the end of backward when
the first bucket is ready only then. It is waited for in ``wait()``. Every rank then holds
the same statistics, so the test phase evaluates one model and a snapshot (rank 0's) holds
the whole state: a resumed run continues bit-exactly on every rank. DDP instead broadcasts
rank 0's buffers before each forward, which discards the other ranks' batches and puts a
collective before compute.

Streams (CUDA): hooks run on autograd's device thread, the statistics' launch on the
training thread; a launch enqueues the collective behind everything already on that
thread's current stream (see ``Communicator.allreduce_async`` and ``nccl_cupy``), and
``wait()`` makes the training thread's current stream wait for the communication stream.
Neither blocks the host. The flat gradient buffers live as long as the model, so they need
no ``record_stream``; fp32 upcasts are kept referenced until ``wait()`` has ordered their
copy-back after the collective.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dptrain.config import ReducerConfig
from dptrain.distributed.buckets.plan import (
    Bucket,
    BucketPlan,
    GroupSpec,
    SegmentSpec,
    build_bucket_plan,
    explain_difference,
    order_from_ready,
    plan_from_ready_order,
)
from dptrain.distributed.buckets.probe import PROBE_CAP_MB
from dptrain.distributed.comm import AsyncAllreduce, Communicator, Work
from dptrain.distributed.shards import Shards
from dptrain.distributed.unused import UnusedParams
from dptrain.errors import ConfigError, RankFailure
from dptrain.flat import FlatParams
from dptrain.observe.trace import Tracer, now_us

log = logging.getLogger(__name__)


def group_specs(flat: FlatParams) -> list[GroupSpec]:
    """The bucket planner's view of ``flat``: segments per group, ranked by layout order."""
    rank_of = {n: i for i, n in enumerate(flat.layout_order)}
    return [GroupSpec(str(g.dtype), g.grads.element_size(),
                      tuple(SegmentSpec(s.name, s.offset, s.padded_numel, rank_of[s.name]) for s in g.segments))
            for g in flat.groups]


@dataclass
class Launched:
    """One collective in flight: a bucket's, or (``bucket`` None) the statistics and control sum."""

    bucket: Bucket | None
    work: Work
    wire: torch.Tensor | None  # [stop - start] the bucket cast to the wire's dtype, when it is not the gradients'

    start_us: float
    end_us: list[float] = field(default_factory=list)  # set by the completion callback


class ReducerObserver(Protocol):
    """What the Reducer tells whoever measures it (``reducer.observers``), at each synced backward;
    the Reducer only moves gradients, as DDP keeps its Logger and Timer beside its reducer. The
    ``bucket_mb = "auto"`` planner is one (:class:`dptrain.distributed.buckets.tuner.BucketTuner`)."""

    @property
    def timing(self) -> bool:
        """Whether the Reducer must stamp each collective's completion for :meth:`completed`."""
        ...

    @property
    def accepts_plan(self) -> bool:
        """Whether a snapshot's bucket plan may stand in for what this observer would measure."""
        ...

    def begin(self) -> bool:
        """A synced backward starts (under the Reducer's lock); True: launch nothing before its end."""
        ...

    def ready(self, name: str) -> None:
        """The gradient of ``name`` is ready (under the Reducer's lock)."""
        ...

    def completed(self, launched: list[Launched], backward_end_us: float) -> None:
        """wait() has waited for every bucket of the synced backward (the statistics may be in flight)."""
        ...

    def after_wait(self) -> None:
        """wait() is done: gradients and statistics are reduced. May run collectives (every rank alike)."""
        ...

    def plan_adopted(self) -> None:
        """A snapshot's plan was applied in place of this observer's measurements."""
        ...


class Reducer:
    """Overlaps the gradient allreduce with backward; see the module docstring."""

    def __init__(self, flat: FlatParams, cfg: ReducerConfig, comm: Communicator, tracer: Tracer,
                 running_stats: list[torch.Tensor] | Callable[[], list[torch.Tensor]] | None = None,
                 unused: UnusedParams | None = None, wire_dtype: torch.dtype | None = None) -> None:
        self.flat, self.cfg, self.comm, self.tracer = flat, cfg, comm, tracer
        fixed = list(running_stats or []) if not callable(running_stats) else None
        self._stats_source: Callable[[], list[torch.Tensor]] = running_stats if fixed is None else (lambda: fixed)
        """The buffers averaged over ranks every synced iteration (normalisations' running mean/var),
        read afresh at each launch: a model may reassign a buffer rather than update it in place."""
        self.running_stats: list[torch.Tensor] = []
        self._stats_views: list[torch.Tensor] = []
        self._stats_numels: list[int] = []
        self._refresh_stats_views()
        self.unused = unused
        """Which parameters got no gradient on any rank (``dptrain.distributed.unused``); its flags ride
        behind the last bucket."""
        self._stats_flight: tuple[Launched, torch.Tensor] | None = None
        self._control: torch.Tensor | None = None
        self.world_size = comm.world_size
        self.wire_dtype = wire_dtype
        """The gradients' dtype on the wire when it is not the flat buffers' own (module docstring); None: theirs."""
        self.fp32_reduce = wire_dtype == torch.float32
        self.grad_divisor = 1 if (self.fp32_reduce or self.world_size == 1) else self.world_size
        """What the solver still divides the reduced gradient by (see the module docstring)."""
        self.launch_log: list[tuple[int, float]] = []
        """(bucket index, time.perf_counter()) of each launch in the last synced backward."""
        self._lock = threading.Lock()  # hooks may run on autograd device threads
        self._active = False
        self._holding = False  # an observer holds this backward's launches; wait() launches all
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._host_completion = flat.groups[0].grads.device.type == "cpu"
        """gloo on CPU: a collective is complete when its wait() returns; CUDA: when its event fires."""
        self._collective = self._build_collective()
        self._cuts: list[int] | None = None
        self.shards = Shards(flat, comm) if cfg.shard == "optimizer" else None
        """With ``reducer.shard = "optimizer"``: this solver's slices of the buckets (``dptrain.distributed.shards``)."""
        self.observers: list[ReducerObserver] = []
        """Measurement beside the mechanism (the auto planner), told of every synced backward."""
        self._set_plan(build_bucket_plan(group_specs(flat), *self._caps()))
        self._check_plan_agreement()
        self._replan_pending = cfg.replan and self.world_size > 1 and cfg.bucket_mb != "auto"
        self._ready_order: list[str] = []
        # One solver reduces nothing, but a traced run still records when each bucket would be
        # ready: that single-solver profile is what the scaling model (benchmarks/scaling/) extrapolates from.
        self._hooked = self.world_size > 1 or tracer.enabled
        if self._hooked:
            for g in flat.groups:
                for s in g.segments:
                    self._handles.append(s.param.register_post_accumulate_grad_hook(self._make_hook(s.name)))
        if comm.rank == 0:
            wire = sorted({str(self._wire_of(g.grads.dtype)).removeprefix("torch.") for g in flat.groups})
            log.info("reducer: %s; reduce in %s via %s", self.plan.describe(), "/".join(wire), cfg.backend)

    def _wire_of(self, grads: torch.dtype) -> torch.dtype:
        """The dtype gradients held in ``grads`` are reduced in."""
        return grads if self.wire_dtype is None else self.wire_dtype

    def _build_collective(self) -> AsyncAllreduce:
        if self.cfg.backend == "torch":
            return self.comm
        if self.world_size == 1:
            log.warning("rank %d: reducer.backend = \"cupy-nccl\" has no effect with one solver", self.comm.rank)
            return self.comm
        if self.comm.device.type != "cuda":
            raise ConfigError(f"rank {self.comm.rank}: reducer.backend = \"cupy-nccl\" needs CUDA devices, "
                             f"this solver runs on {self.comm.device}; use reducer.backend = \"torch\"")
        from dptrain.distributed.cupy_nccl import CupyNcclCommunicator, check_reducible  # imports cupy: GPU runs only

        check_reducible({self._wire_of(g.grads.dtype) for g in self.flat.groups})
        return CupyNcclCommunicator(self.comm, self.cfg.timeout_s)

    # ------------------------------------------------------------------ plan

    def _caps(self) -> tuple[float, float]:
        """(bucket_mb, first_bucket_mb) as numbers; "auto" probes with a bucket per parameter."""
        if self.cfg.bucket_mb == "auto":
            return PROBE_CAP_MB, PROBE_CAP_MB
        return self.cfg.bucket_mb, self.cfg.first_bucket_mb

    def _set_plan(self, plan: BucketPlan) -> None:
        if self.shards is not None:  # padded, so each solver owns an equal aligned slice; then sharded
            plan = self.shards.apply(plan, group_specs(self.flat))
            self.flat.layout_changed()
        self.plan = plan
        self._bucket_of = plan.bucket_of()
        self._sizes = [len(b.names) for b in plan.buckets]

    def _check_plan_agreement(self) -> None:
        """Allgather every rank's plan digest; raise naming both ranks and what differs."""
        digests = self.comm.allgather_object(self.plan.digest())
        if all(d == digests[0] for d in digests):
            return
        plans = self.comm.allgather_object(self.plan)  # every rank saw the mismatch: all gather again
        r = next(i for i, d in enumerate(digests) if d != digests[0])
        raise RuntimeError(
            f"bucket plan differs across ranks (rank {r}: {plans[r].describe()}; rank 0: {plans[0].describe()}; "
            f"{explain_difference(plans[r], plans[0], r, 0)}); "
            "check that every rank builds the same model and [reducer] config"
        )

    @property
    def host_completion(self) -> bool:
        """gloo on CPU: a collective is complete when its wait() returns; CUDA: when its event fires."""
        return self._host_completion

    def _timing(self) -> bool:
        return self.tracer.enabled or any(o.timing for o in self.observers)

    # ------------------------------------------------------------------ per micro-batch

    def begin(self, sync: bool, control: torch.Tensor | None = None) -> None:
        """Arm the hooks for the coming backward; ``sync=False`` only accumulates (iter_size).

        ``control`` (a small fp32 device vector, see ``dptrain.distributed.control``) is summed over the
        ranks with the running statistics, in the collective launched here (in a held probe
        iteration: behind the first bucket), and holds the sums after :meth:`wait`.
        """
        self._control = control if sync else None
        if not self._hooked:
            return
        with self._lock:
            self._active = sync
            if sync:
                self._pending = list(self._sizes)
                self._next_launch = 0
                self._launched: list[Launched] = []
                self._ready: list[str] = []
                self._seen: set[str] = set()
                self.launch_log = []
                self._holding = any([o.begin() for o in self.observers])  # every observer hears it
                if self.world_size > 1 and not self._holding and self._has_stats():
                    self._launch_stats()  # every forward is done: the whole backward to overlap it with

    def _make_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            if self._active:
                self._on_ready(name)

        return hook

    def _on_ready(self, name: str) -> None:
        with self._lock:
            if name in self._seen:
                raise RuntimeError(
                    f"rank {self.comm.rank}: gradient of {name} accumulated twice in one synced backward, "
                    "possibly after its bucket's allreduce started; call Reducer.begin() before every backward"
                )
            self._seen.add(name)
            self._ready.append(name)
            for o in self.observers:
                o.ready(name)
            b = self._bucket_of[name]
            self._pending[b] -= 1
            if self._pending[b] == 0 and self.tracer.enabled:
                self.tracer.instant("bucket_ready", bucket=b, bytes=self.plan.buckets[b].nbytes)
            if self.world_size == 1 or self._holding:
                return
            while self._next_launch < len(self._pending) and self._pending[self._next_launch] == 0:
                self._launch(self.plan.buckets[self._next_launch])

    def _launch(self, b: Bucket) -> None:
        """Start bucket ``b``'s allreduce (caller holds the lock)."""
        view = self.flat.groups[b.group].grads[b.start : b.stop]
        wire = view.to(self.wire_dtype) if self.wire_dtype not in (None, view.dtype) else None
        t, start_us = time.perf_counter(), now_us()
        try:
            if self.shards is not None:  # in place: this solver's slice of the bucket takes the sum
                sent = wire if wire is not None else view
                lo, hi = self.shards.owned(b)
                work = self.comm.reduce_scatter_async(sent[lo - b.start : hi - b.start], sent, tag=b.index)
            else:
                work = self._collective.allreduce_async(wire if wire is not None else view, tag=b.index)
        except Exception as e:  # backend error at enqueue: a peer already gone
            raise self._failure(b, e) from e
        self._next_launch += 1
        self.launch_log.append((b.index, t))
        if self._next_launch == 1 and self._stats_flight is None and self._has_stats():
            self._launch_stats()  # a held probe iteration: behind the first bucket, after backward
        rec = Launched(b, work, wire, start_us)
        if self._timing():
            work.on_complete(lambda end_us, rec=rec: self._completed(rec, end_us))
        self._launched.append(rec)

    def _completed(self, rec: Launched, end_us: float) -> None:
        """A collective's completion callback (any thread). CPU: traced at wait(); CUDA: here."""
        rec.end_us.append(end_us)
        if self.tracer.enabled and not self._host_completion and rec.bucket is not None:
            self._trace(rec, end_us)

    def _refresh_stats_views(self) -> None:
        """Flat views of the statistics, remade only when a buffer tensor changed: a step's launch then
        concatenates them without a Python op per buffer."""
        current = self._stats_source()
        if len(current) == len(self._stats_views) and all(a is b for a, b in zip(current, self.running_stats,
                                                                                  strict=True)):
            return
        self.running_stats = current
        self._stats_views = [t.detach().view(-1) for t in current]
        self._stats_numels = [t.numel() for t in current]

    def _has_stats(self) -> bool:
        """Whether a synced iteration sums anything besides gradients (running statistics, control flags)."""
        return bool(self.running_stats) or self._control is not None

    def _launch_stats(self) -> None:
        """Start the running-statistics average (and the control vector's sum); the caller holds
        the lock and has run every forward of the iteration."""
        self._refresh_stats_views()
        parts = self._stats_views if self._control is None else [*self._stats_views, self._control]
        stats = torch.cat(parts).float()  # one collective for all of it: the statistics, then the control vector
        start_us = now_us()
        try:
            rec = Launched(None, self._collective.allreduce_async(stats), None, start_us)
        except Exception as e:
            raise self._stats_failure(e) from e
        if any(o.timing for o in self.observers):  # it shares the channel with the buckets they time
            rec.work.on_complete(rec.end_us.append)
        self._stats_flight = (rec, stats)

    def _finish_stats(self) -> None:
        """Wait for the running-statistics sum and write the rank average back into the buffers."""
        if self._stats_flight is None:
            return
        rec, stats = self._stats_flight
        self._stats_flight = None
        try:
            rec.work.wait()
        except Exception as e:
            raise self._stats_failure(e) from e
        n = sum(self._stats_numels)
        if self._control is not None:
            self._control.copy_(stats[n:])  # a sum over the ranks, not an average
        if not self.running_stats:
            return
        stats = stats[:n].div_(self.world_size)
        with torch.no_grad():  # one multi-tensor copy back, not a kernel per buffer (ResNet-50 has 106)
            torch._foreach_copy_(self.running_stats,
                                 [avg.view_as(t) for t, avg in zip(self.running_stats, stats.split(self._stats_numels), strict=True)])

    def _stats_failure(self, e: Exception) -> RankFailure:
        return RankFailure(f"rank {self.comm.rank}: allreduce of the running statistics failed or timed out "
                           f"(reducer.timeout_s = {self.cfg.timeout_s}): {e}; a peer rank probably died or hung, "
                           "see its log")

    def _trace(self, rec: Launched, end_us: float) -> None:
        self.tracer.complete("allreduce", rec.start_us, end_us, tid="comm", bucket=rec.bucket.index,
                             bytes=rec.bucket.nbytes)

    def _failure(self, b: Bucket, e: Exception) -> RankFailure:
        return RankFailure(
            f"rank {self.comm.rank}: allreduce of bucket {b.index} ({b.nbytes} B) failed or timed out "
            f"(reducer.timeout_s = {self.cfg.timeout_s}): {e}; a peer rank probably died or hung, see its log"
        )

    def wait(self) -> None:
        """Wait for the synced backward's collectives, then tell the observers.

        Raises RankFailure naming this rank when a collective fails or times out (a peer
        died): the caller exits instead of hanging. On CUDA this does not block the host.
        """
        if self.world_size == 1:
            self._active = False
            if self.unused is not None:
                self.unused.finish()
            return
        backward_end_us = self._launch_rest()
        if self.unused is not None:  # behind the last bucket, in the same order on every rank
            self.unused.launch(self._collective)
        for rec in self._launched:
            self._wait_bucket(rec)
        launched = self._launched + ([self._stats_flight[0]] if self._stats_flight is not None else [])
        self._launched = []
        for o in self.observers:
            o.completed(launched, backward_end_us)
        self._finish_stats()
        if self.unused is not None:
            self.unused.finish()
        if self._replan_pending:
            self._replan()
        for o in self.observers:
            o.after_wait()

    def _launch_rest(self) -> float:
        """Launch the buckets backward left (parameters without gradients, or a held backward); its end (us)."""
        with self._lock:
            if not self._active:
                raise RuntimeError(f"rank {self.comm.rank}: Reducer.wait() without begin(sync=True) before the "
                                   "last backward; gradients would not be reduced")
            self._active = False
            backward_end_us = now_us()
            self._holding = False
            while self._next_launch < len(self.plan.buckets):
                self._launch(self.plan.buckets[self._next_launch])
        return backward_end_us

    def _wait_bucket(self, rec: Launched) -> None:
        """Wait for one bucket's collective; a bucket reduced in another dtype goes back into the gradients
        (with fp32 reduction of 16-bit gradients, averaged in fp32 and rounded once)."""
        try:
            rec.work.wait()
        except Exception as e:  # DistBackendError / timeout: a peer rank probably died
            raise self._failure(rec.bucket, e) from e
        b = rec.bucket
        grads = self.flat.groups[b.group].grads
        lo, hi = (b.start, b.stop) if self.shards is None else self.shards.owned(b)
        view, src = grads[lo:hi], None
        if rec.wire is not None:
            src = rec.wire[lo - b.start : hi - b.start]
        if self.fp32_reduce:
            view.copy_((view if src is None else src).div_(self.world_size))  # average in fp32, then round once
        elif src is not None:  # 16 bits on the wire: back into the fp32 gradients, exactly
            view.copy_(src)
        if self.shards is not None:  # the rest is this solver's own gradient: zero for the next hand-over
            grads[b.start : lo].zero_()
            grads[hi : b.stop].zero_()
        if self.tracer.enabled and self._host_completion:
            self._trace(rec, rec.end_us[0] if rec.end_us else now_us())

    # ------------------------------------------------------------------ replan

    def _replan(self) -> None:
        """Re-plan from the observed gradient-ready order (``reducer.replan``).

        Rank 0's order is broadcast, so every rank re-lays out its flat buffers (weights,
        grads, masters, momentum move with their parameters) and rebuilds the same plan.
        """
        self._replan_pending = False
        order = self.comm.broadcast_object(list(self._ready), src=0)
        old = self.plan.describe()
        self.adopt_ready_order(order)
        if self.comm.rank == 0:
            log.info("reducer re-planned from the observed gradient order: %s (was %s)", self.plan.describe(), old)

    def adopt_ready_order(self, order: list[str], cuts: list[int] | None = None) -> None:
        """Re-lay out the flat buffers and re-plan the buckets for gradient-ready ``order``,
        cut by the caps or, given ``cuts`` (positions in ``order``), there (collective)."""
        if self.shards is not None:  # parameters move between buckets, so between owners: whole first
            self.shards.unshard()
        per_group, predicted = plan_from_ready_order(group_specs(self.flat), order, *self._caps(), cuts)
        self.flat.reorder(per_group, order_from_ready(self.flat.layout_order, order))
        plan = build_bucket_plan(group_specs(self.flat), *self._caps(), cuts)
        assert plan.digest() == predicted.digest(), "relayout does not match the planned layout"
        self._set_plan(plan)
        self._check_plan_agreement()
        self._ready_order, self._cuts = list(order), (list(cuts) if cuts is not None else None)

    # ------------------------------------------------------------------ snapshot

    def state_dict(self) -> dict[str, list]:
        """The gradient-ready order a ``replan`` or auto plan laid the buffers out by, and the auto
        plan's cuts (both empty before they ran)."""
        out: dict = {"ready_order": list(self._ready_order), "bucket_cuts": list(self._cuts or [])}
        if self.unused is not None:
            out["unused"] = self.unused.state_dict()
        return out

    def load_state_dict(self, state: dict[str, list]) -> None:
        """Re-apply a snapshot's replanned layout at once (collective), so a resumed run reduces
        in the same buckets as the interrupted one from its first iteration: bucket boundaries
        decide gloo's summation order with 3+ ranks, so the default plan for that one
        iteration made a resume differ in the last bits. An auto plan's cuts come back with it
        (no new probe); a snapshot taken before the auto plan was chosen leaves probing on."""
        if self.unused is not None and "unused" in state:
            self.unused.load_state_dict(state["unused"])  # type: ignore[arg-type]
        order = list(state.get("ready_order", []))
        cuts = list(state.get("bucket_cuts", []))
        adopt = bool(cuts) and any(o.accepts_plan for o in self.observers)
        if not (order and (self._replan_pending or adopt)):
            return
        if set(order) - set(self.flat.layout_order):
            log.warning("rank %d: the snapshot's bucket layout names parameters this model lacks; re-planning "
                        "from this run's gradient order instead", self.comm.rank)
            return
        self._replan_pending = False
        if adopt:
            for o in self.observers:
                o.plan_adopted()
        self.adopt_ready_order(order, cuts if adopt else None)

    def close(self) -> None:
        """Remove the gradient hooks (the model stays usable without a reducer) and release a
        cupy-nccl communicator; the process group belongs to the Communicator."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.shards is not None:
            self.shards.close()
        if self._collective is not self.comm:
            self._collective.close()  # type: ignore[attr-defined]
