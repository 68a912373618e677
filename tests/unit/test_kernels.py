"""Kernel references, dispatch, and the CUDA source checked on the CPU.

The torch reference (``kernels.spec``) is the oracle: here it is checked against a
hand-written per-element loop in numpy fp32 arithmetic. The CUDA file cannot run without a
GPU, but with ``nvcc`` on the machine (CUDA toolkit, no driver needed) it is compiled with
every template instance the run-time path asks NVRTC for, and its per-thread code
(``dpt::sgd_update_thread``, ``__host__ __device__``) runs on the host over a small
emulated grid and is compared bit-for-bit with the reference.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks.solvers import update_bandwidth
from dptrain import kernels
from dptrain.errors import ConfigError, SetupError
from dptrain.kernels import Hyper, UpdateArgs, cuda, grad_norm_reference, native, reference, selfcheck
from dptrain.kernels.spec import RULES, bias_corrections, sqrt_rn

# ----------------------------------------------------------------------------- helpers

F32 = np.float32
LR, WD = 0.9137, 0.7
"""Far larger than training values on purpose: fp32(WD*LR) != fp32(WD)*fp32(LR), and with
WD*LR near 1 the decay term dominates the step, so a kernel that rounds the decoupled decay
coefficient differently from the reference changes most elements and fails the bit-exact tests."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t``, so torch.equal tells -0.0 from +0.0 and compares NaNs."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def sgd_update_reference(grads, master, params, momentum, *, lr, momentum_coef, weight_decay, decoupled,
                         grad_coef, found_inf, lr_scale=None):
    """The reference through the old flat signature, so the cases below read as before."""
    reference(sgd_args(grads, master, params, momentum, lr=lr, momentum_coef=momentum_coef,
                       weight_decay=weight_decay, decoupled=decoupled, grad_coef=grad_coef, found_inf=found_inf,
                       lr_scale=lr_scale))


def sgd_args(grads, master, params, momentum, *, lr, momentum_coef, weight_decay, decoupled, grad_coef, found_inf,
             lr_scale=None) -> UpdateArgs:
    return UpdateArgs(rule="sgd", grads=grads, master=master, params=params, state=(momentum,), grad_coef=grad_coef,
                      found_inf=found_inf, lr_scale=lr_scale,
                      hyper=Hyper(lr=lr, momentum=momentum_coef, weight_decay=weight_decay, decoupled=decoupled))


def _to_dtype_scalar(x: np.float32, dtype: torch.dtype) -> np.float32:
    """Round one fp32 value to ``dtype`` (round to nearest even) and back to fp32."""
    return F32(torch.tensor(float(x), dtype=torch.float32).to(dtype).float().item())


