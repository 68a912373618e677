"""CUDA kernels vs their torch references, and the solver step: no skip, a falling loss, no host sync.

The update is compared bit-for-bit: the kernel is compiled with --fmad=false --ftz=false and
rounds its scalars as the spec does (see update.cu), so no tolerance is needed. The norm sums
in a different order than torch, so it gets a relative tolerance (see there).

The solver-step, skip and kernel-vs-reference-over-steps tests take ``device`` from
tests/devices.py: on the CPU (`make test`) they run the same steps through the host build of
update.cu (dptrain.kernels.native, the CPU default), on CUDA through the CuPy kernels. The
kernel-level comparisons, the stream test and the self-check stay GPU-only: they test the
CuPy kernels themselves (the host build has its own in tests/unit/test_native_update.py).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from devices import cuda_param, gpu_only, requires_cupy
from dptrain import kernels
from dptrain.config import LossScaleConfig, ParamGroup, SolverConfig
from dptrain.flat import FlatParams
from dptrain.kernels import Hyper, UpdateArgs, cuda, grad_norm_reference, native, reference, selfcheck
from dptrain.kernels.selfcheck import placed_clone
from dptrain.kernels.spec import RULES, bias_corrections
from dptrain.optimizer import MasterOptimizer, rule_for
from dptrain.param_groups import resolve_multipliers
from dptrain.precision import LossScaler

cupy_kernels = gpu_only(requires_cupy())
"""A test of the CuPy kernels themselves: GPU-only."""
DEVICES = ["cpu", cuda_param(requires_cupy())]
"""The CPU always; CUDA where there is a GPU and CuPy (DPTRAIN_KERNELS=cupy makes its absence an error)."""

STORAGE = [torch.float16, torch.bfloat16, torch.float32]
MOMENTUM = [torch.float32, torch.float16]


@pytest.fixture(autouse=True)
def _kernels_env(request, monkeypatch):
    """On CUDA, make the dispatcher raise instead of silently comparing the reference with itself;
    on the CPU, leave it the default (the host build of update.cu, else the in-place passes)."""
    callspec = getattr(request.node, "callspec", None)
    device = callspec.params.get("device", "cuda") if callspec is not None else "cuda"
    monkeypatch.setenv(kernels.KERNELS_ENV, "cupy" if device == "cuda" else "auto")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _case(storage: torch.dtype, mom: torch.dtype, n: int, offset: int, seed: int,
          device: str = "cuda") -> dict[str, torch.Tensor]:
    """Flat buffers on ``device``; ``offset`` elements into a larger allocation (1 breaks 4-element alignment)."""
    gen = torch.Generator().manual_seed(seed)

    def buf(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        full = torch.zeros(n + offset, dtype=dtype, device=device)
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
    """Copies placed as the originals are: a "vec1" case's copies are misaligned too, so the V=1
    kernel is what runs on them (``clone`` would return aligned copies, and the packed kernel)."""
    out = {k: placed_clone(v) for k, v in case.items()}
    if case["params"] is case["master"]:
        out["params"] = out["master"]
    return out


def _want_vec(storage: torch.dtype, offset: int) -> int:
    """The vector width of a case's buffers: 16 bytes of ``storage`` when aligned, 1 at offset 1."""
    return cuda.vector_elems(storage) if offset == 0 else 1


def _scalars(skip: float, device: str = "cuda") -> dict[str, torch.Tensor]:
    """grad_coef and found_inf as [1] fp32 device tensors. Creating them is a blocking host-to-device
    copy (the host waits for the current stream), so callers that must not sync make them beforehand."""
    return {"grad_coef": torch.tensor([0.37 / 4096], device=device), "found_inf": torch.tensor([skip], device=device)}


