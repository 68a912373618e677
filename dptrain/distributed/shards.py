"""``reducer.shard = "optimizer"`` (ZeRO-1): the fp32 masters and the optimizer state sharded over the solvers.

**Layout.** Every bucket is padded at its end (spare elements after its last parameter, which
belong to no parameter and stay zero) to a multiple of ``world_size x ALIGN_ELEMS`` elements, so
solver r owns one contiguous, aligned slice of it: elements ``[start + r*L, start + (r+1)*L)``
with ``L = size / world_size`` a multiple of 64 (the update kernels' 16-byte packs start aligned).
A solver keeps the masters and the optimizer state of its slices only, in shard buffers of their
total length (``FlatGroup.shard``); fp32 weights stay the masters, so there the slices are views
of the weights themselves. The 16-bit weights and gradients stay whole on every solver.

**A step.** During backward each bucket is *reduce-scattered* instead of allreduced (16 bits,
loss-scaled before the reduce, as the allreduce was): in place, so solver r's slice of the bucket
holds the sum over the ranks; the rest of the bucket, this solver's own unreduced gradients, is
zeroed (the next step's gradient hand-over starts from zero). The fused update runs on each owned
slice (``FlatGroup.units``). Then each bucket's updated weights are *all-gathered* in place
(:meth:`Shards.gather_weights`), launched in reverse bucket order (the first layers' bucket first:
the next forward needs it first) and waited for before the next forward reads them
(:meth:`Shards.wait_weights`). The bytes on the wire are an allreduce's: reduce-scatter plus all-gather.

**What needs the whole gradient** gets it from one small collective per step, summing per-rank
partial sums of squares (``dptrain.optimizer``): the overflow flag and the clipping norm (one
allreduce of the per-group partial norms, only when loss scaling or clipping is on), and LAMB's and
LARC's per-parameter norms. The overflow layer's counts are summed over the ranks when displayed.

**Snapshots** hold every parameter's whole master and state, as an unsharded run's do
(:meth:`Shards.gather_group`, one bucket at a time), so any world size, sharded or not, resumes
them; a sharded run loads them by taking its own slices.
"""
from __future__ import annotations

import torch

from dptrain.distributed.buckets.plan import Bucket, BucketPlan, GroupSpec
from dptrain.distributed.comm import Communicator, Work
from dptrain.errors import RankFailure, first_line
from dptrain.flat import ALIGN_ELEMS, FlatGroup, FlatParams


