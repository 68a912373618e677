"""MasterOptimizer on CPU: lr policies, overflow skip, fp16 momentum, clipping, LARC, resume."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dptrain.config import LossScaleConfig, PrecisionConfig, SolverConfig
from dptrain.flat import FlatParams
from dptrain.optimizer import CLIP_EPS, MasterOptimizer, learning_rate
from dptrain.precision import LossScaler, apply_precision

CPU = torch.device("cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# ----------------------------------------------------------------------------- learning rate


@pytest.mark.parametrize("cfg, expected", [
    (dict(lr_policy="fixed"), {0: 0.1, 500: 0.1}),
    (dict(lr_policy="step", gamma=0.1, stepsize=100), {99: 0.1, 100: 0.01, 250: 0.001}),
    (dict(lr_policy="multistep", gamma=0.1, stepvalue=[10, 30]), {9: 0.1, 10: 0.01, 29: 0.01, 30: 0.001}),
    (dict(lr_policy="poly", power=2.0, max_iter=100), {0: 0.1, 50: 0.025, 100: 0.0}),
    (dict(lr_policy="exp", gamma=0.99), {0: 0.1, 10: 0.1 * 0.99**10}),
    (dict(lr_policy="inv", gamma=1e-4, power=0.75), {0: 0.1, 1000: 0.1 * 1.1**-0.75}),
    # linear warmup from 10 % over 10 iterations, then the policy
    (dict(lr_policy="fixed", warmup_iter=10, warmup_start=0.1), {0: 0.01, 5: 0.055, 10: 0.1}),
    (dict(lr_policy="step", gamma=0.5, stepsize=4, warmup_iter=8, warmup_start=0.0),
     {0: 0.0, 4: 0.1 * 0.5 * 0.5, 8: 0.1 * 0.25}),
])
def test_learning_rate_policies(cfg, expected):
    c = SolverConfig(base_lr=0.1, **cfg)
    for it, lr in expected.items():
        assert learning_rate(c, it) == pytest.approx(lr, rel=1e-12, abs=1e-15), it


def test_cosine_follows_its_formula_to_min_lr_and_under_the_warmup():
    c = SolverConfig(base_lr=0.1, lr_policy="cosine", max_iter=200, min_lr=0.001)
    for it in (0, 1, 50, 100, 137, 199, 200):
        want = 0.001 + (0.1 - 0.001) * 0.5 * (1 + math.cos(math.pi * it / 200))
        assert learning_rate(c, it) == pytest.approx(want, rel=1e-12), it
    assert learning_rate(c, 0) == pytest.approx(0.1) and learning_rate(c, 200) == pytest.approx(0.001)
    warm = SolverConfig(base_lr=0.1, lr_policy="cosine", max_iter=200, warmup_iter=10, warmup_start=0.2)
    for it in (0, 5, 10, 11):  # the warmup factor times the cosine at the same iteration
        factor = 0.2 + 0.8 * it / 10 if it < 10 else 1.0
        assert learning_rate(warm, it) == pytest.approx(factor * 0.1 * 0.5 * (1 + math.cos(math.pi * it / 200)),
                                                        rel=1e-12), it


def test_sigmoid_follows_caffes_formula_without_overflow():
    for gamma in (-0.05, 0.02):
        c = SolverConfig(base_lr=0.1, lr_policy="sigmoid", gamma=gamma, stepsize=100)
        for it in (0, 50, 99, 100, 101, 400, 5000):
            want = 0.1 * (1 / (1 + math.exp(-gamma * (it - 100))))
            assert learning_rate(c, it) == pytest.approx(want, rel=1e-12, abs=1e-300), (gamma, it)
        assert learning_rate(c, 100) == pytest.approx(0.05)  # stepsize is the midpoint
    # exp(-gamma * (it - stepsize)) alone would overflow a float here
    assert learning_rate(SolverConfig(lr_policy="sigmoid", gamma=-1.0, stepsize=1), 10**6) == 0.0
    assert learning_rate(SolverConfig(base_lr=0.1, lr_policy="sigmoid", gamma=1.0, stepsize=10**6), 0) == 0.0
    assert learning_rate(SolverConfig(base_lr=0.1, lr_policy="sigmoid", gamma=1.0, stepsize=1), 10**6) == 0.1


def test_min_lr_floors_the_other_policies():
    c = SolverConfig(base_lr=0.1, lr_policy="step", gamma=0.1, stepsize=10, min_lr=0.005)
    assert [learning_rate(c, it) for it in (0, 10, 20)] == pytest.approx([0.1, 0.01, 0.005])
    s = SolverConfig(base_lr=0.1, lr_policy="sigmoid", gamma=-1.0, stepsize=5, min_lr=0.02)
    assert learning_rate(s, 100) == 0.02


# ----------------------------------------------------------------------------- overflow skip


def _fp16_net_with_bn() -> tuple[nn.Module, FlatParams, MasterOptimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    apply_precision(net, PrecisionConfig(storage="fp16"))
    flat = FlatParams(net, state_dtype=torch.float32)
    scaler = LossScaler(LossScaleConfig(init_scale=1024.0), "dynamic", CPU)
    optimizer = MasterOptimizer(flat, SolverConfig(base_lr=0.1, momentum=0.9, weight_decay=5e-4), scaler,
                                grad_divisor=1)
    return net, flat, optimizer


def _backward(net: nn.Module, optimizer: MasterOptimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 8, generator=gen).half()
    optimizer.scaler.scale_loss(net(x).float().square().mean()).backward()


def test_inf_gradient_skips_step_bit_identically_and_halves_scale():
    net, flat, optimizer = _fp16_net_with_bn()
    assert sorted(str(g.dtype) for g in flat.groups) == ["torch.float16", "torch.float32"]  # BN group is fp32
    _backward(net, optimizer, 0)
    optimizer.step(0)  # a clean step first, so the momentum is not zero
    _backward(net, optimizer, 1)
    fp16_group = next(g for g in flat.groups if g.dtype == torch.float16)
    fp16_group.grads[3] = float("inf")
    before = [_bits(t).clone() for g in flat.groups for t in (g.params, g.master, g.state["momentum"])]
    assert any(torch.count_nonzero(g.state["momentum"]) > 0 for g in flat.groups)
    optimizer.step(1)
    after = [_bits(t) for g in flat.groups for t in (g.params, g.master, g.state["momentum"])]
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
    assert all(torch.count_nonzero(g.grads) == 0 for g in flat.groups)  # grads cleared for the next step
    assert optimizer.scaler.stats() == {"loss_scale": 512.0, "skipped_steps": 1}
    _backward(net, optimizer, 2)
    optimizer.step(2)  # and training goes on
    assert not torch.equal(_bits(fp16_group.master), before[1])


def test_nan_gradient_is_an_overflow_too():
    net, flat, optimizer = _fp16_net_with_bn()
    _backward(net, optimizer, 0)
    flat.groups[0].grads[0] = float("nan")
    master = [g.master.clone() for g in flat.groups]
    optimizer.step(0)
    assert all(torch.equal(m, g.master) for m, g in zip(master, flat.groups, strict=True))
    assert optimizer.scaler.stats()["skipped_steps"] == 1


def test_resume_restores_momentum_and_scaler_bit_exactly():
    net, flat, optimizer = _fp16_net_with_bn()
    for it in range(2):
        _backward(net, optimizer, it)
        optimizer.step(it)
    state = optimizer.state_dict()
    masters = flat.master_state()
    net2, flat2, optimizer2 = _fp16_net_with_bn()
    flat2.load_master_state(masters)
    optimizer2.load_state_dict(state)
    for n_, s_ in ((net, optimizer), (net2, optimizer2)):
        _backward(n_, s_, 2)
        s_.step(2)
    for g1, g2 in zip(flat.groups, flat2.groups, strict=True):
        for t1, t2 in ((g1.master, g2.master), (g1.state["momentum"], g2.state["momentum"]), (g1.params, g2.params)):
            assert torch.equal(_bits(t1), _bits(t2))
    assert optimizer.scaler.state_dict().keys() == optimizer2.scaler.state_dict().keys()
    for k, v in optimizer.scaler.state_dict().items():
        other = optimizer2.scaler.state_dict()[k]
        assert (v == other) if isinstance(v, str) else torch.equal(v, other), k


# ----------------------------------------------------------------------------- fp16 momentum

MOM_LR, MOM_G, MOM_M, MOM_STEPS = 1e-5, 1e-3, 0.9, 60
"""lr*g = 1e-8 is below half of fp16's smallest subnormal (2^-25 = 3e-8): it rounds to zero."""
MOM_RTOL = 2.0**-11 / (1 - MOM_M)
"""Bound on the factored form's relative error: each step rounds G to fp16 (<= 2^-11 relative)
and momentum m carries past errors along, summing to at most 2^-11 / (1 - m) = 4.9e-3."""


