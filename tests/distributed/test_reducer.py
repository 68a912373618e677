"""Reducer and Communicator on gloo with 2 and 3 CPU ranks: closed-form averages, reduce
dtypes, iter_size, launch order and overlap, plan agreement, replan, failure propagation."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

from dist_harness import run_ranks, start_ranks
from dptrain.config import ReducerConfig
from dptrain.distributed.comm import Communicator
from dptrain.distributed.reducer import Reducer
from dptrain.errors import ConfigError, RankFailure
from dptrain.flat import FlatParams
from dptrain.observe.trace import NullTracer, Tracer

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
KIB = 1 / 1024  # in MiB, the unit of the bucket caps


class Tiny(nn.Module):
    """Four linear layers; with fp32 storage, 1 KiB/5 KiB caps give 4 buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 32)
        self.fc3, self.fc4 = nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc4(torch.relu(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))))


class WithUnused(Tiny):
    """Registered last, so laid out first (bucket 0), but never used in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(4, 4)


class Swapped(nn.Module):
    """Registered c, b, a but run a -> b -> c: the default layout (reverse registration)
    is the reverse of the gradient-ready order. ``marks`` gets the time at which backward
    reaches layer ``a`` (the gradient of its output)."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.b, self.a = nn.Linear(8, 4), nn.Linear(16, 8), nn.Linear(16, 16)
        self.marks: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.register_hook(lambda g: self.marks.append(time.perf_counter()))
        return self.c(torch.relu(self.b(torch.relu(h))))


def build(comm: Communicator, model: nn.Module, storage: str = "fp32", tracer: Tracer | None = None,
          wire: str | None = None, **cfg: object) -> tuple[FlatParams, Reducer]:
    model.to(DTYPES[storage])
    flat = FlatParams(model, state_dtype=torch.float32)
    cfg = {"bucket_mb": 5 * KIB, "first_bucket_mb": 1 * KIB, **cfg}
    return flat, Reducer(flat, ReducerConfig(**cfg), comm, tracer or NullTracer(comm.rank),
                         wire_dtype=None if wire is None else DTYPES[wire])


def comm_of(timeout_s: float = 30.0) -> Communicator:
    return Communicator.from_initialized(torch.device("cpu"), timeout_s=timeout_s)


def force_grads(model: nn.Module, value: float) -> None:
    """Every parameter's incoming gradient becomes ``value``: a closed-form answer after reduce."""
    for p in model.parameters():
        p.register_hook(lambda g, v=value: torch.full_like(g, v))


def check_grads(flat: FlatParams, expect: float, divisor: int, what: str) -> None:
    for g in flat.groups:
        for s in g.segments:
            got = g.grads[s.offset : s.offset + s.numel].float() / divisor
            assert torch.all(got == expect), f"{what}: {s.name} has {got.unique().tolist()}, expected {expect}"
            assert torch.all(g.grads[s.offset + s.numel : s.offset + s.padded_numel] == 0), f"{what}: padding"


# ---------------------------------------------------------------- running statistics


