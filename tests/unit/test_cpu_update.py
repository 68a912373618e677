"""The CPU backends (in place, compiled) against the torch reference that defines the rule."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from dptrain.kernels import Hyper, UpdateArgs, reference
from dptrain.kernels.cpu import update_compiled, update_inplace
from dptrain.kernels.spec import RULES

CASES = list(itertools.product([torch.float16, torch.bfloat16, torch.float32], [torch.float32, torch.float16],
                               [False, True], [False, True]))


def _state(storage, mom_dtype, n=777, seed=0):
    g = torch.Generator().manual_seed(seed)
    grads = (torch.randn(n, generator=g) * 10).to(storage)
    master = torch.randn(n, generator=g)
    params = master if storage == torch.float32 else master.to(storage)
    momentum = (torch.randn(n, generator=g) * 0.01).to(mom_dtype)
    return grads, master, params, momentum


def _args(state, *, lr, momentum_coef, weight_decay, decoupled, grad_coef, found_inf, lr_scale=None) -> UpdateArgs:
    g, w, p, m = state
    return UpdateArgs(rule="sgd", grads=g, master=w, params=p, state=(m,), grad_coef=grad_coef, found_inf=found_inf,
                      lr_scale=lr_scale, hyper=Hyper(lr=lr, momentum=momentum_coef, weight_decay=weight_decay,
                                                     decoupled=decoupled))


def _clone(state):
    g, w, p, m = (x.clone() for x in state)
    return g, w, (w if state[2] is state[1] else p), m


@pytest.mark.parametrize("storage,mom_dtype,decoupled,larc", CASES)
def test_cpu_path_matches_reference(storage, mom_dtype, decoupled, larc):
    state = _state(storage, mom_dtype)
    lr_scale = torch.rand(777, generator=torch.Generator().manual_seed(1)) + 0.5 if larc else None
    kw = dict(lr=0.1, momentum_coef=0.9, weight_decay=5e-4, decoupled=decoupled,
              grad_coef=torch.tensor([0.25]), found_inf=torch.zeros(1), lr_scale=lr_scale)
    ref, cpu = _clone(state), _clone(state)
    reference(_args(ref, **kw))
    update_inplace(_args(cpu, **kw))
    # The CPU path computes m*h + lr*g as one add_(alpha=lr), the reference as two rounded
    # products and a sum: results differ by at most a couple of fp32 ulps of values ~1.
    torch.testing.assert_close(cpu[1], ref[1], rtol=0, atol=5e-7)
    torch.testing.assert_close(cpu[3].float(), ref[3].float(), rtol=0, atol=5e-7 if mom_dtype == torch.float32 else 0)
    assert torch.equal(cpu[2], cpu[1].to(cpu[2].dtype))  # weights are the rounded masters
    assert torch.count_nonzero(cpu[0]) == 0 and torch.count_nonzero(ref[0]) == 0


def test_cpu_path_skips_bit_exactly():
    state = _state(torch.float16, torch.float32)
    before = _clone(state)
    update_inplace(_args(state, lr=0.1, momentum_coef=0.9, weight_decay=5e-4, decoupled=False,
                         grad_coef=torch.tensor([1.0]), found_inf=torch.ones(1)))
    for a, b in zip(state[1:], before[1:], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.count_nonzero(state[0]) == 0


def test_compiled_cpu_update_matches_reference():
    # One variant (the demo/benchmark one: bf16 storage, fp32 momentum, L2): each variant costs
    # a ~15 s inductor compile on a fresh machine.
    state = _state(torch.bfloat16, torch.float32)
    kw = dict(momentum_coef=0.9, weight_decay=5e-4, decoupled=False, grad_coef=torch.tensor([0.25]),
              found_inf=torch.zeros(1))
    ref, fused = _clone(state), _clone(state)
    for lr in (0.1, 0.05):  # a new lr must not need a recompile (it travels as a tensor)
        for s in (ref, fused):
            s[0].copy_(state[0])
        reference(_args(ref, lr=lr, **kw))
        update_compiled(_args(fused, lr=lr, **kw))
    # inductor may contract a*b+c into one rounding (the reference rounds each op): ~1 fp32 ulp
    torch.testing.assert_close(fused[1], ref[1], rtol=0, atol=5e-7)
    torch.testing.assert_close(fused[3], ref[3], rtol=0, atol=5e-7)
    assert torch.equal(fused[2], fused[1].to(torch.bfloat16)) and torch.count_nonzero(fused[0]) == 0
    skipped = _clone(fused)
    update_compiled(_args(skipped, lr=0.1, **{**kw, "found_inf": torch.ones(1)}))
    assert torch.equal(skipped[1], fused[1]) and torch.equal(skipped[3], fused[3])


def test_compiled_cpu_update_rounds_fp16_momentum_like_the_reference():
    """With fp16 momentum the rule is h = half(m*h + g); w -= lr * float(h). inductor used to
    drop the rounding, so the master moved by the unrounded history (off by ~1e-4)."""
    state = _state(torch.float16, torch.float16)
    kw = dict(lr=0.1, momentum_coef=0.9, weight_decay=5e-4, decoupled=False, grad_coef=torch.tensor([0.25]),
              found_inf=torch.zeros(1))
    ref, fused = _clone(state), _clone(state)
    reference(_args(ref, **kw))
    update_compiled(_args(fused, **kw))
    assert torch.equal(fused[3], ref[3])
    torch.testing.assert_close(fused[1], ref[1], rtol=0, atol=5e-7)
    assert torch.equal(fused[2], fused[1].to(torch.float16))


NEW_RULE_CASES = list(itertools.product(["nesterov", "adam", "lamb", "rmsprop"], [torch.float16, torch.float32],
                                        [False, True], [False, True]))


def _rule_args(rule: str, storage: torch.dtype, decoupled: bool, tables: bool, n: int = 777) -> UpdateArgs:
    g = torch.Generator().manual_seed(2)
    master = torch.randn(n, generator=g)
    state = tuple(torch.rand(n, generator=g) * 0.01 for _ in RULES[rule].state_names)  # second moments are >= 0
    return UpdateArgs(rule=rule, grads=(torch.randn(n, generator=g) * 10).to(storage), master=master,
                      params=master if storage == torch.float32 else master.to(storage), state=state,
                      grad_coef=torch.tensor([0.25]), found_inf=torch.zeros(1),
                      hyper=Hyper(lr=0.01, momentum=0.9, weight_decay=0.05, decoupled=decoupled),
                      lr_scale=torch.rand(n, generator=g) + 0.5 if tables else None,
                      decay_scale=(torch.rand(n, generator=g) * 2).round() if tables else None,
                      bias_correction=torch.tensor([0.271, 0.0547]) if RULES[rule].bias_correction else None)


def _copy(a: UpdateArgs) -> UpdateArgs:
    master = a.master.clone()
    return replace(a, grads=a.grads.clone(), master=master, params=master if a.params is a.master else a.params.clone(),
                   state=tuple(t.clone() for t in a.state))


@pytest.mark.parametrize("rule,storage,decoupled,tables", NEW_RULE_CASES)
def test_cpu_path_matches_reference_for_every_rule(rule, storage, decoupled, tables):
    a = _rule_args(rule, storage, decoupled, tables)
    ref, cpu = _copy(a), _copy(a)
    reference(ref)
    update_inplace(cpu)
    # In-place passes round lr*lr_scale*u as two products, m*b1 + (1-b1)*g through add_(alpha=), and
    # Nesterov's (1+m)*h - m*h0 as -m*h0 + (1+m)*h: a few fp32 ulps of values up to ~3 (weights ~1,
    # steps ~lr) and of the state (relative, up to 1 for the moments).
    torch.testing.assert_close(cpu.master, ref.master, rtol=0, atol=1e-6)
    for c, r in zip(cpu.state, ref.state, strict=True):
        torch.testing.assert_close(c, r, rtol=1e-5, atol=1e-9)
    assert torch.equal(cpu.params, cpu.master.to(storage)) and torch.count_nonzero(cpu.grads) == 0
    assert not torch.equal(cpu.master, a.master)


@pytest.mark.parametrize("rule", ["adam", "rmsprop"])
def test_cpu_path_skips_every_rule_bit_exactly(rule):
    a = replace(_rule_args(rule, torch.float16, True, True), found_inf=torch.ones(1))
    got = _copy(a)
    update_inplace(got)
    assert torch.equal(got.master, a.master) and all(torch.equal(x, y) for x, y in zip(got.state, a.state, strict=True))
    assert torch.count_nonzero(got.grads) == 0


CHUNK_CASES = [(r, s, d, t, m) for r, s, d, t, m in itertools.product(
    RULES, [torch.bfloat16, torch.float16, torch.float32], [False, True], [False, True], [torch.float32, torch.float16])
    if m == torch.float32 or r in ("sgd", "nesterov")]  # only the momentum rules keep an fp16 state


@pytest.fixture
def restore_threads():
    """The chunk tests set torch's thread count; put the suite's back after each."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("rule,storage,decoupled,tables,state_dtype", CHUNK_CASES)