def _momentum_run(momentum_dtype: torch.dtype) -> torch.Tensor:
    """Weights start at 0 (so the fp32 master sums the steps with no absorption); returns them."""
    p = nn.Parameter(torch.zeros(64, dtype=torch.float16))
    holder = nn.Module()
    holder.p = p
    flat = FlatParams(holder, state_dtype=momentum_dtype)
    scaler = LossScaler(LossScaleConfig(), "none", CPU)
    optimizer = MasterOptimizer(flat, SolverConfig(base_lr=MOM_LR, momentum=MOM_M, weight_decay=0.0), scaler,
                                grad_divisor=1)
    g = torch.linspace(0.5, 1.5, 64) * MOM_G
    for it in range(MOM_STEPS):
        p.grad.copy_(g.half())  # p.grad is a view into the flat fp16 gradient buffer
        optimizer.step(it)
    return flat.groups[0].master.clone()


def test_naive_fp16_momentum_stalls():
    """NVIDIA slides' standard form in fp16: H = m*H - lr*g; W = W + H. lr*g underflows, nothing moves."""
    g = (torch.linspace(0.5, 1.5, 64) * MOM_G).half()
    assert torch.count_nonzero(MOM_LR * g) == 0
    w = torch.zeros(64, dtype=torch.float16)
    h = torch.zeros(64, dtype=torch.float16)
    for _ in range(MOM_STEPS):
        h = MOM_M * h - MOM_LR * g
        w = w + h
    assert torch.count_nonzero(w) == 0


