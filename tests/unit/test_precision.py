"""Precision policy, the device-side loss scaler, flat buffers, and fp16 underflow (CPU)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.config import LossScaleConfig, PrecisionConfig, SolverConfig
from dptrain.errors import LossScaleError
from dptrain.flat import ALIGN_ELEMS, FlatParams
from dptrain.optimizer import MasterOptimizer
from dptrain.precision import LossScaler, apply_precision
from dptrain.train.health import check_loss_scale_floor

CPU = torch.device("cpu")


def _scaler(mode: str = "dynamic", **cfg) -> LossScaler:
    return LossScaler(LossScaleConfig(**cfg), mode, CPU)


def _step(scaler: LossScaler, overflow: bool) -> None:
    """What MasterOptimizer.step does to the scaler: set the device flag, then update()."""
    scaler.found_inf.fill_(1.0 if overflow else 0.0)
    scaler.update()


def _scale(scaler: LossScaler) -> float:
    return scaler.stats()["loss_scale"]


# ----------------------------------------------------------------------------- LossScaler


def test_disabled_scaler_is_a_no_op():
    s = _scaler("none")
    loss = torch.tensor(3.0)
    assert s.scale_loss(loss) is loss
    assert s.inv_scale(4).item() == 0.25  # only the average over ranks
    _step(s, overflow=True)
    assert s.stats() == {"loss_scale": 1.0, "skipped_steps": 0}


def test_scale_loss_and_inv_scale():
    s = _scaler(init_scale=1024.0)
    assert s.scale_loss(torch.tensor(0.5)).item() == 512.0
    assert s.inv_scale(2).item() == 1.0 / 2048


def test_overflow_halves_scale_and_counts_skip():
    s = _scaler(init_scale=2.0**16)
    _step(s, overflow=True)
    assert s.stats() == {"loss_scale": 2.0**15, "skipped_steps": 1}


def test_growth_after_growth_interval_clean_steps():
    s = _scaler(init_scale=256.0, growth_interval=3)
    _step(s, False)
    _step(s, False)
    assert _scale(s) == 256.0
    _step(s, False)
    assert _scale(s) == 512.0
    _step(s, False)
    _step(s, True)  # an overflow restarts the clean-step count
    assert _scale(s) == 256.0
    _step(s, False)
    _step(s, False)
    assert _scale(s) == 256.0
    _step(s, False)
    assert _scale(s) == 512.0


def test_growth_stops_at_max_scale():
    s = _scaler(init_scale=2.0**23, growth_interval=1, max_scale=2.0**24)
    for _ in range(3):
        _step(s, False)
    assert _scale(s) == 2.0**24


def test_hysteresis_needs_consecutive_overflows():
    s = _scaler(init_scale=1024.0, hysteresis=2)
    _step(s, True)
    assert s.stats() == {"loss_scale": 1024.0, "skipped_steps": 1}  # skipped, but no backoff yet
    _step(s, False)  # a clean step resets the streak
    _step(s, True)
    assert _scale(s) == 1024.0
    _step(s, True)  # second consecutive overflow: back off
    assert s.stats() == {"loss_scale": 512.0, "skipped_steps": 3}
    _step(s, True)  # the streak restarted with the backoff
    assert _scale(s) == 512.0


def test_min_scale_raises_loss_scale_error():
    s = _scaler(init_scale=4.0, min_scale=2.0)
    _step(s, True)
    assert _scale(s) == 2.0
    check_loss_scale_floor(s)  # at the floor, not below it: training goes on
    _step(s, True)  # a backoff below min_scale
    assert _scale(s) == 2.0
    with pytest.raises(LossScaleError, match=r"precision\.loss_scale\.min_scale = 2\.0"):
        check_loss_scale_floor(s)


def test_static_scale_skips_but_never_changes():
    s = _scaler("static", init_scale=1000.0, growth_interval=1)
    _step(s, True)
    _step(s, False)
    _step(s, False)
    assert s.stats() == {"loss_scale": 1000.0, "skipped_steps": 1}


def test_scaler_state_round_trips():
    a = _scaler(init_scale=64.0, hysteresis=2, growth_interval=5)
    for overflow in (False, False, True):
        _step(a, overflow)
    b = _scaler(init_scale=64.0, hysteresis=2, growth_interval=5)
    b.load_state_dict(a.state_dict())
    for s in (a, b):
        _step(s, True)  # completes the overflow streak only if it was restored
    assert a.stats() == b.stats() == {"loss_scale": 32.0, "skipped_steps": 2}


def test_resume_with_scaling_off_does_not_keep_the_saved_scale(caplog):
    """An fp16 snapshot (scale 65536) resumed with bf16/fp32 storage: no loss scaling, so the
    gradients must not be divided by the stale scale (every update was 65536x too small)."""
    fp16 = _scaler()
    _step(fp16, overflow=True)
    off = _scaler("none")
    off.load_state_dict(fp16.state_dict())
    assert float(off.inv_scale(2)) == 0.5 and _scale(off) == 1.0
    assert off.stats()["skipped_steps"] == 1
    assert "loss scaling is dynamic, this run's is none" in caplog.text


def test_resume_into_dynamic_or_static_starts_from_the_config_scale():
    off = _scaler("none")
    dyn = _scaler(init_scale=1024.0)
    dyn.load_state_dict(off.state_dict())
    assert _scale(dyn) == 1024.0  # not the disabled scaler's 1.0
    grown = _scaler(init_scale=64.0, growth_interval=1)
    _step(grown, overflow=False)
    static = _scaler("static", init_scale=128.0)
    static.load_state_dict(grown.state_dict())
    assert _scale(static) == 128.0  # a static scale is the config's, always
    same = _scaler("static", init_scale=256.0)
    same.load_state_dict(_scaler("static", init_scale=128.0).state_dict())
    assert _scale(same) == 256.0


# ----------------------------------------------------------------------------- precision policy


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


@pytest.mark.parametrize("storage, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_batchnorm_stays_fp32_and_returns_storage_dtype(storage, dtype):
    net = _Net()
    islands = apply_precision(net, PrecisionConfig(storage=storage))
    assert islands == ["bn"]
    assert net.conv.weight.dtype == dtype and net.head.weight.dtype == dtype
    assert {t.dtype for t in (net.bn.weight, net.bn.bias, net.bn.running_mean, net.bn.running_var)} == {torch.float32}
    seen = []
    net.bn.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    out = net(torch.randn(2, 3, 6, 6).to(dtype))
    assert seen == [dtype] and out.dtype == dtype
    out.float().sum().backward()
    assert net.bn.weight.grad.dtype == torch.float32 and net.conv.weight.grad.dtype == dtype


def test_fp32_island_by_name_casts_inputs_and_outputs():
    net = _Net()
    islands = apply_precision(net, PrecisionConfig(storage="fp16", fp32_modules=["head"]))
    assert islands == ["head"] and net.head.weight.dtype == torch.float32
    assert net.bn.weight.dtype == torch.float16  # no longer an island
    assert net(torch.randn(2, 3, 6, 6).half()).dtype == torch.float16


def test_fp32_storage_has_no_islands():
    net = _Net()
    assert apply_precision(net, PrecisionConfig(storage="fp32")) == []
    assert {p.dtype for p in net.parameters()} == {torch.float32}


# ----------------------------------------------------------------------------- flat buffers


def test_flat_params_keep_identity_and_are_views():
    net = _Net().to(memory_format=torch.channels_last)
    params_before = dict(net.named_parameters())
    conv_stride = net.conv.weight.stride()
    flat = FlatParams(net, state_dtype=torch.float32)
    (group,) = flat.groups
    for name, p in net.named_parameters():
        assert p is params_before[name]
        assert isinstance(p, nn.Parameter)
    assert net.conv.weight.stride() == conv_stride  # channels_last survives
    assert net.conv.weight.is_contiguous(memory_format=torch.channels_last)
    base = group.params.data_ptr()
    gbase = group.grads.data_ptr()
    for s in group.segments:
        assert s.offset % ALIGN_ELEMS == 0
        assert s.param.data_ptr() == base + 4 * s.offset
        assert s.param.grad.data_ptr() == gbase + 4 * s.offset
    # layout: reverse registration order, so the head comes first
    assert [s.name for s in group.segments] == ["head.bias", "head.weight", "bn.bias", "bn.weight", "conv.weight"]


def test_backward_accumulates_into_flat_grads():
    torch.manual_seed(0)
    net = _Net()
    flat = FlatParams(net, state_dtype=torch.float32)
    (group,) = flat.groups
    x = torch.randn(2, 3, 6, 6)
    net(x).sum().backward()
    first = group.grads.clone()
    assert torch.count_nonzero(first) > 0
    net(x).sum().backward()  # a second micro-batch accumulates in place
    assert torch.allclose(group.grads, 2 * first)
    flat.check_grad_views()  # still views: nothing replaced a .grad
    seg = next(s for s in group.segments if s.name == "conv.weight")
    assert torch.equal(net.conv.weight.grad.reshape(-1),
                       group.grads[seg.offset: seg.offset + seg.numel].view(8, 3, 3, 3).reshape(-1))


def test_writing_a_flat_buffer_moves_the_model_weights():
    net = nn.Linear(3, 2)
    flat = FlatParams(net, state_dtype=torch.float32)
    flat.groups[0].params.fill_(0.5)
    assert torch.all(net.weight == 0.5) and torch.all(net.bias == 0.5)


def test_replaced_grad_is_detected():
    net = nn.Linear(3, 2)
    flat = FlatParams(net, state_dtype=torch.float32)
    net.weight.grad = None
    with pytest.raises(RuntimeError, match="gradient of weight is no longer a view"):
        flat.check_grad_views()


def _aligned_linear() -> nn.Module:
    return nn.Linear(64, 64)  # 4096 + 64 elements: both multiples of 64, so no padding


def test_bytes_per_param_fp16_storage():
    net = _aligned_linear().half()
    assert FlatParams(net, state_dtype=torch.float32).bytes_per_param() == {
        "weights": 2.0, "masters": 4.0, "momentum": 4.0, "grads": 2.0}
    assert FlatParams(_aligned_linear().half(), state_dtype=torch.float16).bytes_per_param()["momentum"] == 2.0


def test_bytes_per_param_fp32_storage_has_no_masters():
    assert FlatParams(_aligned_linear(), state_dtype=torch.float32).bytes_per_param() == {
        "weights": 4.0, "masters": 0.0, "momentum": 4.0, "grads": 4.0}


def test_bytes_per_param_counts_padding():
    net = nn.Linear(3, 1, bias=False).half()  # 3 elements padded to 64
    assert FlatParams(net, state_dtype=torch.float32).bytes_per_param()["weights"] == round(64 * 2 / 3, 3)


# ----------------------------------------------------------------------------- underflow

TRUE_GRAD_SCALE = 1e-8
"""The loss is multiplied by this, so the gradient reaching the fp16 output is ~2e-8: below
half of fp16's smallest subnormal (2^-24 = 6e-8), it rounds to zero without loss scaling."""


