"""FP16 and BF16 storage train LeNet on digits to within 1 point of FP32 top-1."""
from __future__ import annotations

import json

import torch

from dptrain.comm import Communicator
from dptrain.config import load_config
from dptrain.topology import Topology
from dptrain.train import Trainer


def train_top1(tmp_path, storage: str) -> tuple[float, dict]:
    # 150 iterations of 64: 6.4 epochs of the 1500 training digits. FP16 convolutions are
    # slow on CPU (~8x fp32), so this is the smallest run that converges (~97-98 %).
    cfg = load_config(None, [
        "model.name=lenet", "data.source=digits", "data.batch_size=64", "solver.base_lr=0.01",
        "solver.lr_policy=poly", "solver.warmup_iter=10", "solver.max_iter=150", "solver.display=50",
        f"precision.storage={storage}", f"train.run_dir={json.dumps(str(tmp_path / storage))}",
    ])
    trainer = Trainer(cfg, Communicator.from_env(Topology(), cfg.reducer.timeout_s, torch.device("cpu")))
    result = trainer.fit()
    trainer.close()
    return result["test_top1"], result


def test_fp16_and_bf16_match_fp32_accuracy(tmp_path):
    fp32, _ = train_top1(tmp_path, "fp32")
    bf16, _ = train_top1(tmp_path, "bf16")
    fp16, rec16 = train_top1(tmp_path, "fp16")
    assert fp32 >= 0.95, fp32
    assert abs(bf16 - fp32) <= 0.01, (bf16, fp32)
    assert abs(fp16 - fp32) <= 0.01, (fp16, fp32)
    assert rec16["loss_scale"] >= 1.0  # dynamic scaling was active and sane