def _update(fn, c: dict[str, torch.Tensor], *, with_scale: bool, skip: float = 0.0,
            scalars: dict[str, torch.Tensor] | None = None, lr: float, momentum_coef: float, weight_decay: float,
            decoupled: bool) -> None:
    scalars = scalars if scalars is not None else _scalars(skip, c["grads"].device.type)
    fn(UpdateArgs(rule="sgd", grads=c["grads"], master=c["master"], params=c["params"], state=(c["momentum"],),
                  lr_scale=c["lr_scale"] if with_scale else None, **scalars,
                  hyper=Hyper(lr=lr, momentum=momentum_coef, weight_decay=weight_decay, decoupled=decoupled)))


@cupy_kernels
@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("mom", MOMENTUM)
@pytest.mark.parametrize("decay", ["none", "l2", "decoupled"])
@pytest.mark.parametrize("offset", [0, 1], ids=["packed", "vec1"])
def test_sgd_kernel_bit_exact(storage, mom, decay, offset):
    n = 64 * 1001 + 3  # not a multiple of 4: the scalar tail runs too
    case = _case(storage, mom, n, offset, seed=1)
    assert kernels.kernel_backend(case["grads"]) == "cupy"
    # lr/wd large so the decay term dominates and a mis-rounded coefficient shows (see tests/unit/test_kernels.py)
    kw = dict(lr=0.9137, momentum_coef=0.9, weight_decay=0.0 if decay == "none" else 0.7,
              decoupled=decay == "decoupled")
    for with_scale in (False, True):
        got, want = _clone(case), _clone(case)
        passed = [got[k] for k in ("grads", "master", "params", "momentum", *(("lr_scale",) if with_scale else ()))]
        assert cuda.vector_width(passed, storage) == _want_vec(storage, offset)  # the kernel this case is for
        _update(kernels.update, got, with_scale=with_scale, skip=0.0, **kw)
        _update(reference, want, with_scale=with_scale, skip=0.0, **kw)
        for name in ("grads", "master", "params", "momentum"):
            assert torch.equal(_bits(got[name]), _bits(want[name])), f"{name} with_scale={with_scale}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("offset", [0, 1], ids=["packed", "vec1"])
def test_the_kernel_tests_copies_are_aligned_as_their_case_says(device, storage, offset):
    """What the bit-exact kernel tests pass: a "vec1" case's copies are misaligned in every stream, so
    the V=1 kernel runs on them; a "packed" case's copies allow 16-byte packs. Checked where the
    copies are made, so on the CPU too (vector_width reads only the pointers)."""
    case = _case(storage, torch.float32, 64 * 11 + 3, offset, seed=4, device=device)
    state = placed_clone(case["momentum"])
    copies = [*_clone(case).values(), state, placed_clone(case["lr_scale"])]
    assert {cuda.vector_width([t], storage) for t in copies} == {_want_vec(storage, offset)}
    assert cuda.vector_width(copies, storage) == _want_vec(storage, offset)


RULE_CASES = [(r, s, m) for r in ("nesterov", "adam", "lamb", "rmsprop") for s in STORAGE
              for m in RULES[r].state_dtypes]


@cupy_kernels
@pytest.mark.parametrize("rule,storage,state_dtype", RULE_CASES,
                         ids=[f"{r}-{str(s)[6:]}-{str(m)[6:]}" for r, s, m in RULE_CASES])
@pytest.mark.parametrize("decay", ["none", "l2", "decoupled"])
@pytest.mark.parametrize("offset", [0, 1], ids=["packed", "vec1"])
def test_every_rule_kernel_bit_exact(rule, storage, state_dtype, decay, offset):
    """Each rule with and without the lr/decay tables and (adam, lamb) device-side bias corrections."""
    n = 64 * 1001 + 3
    case = _case(storage, state_dtype, n, offset, seed=6)
    gen = torch.Generator().manual_seed(7)
    state = tuple(_case(storage, state_dtype, n, offset, seed=8 + j)["momentum"].abs_()
                  for j in range(len(RULES[rule].state_names)))  # second moments are >= 0
    decay_scale = placed_clone(case["lr_scale"]).copy_((torch.rand(n, generator=gen) * 2).round())
    bc = bias_corrections(torch.tensor([3], device="cuda"), 0.9, 0.999) if RULES[rule].bias_correction else None
    hyper = Hyper(lr=0.9137, momentum=0.9, weight_decay=0.0 if decay == "none" else 0.7,
                  decoupled=decay == "decoupled")
    for tables in (False, True):
        runs = []
        for fn in (kernels.update, reference):
            c = _clone(case)
            st = tuple(placed_clone(t) for t in state)
            a = UpdateArgs(rule=rule, grads=c["grads"], master=c["master"], params=c["params"], state=st, hyper=hyper,
                           lr_scale=c["lr_scale"] if tables else None, decay_scale=decay_scale if tables else None,
                           bias_correction=bc, **_scalars(0.0))
            assert cuda.vector_width([t for t in a.tensors() if t.numel() == n], storage) == _want_vec(storage, offset)
            fn(a)
            runs.append([c["grads"], c["master"], c["params"], *st])
        for got, want in zip(*runs, strict=True):
            assert torch.equal(_bits(got), _bits(want)), f"tables={tables}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flag", [1.0, float("nan")], ids=["one", "nan"])