def test_factored_fp16_momentum_tracks_fp32_momentum():
    w32 = _momentum_run(torch.float32)
    w16 = _momentum_run(torch.float16)
    assert torch.all(w32 < 0)  # it moved, downhill
    rel = ((w16 - w32).abs() / w32.abs()).max().item()
    assert rel <= MOM_RTOL, rel


# ----------------------------------------------------------------------------- clipping and LARC


class _TwoParams(nn.Module):
    def __init__(self, a: list[float], b: list[float]) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a))
        self.b = nn.Parameter(torch.tensor(b))


def _fp32_solver(model: nn.Module, scaler: LossScaler, **cfg) -> tuple[FlatParams, MasterOptimizer]:
    flat = FlatParams(model, state_dtype=torch.float32)
    return flat, MasterOptimizer(flat, SolverConfig(weight_decay=0.0, **cfg), scaler, grad_divisor=1)


@pytest.mark.parametrize("scaled_grads, factor", [([24.0, 32.0, 0.0], 1 / 5), ([0.8, 1.6, 0.0], 1.0)],
                         ids=["clipped", "below-threshold"])
def test_clipping_scales_the_unscaled_gradient(scaled_grads, factor):
    """Loss scale 8: the unscaled gradient is [3, 4] (norm 5, clipped to 1) or [0.1, 0.2] (kept)."""
    model = _TwoParams([1.0, 1.0, 1.0], [1.0])
    scaler = LossScaler(LossScaleConfig(init_scale=8.0), "static", CPU)
    _, optimizer = _fp32_solver(model, scaler, base_lr=0.5, momentum=0.0, clip_gradients=1.0)
    model.a.grad.copy_(torch.tensor(scaled_grads))
    optimizer.step(0)
    unscaled = torch.tensor(scaled_grads) / 8
    norm = unscaled.norm().item()
    clip = min(1.0, 1.0 / (norm + CLIP_EPS)) if factor != 1.0 else 1.0
    # fp32 arithmetic in a different order than this float64 expectation: a few ulps of 1.0
    assert torch.allclose(model.a.detach(), 1.0 - 0.5 * clip * unscaled, rtol=0, atol=1e-6)
    assert torch.equal(model.b.detach(), torch.tensor([1.0]))  # zero gradient: untouched


@pytest.mark.parametrize("policy", ["scale", "clip"])
def test_larc_policies(policy):
    """rate = (1-m)*eta*|w|/|g| per parameter; "scale": lr*rate, "clip": min(lr, rate)."""
    lr, m, eta = 0.1, 0.9, 0.001
    model = _TwoParams([3.0, 4.0, 0.0, 0.0], [1.0, 2.0, 2.0])  # |w| = 5 and 3
    scaler = LossScaler(LossScaleConfig(), "none", CPU)
    _, optimizer = _fp32_solver(model, scaler, base_lr=lr, momentum=m, larc=True, larc_policy=policy, larc_eta=eta)
    ga = torch.tensor([0.0, 0.0, 0.6, 0.8])  # |g| = 1    -> rate 5e-4 (< lr)
    gb = torch.tensor([0.0, 0.0, 1e-3])  # |g| = 1e-3 -> rate 0.3  (> lr)
    model.a.grad.copy_(ga)
    model.b.grad.copy_(gb)
    wa, wb = model.a.detach().clone(), model.b.detach().clone()
    optimizer.step(0)
    rate_a, rate_b = (1 - m) * eta * 5 / 1, (1 - m) * eta * 3 / 1e-3
    lr_a, lr_b = (lr * rate_a, lr * rate_b) if policy == "scale" else (min(lr, rate_a), min(lr, rate_b))
    # first step from zero momentum: h = lr_e*g, w -= h. Norms are fp32: 1e-5 relative covers them.
    assert torch.allclose(model.a.detach(), wa - lr_a * ga, rtol=1e-5, atol=1e-9)
    assert torch.allclose(model.b.detach(), wb - lr_b * gb, rtol=1e-5, atol=1e-9)
    assert math.isclose(lr_b, 0.03 if policy == "scale" else 0.1)