def _stats_rank(rank: int, world: int, out: str) -> None:
    comm = comm_of()
    torch.manual_seed(0)
    model = Tiny()
    mean, var = torch.full((6,), float(rank)), torch.full((2, 3), 2.0 ** rank)  # any shapes, distinct per rank
    flat = FlatParams(model, state_dtype=torch.float32)
    reducer = Reducer(flat, ReducerConfig(bucket_mb=5 * KIB, first_bucket_mb=1 * KIB), comm, NullTracer(rank),
                      running_stats=[mean, var])
    reducer.begin(sync=True)
    assert reducer._stats_flight is not None, "launched before backward, to overlap all of it"
    model(torch.randn(4, 16)).sum().backward()
    reducer.wait()
    torch.save({"mean": mean, "var": var}, Path(out) / f"rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 3])
def test_running_stats_are_averaged_over_ranks(tmp_path, world):
    run_ranks(world, _stats_rank, str(tmp_path))
    expect_mean = sum(range(world)) / world
    expect_var = sum(2.0 ** r for r in range(world)) / world
    for r in range(world):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert torch.equal(got["mean"], torch.full((6,), expect_mean)), got["mean"]
        assert torch.equal(got["var"], torch.full((2, 3), expect_var)), got["var"]


# ---------------------------------------------------------------- averaging, dtypes, iter_size

CASES = [("fp32", None), ("fp16", None), ("bf16", None), ("fp16", "fp32"), ("bf16", "fp32"),
         ("fp32", "bf16"), ("fp32", "fp16")]
"""(gradients' dtype, dtype on the wire; None: theirs): storage mode, fp32 reduction of 16-bit gradients,
and autocast mode's fp32 gradients reduced in 16 bits."""


def _average_rank(rank: int, world: int) -> None:
    comm = comm_of()
    for storage, wire in CASES:
        what = f"{storage}/{wire}"
        torch.manual_seed(0)
        model = Tiny()
        flat, reducer = build(comm, model, storage, wire=wire)
        assert reducer.grad_divisor == (1 if wire == "fp32" else world), what
        force_grads(model, rank + 1)
        x = torch.randn(4, 16, dtype=DTYPES[storage])
        # iter_size 2: the first micro-batch only accumulates, locally
        reducer.begin(sync=False)
        model(x).sum().backward()
        assert reducer.launch_log == [], f"{what}: a sync=False backward launched {reducer.launch_log}"
        check_grads(flat, rank + 1, 1, f"{what} after the accumulate-only micro-batch")
        reducer.begin(sync=True)
        model(x).sum().backward()
        reducer.wait()
        # sum over ranks of 2 * (r + 1), divided by world: exact in fp16 and bf16 for world <= 3
        check_grads(flat, world + 1, reducer.grad_divisor, what)
        assert [b for b, _ in reducer.launch_log] == list(range(len(reducer.plan.buckets))), what
        reducer.close()


def test_reducer_averages_in_every_reduce_dtype_with_accumulation():
    run_ranks(3, _average_rank)  # 2 ranks: see the unused-parameter case of the launch-order test


# ---------------------------------------------------------------- launch order and overlap

def _order_rank(rank: int, world: int) -> None:
    comm = comm_of()
    tracer = Tracer(rank)
    torch.manual_seed(0)
    model = Tiny()
    flat, reducer = build(comm, model, tracer=tracer)
    n = len(reducer.plan.buckets)
    assert n >= 3, reducer.plan.describe()
    x = torch.randn(64, 16, requires_grad=True)
    input_grad_at: list[float] = []
    x.register_hook(lambda g: input_grad_at.append(time.perf_counter()))  # among the last steps of backward
    reducer.begin(sync=True)
    model(x).square().mean().backward()
    backward_done = time.perf_counter()
    reducer.wait()
    launches = reducer.launch_log
    assert [b for b, _ in launches] == list(range(n)), launches
    assert launches[0][1] < input_grad_at[0] < backward_done, "bucket 0 must launch while backward still runs"
    ready = [e["args"]["bucket"] for e in tracer.events if e["name"] == "bucket_ready"]
    assert sorted(ready) == list(range(n))
    spans = sorted((e for e in tracer.events if e["name"] == "allreduce"), key=lambda e: e["args"]["bucket"])
    assert [e["args"]["bucket"] for e in spans] == list(range(n))
    assert all(e["tid"] == "comm" and e["dur"] >= 0 and e["args"]["bytes"] == b.nbytes
               for e, b in zip(spans, reducer.plan.buckets, strict=True))
    with pytest.raises(RuntimeError, match=r"rank \d: Reducer.wait\(\) without begin\(sync=True\)"):
        reducer.wait()
    # a second gradient for the same parameter in one synced backward is refused
    reducer.begin(sync=True)
    loss = model(x).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"gradient of fc4.bias accumulated twice in one synced backward"):
        loss.backward()
    reducer.wait()  # every rank drains the same collectives
    reducer.close()

    # a bucket whose parameter gets no gradient holds back the launch of every later bucket
    torch.manual_seed(0)
    model = WithUnused()
    flat, reducer = build(comm, model)
    assert "unused.bias" in reducer.plan.buckets[0].names
    force_grads(model, rank + 1)
    reducer.begin(sync=True)
    model(torch.randn(4, 16)).sum().backward()
    assert reducer.launch_log == [], "launched past an incomplete bucket 0"
    reducer.wait()
    assert [b for b, _ in reducer.launch_log] == list(range(len(reducer.plan.buckets)))
    unused = [s for g in flat.groups for s in g.segments if s.name.startswith("unused.")]
    assert all(torch.all(flat.groups[0].grads[s.offset : s.offset + s.numel] == 0) for s in unused)
    used = reducer.plan.buckets[-1]
    assert torch.all(flat.groups[0].grads[used.start : used.start + 8] / world == (world + 1) / 2)