def test_sgd_kernel_skip_leaves_state_bit_identical(device, flag):
    case = _case(torch.float16, torch.float32, 4096, 0, seed=2, device=device)
    assert kernels.kernel_backend(case["grads"]) in (("cupy",) if device == "cuda" else ("native", "inplace"))
    got = _clone(case)
    _update(kernels.update, got, with_scale=True, skip=flag, lr=0.1, momentum_coef=0.9, weight_decay=5e-4,
            decoupled=False)
    for name in ("master", "params", "momentum"):
        assert torch.equal(_bits(got[name]), _bits(case[name])), name
    assert torch.count_nonzero(got["grads"]) == 0


@cupy_kernels
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


@cupy_kernels
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


@cupy_kernels
def test_one_launch_norm_reuses_its_counter_across_sizes_and_streams():
    """dptrain_norm's last block resets the arrival counter: one stream alternating a one-block and a
    1024-block grid, and two side streams at once (each with its own scratch), give the bits a fresh
    call gives, and every counter is 0 afterwards."""
    small, big = torch.randn(7, device="cuda").half(), torch.randn(1 << 22, device="cuda").half()
    want = {id(small): kernels.grad_norm(small).clone(), id(big): kernels.grad_norm(big).clone()}
    got = [(x, kernels.grad_norm(x)) for _ in range(5) for x in (small, big)]
    sides = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in sides:
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            got += [(x, kernels.grad_norm(x)) for _ in range(5) for x in (big, small)]
    torch.cuda.synchronize()
    for x, norm in got:
        assert torch.equal(_bits(norm), _bits(want[id(x)]))
    for _partials, arrived in cuda._NORM_SCRATCH.values():
        assert int(arrived.item()) == 0


@cupy_kernels
@pytest.mark.parametrize("bad, check", [(float("inf"), torch.isinf), (float("nan"), torch.isnan)])
def test_norm_kernel_propagates_non_finite(bad, check):
    x = torch.randn(10_000, device="cuda").half()
    x[1234] = bad
    assert check(kernels.grad_norm(x))


def _toy_model(device: str) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device).half()


def _solver(model: nn.Module, device: str, base_lr: float = 0.1, **solver_kw) -> MasterOptimizer:
    cfg = SolverConfig(base_lr=base_lr, **solver_kw)
    flat = FlatParams(model, state_names=rule_for(cfg).state_names, state_dtype=torch.float32)
    scaler = LossScaler(LossScaleConfig(init_scale=1024.0, growth_interval=3), "dynamic", torch.device(device))
    return MasterOptimizer(flat, cfg, scaler, grad_divisor=1,
                           multipliers=resolve_multipliers(model, cfg.param_groups, cfg.no_decay))


