"""GPU trainer checks (run with `pytest -m gpu` on a CUDA machine)."""
from __future__ import annotations

import json

import pytest
import torch

from dptrain.comm import Communicator
from dptrain.config import load_config
from dptrain.topology import Topology
from dptrain.train import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible"),
]


def _trainer(tmp_path, *sets: str) -> Trainer:
    cfg = load_config(None, ["model.name=resnet18_cifar", "model.width=16", "model.num_classes=10",
                             "data.source=synthetic", "data.image_size=32", "data.batch_size=32",
                             "solver.display=0", f"train.run_dir={json.dumps(str(tmp_path))}", *sets])
    return Trainer(cfg, Communicator.from_env(Topology(), 60, torch.device("cuda", 0)))


def test_fp16_step_has_no_host_sync(tmp_path):
    # init_scale 1024, not the default 65536: the early overflows a large first scale causes would
    # be skipped steps, which the last assertion counts; they are no host sync either way.
    t = _trainer(tmp_path, "precision.storage=fp16", "model.channels_last=true", "precision.loss_scale.init_scale=1024")
    t.train_step()  # warm-up: allocations, cuDNN autotuning, kernel compilation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            t.train_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert t.scaler.stats()["skipped_steps"] <= 1


@pytest.mark.parametrize("storage", ["fp16", "bf16"])
def test_reduced_precision_tracks_fp32_loss(tmp_path, storage):
    losses = {}
    for st in ("fp32", storage):
        t = _trainer(tmp_path / st, f"precision.storage={st}", "solver.base_lr=0.05")
        for _ in range(30):
            t.train_step()
        losses[st] = float(t._loss_sum) / 30
    # 30 steps on a fixed synthetic set: the mean losses agree to a few percent
    assert abs(losses[storage] - losses["fp32"]) / losses["fp32"] < 0.05, losses