def test_buckets_launch_in_plan_order_during_backward():
    run_ranks(2, _order_rank)


# ---------------------------------------------------------------- plan agreement and replan

def _mismatch_rank(rank: int, world: int) -> None:
    caps = {"bucket_mb": 1000.0, "first_bucket_mb": 1000.0} if rank == 2 else {}
    with pytest.raises(RuntimeError, match=r"bucket plan differs across ranks \(rank 2: 1 buckets, .*; rank 0: "
                                           r"4 buckets, .*rank 2 has 1 buckets, rank 0 has 4; first difference "
                                           r"at bucket 0: .*check that every rank builds the same model"):
        build(comm_of(), Tiny(), **caps)


def _replan_rank(rank: int, world: int) -> None:
    comm = comm_of()
    torch.manual_seed(0)
    model = Swapped()
    flat, reducer = build(comm, model, replan=True, bucket_mb=1e-9, first_bucket_mb=1e-9)  # a bucket per tensor
    assert reducer.plan.buckets[0].names == ("a.bias",)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    force_grads(model, rank + 1)
    x = torch.randn(4, 16)
    reducer.begin(sync=True)
    model(x).sum().backward()
    if rank != 0:  # pretend this rank saw another ready order: rank 0's must win
        reducer._ready.reverse()
    first_launch = reducer.launch_log[0][1]
    assert first_launch > model.marks[-1], "before replan, bucket 0 (layer a) waits for the end of backward"
    reducer.wait()  # reduces, then re-plans and re-lays out the flat buffers
    assert flat.layout_order[:2] in (["c.bias", "c.weight"], ["c.weight", "c.bias"]), flat.layout_order
    assert reducer.plan.buckets[0].names[0].startswith("c."), reducer.plan.describe()
    digests = comm.allgather_object((reducer.plan.digest(), flat.layout_order))
    assert all(d == digests[0] for d in digests), digests
    flat.check_grad_views()
    check_grads(flat, (world + 1) / 2, reducer.grad_divisor, "reduced grads moved with their parameters")
    assert all(torch.equal(p.detach(), weights[n]) for n, p in model.named_parameters())
    for g in flat.groups:
        g.grads.zero_()
    reducer.begin(sync=True)
    model(x).sum().backward()
    reducer.wait()
    assert reducer.launch_log[0][1] < model.marks[-1], "after replan, bucket 0 (layer c) launches mid-backward"
    assert [b for b, _ in reducer.launch_log] == list(range(len(reducer.plan.buckets)))
    check_grads(flat, (world + 1) / 2, reducer.grad_divisor, "second iteration")


def test_replan_follows_rank0_ready_order_on_every_rank():
    run_ranks(3, _replan_rank)


# ---------------------------------------------------------------- communicator

class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 2)


def _comm_rank(rank: int, world: int) -> None:
    comm = comm_of()
    torch.manual_seed(rank)  # different weights everywhere before the broadcast
    model = WithBuffers().to(memory_format=torch.channels_last)  # conv weight: not contiguous()
    model.bn.running_mean.fill_(rank)
    model.bn.num_batches_tracked.fill_(rank + 7)
    flat = FlatParams(model, state_dtype=torch.float32)
    ptrs = [p.data_ptr() for p in model.parameters()]
    comm.broadcast_module(model)
    assert [p.data_ptr() for p in model.parameters()] == ptrs, "broadcast must write into the flat views"
    torch.manual_seed(0)
    ref = WithBuffers()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    assert torch.all(model.bn.running_mean == 0) and int(model.bn.num_batches_tracked) == 7  # rank 0's
    assert torch.equal(flat.groups[0].params[: ref.fc.bias.numel()], ref.fc.bias.detach())
    t = torch.tensor([float(rank + 1)])
    assert comm.allreduce_sum_(t).item() == world * (world + 1) / 2
    assert comm.allgather_object({"r": rank}) == [{"r": r} for r in range(world)]
    assert comm.broadcast_object(f"from {rank}", src=1) == "from 1"
    comm.barrier()
    different = nn.Linear(4, 3 if rank else 2)
    with pytest.raises(ConfigError, match=r"model tensors differ from rank \d.*check that every rank builds"):
        comm.broadcast_module(different)
    _mismatch_rank(rank, world)


