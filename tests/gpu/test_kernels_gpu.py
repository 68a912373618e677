"""CuPy kernels vs their torch references on the GPU, and the step with no host sync.

The update is compared bit-for-bit: the kernel is compiled with --fmad=false --ftz=false and
rounds its scalars as the spec does (see update.cu), so no tolerance is needed. The norm sums
in a different order than torch, so it gets a relative tolerance (see there).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from dptrain import kernels
from dptrain.config import LossScaleConfig, ParamGroup, SolverConfig
from dptrain.flat import FlatParams
from dptrain.kernels import Hyper, UpdateArgs, cuda, grad_norm_reference, reference, selfcheck
from dptrain.kernels.spec import RULES, bias_corrections
from dptrain.optimizer import MasterOptimizer, rule_for
from dptrain.param_groups import resolve_multipliers
from dptrain.precision import LossScaler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU, torch.cuda.is_available() is False"),
    pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                       reason="needs CuPy (pip install dptrain[cuda12]) for the CUDA kernels"),
]

STORAGE = [torch.float16, torch.bfloat16, torch.float32]
MOMENTUM = [torch.float32, torch.float16]


@pytest.fixture(autouse=True)
def _force_cupy(monkeypatch):
    """Make the dispatcher raise instead of silently comparing the reference with itself."""
    monkeypatch.setenv(kernels.KERNELS_ENV, "cupy")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _case(storage: torch.dtype, mom: torch.dtype, n: int, offset: int, seed: int) -> dict[str, torch.Tensor]:
    """Flat buffers on the GPU; ``offset`` elements into a larger allocation (1 breaks 4-element alignment)."""
    gen = torch.Generator().manual_seed(seed)

    def buf(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        full = torch.zeros(n + offset, dtype=dtype, device="cuda")
        full[offset:] = values.to(dtype)
        return full[offset:]

    mag = torch.exp2(torch.randint(-30, 12, (n,), generator=gen).float())
    grads = torch.randn(n, generator=gen) * mag
    grads[::17] = 0.0
    master = torch.randn(n, generator=gen) * 0.1
    master[3::19] = -0.0
    m = buf(master, torch.float32)
    return {
        "grads": buf(grads, storage),
        "master": m,
        "params": m if storage == torch.float32 else buf(master, storage),
        "momentum": buf(torch.randn(n, generator=gen) * 0.01, mom),
        "lr_scale": buf(torch.rand(n, generator=gen) * 2.0, torch.float32),
    }


def _clone(case: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in case.items()}
    if case["params"] is case["master"]:
        out["params"] = out["master"]
    return out


def _scalars(skip: float) -> dict[str, torch.Tensor]:
    """grad_coef and found_inf as [1] fp32 device tensors. Creating them is a blocking host-to-device
    copy (the host waits for the current stream), so callers that must not sync make them beforehand."""
    return {"grad_coef": torch.tensor([0.37 / 4096], device="cuda"), "found_inf": torch.tensor([skip], device="cuda")}


def _update(fn, c: dict[str, torch.Tensor], *, with_scale: bool, skip: float = 0.0,
            scalars: dict[str, torch.Tensor] | None = None, lr: float, momentum_coef: float, weight_decay: float,
            decoupled: bool) -> None:
    fn(UpdateArgs(rule="sgd", grads=c["grads"], master=c["master"], params=c["params"], state=(c["momentum"],),
                  lr_scale=c["lr_scale"] if with_scale else None, **(scalars if scalars is not None else _scalars(skip)),
                  hyper=Hyper(lr=lr, momentum=momentum_coef, weight_decay=weight_decay, decoupled=decoupled)))


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("mom", MOMENTUM)
@pytest.mark.parametrize("decay", ["none", "l2", "decoupled"])
@pytest.mark.parametrize("offset", [0, 1], ids=["vec4", "vec1"])
def test_sgd_kernel_bit_exact(storage, mom, decay, offset):
    n = 64 * 1001 + 3  # not a multiple of 4: the scalar tail runs too
    case = _case(storage, mom, n, offset, seed=1)
    assert kernels.kernel_backend(case["grads"]) == "cupy"
    want_vec = cuda.VECTOR_ELEMS if offset == 0 else 1
    assert cuda.vector_width([case["grads"], case["master"], case["momentum"]]) == want_vec
    # lr/wd large so the decay term dominates and a mis-rounded coefficient shows (see tests/unit/test_kernels.py)
    kw = dict(lr=0.9137, momentum_coef=0.9, weight_decay=0.0 if decay == "none" else 0.7,
              decoupled=decay == "decoupled")
    for with_scale in (False, True):
        got, want = _clone(case), _clone(case)
        _update(kernels.update, got, with_scale=with_scale, skip=0.0, **kw)
        _update(reference, want, with_scale=with_scale, skip=0.0, **kw)
        for name in ("grads", "master", "params", "momentum"):
            assert torch.equal(_bits(got[name]), _bits(want[name])), f"{name} with_scale={with_scale}"


RULE_CASES = [(r, s, m) for r in ("nesterov", "adam", "lamb", "rmsprop") for s in STORAGE
              for m in RULES[r].state_dtypes]


@pytest.mark.parametrize("rule,storage,state_dtype", RULE_CASES,
                         ids=[f"{r}-{str(s)[6:]}-{str(m)[6:]}" for r, s, m in RULE_CASES])
@pytest.mark.parametrize("decay", ["none", "l2", "decoupled"])
@pytest.mark.parametrize("offset", [0, 1], ids=["vec4", "vec1"])
def test_every_rule_kernel_bit_exact(rule, storage, state_dtype, decay, offset):
    """Each rule with and without the lr/decay tables and (adam, lamb) device-side bias corrections."""
    n = 64 * 1001 + 3
    case = _case(storage, state_dtype, n, offset, seed=6)
    gen = torch.Generator().manual_seed(7)
    state = tuple(_case(storage, state_dtype, n, offset, seed=8 + j)["momentum"].abs_()
                  for j in range(len(RULES[rule].state_names)))  # second moments are >= 0
    decay_scale = case["lr_scale"].clone().copy_((torch.rand(n, generator=gen) * 2).round())
    bc = bias_corrections(torch.tensor([3], device="cuda"), 0.9, 0.999) if RULES[rule].bias_correction else None
    hyper = Hyper(lr=0.9137, momentum=0.9, weight_decay=0.0 if decay == "none" else 0.7,
                  decoupled=decay == "decoupled")
    for tables in (False, True):
        runs = []
        for fn in (kernels.update, reference):
            c = _clone(case)
            st = tuple(t.clone() for t in state)
            fn(UpdateArgs(rule=rule, grads=c["grads"], master=c["master"], params=c["params"], state=st, hyper=hyper,
                          lr_scale=c["lr_scale"] if tables else None, decay_scale=decay_scale if tables else None,
                          bias_correction=bc, **_scalars(0.0)))
            runs.append([c["grads"], c["master"], c["params"], *st])
        for got, want in zip(*runs, strict=True):
            assert torch.equal(_bits(got), _bits(want)), f"tables={tables}"


@pytest.mark.parametrize("flag", [1.0, float("nan")], ids=["one", "nan"])
def test_sgd_kernel_skip_leaves_state_bit_identical(flag):
    case = _case(torch.float16, torch.float32, 4096, 0, seed=2)
    got = _clone(case)
    _update(kernels.update, got, with_scale=True, skip=flag, lr=0.1, momentum_coef=0.9, weight_decay=5e-4,
            decoupled=False)
    for name in ("master", "params", "momentum"):
        assert torch.equal(_bits(got[name]), _bits(case[name])), name
    assert torch.count_nonzero(got["grads"]) == 0


def test_sgd_kernel_runs_on_torch_current_stream():
    """The producer of the grads is delayed on a side stream; a kernel launched on any other stream
    would read the old grads and differ from the reference."""
    case = _case(torch.float16, torch.float32, 1 << 20, 0, seed=3)
    fresh = torch.randn(1 << 20, device="cuda").half()
    want = _clone(case)
    want["grads"].copy_(fresh)
    kw = dict(lr=0.1, momentum_coef=0.9, weight_decay=0.0, decoupled=False)
    _update(reference, want, with_scale=False, skip=0.0, **kw)
    _update(kernels.update, _clone(case), with_scale=False, **kw)  # compile/load before the timed part
    got = _clone(case)
    # Made before the spin: created inside it, torch.tensor(..., device="cuda") would block the host
    # until the side stream drained, and a kernel on any stream would then see the fresh grads.
    scalars = _scalars(0.0)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms of spinning before the grads are written
        got["grads"].copy_(fresh)
        _update(kernels.update, got, with_scale=False, scalars=scalars, **kw)
        assert not side.query(), "the host must not have waited for the side stream before the launch"
    side.synchronize()
    assert torch.equal(_bits(got["master"]), _bits(want["master"]))


@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("n", [1, 1000, (1 << 22) + 3])
def test_norm_kernel_matches_reference(dtype, n):
    x = torch.randn(n, device="cuda").to(dtype)
    got = kernels.grad_norm(x)
    want = grad_norm_reference(x)
    assert got.shape == () and got.dtype == torch.float32
    # Both sum n fp32 squares, in different orders (blocks of 256 threads vs torch's tree); each
    # rounding error is <= 2^-24 relative and they partly cancel; 1e-5 covers 4M elements with margin.
    assert torch.allclose(got, want, rtol=1e-5, atol=0)
    assert torch.equal(_bits(kernels.grad_norm(x)), _bits(got))  # deterministic for a given n


@pytest.mark.parametrize("bad, check", [(float("inf"), torch.isinf), (float("nan"), torch.isnan)])
def test_norm_kernel_propagates_non_finite(bad, check):
    x = torch.randn(10_000, device="cuda").half()
    x[1234] = bad
    assert check(kernels.grad_norm(x))


def _toy_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda().half()


def _solver(model: nn.Module, **solver_kw) -> MasterOptimizer:
    cfg = SolverConfig(base_lr=0.1, **solver_kw)
    flat = FlatParams(model, state_names=rule_for(cfg).state_names, state_dtype=torch.float32)
    scaler = LossScaler(LossScaleConfig(init_scale=1024.0, growth_interval=3), "dynamic", torch.device("cuda"))
    return MasterOptimizer(flat, cfg, scaler, grad_divisor=1,
                           multipliers=resolve_multipliers(model, cfg.param_groups, cfg.no_decay))


def _backward(model: nn.Module, solver: MasterOptimizer, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(32, 64, device="cuda", generator=gen).half()
    loss = model(x).float().square().mean()
    solver.scaler.scale_loss(loss).backward()


@pytest.mark.parametrize("solver_kw", [{}, {"clip_gradients": 1.0}, {"larc": True, "larc_policy": "clip"},
                                       {"type": "adamw", "no_decay": ["bias"],
                                        "param_groups": [ParamGroup(match="2.*", lr_mult=2.0)]},
                                       {"type": "lamb", "no_decay": ["bias"]}, {"type": "rmsprop"}],
                         ids=["plain", "clip", "larc", "adamw-groups", "lamb", "rmsprop"])
def test_step_has_no_host_sync(solver_kw):
    torch.manual_seed(0)
    model = _toy_model()
    solver = _solver(model, **solver_kw)
    _backward(model, solver, 0)
    solver.step(0)  # warm-up: compiles and loads the kernels, caches device properties
    for it in range(1, 4):
        _backward(model, solver, it)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host sync inside step() raises
        try:
            solver.step(it)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert solver.scaler.stats()["skipped_steps"] == 0


@pytest.mark.parametrize("kind", ["sgd", "adamw", "lamb"])
def test_solver_kernel_and_reference_agree_over_steps(monkeypatch, kind):
    """Several full steps (dynamic scaler, no clipping: the norm only feeds the overflow flag) give
    bit-identical masters, state and fp16 weights with the kernels and with the references (LAMB's
    trust ratio comes from the same torch ops on both sides)."""
    states = []
    for backend in ("cupy", "torch"):
        monkeypatch.setenv(kernels.KERNELS_ENV, backend)
        torch.manual_seed(0)
        model = _toy_model()
        solver = _solver(model, type=kind, momentum=0.9, weight_decay=5e-4, no_decay=["bias"])
        for it in range(5):
            _backward(model, solver, it)
            solver.step(it)
        g = solver.flat.groups[0]
        states.append([_bits(t).clone() for t in (g.master, *g.state.values(), g.params)])
    for a, b in zip(*states, strict=True):
        assert torch.equal(a, b)


def test_self_check_passes_on_this_gpu():
    """What a solver runs at first use: every rule, dtype, alignment, subnormals and a skip."""
    assert selfcheck.run(torch.cuda.current_device()) is None
    assert kernels.cuda_unusable(torch.cuda.current_device()) is None


def test_kernels_keep_fp32_subnormals_like_the_reference():
    """CuPy would add -ftz=true; dptrain compiles with its own NVRTC call, so a momentum that decays
    below 2^-126 on a parameter whose gradient is 0 stays equal to torch's."""
    n = 1024
    case = _case(torch.float16, torch.float32, n, 0, seed=5)
    case["grads"].zero_()
    case["momentum"].fill_(3e-39)  # subnormal fp32: m*h = 2.7e-39 is subnormal too
    got, want = _clone(case), _clone(case)
    kw = dict(lr=0.1, momentum_coef=0.9, weight_decay=0.0, decoupled=False)
    _update(kernels.update, got, with_scale=False, **kw)
    _update(reference, want, with_scale=False, **kw)
    assert torch.count_nonzero(want["momentum"]) == n  # the reference keeps them
    assert torch.equal(_bits(got["momentum"]), _bits(want["momentum"]))