def _underflow_run(mode: str, steps: int) -> tuple[nn.Module, torch.Tensor, list[float], list[torch.Tensor]]:
    """y = w.x with fp16 w; loss = 1e-8 * (y - 3)^2 / 2 in fp32; returns the model, the initial
    weights, the losses and the fp16 gradients seen at each step."""
    net = nn.Linear(4, 1, bias=False)
    nn.init.constant_(net.weight, 0.25)  # y = 1, so dL/dy = 1e-8 * (1 - 3) = -2e-8
    net.half()
    w0 = net.weight.detach().clone()
    flat = FlatParams(net, state_dtype=torch.float32)
    scaler = _scaler(mode, init_scale=2.0**16)
    # lr compensates the tiny true gradient so the masters move visibly: dw = lr * 2e-8 = 0.02 / step
    solver = MasterOptimizer(flat, SolverConfig(base_lr=1e6, momentum=0.0, weight_decay=0.0), scaler, grad_divisor=1)
    x = torch.ones(1, 4, dtype=torch.float16)
    losses, grads = [], []
    for it in range(steps):
        loss = TRUE_GRAD_SCALE * (net(x).float() - 3.0).square().sum() / 2
        scaler.scale_loss(loss).backward()
        losses.append(loss.item())
        grads.append(net.weight.grad.clone())
        solver.step(it)
    return net, w0, losses, grads