def test_communicator_collectives_and_plan_mismatch_error():
    run_ranks(3, _comm_rank)


# ---------------------------------------------------------------- failure

def _fails_rank(rank: int, world: int, out: str, mode: str) -> None:
    comm = comm_of(timeout_s=6)
    torch.manual_seed(0)
    model = Tiny()
    _, reducer = build(comm, model, timeout_s=6)
    if rank == 1:
        if mode == "dies":
            raise RuntimeError("injected failure on rank 1")
        time.sleep(120)  # hangs: never joins the allreduce; the test kills it
    reducer.begin(sync=True)
    model(torch.randn(4, 16)).sum().backward()
    try:
        reducer.wait()
    except RankFailure as e:
        Path(out, "rank0.txt").write_text(str(e))
        raise


@pytest.mark.parametrize("mode", ["dies", "hangs"])
def test_peer_failure_fails_this_rank_fast_with_its_rank_named(tmp_path, mode):
    start = time.monotonic()
    with _started_ranks(2, _fails_rank, str(tmp_path), mode, timeout_s=6) as procs:
        procs[0].join(timeout=45)
        elapsed = time.monotonic() - start
        assert procs[0].exitcode not in (None, 0), f"rank 0 exit code {procs[0].exitcode}"
        # dies: the peer's closed sockets fail the allreduce at once; hangs: the 6 s timeout does
        assert elapsed < (20 if mode == "dies" else 30), elapsed
        msg = (tmp_path / "rank0.txt").read_text()
        assert msg.startswith("rank 0: allreduce of bucket ") and "a peer rank probably died or hung" in msg, msg
        if mode == "dies":
            procs[1].join(timeout=10)
            assert procs[1].exitcode not in (None, 0)


@contextmanager
def _started_ranks(world: int, fn, *args, timeout_s: float) -> Iterator[list]:
    """start_ranks, and on the way out kill whatever still runs and remove the rendezvous folder."""
    procs, tmp = start_ranks(world, fn, *args, timeout_s=timeout_s)
    try:
        yield procs
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        tmp.cleanup()


def _blocking_fails_rank(rank: int, world: int, out: str, collective: str) -> None:
    comm = comm_of(timeout_s=6)
    comm.barrier()
    if rank == 1:
        raise RuntimeError("injected failure on rank 1")
    calls = {"allreduce_sum_": lambda: comm.allreduce_sum_(torch.ones(4)),
             "allgather_object": lambda: comm.allgather_object({"rank": rank}),
             "broadcast_module": lambda: comm.broadcast_module(Tiny())}
    try:
        calls[collective]()
    except RankFailure as e:
        Path(out, "rank0.txt").write_text(str(e))
        raise


@pytest.mark.parametrize("collective", ["allreduce_sum_", "allgather_object", "broadcast_module"])
def test_blocking_collective_with_a_dead_peer_is_a_peer_failure(tmp_path, collective):
    """The test phase, snapshots and startup use blocking collectives: a dead peer there must
    be the same one-line RankFailure as in the reducer, not gloo's traceback."""
    with _started_ranks(2, _blocking_fails_rank, str(tmp_path), collective, timeout_s=6) as procs:
        for p in procs:
            p.join(timeout=45)
        assert all(p.exitcode not in (None, 0) for p in procs), [p.exitcode for p in procs]
        msg = (tmp_path / "rank0.txt").read_text()
        assert msg.startswith("rank 0: ") and "failed or timed out" in msg and "a peer rank probably died" in msg, msg
        assert "\n" not in msg
