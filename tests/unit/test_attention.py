"""``model.attention`` (``dptrain.train.attention``): the SDPA calls recorded from any caller, the
kernel chosen by measurement (torch's dispatch unless a kernel is clearly faster), agreed over the
ranks, used in every forward, and kept by a resume."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from byo_models import TvViT
from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.topology import Topology
from dptrain.train import Trainer, attention
from dptrain.train.attention import Call, fastest, record_calls, time_kernels
from examples.vit import VisionTransformer

FLASH_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"


def test_calls_are_recorded_from_the_models_code_and_from_torchs_multihead_attention():
    """The example ViT calls SDPA itself; nn.MultiheadAttention (torchvision's ViT block) calls it from
    torch's own code, and only in training mode: both are seen, and the model is left as it was."""
    vit = VisionTransformer(num_classes=10, image_size=32, patch_size=4, dim=32, depth=3, heads=2).eval()
    rng = torch.get_rng_state()
    calls = record_calls(vit, torch.zeros(2, 3, 32, 32), contextlib.nullcontext)
    assert calls == [Call((2, 2, 65, 16), (2, 2, 65, 16), (2, 2, 65, 16), torch.float32, None, 0.0, False, None)] * 3
    assert not vit.training and torch.equal(torch.get_rng_state(), rng)
    tv = TvViT(10)
    bn = torch.nn.BatchNorm2d(3)  # in front: a training-mode forward would move its statistics
    model = torch.nn.Sequential(bn, tv)
    assert len(record_calls(model, torch.randn(2, 3, 32, 32), contextlib.nullcontext)) == 4
    assert torch.equal(bn.running_mean, torch.zeros(3)) and int(bn.num_batches_tracked) == 0
    under = record_calls(vit, torch.zeros(2, 3, 32, 32), lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert {c.dtype for c in under} == {torch.bfloat16}


def test_a_recorded_call_scales_to_the_solvers_batch_and_a_failing_forward_records_nothing():
    c = Call((2, 3, 65, 64), (2, 3, 65, 64), (2, 3, 65, 64), torch.bfloat16, ((2, 1, 65, 65), torch.bool), 0.1,
             False, None)
    assert c.scaled(32) == Call((32, 3, 65, 64), (32, 3, 65, 64), (32, 3, 65, 64), torch.bfloat16,
                                ((32, 1, 65, 65), torch.bool), 0.1, False, None)
    assert record_calls(VisionTransformer(num_classes=10, image_size=32, patch_size=4, dim=32, depth=1, heads=2),
                        torch.zeros(2, 3, 16, 16), contextlib.nullcontext) == []


def test_torchs_dispatch_stays_unless_a_kernel_is_clearly_faster():
    assert fastest({"torch": 1.0, "math": 0.5, "flash": 1.0}) == "math"
    assert fastest({"torch": 1.0, "math": 0.98, "flash": 1.0}) == "torch"  # within MIN_GAIN
    assert fastest({"torch": 1.0, "flash": 1.0}) == "torch"
    assert fastest({"math": 0.5}) == "torch"  # no baseline measured: no reason to leave torch's


def test_kernels_that_refuse_the_inputs_are_left_out_of_the_timing():
    """On the CPU there is no memory-efficient or cuDNN kernel: torch, math and flash are timed."""
    times = time_kernels([Call((4, 2, 16, 8), (4, 2, 16, 8), (4, 2, 16, 8), torch.float32, None, 0.0, False, None)],
                         torch.device("cpu"))
    assert set(times) == {"torch", "math", "flash"} and all(t > 0 for t in times.values())


BASE = ["data.source=digits", "data.batch_size=8", "solver.display=0", "solver.type=adamw", "solver.base_lr=0.001"]
VIT = ["model.name=\"examples.vit:VisionTransformer\"", "model.args.dim=32", "model.args.depth=2", "model.args.heads=2"]


def _trainer(tmp: Path, *sets: str, model: tuple[str, ...] = tuple(VIT)) -> Trainer:
    cfg = load_config(None, [*BASE, *model, f"train.run_dir={json.dumps(str(tmp))}", *sets])
    return Trainer(cfg, Communicator.from_env(Topology(), 60, torch.device("cpu")))


def _ops(t: Trainer) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as p:
        t.train_step()
    return {e.key for e in p.key_averages()}


def test_the_chosen_kernel_runs_every_forward_and_a_resume_keeps_the_snapshots(tmp_path, monkeypatch):
    monkeypatch.setattr(attention, "time_kernels", lambda calls, device: {"torch": 1.0, "math": 0.5, "flash": 0.9})
    first = _trainer(tmp_path / "a")
    assert first.attention == "math" and first.snapshots.config["model"]["attention"] == "math"
    assert FLASH_CPU not in _ops(first)
    first.save()
    first.close()
    monkeypatch.setattr(attention, "time_kernels", lambda calls, device: {"torch": 1.0, "math": 0.9, "flash": 0.5})
    second = _trainer(tmp_path / "b")
    assert second.attention == "flash" and FLASH_CPU in _ops(second)
    second.close()
    resumed = _trainer(tmp_path / "c")
    resumed.resume(tmp_path / "a" / "snapshot_iter_1.pt")
    assert resumed.attention == "math" and FLASH_CPU not in _ops(resumed)
    resumed.close()


@pytest.mark.parametrize("sets, model, want", [(["model.attention=torch"], VIT, "torch"),
                                               (["model.attention=flash"], VIT, "flash"),
                                               ([], ["model.name=lenet"], "torch")])
def test_a_set_kernel_or_a_zoo_model_is_not_measured(tmp_path, monkeypatch, sets, model, want):
    monkeypatch.setattr(attention, "time_kernels", lambda calls, device: pytest.fail("measured"))
    t = _trainer(tmp_path, *sets, model=tuple(model))
    assert t.attention == want
    t.close()