def _align(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class Shards:
    """This solver's slices of the buckets, and the collectives that move the rest (module docstring)."""

    def __init__(self, flat: FlatParams, comm: Communicator) -> None:
        self.flat, self.comm = flat, comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.plan: BucketPlan | None = None
        self._bucket_of: dict[str, int] = {}
        """Parameter name -> index of its bucket in :attr:`plan`."""
        self._gathers: dict[int, Work] = {}
        """Bucket index -> its weights' all-gather in flight."""
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        flat.gather = self.gather_group

    # ------------------------------------------------------------------ layout

    def owned(self, b: Bucket) -> tuple[int, int]:
        """This solver's slice [start, stop) of bucket ``b``."""
        size = (b.stop - b.start) // self.world_size
        return b.start + self.rank * size, b.start + (self.rank + 1) * size

    def apply(self, plan: BucketPlan, specs: list[GroupSpec]) -> BucketPlan:
        """Pad ``plan``'s buckets (re-laying out groups whose padding changes, values moving with their
        parameters), shard every group by the padded plan, and return it. The groups must be unsharded."""
        unit = self.world_size * ALIGN_ELEMS
        pad_now = {s.name: s.pad for g in self.flat.groups for s in g.segments}
        base = {s.name: s.padded_numel - pad_now[s.name] for g in specs for s in g.segments}
        pads: dict[int, dict[str, int]] = {}
        for b in plan.buckets:
            size = sum(base[n] for n in b.names)
            pads.setdefault(b.group, {})[b.names[-1]] = _align(size, unit) - size
        for gi, g in enumerate(self.flat.groups):
            want = pads.get(gi, {})
            if any(s.pad != want.get(s.name, 0) for s in g.segments):
                g.relayout([s.name for s in g.segments], {n: p for n, p in want.items() if p})
        padded = _replace_ranges(plan, self.flat)
        for gi, g in enumerate(self.flat.groups):
            g.shard([self.owned(b) for b in padded.buckets if b.group == gi])
        self.plan, self._bucket_of = padded, padded.bucket_of()
        return padded

    def unshard(self) -> None:
        """Every group back to whole masters and state, gathered from every solver (collective): before
        a relayout, whose parameters move between buckets and so between owners."""
        self.wait_weights()
        for g in self.flat.groups:
            if g.parts is not None:
                master, state = self.gather_group(g)
                g.unshard(master, state)
        for g in self.flat.groups:  # the spare elements belong to the old buckets
            if any(s.pad for s in g.segments):
                g.relayout([s.name for s in g.segments], {})
        self.plan, self._bucket_of = None, {}

    # ------------------------------------------------------------------ collectives

    def gather_group(self, g: FlatGroup, *, with_master: bool = True, with_state: bool = True
                     ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """Group ``g``'s whole masters (None for fp32 weights: the weights are the masters, and whole
        once :meth:`wait_weights` returned) and state, from every solver's parts (collective); the
        masters alone or the state alone when the other is not asked for. A snapshot takes them one
        after the other and keeps views of what was gathered, so beside this solver's slices it holds
        the unsharded state once, no more."""
        assert self.plan is not None and g.parts is not None, "gather_group needs a sharded group"
        self.wait_weights()
        gi = self.flat.groups.index(g)
        buckets = [b for b in self.plan.buckets if b.group == gi]
        own = with_master and g.master is not g.params
        master = torch.zeros(g.numel, dtype=torch.float32, device=g.device) if own else None
        state = {k: torch.zeros(g.numel, dtype=v.dtype, device=g.device) for k, v in g.state.items()} if with_state else {}
        for b, p in zip(buckets, g.parts, strict=True):
            pairs = [(state[k], v) for k, v in g.state.items() if k in state]
            if master is not None:
                pairs.append((master, g.master))
            for full, shard in pairs:
                self.comm.all_gather_async(full[b.start : b.stop], shard[p.offset : p.offset + p.size]).wait()
        return master, state

    def gather_weights(self) -> None:
        """After the update: each bucket's weights from every owner, async, the first layers' bucket first."""
        if self.world_size == 1 or self.plan is None:
            return
        self.wait_weights()  # a gather still writing a bucket would race the update of its slice
        for b in reversed(self.plan.buckets):
            params = self.flat.groups[b.group].params
            start, stop = self.owned(b)
            self._gathers[b.index] = self.comm.all_gather_async(params[b.start : b.stop], params[start:stop],
                                                                tag=b.index)

    def wait_weights(self, buckets: list[int] | None = None) -> None:
        """Wait until the weights of ``buckets`` (all: None) are whole again (CUDA: the current stream
        waits, the host does not). A gather that fails or times out (a peer died) raises RankFailure
        naming this rank."""
        for i in list(self._gathers) if buckets is None else [i for i in buckets if i in self._gathers]:
            w = self._gathers.pop(i)
            try:
                w.wait()
            except Exception as e:  # DistBackendError / timeout: a peer rank probably died
                raise RankFailure(f"rank {self.rank}: all-gather of the updated weights failed or timed out "
                                  f"(reducer.timeout_s = {self.comm.timeout_s:g}): {first_line(e)}; a peer rank "
                                  f"probably died or hung, see its log") from e

    def wait_in_forward(self, model: torch.nn.Module) -> None:
        """Wait for each bucket's gather just before the first module whose own parameters it holds runs
        its forward (a forward pre-hook per module with parameters), so the first layers compute while
        the later layers' weights still arrive (``reducer.gather_wait = "forward"``)."""
        for prefix, m in model.named_modules():
            names = [f"{prefix}.{n}" if prefix else n for n, _ in m.named_parameters(recurse=False)]
            if names:
                self._hooks.append(m.register_forward_pre_hook(self._waiter(names)))

    def _waiter(self, names: list[str]):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            if self._gathers:
                of = self._bucket_of
                self.wait_weights(sorted({of[n] for n in names if n in of}))

        return hook

    def close(self) -> None:
        """Remove the forward hooks (the model stays usable without the shards)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the solvers, in place, without a host sync (the per-step norm collective)."""
        if self.world_size > 1:
            self.comm.allreduce_async(t).wait()
        return t


def _replace_ranges(plan: BucketPlan, flat: FlatParams) -> BucketPlan:
    """``plan``'s buckets (same parameters, same order) over ``flat``'s current layout."""
    where = {s.name: (s.offset, s.padded_numel) for g in flat.groups for s in g.segments}
    elem = [g.grads.element_size() for g in flat.groups]
    out = []
    for b in plan.buckets:
        start = where[b.names[0]][0]
        stop = where[b.names[-1]][0] + where[b.names[-1]][1]
        out.append(Bucket(b.index, b.group, b.dtype, start, stop, b.names, (stop - start) * elem[b.group]))
    return BucketPlan(tuple(out))

