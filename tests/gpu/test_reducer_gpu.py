"""Reducer on CUDA: NCCL (torch backend) and cupy-nccl, stream ordering, watchdog.

One-GPU tests exercise the cupy-nccl communicator over a one-rank NCCL clique; the
multi-rank tests need two GPUs (one NCCL rank per device: NCCL refuses two ranks on one GPU).
The watchdog's error (type and message) is also checked on the CPU, with a stand-in for
CuPy's communicator; the averaging, launch order and plan agreement of the two-GPU tests
run on gloo in tests/distributed/test_reducer.py and tests/distributed/test_bucket_auto.py.
"""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from devices import cuda_param, requires_gpus
from dist_harness import run_ranks
from dptrain.config import ReducerConfig
from dptrain.distributed.comm import Communicator, CompletionWatcher
from dptrain.distributed.flight import FlightRecorder
from dptrain.distributed.reducer import Reducer
from dptrain.errors import RankFailure
from dptrain.flat import FlatParams
from dptrain.observe.trace import Tracer
from dptrain.topology import Topology


def requires_cupy_nccl() -> pytest.MarkDecorator:
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        ok, why = False, str(e)
    else:
        # cupy.cuda.nccl imports even when libnccl cannot be loaded; it then says available = False
        ok = bool(getattr(nccl, "available", False)) and hasattr(nccl, "NcclCommunicator")
        why = "" if ok else "cupy.cuda.nccl.available is False (CuPy cannot load libnccl)"
    return pytest.mark.skipif(not ok, reason=f"needs CuPy with NCCL: {why}")


gpu = pytest.mark.gpu
KIB = 1 / 1024
SLEEP_CYCLES = 200_000_000
"""torch.cuda._sleep spin length (~0.1 s on a 1.5-2 GHz GPU): long enough that a missing
stream dependency would let NCCL read the buffer before the write queued behind it."""


def _one_rank_cupy():
    from dptrain.distributed.cupy_nccl import CupyNcclCommunicator

    comm = Communicator(Topology(), device=torch.device("cuda", 0), backend=None)
    return CupyNcclCommunicator(comm, timeout_s=30)


@gpu
@requires_gpus(1)
@requires_cupy_nccl()
def test_cupy_comm_orders_against_torch_streams_on_a_high_priority_stream():
    cc = _one_rank_cupy()
    try:
        assert cc.stream.priority < 0  # higher than torch's default stream (0)
        x = torch.zeros(1 << 20, device="cuda", dtype=torch.float16)
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(3)  # queued behind the spin on the current stream
        work = cc.allreduce_async(x)
        ends: list[float] = []
        work.on_complete(ends.append)
        assert not work.done.query(), "the comm stream must wait for the spin on the current stream"
        work.wait()
        y = x * 2  # ordered after the allreduce by wait(), without a host sync
        assert torch.all(y == 6)
        deadline = time.monotonic() + 5
        while not ends and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ends, "completion callback never fired"
    finally:
        cc.close()


WATCHDOG_TIMEOUT_S = 0.05


def _expect_watchdog_failure(work, launch) -> None:
    """After the watchdog fired, the wait and any later launch raise RankFailure (a peer's
    failure: the CLI's one line and exit code 1) naming the rank and the timeout."""
    with pytest.raises(RankFailure, match=r"^rank 0: cupy-nccl allreduce did not complete within reducer.timeout_s "
                                          r"= 0.05 s; a peer rank probably died or hung, see its log$"):
        work.wait()
    with pytest.raises(RankFailure, match="did not complete"):
        launch()  # nothing more is launched on the aborted communicator


def _watchdog_rank(rank: int, world: int) -> None:
    from dptrain.distributed.cupy_nccl import CupyNcclCommunicator

    comm = Communicator(Topology(), device=torch.device("cuda", 0), backend=None)
    cc = CupyNcclCommunicator(comm, timeout_s=WATCHDOG_TIMEOUT_S)
    x = torch.ones(1024, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES * 10)  # the allreduce cannot complete within 0.05 s
    work = cc.allreduce_async(x)
    time.sleep(0.5)
    _expect_watchdog_failure(work, lambda: cc.allreduce_async(x))
    torch.cuda.synchronize()


class _NeverDoneNccl:
    """Stands in for CuPy's NcclCommunicator on the CPU: counts abort() calls."""

    def __init__(self) -> None:
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1


def _watchdog_on_cpu() -> None:
    """The watchdog's part that needs no GPU: a collective whose completion never comes is
    aborted by the CompletionWatcher at its deadline, and the communicator fails from then on."""
    from dptrain.distributed.cupy_nccl import CupyNcclCommunicator, CupyWork

    cc = CupyNcclCommunicator.__new__(CupyNcclCommunicator)  # __init__ creates a CUDA stream and NCCL clique
    cc.rank, cc.world_size, cc.device, cc.timeout_s = 0, 1, torch.device("cpu"), WATCHDOG_TIMEOUT_S
    cc._nccl, cc._error, cc.flight = _NeverDoneNccl(), None, FlightRecorder(0, 1)
    cc.watcher = CompletionWatcher("test-cupy-watchdog")
    try:
        # armed as allreduce_async arms it, for a done event that never fires
        cc.watcher.watch(lambda: False, lambda _t: None, deadline_s=time.monotonic() + cc.timeout_s,
                         on_timeout=cc._abort)
        deadline = time.monotonic() + 5
        while cc._nccl.aborts == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cc._nccl.aborts == 1, "the watchdog never aborted the communicator"
        _expect_watchdog_failure(CupyWork(cc, done=None, seq=0), lambda: cc.allreduce_async(torch.ones(4)))
    finally:
        cc.watcher.close()


