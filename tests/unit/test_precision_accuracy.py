"""FP16 and BF16 storage train LeNet on digits to within 1 point of FP32 top-1."""
from __future__ import annotations

import json

import pytest
import torch

from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
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


@pytest.fixture(scope="module")
def fp32_top1(tmp_path_factory) -> float:
    top1, _ = train_top1(tmp_path_factory.mktemp("fp32"), "fp32")
    assert top1 >= 0.95, top1
    return top1


def _native_speed(storage: str) -> None:
    """Skip where this CPU runs ``storage`` convolutions on oneDNN's reference path (measured): the run
    would take minutes (fp16 on an AVX512-FP16 VM: 28x fp32, over 6 minutes). tests/gpu/test_train_gpu.py's
    CPU case still checks there that the storage tracks fp32's loss, on a small model."""
    from dptrain.precision import SLOW_FACTOR, cpu_slowdown

    if cpu_slowdown(storage) >= SLOW_FACTOR:
        pytest.skip(f"{storage} convolutions run {cpu_slowdown(storage):.0f}x slower than fp32 on this CPU "
                    f"(measured); its accuracy run belongs on a CPU with native {storage} or a GPU")


@pytest.mark.parametrize("storage", ["bf16", "fp16"])
def test_reduced_precision_matches_fp32_accuracy(tmp_path, fp32_top1, storage):
    _native_speed(storage)
    top1, rec = train_top1(tmp_path, storage)
    assert abs(top1 - fp32_top1) <= 0.01, (top1, fp32_top1)
    if storage == "fp16":
        assert rec["loss_scale"] >= 1.0  # dynamic scaling was active and sane