def test_fp16_gradient_underflows_to_zero_without_loss_scaling():
    net, w0, losses, grads = _underflow_run("none", steps=5)
    assert all(torch.count_nonzero(g) == 0 for g in grads)
    assert torch.equal(net.weight.view(torch.int16), w0.view(torch.int16))  # the weights never moved
    assert losses[0] == losses[-1]


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_loss_scaling_recovers_the_gradient_and_learns(mode):
    net, w0, losses, grads = _underflow_run(mode, steps=5)
    assert torch.all(grads[0] < 0)  # survives in fp16, with the right sign (the loss wants larger w)
    assert torch.all(net.weight > w0)  # weights moved towards y = 3
    assert losses[-1] < 0.75 * losses[0]


def test_slow_cpu_dtype_warning_follows_the_measured_probe(monkeypatch, caplog):
    import dptrain.precision as prec

    assert prec.cpu_native_support("fp32") and prec.cpu_slowdown("fp32") == 1.0
    measured = prec.cpu_slowdown("bf16")  # the real probe, on this CPU: a ratio, measured once
    assert measured > 0 and prec.cpu_slowdown("bf16") == measured
    slowdowns = {"fp32": 1.0, "fp16": 29.0, "bf16": 1.1}
    monkeypatch.setattr(prec, "cpu_slowdown", lambda storage: slowdowns[storage])
    with caplog.at_level("WARNING", logger="dptrain.precision"):
        prec.warn_if_slow_on_cpu("fp16", torch.device("cpu"))
        prec.warn_if_slow_on_cpu("bf16", torch.device("cpu"))
        prec.warn_if_slow_on_cpu("fp32", torch.device("cpu"))
        prec.warn_if_slow_on_cpu("fp16", torch.device("meta"))
        slowdowns["bf16"] = 40.0
        prec.warn_if_slow_on_cpu("fp16", torch.device("cpu"))
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and "'fp16' runs 29x slower than fp32" in msgs[0], msgs
    assert "Use precision.storage = 'bf16'" in msgs[0] and "Use precision.storage = 'fp32'" in msgs[1]