@pytest.mark.parametrize("device", ["cpu", cuda_param(requires_cupy_nccl())])
def test_cupy_watchdog_aborts_a_collective_past_the_timeout(device):
    if device == "cpu":
        _watchdog_on_cpu()
    else:  # in its own process: an aborted communicator must not leave this process's CUDA context in doubt
        run_ranks(1, _watchdog_rank)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.fc4 = (nn.Linear(256, 512), nn.Linear(512, 512), nn.Linear(512, 512),
                                                  nn.Linear(512, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc4(torch.relu(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))))


def _nccl_rank(rank: int, world: int, backend: str) -> None:
    device = torch.device("cuda", rank)
    comm = Communicator.from_initialized(device)
    for storage in (torch.float16, torch.bfloat16):
        for reduce_dtype in (None, torch.float32):
            torch.manual_seed(0)
            model = Tiny().to(device, storage)
            flat = FlatParams(model, state_dtype=torch.float32)
            tracer = Tracer(rank)
            reducer = Reducer(flat, ReducerConfig(backend=backend, bucket_mb=256 * KIB, first_bucket_mb=64 * KIB),
                              comm, tracer, wire_dtype=reduce_dtype)
            assert len(reducer.plan.buckets) >= 3, reducer.plan.describe()
            for p in model.parameters():
                p.register_hook(lambda g, v=rank + 1: torch.full_like(g, v))
            x = torch.randn(64, 256, device=device, dtype=storage, requires_grad=True)
            input_grad_at: list[float] = []
            x.register_hook(lambda g, at=input_grad_at: at.append(time.perf_counter()))
            reducer.begin(sync=True)
            model(x).float().sum().backward()
            reducer.wait()
            for g in flat.groups:
                for s in g.segments:
                    got = g.grads[s.offset : s.offset + s.numel].float() / reducer.grad_divisor
                    assert torch.all(got == (world + 1) / 2), (backend, storage, reduce_dtype, s.name)
            assert [b for b, _ in reducer.launch_log] == list(range(len(reducer.plan.buckets)))
            assert reducer.launch_log[0][1] < input_grad_at[0], "bucket 0 must launch during backward"
            torch.cuda.synchronize()
            time.sleep(0.05)  # the watcher thread records completions by polling
            spans = [e for e in tracer.events if e["name"] == "allreduce"]
            assert sorted(e["args"]["bucket"] for e in spans) == list(range(len(reducer.plan.buckets)))
            reducer.close()


@gpu
@requires_gpus(2)
def test_nccl_reducer_averages_and_overlaps_on_two_gpus():
    run_ranks(2, _nccl_rank, "torch", backend="nccl")


@gpu
@requires_gpus(2)
@requires_cupy_nccl()
def test_cupy_nccl_reducer_averages_and_overlaps_on_two_gpus():
    run_ranks(2, _nccl_rank, "cupy-nccl", backend="nccl")


def _auto_rank(rank: int, world: int) -> None:
    from dptrain.distributed.buckets.probe import AUTO_DONE_ITER
    from dptrain.distributed.buckets.tuner import attach_bucket_tuner

    device = torch.device("cuda", rank)
    comm = Communicator.from_initialized(device)
    torch.manual_seed(0)
    model = Tiny().to(device, torch.float16)
    flat = FlatParams(model, state_dtype=torch.float32)
    reducer = Reducer(flat, ReducerConfig(bucket_mb="auto"), comm, Tracer(rank))
    bucket_tuner = attach_bucket_tuner(reducer)
    for p in model.parameters():
        p.register_hook(lambda g, v=rank + 1: torch.full_like(g, v))
    x = torch.randn(64, 256, device=device, dtype=torch.float16)
    for _ in range(AUTO_DONE_ITER):
        for g in flat.groups:
            g.grads.zero_()
        reducer.begin(sync=True)
        model(x).float().sum().backward()
        reducer.wait()
        torch.cuda.synchronize()
        for g in flat.groups:  # every plan reduces to the closed-form average
            assert torch.all(g.grads.float() / reducer.grad_divisor == (world + 1) / 2)
    report = bucket_tuner.report
    assert report["buckets"] == len(reducer.plan.buckets) and report["measured_exposed_ms"] is None, report
    assert report["predicted_exposed_ms"] >= 0 and reducer.state_dict()["bucket_cuts"][0] == 0
    assert report["measured_contention_ms"] is None and 0 <= report["contention"] <= 1, report  # not host-timed
    digests = comm.allgather_object(reducer.plan.digest())
    assert digests[0] == digests[1]
    reducer.close()


@gpu
@requires_gpus(2)
def test_auto_bucket_plan_on_two_gpus():
    run_ranks(2, _auto_rank, backend="nccl")