def _batch(device: str, seed: int, rows: int = 32) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(rows, 64, device=device, generator=gen).half()  # [rows, 64] fp16


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The toy objective: drive the outputs to zero (fp32 mean of squares)."""
    return model(x).float().square().mean()


def _backward(model: nn.Module, solver: MasterOptimizer, seed: int, device: str) -> None:
    solver.scaler.scale_loss(_loss(model, _batch(device, seed))).backward()


@contextlib.contextmanager
def _no_host_sync(device: str) -> Iterator[None]:
    """On CUDA, any host sync inside raises (torch's sync-debug mode); the CPU has no such mode."""
    if device != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


SOLVER_CASES = [
    ("plain", {}, 0.1),
    ("clip", {"clip_gradients": 1.0}, 0.1),
    ("larc", {"larc": True, "larc_policy": "clip"}, 0.1),
    ("adamw-groups", {"type": "adamw", "no_decay": ["bias"], "param_groups": [ParamGroup(match="2.*", lr_mult=2.0)]},
     1e-3),
    ("lamb", {"type": "lamb", "no_decay": ["bias"]}, 0.03),
    ("rmsprop", {"type": "rmsprop"}, 3e-4),
]
"""(id, solver settings, base_lr that trains the fp16 toy model). Adam's and RMSProp's first
step is about lr (RMSProp: 10x lr) per element, so they need far smaller rates than SGD: on
the CPU, 4 steps at lr 0.1 take the held-out loss from 0.064 to 280 (adamw) and to 5e5
(rmsprop, 3 of 4 steps skipped); at lr 0.01 RMSProp skips none but still reaches 480."""


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("solver_kw, base_lr", [c[1:] for c in SOLVER_CASES], ids=[c[0] for c in SOLVER_CASES])
def test_step_has_no_host_sync(device, solver_kw, base_lr):
    """Four steps of each rule train the fp16 toy model: no step is skipped and the loss on a
    held-out batch falls; on CUDA, no step syncs with the host."""
    torch.manual_seed(0)
    model = _toy_model(device)
    held_out = _batch(device, seed=1000, rows=256)
    with torch.no_grad():
        before = float(_loss(model, held_out))
    solver = _solver(model, device, base_lr=base_lr, **solver_kw)
    _backward(model, solver, 0, device)
    solver.step(0)  # warm-up: compiles and loads the kernels, caches device properties
    for it in range(1, 4):
        _backward(model, solver, it, device)
        with _no_host_sync(device):
            solver.step(it)
    with torch.no_grad():
        after = float(_loss(model, held_out))
    trained = f"held-out loss {before:.4g} -> {after:.4g} after 4 steps at base_lr {base_lr}"
    assert solver.scaler.stats()["skipped_steps"] == 0, trained
    assert after < before, trained


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["sgd", "adamw", "lamb"])
def test_solver_kernel_and_reference_agree_over_steps(monkeypatch, device, kind):
    """Several full steps (dynamic scaler, no clipping: the norm only feeds the overflow flag) give
    bit-identical masters, state and fp16 weights with the kernels (CuPy on CUDA, the host build
    of update.cu on the CPU) and with the references (LAMB's trust ratio comes from the same
    torch ops on both sides)."""
    kernel = "cupy" if device == "cuda" else "native"
    if kernel == "native" and native.unusable() is not None:
        pytest.skip(f"the host build of update.cu cannot be used here: {native.unusable()}")
    states = []
    for backend in (kernel, "torch"):
        monkeypatch.setenv(kernels.KERNELS_ENV, backend)
        torch.manual_seed(0)
        model = _toy_model(device)
        solver = _solver(model, device, type=kind, momentum=0.9, weight_decay=5e-4, no_decay=["bias"])
        assert kernels.kernel_backend(solver.flat.groups[0].grads) == backend
        for it in range(5):
            _backward(model, solver, it, device)
            solver.step(it)
        g = solver.flat.groups[0]
        states.append([_bits(t).clone() for t in (g.master, *g.state.values(), g.params)])
    for a, b in zip(*states, strict=True):
        assert torch.equal(a, b)


@cupy_kernels
def test_self_check_passes_on_this_gpu():
    """What a solver runs at first use: every rule, dtype, alignment, subnormals and a skip."""
    assert selfcheck.run(torch.cuda.current_device()) is None
    assert kernels.cuda_unusable(torch.cuda.current_device()) is None


@cupy_kernels
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
