"""BucketPlan: caps, first bucket, groups, launch order, digests, replan. Pure CPU, no process group."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.config import ReducerConfig
from dptrain.distributed.buckets.plan import (
    MIB,
    GroupSpec,
    SegmentSpec,
    build_bucket_plan,
    explain_difference,
    order_from_ready,
    plan_from_ready_order,
)
from dptrain.distributed.comm import Communicator
from dptrain.distributed.reducer import Reducer, group_specs
from dptrain.errors import ConfigError
from dptrain.flat import FlatParams
from dptrain.observe.trace import NullTracer
from dptrain.topology import Topology

KIB = 1024 / MIB  # 1 KiB expressed in MiB, the unit of the caps


def group(sizes: dict[str, int], elem_size: int = 2, orders: list[int] | None = None, dtype: str = "float16"):
    """A group whose segments tile the buffer in the given order; sizes are padded element counts."""
    segs, offset = [], 0
    for i, (name, n) in enumerate(sizes.items()):
        segs.append(SegmentSpec(name, offset, n, orders[i] if orders else i))
        offset += n
    return GroupSpec(dtype, elem_size, tuple(segs))


def names(plan) -> list[tuple[str, ...]]:
    return [b.names for b in plan.buckets]


# 512 fp16 elements = 1 KiB each
FOUR = {"fc3.weight": 512, "fc2.weight": 512, "fc1.weight": 512, "conv.weight": 512}


def test_cap_fills_in_layout_order_and_first_bucket_is_smaller():
    plan = build_bucket_plan([group(FOUR)], bucket_mb=2 * KIB, first_bucket_mb=1 * KIB)
    assert names(plan) == [("fc3.weight",), ("fc2.weight", "fc1.weight"), ("conv.weight",)]
    assert [(b.start, b.stop, b.nbytes) for b in plan.buckets] == [(0, 512, 1024), (512, 1536, 2048),
                                                                   (1536, 2048, 1024)]
    assert [b.index for b in plan.buckets] == [0, 1, 2]


def test_one_bucket_for_everything_and_one_per_parameter():
    everything = build_bucket_plan([group(FOUR)], bucket_mb=1000, first_bucket_mb=1000)
    assert names(everything) == [tuple(FOUR)]
    assert (everything.buckets[0].start, everything.buckets[0].stop) == (0, 2048)
    per_param = build_bucket_plan([group(FOUR)], bucket_mb=1e-9, first_bucket_mb=1e-9)
    assert names(per_param) == [(n,) for n in FOUR]


def test_parameter_larger_than_cap_gets_its_own_bucket_and_is_never_split():
    sizes = {"a": 256, "big": 4096, "b": 256, "c": 256}
    plan = build_bucket_plan([group(sizes)], bucket_mb=1 * KIB, first_bucket_mb=1 * KIB)
    assert names(plan) == [("a",), ("big",), ("b", "c")]
    assert plan.buckets[1].nbytes == 8192  # 8 KiB in one bucket despite the 1 KiB cap


def test_buckets_never_cross_groups_and_launch_by_last_ready_parameter():
    # fp16 conv weights with fp32 BatchNorm islands interleaved in backward order
    fp16 = group({"conv3.weight": 512, "conv2.weight": 512, "conv1.weight": 512}, orders=[0, 2, 4])
    fp32 = group({"bn3.weight": 64, "bn2.weight": 64, "bn1.weight": 64}, elem_size=4, orders=[1, 3, 5],
                 dtype="float32")
    plan = build_bucket_plan([fp16, fp32], bucket_mb=1 * KIB, first_bucket_mb=1 * KIB)
    for b in plan.buckets:
        members = set(b.names)
        assert members <= {s.name for s in (fp16, fp32)[b.group].segments}, b
    # the fp32 bucket completes only with bn1 (ready last), so it launches last and holds back nothing
    assert names(plan) == [("conv3.weight",), ("conv2.weight",), ("conv1.weight",),
                           ("bn3.weight", "bn2.weight", "bn1.weight")]
    assert [b.group for b in plan.buckets] == [0, 0, 0, 1]


def test_digest_is_stable_and_sensitive():
    a = build_bucket_plan([group(FOUR)], bucket_mb=2 * KIB, first_bucket_mb=1 * KIB)
    b = build_bucket_plan([group(FOUR)], bucket_mb=2 * KIB, first_bucket_mb=1 * KIB)
    assert a.digest() == b.digest() and len(a.digest()) == 16
    int(a.digest(), 16)  # hex of a sha256: equal across processes (no per-process hash seed)
    other_cap = build_bucket_plan([group(FOUR)], bucket_mb=4 * KIB, first_bucket_mb=1 * KIB)
    renamed = build_bucket_plan([group({"x": 512, "fc2.weight": 512, "fc1.weight": 512, "conv.weight": 512})],
                                2 * KIB, 1 * KIB)
    bf16 = build_bucket_plan([group(FOUR, dtype="bfloat16")], bucket_mb=2 * KIB, first_bucket_mb=1 * KIB)
    assert len({a.digest(), other_cap.digest(), renamed.digest(), bf16.digest()}) == 4


def test_describe_and_explain_difference_name_what_differs():
    a = build_bucket_plan([group(FOUR)], bucket_mb=2 * KIB, first_bucket_mb=1 * KIB)
    b = build_bucket_plan([group(FOUR)], bucket_mb=4 * KIB, first_bucket_mb=1 * KIB)
    assert a.describe().startswith("3 buckets, MiB [") and "first parameter fc3.weight" in a.describe()
    msg = explain_difference(b, a, 1, 0)
    assert msg.startswith("rank 1 has 2 buckets, rank 0 has 3; first difference at bucket 1:"), msg
    assert "'fc2.weight', 'fc1.weight', 'conv.weight'" in msg


def test_bad_caps_and_gapped_segments_raise():
    with pytest.raises(RuntimeError, match=r"bucket caps must be > 0 MiB, got bucket_mb=0"):
        build_bucket_plan([group(FOUR)], bucket_mb=0, first_bucket_mb=1)
    gapped = GroupSpec("float16", 2, (SegmentSpec("a", 0, 64, 0), SegmentSpec("b", 128, 64, 1)))
    with pytest.raises(RuntimeError, match=r"segment b at offset 128, expected 64"):
        build_bucket_plan([gapped], bucket_mb=1, first_bucket_mb=1)


def test_order_from_ready_appends_unused_parameters_and_rejects_strangers():
    assert order_from_ready(["a", "b", "c", "d"], ["c", "a"]) == ["c", "a", "b", "d"]
    with pytest.raises(RuntimeError, match=r"unknown: \['zz'\]"):
        order_from_ready(["a", "b"], ["b", "zz"])
    with pytest.raises(RuntimeError, match="unknown or repeated"):
        order_from_ready(["a", "b"], ["b", "b"])


class _Swapped(nn.Module):
    """Registers ``late`` before ``early`` but runs early -> late, so reverse registration
    order (the default layout) differs from the gradient-ready order."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(8, 4)
        self.early = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(torch.relu(self.early(x)))