def _make_case(storage: torch.dtype, mom: torch.dtype, n: int, seed: int) -> dict[str, torch.Tensor]:
    """Flat buffers whose values span many binades, with zeros, -0.0 and fp16 subnormal grads."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-30, 12, (n,), generator=gen).float())  # 2^-30 .. 2^11
    grads = (torch.randn(n, generator=gen) * mag).to(storage)  # loss-scaled, storage dtype
    grads[::17] = 0.0
    grads[5::23] = -0.0
    master = torch.randn(n, generator=gen) * 0.1
    master[3::19] = 0.0
    master[7::29] = -0.0
    momentum = (torch.randn(n, generator=gen) * 0.01).to(mom)
    return {
        "grads": grads,
        "master": master,
        "params": master.to(storage),
        "momentum": momentum,
        "lr_scale": torch.rand(n, generator=gen) * 2.0,
    }


def _run_reference(case: dict[str, torch.Tensor], *, with_scale: bool, skip: bool, **kw) -> dict[str, torch.Tensor]:
    c = {k: v.clone() for k, v in case.items()}
    params = c["master"] if c["params"].dtype == torch.float32 else c["params"]
    sgd_update_reference(
        c["grads"], c["master"], params, c["momentum"],
        found_inf=torch.tensor([1.0 if skip else 0.0]), lr_scale=c["lr_scale"] if with_scale else None, **kw,
    )
    c["params"] = params
    return c


def _hand_loop(case: dict[str, torch.Tensor], *, lr: float, momentum_coef: float, weight_decay: float,
               decoupled: bool, coef: float, with_scale: bool) -> tuple[list, list, list]:
    """The documented update, element by element, every operation rounded to fp32."""
    storage, mom = case["params"].dtype, case["momentum"].dtype
    out_w, out_h, out_p = [], [], []
    for i in range(case["grads"].numel()):
        g = F32(case["grads"][i].float().item()) * F32(coef)
        w = F32(case["master"][i].item())
        h = F32(case["momentum"][i].float().item())
        if weight_decay and not decoupled:
            g = g + F32(weight_decay) * w
        lr_e = F32(lr) * F32(case["lr_scale"][i].item()) if with_scale else F32(lr)
        if mom == torch.float32:
            h = F32(momentum_coef) * h + lr_e * g
            step = h
        else:
            h = _to_dtype_scalar(F32(momentum_coef) * h + g, torch.float16)
            step = lr_e * h
        if weight_decay and decoupled:
            # the reference multiplies the two Python floats first: fp32(wd*lr), not fp32(wd)*fp32(lr)
            step = step + (F32(weight_decay) * lr_e if with_scale else F32(weight_decay * lr)) * w
        w = w - step
        out_w.append(w)
        out_h.append(h)
        out_p.append(_to_dtype_scalar(w, storage))
    return out_w, out_h, out_p


# ----------------------------------------------------------------------------- reference semantics


@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mom", [torch.float32, torch.float16])
@pytest.mark.parametrize("decay", ["none", "l2", "decoupled"])
@pytest.mark.parametrize("with_scale", [False, True])
def test_reference_matches_hand_written_loop(storage, mom, decay, with_scale):
    case = _make_case(storage, mom, 48, seed=1)
    kw = dict(lr=LR, momentum_coef=0.9, weight_decay=0.0 if decay == "none" else WD,
              decoupled=decay == "decoupled")
    coef = 0.37 / 1024  # 1/S (S = 1024) times a clipping factor 0.37
    out = _run_reference(case, with_scale=with_scale, skip=False, grad_coef=torch.tensor([coef], dtype=torch.float32),
                         **kw)
    w, h, p = _hand_loop(case, coef=float(F32(coef)), with_scale=with_scale, **kw)
    assert torch.equal(_bits(out["master"]), _bits(torch.tensor(np.array(w, dtype=F32))))
    assert torch.equal(_bits(out["momentum"].float()), _bits(torch.tensor(np.array(h, dtype=F32))))
    assert torch.equal(_bits(out["params"].float()), _bits(torch.tensor(np.array(p, dtype=F32))))
    assert torch.equal(_bits(out["grads"]), torch.zeros_like(_bits(out["grads"])))  # +0.0 everywhere


def test_decay_constants_tell_the_two_roundings_apart():
    assert F32(WD * LR) != F32(WD) * F32(LR)


def test_reference_skip_keeps_state_bit_identical_and_zeroes_grads():
    case = _make_case(torch.float16, torch.float32, 64, seed=2)
    out = _run_reference(case, with_scale=False, skip=True, lr=0.1, momentum_coef=0.9, weight_decay=1e-4,
                         decoupled=False, grad_coef=torch.tensor([1.0]))
    for name in ("master", "params", "momentum"):
        assert torch.equal(_bits(out[name]), _bits(case[name])), name
    assert torch.count_nonzero(out["grads"]) == 0


def test_reference_clipping_enters_through_grad_coef():
    """grad_coef = clip factor: the step is the unclipped one scaled by it (momentum 0, no decay)."""
    grads = torch.tensor([3.0, 4.0, 0.0, 0.0])
    master = torch.ones(4)
    kw = dict(lr=0.5, momentum_coef=0.0, weight_decay=0.0, decoupled=False, found_inf=torch.zeros(1))
    sgd_update_reference(grads.clone(), master, master, torch.zeros(4), grad_coef=torch.tensor([0.2]), **kw)
    # norm 5 clipped to 1: g * 1/5; w = 1 - 0.5 * g/5
    assert torch.allclose(master, torch.tensor([1 - 0.3, 1 - 0.4, 1.0, 1.0]), rtol=0, atol=1e-7)


def test_the_cuda_norm_is_one_launch_and_its_scratch_is_made_once_per_stream(monkeypatch):
    """The host path of kernels.cuda.grad_norm, with the launch, the stream and the CUDA allocations
    stubbed (no GPU here): one kernel per call, the grid a function of n, the partials and counter
    made once per stream (the counter zeroed then), and never first inside a CUDA graph capture."""
    launches, made = [], []
    monkeypatch.setattr(cuda, "_launch", lambda expr, device, blocks, args, stream=None:
                        launches.append((expr, blocks, len(args), stream)))
    stream = SimpleNamespace(cuda_stream=1234)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(cuda, "_NORM_SCRATCH", {})
    real_empty, real_zeros = torch.empty, torch.zeros

    def on_cpu(make, what):
        def wrapped(*shape, dtype=None, device=None, **kw):
            if device is not None and torch.device(device).type == "cuda":
                made.append((what, shape, dtype))
                device = "cpu"
            return make(*shape, dtype=dtype, device=device, **kw)
        return wrapped
    monkeypatch.setattr(torch, "empty", on_cpu(real_empty, "empty"))
    monkeypatch.setattr(torch, "zeros", on_cpu(real_zeros, "zeros"))
    grads = torch.zeros(10_000, dtype=torch.float16)
    for _ in range(3):
        assert cuda.grad_norm(grads).shape == ()
    stream.cuda_stream = 5678
    cuda.grad_norm(torch.zeros(10**7, dtype=torch.float32))
    assert launches == [("dptrain_norm<__half, 8>", 5, 5, 1234)] * 3 + [("dptrain_norm<float, 4>", 1024, 5, 5678)]
    scratch = [("empty", (cuda.NORM_MAX_BLOCKS,), torch.float32), ("zeros", (1,), torch.int32)]
    assert made == scratch * 2  # once per stream, whatever the calls
    assert set(cuda._NORM_SCRATCH) == {(None, 1234), (None, 5678)}
    stream.cuda_stream = 9
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"first call on this stream inside a CUDA graph capture; call it once"):
        cuda.grad_norm(grads)


def test_grad_norm_reference_propagates_non_finite():
    g = torch.tensor([3.0, 4.0], dtype=torch.float16)
    assert grad_norm_reference(g).item() == 5.0
    assert grad_norm_reference(g).dtype == torch.float32
    assert torch.isinf(grad_norm_reference(torch.tensor([1.0, float("inf")], dtype=torch.float16)))
    assert torch.isnan(grad_norm_reference(torch.tensor([float("inf"), float("nan")], dtype=torch.float16)))


def _numpy_update(a: UpdateArgs) -> tuple[np.ndarray, list[np.ndarray]]:
    """The spec docstrings' formulas for every rule, in numpy fp32 (each op rounded to fp32; np.sqrt
    is correctly rounded), fp32 state: the new master and state."""
    s = RULES[a.rule].scalars(a.hyper)

    def f(t: torch.Tensor) -> np.ndarray:
        return t.float().numpy().copy()

    g, w, st = f(a.grads) * F32(a.grad_coef.item()), f(a.master), [f(t) for t in a.state]
    lr_e = F32(s.lr) * f(a.lr_scale) if a.lr_scale is not None else F32(s.lr)
    wd = F32(s.weight_decay)
    l2 = wd * f(a.decay_scale) if a.decay_scale is not None else wd
    dec = F32(s.wd_lr) if a.lr_scale is None else wd * lr_e
    dec = dec * f(a.decay_scale) if a.decay_scale is not None else dec
    bc1, bc2 = (f(a.bias_correction) if a.bias_correction is not None else np.ones(2, dtype=F32))
    if s.decay_mode == 1:
        g = g + l2 * w
    if a.rule in ("sgd", "nesterov"):
        m, h0 = F32(s.momentum), st[0]
        h = m * h0 + lr_e * g
        step, st = ((F32(1) + m) * h - m * h0 if a.rule == "nesterov" else h), [h]
    elif a.rule in ("adam", "lamb"):
        m = F32(s.beta1) * st[0] + F32(s.one_minus_beta1) * g
        v = F32(s.beta2) * st[1] + F32(s.one_minus_beta2) * (g * g)
        u, st = (m / bc1) / (np.sqrt(v) / bc2 + F32(s.eps)), [m, v]
        if a.rule == "lamb" and s.decay_mode == 2:
            u = u + l2 * w
        step = lr_e * u
    else:
        v = F32(s.rms_decay) * st[0] + F32(s.one_minus_rms_decay) * (g * g)
        b = F32(s.momentum) * st[1] + g / (np.sqrt(v) + F32(s.eps))
        step, st = lr_e * b, [v, b]
    if s.decay_mode == 2 and a.rule != "lamb":
        step = step + dec * w
    return w - step, st


@pytest.mark.parametrize("rule", ["nesterov", "adam", "lamb", "rmsprop"])
@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("decay", ["none", "l2", "decoupled"])
@pytest.mark.parametrize("tables", [False, True])
def test_new_rules_reference_matches_their_documented_formulas(rule, storage, decay, tables):
    a = _rule_args(rule, storage, torch.float32, 96, seed=6, decay=decay, tables=tables)
    want_w, want_state = _numpy_update(a)
    got = _copy(a)
    reference(got)
    assert torch.equal(_bits(got.master), _bits(torch.from_numpy(want_w)))
    for t, w in zip(got.state, want_state, strict=True):
        assert torch.equal(_bits(t), _bits(torch.from_numpy(w)))
    assert torch.equal(got.params, got.master.to(storage)) and torch.count_nonzero(got.grads) == 0


def test_bias_corrections_are_adams_rounded_once_and_start_at_step_one():
    bc = bias_corrections(torch.tensor([5]), 0.9, 0.999)
    assert bc.dtype == torch.float32 and bc.tolist() == [F32(1 - 0.9**5), F32((1 - 0.999**5) ** 0.5)]
    assert torch.equal(bias_corrections(torch.tensor([0]), 0.9, 0.999),
                       bias_corrections(torch.tensor([1]), 0.9, 0.999))


def test_the_reference_square_root_is_correctly_rounded():
    """torch's vectorised CPU sqrt is not (the kernels' sqrtf is): the spec takes it in float64."""
    x = torch.rand(4096, generator=torch.Generator().manual_seed(7)) * 0.01
    want = torch.from_numpy(np.sqrt(x.numpy().astype(np.float64)).astype(F32))
    assert torch.equal(sqrt_rn(x), want)


# ----------------------------------------------------------------------------- dispatch


def test_bad_backend_env_is_rejected(monkeypatch):
    monkeypatch.setenv(kernels.KERNELS_ENV, "triton")
    with pytest.raises(ConfigError, match="DPTRAIN_KERNELS='triton' is not one of"):
        kernels.kernel_backend(torch.zeros(1))


def test_forced_cupy_without_cupy_is_an_error(monkeypatch):
    monkeypatch.setattr(cuda, "cupy_module", lambda: None)
    kernels.cuda_unusable.cache_clear()
    on_cuda = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))  # a CUDA tensor on this CPU machine
    monkeypatch.setenv(kernels.KERNELS_ENV, "cupy")
    with pytest.raises(SetupError, match="DPTRAIN_KERNELS=cupy but the CuPy update kernels cannot run on cuda:0: "
                                         "CuPy is not importable"):
        kernels.kernel_backend(on_cuda)
    monkeypatch.setenv(kernels.KERNELS_ENV, "auto")
    assert kernels.kernel_backend(on_cuda) == "torch"  # auto falls back to the reference
    kernels.cuda_unusable.cache_clear()


def test_kernel_wrappers_reject_bad_layouts():
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="master must be a contiguous 1-D tensor of 8 elements"):
        cuda.check_flat("master", torch.zeros(2, 4), 8, (torch.float32,), cpu)
    with pytest.raises(RuntimeError, match="master must be a contiguous 1-D tensor"):
        cuda.check_flat("master", torch.zeros(16)[::2], 8, (torch.float32,), cpu)
    with pytest.raises(RuntimeError, match="momentum has dtype torch.float64"):
        cuda.check_flat("momentum", torch.zeros(8, dtype=torch.float64), 8, RULES["sgd"].state_dtypes, cpu)
    with pytest.raises(RuntimeError, match="found_inf must be one fp32 element"):
        cuda.check_scalar("found_inf", torch.zeros(1, dtype=torch.float16), cpu)
    cuda.check_scalar("grad_coef", torch.tensor(0.5), cpu)  # 0-dim is fine too


def test_vector_width_is_16_bytes_of_storage_where_every_pointer_allows_it():
    buf = torch.zeros(64)  # allocator alignment: far more than 32 bytes
    assert cuda.vector_elems(torch.float32) == 4 and cuda.vector_elems(torch.float16) == 8
    assert cuda.vector_elems(torch.bfloat16) == 8
    assert cuda.vector_width([buf, buf.half()], torch.float16) == 8  # fp32 master: a pack of 8 is 32 bytes
    assert cuda.vector_width([buf[8:], buf.half()[8:]], torch.float16) == 8
    assert cuda.vector_width([buf[4:], buf.half()[4:]], torch.float16) == 1  # 16-byte aligned, not 8 elements
    assert cuda.vector_width([buf[4:], buf[8:]], torch.float32) == 4
    assert cuda.vector_width([buf, buf[1:]], torch.float32) == 1


def test_the_self_check_runs_its_misaligned_cases_on_misaligned_copies():
    """selfcheck.compare runs the kernel on copies of each case: those of a case at offset 1 are
    misaligned in every stream the kernel writes (the V=1 kernel runs on them, as the case means),
    those at offset 0 allow 16-byte packs. ``clone`` would align every copy."""
    offsets = set()
    for label, args in selfcheck.cases(torch.device("cpu")):
        copy = selfcheck._clone(args)
        offset = args.grads.storage_offset()
        want = 1 if offset else cuda.vector_elems(args.grads.dtype)
        written = [copy.grads, copy.master, copy.params, *copy.state]
        assert {cuda.vector_width([t], args.grads.dtype) for t in written} == {want}, label
        assert all(c.storage_offset() == a.storage_offset() for c, a in
                   zip(written, [args.grads, args.master, args.params, *args.state], strict=True)), label
        offsets.add(offset)
    assert offsets == {0, 1}


def test_dispatchers_forced_to_torch_equal_the_references(monkeypatch):
    # auto on CPU takes the host library (test_native_update.py); "torch" is the oracle
    monkeypatch.setenv(kernels.KERNELS_ENV, "torch")
    case = _make_case(torch.float16, torch.float16, 128, seed=3)
    kw = dict(lr=0.05, momentum_coef=0.9, weight_decay=5e-4, decoupled=True, grad_coef=torch.tensor([2.0**-10]),
              found_inf=torch.zeros(1))
    a = {k: v.clone() for k, v in case.items()}
    b = {k: v.clone() for k, v in case.items()}
    kernels.update(sgd_args(a["grads"], a["master"], a["params"], a["momentum"], lr_scale=a["lr_scale"], **kw))
    sgd_update_reference(b["grads"], b["master"], b["params"], b["momentum"], lr_scale=b["lr_scale"], **kw)
    for name in ("grads", "master", "params", "momentum"):
        assert torch.equal(_bits(a[name]), _bits(b[name])), name
    assert torch.equal(kernels.grad_norm(case["grads"]), grad_norm_reference(case["grads"]))


def test_package_imports_without_cupy():
    """The kernels package must not import CuPy at import time (CPU machines have none)."""
    code = "import sys, dptrain.kernels, dptrain.optimizer; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cuda_source_exists_with_every_name_expression():
    src = cuda.SOURCE.read_text()
    for name in (*(f"dptrain_{r}_update" for r in RULES), "dptrain_norm"):
        assert f"{name}(" in src
    assert "#include <cuda_fp16.h>" in src and "#include <cuda_bf16.h>" in src
    for rule in RULES.values():
        mine = [n for n in cuda.name_expressions() if n.startswith(f"dptrain_{rule.name}_update<")]
        assert len(mine) == 3 * len(rule.state_dtypes) * 2  # storage x state dtype x vector width
    assert "--fmad=false" in cuda.NVRTC_OPTIONS and "--ftz=false" in cuda.NVRTC_OPTIONS


# ----------------------------------------------------------------------------- bandwidth benchmark


def test_bandwidth_peak_table_and_bytes():
    assert update_bandwidth.peak_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3.35e12  # SXM
    assert update_bandwidth.peak_bandwidth("NVIDIA H100 PCIe")[0] == 2.0e12
    assert update_bandwidth.peak_bandwidth("NVIDIA H200")[0] == 4.8e12
    assert update_bandwidth.peak_bandwidth("NVIDIA A100-SXM4-80GB")[0] == 2.039e12
    assert update_bandwidth.peak_bandwidth("NVIDIA A100-SXM4-40GB")[0] == 1.555e12
    assert update_bandwidth.peak_bandwidth("Some Future GPU") is None
    # fp16 storage: read g 2 + master 4 + momentum 4; write master 4 + momentum 4 + params 2 + g 2
    assert update_bandwidth.update_bytes_per_elem(torch.float16, torch.float32, larc=False) == 22
    # fp32 storage: the weights are the masters, written once
    assert update_bandwidth.update_bytes_per_elem(torch.float32, torch.float32, larc=False) == 24
    assert update_bandwidth.update_bytes_per_elem(torch.float16, torch.float16, larc=True) == 22


def test_bandwidth_benchmark_on_cpu_reports_the_host_kernel_the_fallback_and_the_reference(capsys):
    record = update_bandwidth.main(["--numel", "4096", "--iters", "1", "--repeats", "1", "--warmup", "0",
                                   "--device", "cpu"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == json.loads(json.dumps(record))
    sides = ("inplace", "reference") if native._compiler() is None else ("kernel", "inplace", "reference")
    for side in sides:  # the host kernel only where a C++ compiler builds it
        assert line[side]["update_ms"] > 0 and line[side]["norm_ms"] > 0, side
    assert (line["kernel_speedup"] is None) == (line["kernel"] is None)
    assert line["numel"] == 4096 and line["update_bytes_per_elem"] == 22
    # the yardstick: a copy moving each pass's bytes, in the same run; fractions by wall time on the CPU
    assert line["copy"]["update_bytes"] == 4096 * 22 and line["copy"]["norm_bytes"] == 4096 * 2
    assert line["copy"]["update_ms"] > 0 and line["copy"]["norm_ms"] > 0
    for side in sides:
        assert line[side]["update_fraction_of_copy"] > 0 and line[side]["norm_fraction_of_copy"] > 0, side
        assert "update_kernel_ms" not in line[side], side  # CUDA events only on CUDA
    # the norm only reads: a read-only yardstick of its bytes too, and the caveat stated in the record
    assert line["read"]["norm_bytes"] == 4096 * 2 and line["read"]["norm_ms"] > 0 and "update_ms" not in line["read"]
    for side in sides:
        assert line[side]["norm_fraction_of_read"] > 0 and "update_fraction_of_read" not in line[side], side
    assert "read-only stream beats a copy" in line["yardsticks"]
    assert line["timing"]["fraction_of_copy_from"] == "wall time" and line["goals_met"] is None
    assert line["buffers_rotated"] == {"update": 16, "norm": 16}  # tiny buffers: the most copies
    assert line["goals"] == {"update_fraction_of_copy": 0.9, "norm_fraction_of_copy": 0.75}


def test_bandwidth_passes_rotate_over_copies_that_span_more_than_the_l2():
    copies = update_bandwidth.copies_for
    mb = 2**20
    assert copies(25_557_032 * 2, 256 * mb) == 6  # the ResNet-50 norm's 51 MB: 6 copies, 307 MB
    assert copies(25_557_032 * 22, 256 * mb) == 1  # the update's 562 MB already spans it
    assert copies(4096, 256 * mb) == 16 and copies(51 * mb, 0) == 1


def test_bandwidth_fractions_come_from_kernel_time_where_there_is_one():
    timing = update_bandwidth.Timing
    gb = 10**9
    copy = timing(nbytes=gb, wall_ms=2000.0, kernel_ms=1000.0, dispatch_hidden=True)  # 1 GB/s by kernel time
    # host-bound: 4 s per call by wall clock, 1.25 s of kernel time: 0.8 of the copy, and of a 1 GB/s peak
    norm = timing(nbytes=gb, wall_ms=4000.0, kernel_ms=1250.0, dispatch_hidden=True)
    assert norm.figures("norm", 1e9, copy) == {
        "norm_ms": 4000.0, "norm_gb_per_s": 0.25, "norm_kernel_ms": 1250.0, "norm_kernel_gb_per_s": 0.8,
        "norm_dispatch_hidden": True, "norm_wall_over_kernel": 3.2, "norm_fraction_of_peak": 0.8,
        "norm_fraction_of_copy": 0.8}
    # a read-only pass of the same bytes at 1.6 GB/s (faster than the copy): the norm is half of it
    read = timing(nbytes=gb, wall_ms=1000.0, kernel_ms=625.0, dispatch_hidden=True)
    assert norm.figures("norm", 1e9, copy, read)["norm_fraction_of_read"] == 0.5
    # on the CPU: wall time against the copy's wall time, no kernel fields
    cpu_copy = timing(nbytes=gb, wall_ms=2000.0, kernel_ms=None, dispatch_hidden=None)
    on_cpu = timing(nbytes=gb, wall_ms=4000.0, kernel_ms=None, dispatch_hidden=None).figures("norm", None, cpu_copy)
    assert on_cpu == {"norm_ms": 4000.0, "norm_gb_per_s": 0.25, "norm_fraction_of_peak": None,
                      "norm_fraction_of_copy": 0.5}


# ----------------------------------------------------------------------------- CUDA source on the host

NVCC = shutil.which("nvcc")
_CODES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_KERNEL_RULES = {"sgd": "dpt::MomentumRule<false>", "nesterov": "dpt::MomentumRule<true>", "adam": "dpt::AdamRule",
                 "lamb": "dpt::LambRule", "rmsprop": "dpt::RmspropRule"}
"""Each rule's functor in update.cu, which the harness runs through dpt::update_thread."""
_HARNESS = r"""
#include "update.cu"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

// Every template instance kernels.py hands NVRTC as a name expression; taking the address forces
// nvcc to compile the device code of each, as NVRTC will.
@KERNEL_ADDRESSES@

template <typename X> static void read_into(const std::string& path, X* p, long long n) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f || std::fread(p, sizeof(X), n, f) != static_cast<size_t>(n)) {
    std::fprintf(stderr, "cannot read %lld values from %s\n", n, path.c_str());
    std::exit(2);
  }
  std::fclose(f);
}
template <typename X> static X* load(const std::string& path, long long n) {
  X* p = static_cast<X*>(std::aligned_alloc(64, ((n * sizeof(X) + 63) / 64) * 64));  // 64 B aligned, as cudaMalloc
  read_into(path, p, n);
  return p;
}
template <typename X> static void save(const std::string& path, const X* p, long long n) {
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(p, sizeof(X), n, f);
  std::fclose(f);
}

// Every rule's scalars struct is its fp32 floats followed by one int (decay_mode), as spec.py's
// NamedTuples are; the floats arrive in that order.
template <typename S, size_t... I> static S make_scalars(const float* f, int mode, std::index_sequence<I...>) {
  return S{f[I]..., mode};
}

// Runs threads 0..nthreads-1 of the grid one after another, as the kernel would in parallel.
template <typename R, typename T, typename M, int V> static void run(const std::string& d) {
  using S = typename R::Scalars;
  constexpr size_t kFloats = sizeof(S) / sizeof(float) - 1;
  static_assert(sizeof(S) == (kFloats + 1) * sizeof(float), "scalars are floats then one int");
  // n, nthreads, decay_mode, has_lr_scale, has_decay_scale, has_bias_correction, params_is_master, states
  long long ints[8];
  float fl[kFloats];
  read_into(d + "/ints", ints, 8);
  read_into(d + "/floats", fl, kFloats);
  const long long n = ints[0];
  dpt::Args<T, M> a;
  a.grads = load<T>(d + "/grads", n);
  a.master = load<float>(d + "/master", n);
  a.params = ints[6] ? nullptr : load<T>(d + "/params", n);
  for (int j = 0; j < dpt::kMaxStates; ++j) a.state[j] = j < ints[7] ? load<M>(d + "/state" + std::to_string(j), n) : nullptr;
  a.lr_scale = ints[3] ? load<float>(d + "/lr_scale", n) : nullptr;
  a.decay_scale = ints[4] ? load<float>(d + "/decay_scale", n) : nullptr;
  a.bias_correction = ints[5] ? load<float>(d + "/bias_correction", 2) : nullptr;
  a.grad_coef = load<float>(d + "/grad_coef", 1);
  a.found_inf = load<float>(d + "/found_inf", 1);
  a.n = n;
  const S c = make_scalars<S>(fl, static_cast<int>(ints[2]), std::make_index_sequence<kFloats>{});
  for (long long t = 0; t < ints[1]; ++t) dpt::update_thread<R, T, M, V>(a, c, t, ints[1]);
  save(d + "/grads.out", a.grads, n);
  save(d + "/master.out", a.master, n);
  if (a.params) save(d + "/params.out", a.params, n);
  for (int j = 0; j < ints[7]; ++j) save(d + "/state" + std::to_string(j) + ".out", a.state[j], n);
}

// The norm's per-thread part (dpt::sumsq_thread): each emulated thread's partial sum to sumsq.out.
template <typename T, int V> static void run_sumsq(const std::string& d) {
  long long ints[2];  // n, nthreads
  read_into(d + "/ints", ints, 2);
  const T* x = load<T>(d + "/x", ints[0]);
  float* out = static_cast<float*>(std::malloc(ints[1] * sizeof(float)));
  for (long long t = 0; t < ints[1]; ++t) out[t] = dpt::sumsq_thread<T, V>(x, ints[0], t, ints[1]);
  save(d + "/sumsq.out", out, ints[1]);
}
template <typename T> static void run_sumsq_vec(int vec, const std::string& d) {
  if (vec == 8) run_sumsq<T, 8>(d); else if (vec == 4) run_sumsq<T, 4>(d); else run_sumsq<T, 1>(d);
}

template <typename R, typename T, typename M> static void run_vec(int vec, const std::string& d) {
  if (vec == 8) run<R, T, M, 8>(d); else if (vec == 4) run<R, T, M, 4>(d); else run<R, T, M, 1>(d);
}
template <typename R, typename T> static void run_state(const std::string& state, int vec, const std::string& d) {
  if constexpr (R::kStates == 1) {  // the momentum rules also take an fp16 history
    if (state == "f16") return run_vec<R, T, __half>(vec, d);
  }
  run_vec<R, T, float>(vec, d);
}
template <typename R> static void run_storage(const std::string& storage, const std::string& state, int vec,
                                              const std::string& d) {
  if (storage == "f32") run_state<R, float>(state, vec, d);
  else if (storage == "f16") run_state<R, __half>(state, vec, d);
  else run_state<R, __nv_bfloat16>(state, vec, d);
}
int main(int argc, char** argv) {
  if (argc != 6) return 2;
  const std::string rule = argv[1], storage = argv[2], state = argv[3], d = argv[5];
  const int vec = std::atoi(argv[4]);
  if (rule == "sumsq") {
    if (storage == "f32") run_sumsq_vec<float>(vec, d);
    else if (storage == "f16") run_sumsq_vec<__half>(vec, d);
    else run_sumsq_vec<__nv_bfloat16>(vec, d);
    return 0;
  }
@RULE_DISPATCH@
  return 2;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    """Compile update.cu with every NVRTC name expression plus the host harness (about 10 s)."""
    if NVCC is None:
        pytest.skip("nvcc (CUDA toolkit) not on PATH: cannot compile dptrain/csrc/update.cu on this machine")
    assert set(_KERNEL_RULES) == set(RULES), "every rule needs its functor named in _KERNEL_RULES"
    d = tmp_path_factory.mktemp("cuda")
    names = cuda.name_expressions()
    addresses = "\n".join(f"void* const kernel_address_{i} = (void*)&{n};" for i, n in enumerate(names))
    dispatch = "\n".join(f'  if (rule == "{r}") {{ run_storage<{f}>(storage, state, vec, d); return 0; }}'
                         for r, f in _KERNEL_RULES.items())
    source = _HARNESS.replace("@KERNEL_ADDRESSES@", addresses).replace("@RULE_DISPATCH@", dispatch)
    (d / "harness.cu").write_text(source)
    opts = [o for o in cuda.NVRTC_OPTIONS if o != "--std=c++17"]
    cmd = [NVCC, "-std=c++17", *opts, "-arch=sm_80", "-diag-suppress=177", "-Xcompiler", "-ffp-contract=off",
           f"-I{cuda.SOURCE.parent}", str(d / "harness.cu"), "-o", str(d / "harness")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"nvcc failed:\n{res.stderr[-4000:]}"
    return d / "harness"


def _raw_dtype(dtype: torch.dtype) -> np.dtype:
    return _bits(torch.zeros(1, dtype=dtype)).numpy().dtype  # int16 or int32


@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16, torch.float32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("n, nthreads", [(203, 7), (4099, 16), (96, 3), (5, 8)])
def test_norm_thread_code_visits_every_element_once_in_a_fixed_order(harness, tmp_path, storage, n, nthreads):
    """The norm's unrolled per-thread loop on the host: small integers square and sum exactly in fp32, so
    the emulated threads' partials must add up to the exact sum of squares (an element missed or
    visited twice would show), at the 16-byte pack width and at 1; and the same input gives the same bits."""
    x = torch.randint(0, 4, (n,), generator=torch.Generator().manual_seed(n)).to(storage)
    exact = float((x.double() ** 2).sum())
    for vec in (cuda.vector_elems(storage), 1):
        runs = []
        for rep in range(2):
            work = tmp_path / f"v{vec}r{rep}"
            work.mkdir()
            np.array([n, nthreads], dtype=np.int64).tofile(work / "ints")
            _bits(x).numpy().tofile(work / "x")
            subprocess.run([str(harness), "sumsq", _CODES[storage], "f32", str(vec), str(work)], check=True)
            runs.append(np.fromfile(work / "sumsq.out", dtype=np.float32))
        assert len(runs[0]) == nthreads and float(runs[0].astype(np.float64).sum()) == exact, (vec, runs[0])
        assert np.array_equal(runs[0].view(np.int32), runs[1].view(np.int32))


def _emulate(harness: Path, work: Path, a: UpdateArgs, *, vec: int, nthreads: int) -> dict[str, torch.Tensor]:
    """Run the kernel's per-thread code for ``a`` on the host (on copies); scalars rounded exactly as
    kernels.cuda rounds them. Returns grads, master, params and state0.. as the kernel left them."""
    work.mkdir()
    rule = RULES[a.rule]
    storage, state_dtype = a.grads.dtype, a.state[0].dtype
    params_is_master = a.params is a.master
    n = a.numel
    *floats, decay_mode = cuda.kernel_scalars(rule.scalars(a.hyper))
    flags = [a.lr_scale is not None, a.decay_scale is not None, a.bias_correction is not None]
    np.array([n, nthreads, decay_mode, *flags, params_is_master, len(a.state)], dtype=np.int64).tofile(work / "ints")
    np.array(floats, dtype=np.float32).tofile(work / "floats")
    raw = {"grads": a.grads, "master": a.master, "params": a.params, "lr_scale": a.lr_scale,
           "decay_scale": a.decay_scale, "bias_correction": a.bias_correction, "grad_coef": a.grad_coef,
           "found_inf": a.found_inf, **{f"state{j}": t for j, t in enumerate(a.state)}}
    for name, t in raw.items():
        if t is not None:
            _bits(t.contiguous()).numpy().tofile(work / name)
    subprocess.run([str(harness), a.rule, _CODES[storage], _CODES[state_dtype], str(vec), str(work)], check=True)
    out = {}
    dtypes = {"grads": storage, "master": torch.float32, "params": storage,
              **{f"state{j}": state_dtype for j in range(len(a.state))}}
    for name, dtype in dtypes.items():
        if name == "params" and params_is_master:
            out[name] = out["master"]
            continue
        out[name] = torch.from_numpy(np.fromfile(work / f"{name}.out", dtype=_raw_dtype(dtype))).view(dtype)
    return out


def _rule_args(rule: str, storage: torch.dtype, state_dtype: torch.dtype, n: int, seed: int, *, decay: str,
               tables: bool, skip: bool = False) -> UpdateArgs:
    """Arguments for any rule over the values of _make_case (non-negative state: Adam's and RMSProp's
    second moments are); lr_scale in [0, 2), decay_scale in {0, 1, 2} (no_decay, plain, doubled)."""
    case = _make_case(storage, state_dtype, n, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    state = tuple((torch.randn(n, generator=gen).abs() * 0.01).to(state_dtype) for _ in RULES[rule].state_names)
    master = case["master"]
    return UpdateArgs(
        rule=rule, grads=case["grads"], master=master, params=master if storage == torch.float32 else case["params"],
        state=state, grad_coef=torch.tensor([0.37 / 4096]), found_inf=torch.tensor([1.0 if skip else 0.0]),
        hyper=Hyper(lr=LR, momentum=0.9, weight_decay=0.0 if decay == "none" else WD, decoupled=decay == "decoupled",
                    beta1=0.9, beta2=0.999, eps=1e-8, rms_decay=0.99),
        lr_scale=case["lr_scale"] if tables else None,
        decay_scale=(torch.rand(n, generator=gen) * 2).round() if tables else None,
        bias_correction=torch.tensor([1 - 0.9**3, (1 - 0.999**3) ** 0.5]) if RULES[rule].bias_correction else None,
    )


def _copy(a: UpdateArgs) -> UpdateArgs:
    master = a.master.clone()
    return replace(a, grads=a.grads.clone(), master=master, params=master if a.params is a.master else a.params.clone(),
                   state=tuple(t.clone() for t in a.state))


RULE_CASES = [(r, s, m) for r in RULES for s in (torch.float16, torch.bfloat16, torch.float32)
              for m in RULES[r].state_dtypes]


@pytest.mark.parametrize("rule,storage,state_dtype", RULE_CASES,
                         ids=[f"{r}-{_CODES[s]}-{_CODES[m]}" for r, s, m in RULE_CASES])
@pytest.mark.parametrize("decay", ["none", "l2", "decoupled"])
def test_cuda_thread_code_matches_reference_bit_exactly(harness, tmp_path, rule, storage, state_dtype, decay):
    """n = 203 is not a multiple of 4 or 8 (tail path) and 7 emulated threads wrap the grid-stride loop;
    with and without the lr/decay tables, on both vector widths (16 bytes of storage, and 1)."""
    for vec in (cuda.vector_elems(storage), 1):
        for tables in (False, True):
            a = _rule_args(rule, storage, state_dtype, 203, seed=4, decay=decay, tables=tables)
            got = _emulate(harness, tmp_path / f"v{vec}t{int(tables)}", a, vec=vec, nthreads=7)
            want = _copy(a)
            reference(want)
            expect = {"grads": want.grads, "master": want.master, "params": want.params,
                      **{f"state{j}": t for j, t in enumerate(want.state)}}
            for name, t in expect.items():
                assert torch.equal(_bits(got[name]), _bits(t)), f"{name} vec={vec} tables={tables}"


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16])
def test_cuda_thread_code_skip_writes_only_zeroed_grads(harness, tmp_path, rule, storage):
    a = _rule_args(rule, storage, torch.float32, 203, seed=5, decay="l2", tables=True, skip=True)
    got = _emulate(harness, tmp_path / "skip", a, vec=4, nthreads=5)
    assert torch.equal(_bits(got["master"]), _bits(a.master)) and torch.equal(_bits(got["params"]), _bits(a.params))
    for j, t in enumerate(a.state):
        assert torch.equal(_bits(got[f"state{j}"]), _bits(t)), j
    assert torch.equal(_bits(got["grads"]), torch.zeros(203, dtype=torch.int16))


def test_the_self_check_covers_autocast_modes_fp32_gradients_on_fp32_masters():
    """precision.mode = "autocast" updates fp32 weights, which are the masters, from fp32 gradients:
    the self-check runs that combination for every rule, aligned and misaligned."""
    from dptrain.kernels import selfcheck

    seen = {(a.rule, a.master.data_ptr() % 16 == 0) for _, a in selfcheck.cases(torch.device("cpu"))
            if a.grads.dtype == torch.float32 and a.params is a.master}
    assert {rule for rule, _ in seen} == set(RULES) and {aligned for _, aligned in seen} == {True, False}