def test_chunked_cpu_path_is_bit_exact_with_one_piece(monkeypatch, restore_threads, rule, storage, decoupled, tables,
                                                    state_dtype):
    """The in-place passes run chunk by chunk (cache reuse); element-wise, so on one thread the same
    bits as over the whole buffer, with a chunk boundary inside a segment and a short last chunk."""
    import dptrain.kernels.cpu as cpu_mod

    n = 3 * 256 + 77
    a = _rule_args(rule, storage, decoupled=decoupled, tables=tables, n=n)
    a = replace(a, state=tuple(t.to(state_dtype) for t in a.state))
    whole, chunked = _copy(a), _copy(a)
    torch.set_num_threads(1)
    monkeypatch.setattr(cpu_mod, "INPLACE_CHUNK", 1 << 30)
    update_inplace(whole)
    monkeypatch.setattr(cpu_mod, "INPLACE_CHUNK", 256)
    update_inplace(chunked)
    assert torch.equal(chunked.master, whole.master) and not torch.equal(whole.master, a.master)
    assert all(torch.equal(c, w) for c, w in zip(chunked.state, whole.state, strict=True))
    assert torch.equal(chunked.params, whole.params)
    assert (chunked.params is chunked.master) == (a.params is a.master) == (storage == torch.float32)
    assert torch.count_nonzero(chunked.grads) == 0


def test_chunks_grow_with_the_thread_count(monkeypatch, restore_threads):
    """Each of T threads still gets INPLACE_CHUNK elements of every pass (ATen splits an
    element-wise op among threads by a fixed grain)."""
    import dptrain.kernels.cpu as cpu_mod

    bounds = []
    real = cpu_mod._chunk
    monkeypatch.setattr(cpu_mod, "_chunk", lambda a, start, stop: bounds.append((start, stop)) or real(a, start, stop))
    monkeypatch.setattr(cpu_mod, "INPLACE_CHUNK", 100)
    for t, expect in ((1, [(0, 100), (100, 200), (200, 250)]), (2, [(0, 200), (200, 250)])):
        torch.set_num_threads(t)
        bounds.clear()
        update_inplace(_rule_args("sgd", torch.bfloat16, decoupled=False, tables=False, n=250))
        assert bounds == expect