def test_replan_predicts_the_relayout_of_the_flat_buffers():
    torch.manual_seed(0)
    model = _Swapped()
    flat = FlatParams(model, state_dtype=torch.float32)
    assert flat.layout_order == ["early.bias", "early.weight", "late.bias", "late.weight"]
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    for g in flat.groups:
        g.grads.copy_(torch.arange(g.numel, dtype=g.grads.dtype))
        g.state["momentum"].copy_(torch.arange(g.numel, dtype=g.state["momentum"].dtype) * 2)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    momentum = flat.state_dict()["momentum"]
    ready = ["late.bias", "late.weight", "early.bias", "early.weight"]  # what backward reports
    per_group, predicted = plan_from_ready_order(group_specs(flat), ready, bucket_mb=1e-9, first_bucket_mb=1e-9)
    assert per_group == [ready]
    version = flat.layout_version
    flat.reorder(per_group, order_from_ready(flat.layout_order, ready))
    assert flat.layout_version == version + 1
    actual = build_bucket_plan(group_specs(flat), 1e-9, 1e-9)
    assert actual.digest() == predicted.digest()
    assert names(actual) == [(n,) for n in ready]
    flat.check_grad_views()  # grads are still views into the (new) flat buffer
    for n, p in model.named_parameters():  # values moved with their parameters, bit for bit
        assert torch.equal(p.detach(), values[n]) and torch.equal(p.grad, grads[n]), n
    assert all(torch.equal(flat.state_dict()["momentum"][n], momentum[n]) for n in momentum)


# ---------------------------------------------------------------- Reducer without a process group


def test_single_process_reducer_is_inert():
    model = nn.Linear(4, 2)
    flat = FlatParams(model, state_dtype=torch.float32)
    comm = Communicator.from_env(Topology(), 60, torch.device("cpu"))  # conftest clears WORLD_SIZE: one process
    reducer = Reducer(flat, ReducerConfig(backend="cupy-nccl"), comm, NullTracer())  # no effect, just a warning
    assert comm.world_size == 1 and reducer.grad_divisor == 1
    reducer.begin(sync=True)
    model(torch.ones(3, 4)).sum().backward()
    grads = flat.groups[0].grads.clone()
    reducer.wait()
    assert reducer.launch_log == [] and torch.equal(flat.groups[0].grads, grads)
    assert torch.equal(flat.groups[0].grads[:2], torch.full((2,), 3.0))  # bias grad: 3 rows of ones


def test_cupy_backend_on_cpu_is_refused_before_any_collective():
    comm = Communicator(Topology(world_size=2, local_world_size=2), device=torch.device("cpu"), backend="gloo")
    flat = FlatParams(nn.Linear(2, 2), state_dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"rank 0: reducer.backend = \"cupy-nccl\" needs CUDA devices"):
        Reducer(flat, ReducerConfig(backend="cupy-nccl"), comm, NullTracer())
