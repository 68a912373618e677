"""Reducer: bucketed gradient allreduce, launched during backward, waited for once.

Each parameter has a post-accumulate-grad hook (public autograd API). In the last
micro-batch of an iteration, when a bucket's last gradient has accumulated into the flat
buffer, the bucket's async SUM allreduce is launched, strictly in plan order: a bucket
that completes early waits until every earlier bucket has launched, so all ranks issue
the same collectives in the same order. ``wait()`` after backward launches any bucket
whose parameters got no gradient, then waits for all of them: the only point where
compute waits on communication.

Loss scaling happens before the reduce: the buckets hold loss-scaled storage-dtype
gradients, summed over ranks. The solver unscales by ``1 / (S * grad_divisor)`` in fp32.
Every rank then holds the identical reduced gradient, so the overflow decision taken on
it is identical everywhere without another collective.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from dptrain.buckets import Bucket, BucketPlan, GroupSpec, SegmentSpec, build_bucket_plan
from dptrain.comm import Communicator, Work
from dptrain.config import ReducerConfig
from dptrain.flat import FlatParams
from dptrain.trace import Tracer, now_us

log = logging.getLogger(__name__)


def plan_for(flat: FlatParams, cfg: ReducerConfig, order: list[str]) -> BucketPlan:
    """The bucket plan of ``flat`` with parameters ranked by ``order`` (names)."""
    rank_of = {n: i for i, n in enumerate(order)}
    specs = [GroupSpec(str(g.dtype), g.grads.element_size(),
                       tuple(SegmentSpec(s.name, s.offset, s.padded_numel, rank_of[s.name]) for s in g.segments))
             for g in flat.groups]
    return build_bucket_plan(specs, cfg.bucket_mb, cfg.first_bucket_mb)


class Reducer:
    """Overlaps the gradient allreduce with backward; see the module docstring."""

    def __init__(self, flat: FlatParams, cfg: ReducerConfig, comm: Communicator, tracer: Tracer) -> None:
        self.flat, self.cfg, self.comm, self.tracer = flat, cfg, comm, tracer
        self.world_size = comm.world_size
        self.fp32_reduce = cfg.reduce_dtype == "fp32"
        self.grad_divisor = 1 if (self.fp32_reduce or self.world_size == 1) else self.world_size
        """What the solver still divides the reduced gradient by: the SUM in the storage dtype
        needs 1/world_size; the fp32 path averages before writing back (no fp16 overflow)."""
        self._lock = threading.Lock()
        self._set_plan(plan_for(flat, cfg, flat.layout_order))
        self._check_plan_agreement()
        self._active = False
        self._replan_pending = cfg.replan and self.world_size > 1
        self._ready_order: list[str] = []
        self.launch_log: list[tuple[int, float]] = []
        """(bucket index, time.perf_counter()) of each launch in the last synced iteration."""
        if self.world_size > 1:
            for g in flat.groups:
                for s in g.segments:
                    s.param.register_post_accumulate_grad_hook(self._make_hook(s.name))
        log.info("reducer: %s, reduce in %s", self.plan.describe(), cfg.reduce_dtype)

    # ------------------------------------------------------------------ plan

    def _set_plan(self, plan: BucketPlan) -> None:
        self.plan = plan
        self._bucket_of = plan.bucket_of()
        self._sizes = [len(b.names) for b in plan.buckets]

    def _check_plan_agreement(self) -> None:
        """Allgather every rank's plan digest; raise naming both ranks if any differs."""
        mine = (self.plan.digest(), self.plan.describe())
        everyone = self.comm.allgather_object(mine)
        for r, (digest, desc) in enumerate(everyone):
            if digest != everyone[0][0]:
                raise RuntimeError(
                    f"bucket plan differs across ranks (rank {r}: {desc}; rank 0: {everyone[0][1]}); "
                    "check that every rank builds the same model and [reducer] config"
                )

    # ------------------------------------------------------------------ per micro-batch

    def begin(self, sync: bool) -> None:
        """Arm the hooks for the coming backward; ``sync=False`` only accumulates (iter_size)."""
        if self.world_size == 1:
            return
        self._active = sync
        if not sync:
            return
        self._pending = list(self._sizes)
        self._next_launch = 0
        self._works: list[tuple[Bucket, Work, torch.Tensor | None, float]] = []
        self.launch_log = []
        self._ready_order = []

    def _make_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            if self._active:
                self._on_ready(name)

        return hook

    def _on_ready(self, name: str) -> None:
        with self._lock:  # hooks of one backward may run on several autograd threads
            self._ready_order.append(name)
            b = self._bucket_of[name]
            self._pending[b] -= 1
            if self._pending[b] == 0 and self.tracer.enabled:
                self.tracer.instant("bucket_ready", bucket=b, bytes=self.plan.buckets[b].nbytes)
            while self._next_launch < len(self._pending) and self._pending[self._next_launch] == 0:
                self._launch(self.plan.buckets[self._next_launch])
                self._next_launch += 1

    def _launch(self, b: Bucket) -> None:
        view = self.flat.groups[b.group].grads[b.start : b.stop]
        send = view.float() if self.fp32_reduce and view.dtype != torch.float32 else None
        t = time.perf_counter()
        work = self.comm.allreduce_async(send if send is not None else view)
        self.launch_log.append((b.index, t))
        self._works.append((b, work, send, now_us()))

    def wait(self) -> None:
        """Launch what backward did not (parameters without gradients), then wait for all.

        Raises RuntimeError naming this rank when a collective fails or times out (a peer
        died): the caller exits instead of hanging.
        """
        if self.world_size == 1 or not self._active:
            return
        with self._lock:
            while self._next_launch < len(self.plan.buckets):
                self._launch(self.plan.buckets[self._next_launch])
                self._next_launch += 1
        for b, work, send, start_us in self._works:
            try:
                work.wait()
            except Exception as e:  # DistBackendError / timeout: a peer rank probably died
                raise RuntimeError(
                    f"rank {self.comm.rank}: allreduce of bucket {b.index} failed or timed out "
                    f"(reducer.timeout_s = {self.cfg.timeout_s}): {e}; a peer rank probably died, see its log"
                ) from e
            view = self.flat.groups[b.group].grads[b.start : b.stop]
            if self.fp32_reduce:
                src = send if send is not None else view
                view.copy_(src.div_(self.world_size))
            if self.tracer.enabled:
                self.tracer.complete("allreduce", start_us, now_us(), tid="comm", bucket=b.index, bytes=b.nbytes)
        self._active = False
        if self._replan_pending:
            self._replan()

    # ------------------------------------------------------------------ replan

    def _replan(self) -> None:
        """Re-plan from the observed gradient-ready order. Rank 0 decides and broadcasts it,
        so every rank re-lays out its buffers identically."""
        self._replan_pending = False
        seen = set(self._ready_order)
        observed = self._ready_order + [n for n in self.flat.layout_order if n not in seen]
        order = self.comm.broadcast_object(observed, src=0)
        for g in self.flat.groups:
            names = {s.name for s in g.segments}
            g.relayout([n for n in order if n in names])
        self.flat.layout_order = list(order)
        old = self.plan.describe()
        self._set_plan(plan_for(self.flat, self.cfg, order))
        self._check_plan_agreement()
        log.info("reducer re-planned from the observed order: %s (was %s)", self.plan.describe(), old)

