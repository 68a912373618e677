"""Trainer checks on both devices: fp16 steps without skips (and, on CUDA, without a host sync),
and fp16/bf16 training that tracks fp32; on CUDA only, the step replayed as CUDA graphs.

Each test takes ``device`` from tests/devices.py: `make test` runs the CPU case with small
shapes (fp16 convolutions have no fast CPU kernels), `pytest -m gpu` the CUDA case at the
original size.
"""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from devices import DEVICES, gpu_only
from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.topology import Topology
from dptrain.train import Trainer

SHAPES = {
    "cuda": ["model.width=16", "data.image_size=32", "data.batch_size=16"],
    # 4 channels, 8 px: ~20 ms per fp32 step on one core, 60 ms in fp16; NCHW, since torch's CPU
    # NHWC backward of the 1x1 stride-2 shortcut with 4 input channels corrupts the heap (dptrain.memory_format)
    "cpu": ["model.width=4", "data.image_size=8", "data.batch_size=16", "model.channels_last=false"],
}
"""Model and batch sizes per device."""


@pytest.fixture(autouse=True)
def _one_cpu_thread() -> Iterator[None]:
    """Tiny CPU steps gain nothing from intra-op threads, and on a loaded 2-core machine two
    threads spin-wait for each other: measured 0.28 s per step instead of 0.02 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _trainer(tmp_path, device: str, *sets: str) -> Trainer:
    # 16 samples, one batch: the synthetic set has 16 distinct images (SYNTHETIC_POOL) and a fixed
    # label per sample, so with no more samples than images it can be learnt in a few dozen steps
    cfg = load_config(None, ["model.name=resnet18_cifar", "model.num_classes=10", "data.source=synthetic",
                             "data.synthetic_samples=16", "solver.display=0",
                             f"train.run_dir={json.dumps(str(tmp_path))}", *SHAPES[device], *sets])
    return Trainer(cfg, Communicator.from_env(Topology(), 60, torch.device(device, 0) if device == "cuda"
                                              else torch.device("cpu")))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["storage", "autocast"])
def test_fp16_step_has_no_host_sync(tmp_path, device, mode):
    # eager (model.compile "auto" would compile on CUDA: test_cuda_graph_steps_track_eager checks a
    # compiled step, and one compile is what the tests stage has time for); init_scale 1024, not the default 65536: the early overflows a large first scale causes would
    # be skipped steps, which the last assertion counts; they are no host sync either way.
    layout = ["model.channels_last=true"] if device == "cuda" else []
    t = _trainer(tmp_path, device, "precision.storage=fp16", *layout, "precision.loss_scale.init_scale=1024",
                 "model.compile=false", f"precision.mode={mode}")
    assert t.flat.groups[0].grads.dtype == (torch.float32 if mode == "autocast" else torch.float16)
    t.train_step()  # warm-up: allocations, cuDNN autotuning, kernel compilation
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            t.train_step()
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert t.scaler.stats()["skipped_steps"] <= 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["fp16", "bf16"])
def test_reduced_precision_tracks_fp32_loss(tmp_path, device, storage):
    steps = 30
    losses: dict[str, list[float]] = {}
    for st in ("fp32", storage):
        # eager on both sides: what is compared is the precision
        t = _trainer(tmp_path / st, device, f"precision.storage={st}", "solver.base_lr=0.05", "model.compile=false")
        losses[st] = []
        for _ in range(steps):
            t.train_step()
            losses[st].append(float(t._iter_loss))  # a host sync; this test checks values, not overlap
    means = {st: sum(v) / steps for st, v in losses.items()}
    for st, v in losses.items():  # both learn the set: a precision that stalls would track nothing
        assert v[-1] < 0.5 * v[0], (st, v)
    # 30 steps on a fixed synthetic set: the mean losses agree to a few percent (measured on the
    # CPU: within 1 %)
    assert abs(means[storage] - means["fp32"]) / means["fp32"] < 0.05, means


CUDA_GRAPH_TEST_TIMEOUT_S = 90
"""pytest-timeout's limit for the CUDA-graph test, over gpu_session's 60 s per test: the first inductor
compile on a fresh machine (compile workers, Triton's gcc-built launchers, a small ResNet's forward and
backward) after an eager trainer, estimated 40-55 s on the H200. The tests stage's limit has room for it."""


@gpu_only(pytest.mark.timeout(CUDA_GRAPH_TEST_TIMEOUT_S))
def test_cuda_graph_steps_track_eager_without_a_host_sync(tmp_path):
    """model.compile = "reduce-overhead" on one GPU: every graph recorded (none skipped, at start-up
    or in the steps), 6 fp16 steps replayed with no host sync after the first, and their losses
    those of eager steps from the same start. GPU-only: on the CPU the mode compiles without CUDA
    graphs (tests/unit/test_compiled.py). Its cold compile has its own pytest-timeout
    (:data:`CUDA_GRAPH_TEST_TIMEOUT_S`), and it runs last in gpu_session (file order): a timeout there
    ends pytest at once, which then costs only this test."""
    steps, losses = 6, {}
    for mode in ("false", "reduce-overhead"):
        t = _trainer(tmp_path / mode, "cuda", "precision.storage=fp16", "model.channels_last=true",
                     "precision.loss_scale.init_scale=1024", "solver.base_lr=0.05", f"model.compile={mode}")
        try:
            if mode != "false":
                assert t.compiled is not None and t.compiled.cuda_graphs and t.compiled.cuda_graph_skips == 0
            losses[mode] = []
            for i in range(steps):
                torch.cuda.synchronize()
                # the first step may sync (cuDNN autotuning, the update kernels' first-use self-check)
                torch.cuda.set_sync_debug_mode("error" if i else "default")
                try:
                    t.train_step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                losses[mode].append(float(t._iter_loss))
            assert t.scaler.stats()["skipped_steps"] == 0
            if mode != "false":  # none skipped while training either (a re-recording past its limit)
                assert t.compiled.cuda_graph_skips == 0
        finally:
            t.close()
    eager, graphs = losses["false"], losses["reduce-overhead"]
    # compiled kernels round differently from eager ones: close, not equal (measured on the CPU
    # for the compiled step: within 1 % over 200 LeNet iterations)
    assert all(abs(g - e) <= 0.02 * e for e, g in zip(eager, graphs, strict=True)), losses
    assert graphs[-1] < graphs[0], graphs
