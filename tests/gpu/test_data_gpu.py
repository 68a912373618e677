"""Input-path checks for the device feeder: the batch ring with copy events, and the mean image on CUDA.

The ring test takes ``device`` from tests/devices.py: on the CPU (`make test`) it checks the
feeder's order and labels through a ring that is rewritten many times, on CUDA the same with
pinned slots reused only after their copy event. The mean-image test compares the CUDA form
with the CPU one, so it is GPU-only (run with `pytest -m gpu` on a CUDA machine).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from devices import DEVICES, gpu_only
from dptrain.data.sampling import SampleOrder, rank_batch_indices
from dptrain.data.sources.caffe_lmdb import LmdbSource
from lmdb_helpers import NUM_CLASSES, H, W, input_threads, make_cfg, raw_value, write_db


@pytest.fixture(scope="module")
def db29(tmp_path_factory) -> str:
    return write_db(tmp_path_factory.mktemp("db") / "train", [raw_value(i) for i in range(29)])


@pytest.mark.parametrize("device", DEVICES)
def test_device_feeder_reuses_ring_slots_only_after_their_copy(db29, device):
    from dptrain.data.base import DeviceFeeder

    pinned = device == "cuda"  # as build_source does
    src = LmdbSource(make_cfg(db29, prefetch=1, parser_threads=2, transformer_threads=2),
                      num_classes=NUM_CLASSES, seed=2, pin_memory=pinned)
    plan = SampleOrder(0, 1, 4, seed=2)
    stream = src.train_batches(plan, 0)
    assert stream._ring.images.is_pinned() == pinned
    feeder = DeviceFeeder(stream, device=torch.device(device), dtype=torch.float32, mean=(0.0,), scale=1.0,
                          channels_last=False)
    try:
        for step in range(30):  # 3 ring slots, so every slot is rewritten many times
            x, y = next(feeder)
            feeder.prefetch()
            expect = rank_batch_indices(step, 29, plan)
            assert x[:, 1, 0, 0].cpu().tolist() == expect.astype(float).tolist()
            assert y.cpu().tolist() == (expect % NUM_CLASSES).tolist()
    finally:
        feeder.close()
    assert input_threads() == []


@gpu_only()
def test_mean_image_on_cuda_equals_the_cpu_feeder(tmp_path):
    from dptrain.data.base import DeviceFeeder

    mean_rgb = np.random.default_rng(3).uniform(0, 255, (3, H, W))
    np.save(tmp_path / "mean.npy", mean_rgb)
    cfg = make_cfg(write_db(tmp_path / "db", [raw_value(i) for i in range(16)]), mean_file=str(tmp_path / "mean.npy"),
                   crop_size=4, mirror=True, scale=0.25)
    out = {}
    for device in ("cpu", "cuda"):
        src = LmdbSource(cfg, num_classes=NUM_CLASSES, seed=5, pin_memory=device == "cuda")
        feeder = DeviceFeeder(src.train_batches(SampleOrder(0, 1, 4, seed=5), 0), device=torch.device(device),
                              dtype=torch.float32, mean=src.mean, scale=src.scale, channels_last=True,
                              mean_image=src.mean_image)
        try:
            out[device] = [next(feeder)[0].cpu() for _ in range(6)]
        finally:
            feeder.close()
    for a, b in zip(out["cpu"], out["cuda"], strict=True):
        torch.testing.assert_close(a, b)  # the fused CUDA form is one fp32 rounding from the CPU form
