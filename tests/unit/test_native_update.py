"""The CPU update library (dptrain/csrc/update_cpu.cc: update.cu's rules built for the host)
against the torch reference, bit for bit, and its build, dispatch and fallback."""
from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from dptrain import kernels
from dptrain.csrc import build as native_build
from dptrain.errors import SetupError
from dptrain.kernels import Hyper, UpdateArgs, native, reference, selfcheck
from dptrain.kernels.spec import RULES

_bits, _clone = selfcheck._bits, selfcheck._clone  # raw bits (tell -0.0 from +0.0), copies of an update's buffers
NO_CXX_REASON = "no C++ compiler (c++/g++ or $CXX): the host library cannot be built"

NO_CXX = native._compiler() is None
needs_cxx = pytest.mark.skipif(NO_CXX, reason=NO_CXX_REASON)


@pytest.fixture(scope="module")
def tuned():
    """The library as solvers build it (tuned for this CPU: on x86-64 with F16C, hardware fp16 conversions)."""
    if NO_CXX:
        pytest.skip(NO_CXX_REASON)
    return native.load(native.build())


@pytest.fixture(scope="module")
def generic(tmp_path_factory):
    """Built without -march, and on x86-64 without F16C: fp16 converts in host_half.h's integer code."""
    if NO_CXX:
        pytest.skip(NO_CXX_REASON)
    no_f16c = ("-mno-f16c",) if native.TUNE_FLAGS else ()
    return native.load(native_build.build_library(
        name="update_cpu", main=native.SOURCE, sources=native.SOURCES, command=native._compiler(),
        flags=(*native.CXXFLAGS, native.rules_macro(), *no_f16c), directory=tmp_path_factory.mktemp("generic")))


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def fresh(monkeypatch, shared_cache):
    """A process that has not yet decided whether it can use the library (the library itself is
    built once for these tests, in a cache of their own)."""
    monkeypatch.setenv("DPTRAIN_CACHE", str(shared_cache))
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    native.reset()
    kernels._warn_native_fallback.cache_clear()
    yield
    native.reset()
    kernels._warn_native_fallback.cache_clear()


def _assert_same_bits(got: UpdateArgs, want: UpdateArgs, label: str) -> None:
    for name in ("grads", "master", "params"):
        assert torch.equal(_bits(getattr(got, name)), _bits(getattr(want, name))), f"{label}: {name}"
    for i, (g, w) in enumerate(zip(got.state, want.state, strict=True)):
        assert torch.equal(_bits(g), _bits(w)), f"{label}: state {i}"


@pytest.mark.parametrize("build", ["tuned", "generic"])
def test_every_selfcheck_case_matches_the_reference_bit_exactly(build, request):
    """Every rule x storage x state dtype, aligned and misaligned starts, l2 and decoupled decay,
    lr/decay tables, bias corrections, fp32 subnormals, and a skipped step."""
    lib = request.getfixturevalue(build)
    count = 0
    for label, args in selfcheck.cases(torch.device("cpu")):
        want, got = _clone(args), _clone(args)
        reference(want)
        native.update(got, lib=lib)
        _assert_same_bits(got, want, label)
        count += 1
    assert count == sum(3 * len(r.state_dtypes) * len(selfcheck.VARIANTS) for r in RULES.values())
    assert native.self_check(lib) is None


def _specials() -> torch.Tensor:
    """fp32 values around every rounding boundary of fp16 and bf16, plus random bit patterns."""
    f16_edges = [65504.0, 65519.996, 65520.0, 65536.0, 2.0**-14, 2.0**-24, 2.0**-25, 2.0**-26, 1.5 * 2.0**-25, 3e-39]
    exact = torch.tensor([0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan"), 3.4028235e38, 1e-45, *f16_edges])
    near = torch.cat([exact, torch.nextafter(exact, torch.full_like(exact, float("inf"))),
                      torch.nextafter(exact, torch.full_like(exact, float("-inf")))])
    ints = np.random.default_rng(7).integers(0, 2**32, size=1 << 16, dtype=np.uint64).astype(np.uint32)
    # ties of both formats: a kept bit, then exactly half an ulp of fp16 (bit 12) or bf16 (bit 15)
    ties = np.concatenate([(ints & ~np.uint32(0x1FFF)) | np.uint32(0x1000),
                           (ints & ~np.uint32(0xFFFF)) | np.uint32(0x8000)])
    patterns = torch.from_numpy(np.concatenate([ints, ties]).view(np.int32)).view(torch.float32)
    values = torch.cat([near, -near, patterns])
    # one NaN (exact[5]), of which only NaN-ness is compared: payloads may differ between conversions
    return values[~torch.isnan(values) | (torch.arange(values.numel()) == 5)]


@pytest.mark.parametrize("build", ["tuned", "generic"])
@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16])
def test_the_weight_write_back_rounds_as_torch_does(build, storage, request):
    """With lr, momentum and decay 0 the new master is the old one, so the weights are the
    master converted to the storage dtype: compared with torch's conversion over boundaries,
    ties, subnormals, infinities and random bit patterns."""
    lib = request.getfixturevalue(build)
    master = _specials()
    n = master.numel()
    a = UpdateArgs(rule="sgd", grads=torch.zeros(n, dtype=storage), master=master.clone(),
                   params=torch.zeros(n, dtype=storage), state=(torch.zeros(n),), grad_coef=torch.ones(1),
                   found_inf=torch.zeros(1), hyper=Hyper(lr=0.0, momentum=0.0))
    native.update(a, lib=lib)
    assert torch.equal(_bits(a.master), _bits(master))
    want = master.to(storage)
    nan = torch.isnan(master)
    assert torch.equal(_bits(a.params)[~nan], _bits(want)[~nan])
    assert torch.isnan(a.params[nan]).all()


def test_threads_split_the_update_without_changing_a_bit(tuned, monkeypatch):
    args = next(a for label, a in selfcheck.cases(torch.device("cpu")) if "adam storage bfloat16" in label
                and "lr_scale" in label and "skipped" not in label)
    n = 64 * 40 + 3
    def longer(t: torch.Tensor) -> torch.Tensor:
        return t.repeat(13)[:n].contiguous()

    big = replace(args, grads=longer(args.grads), master=longer(args.master), state=tuple(map(longer, args.state)),
                  lr_scale=longer(args.lr_scale), decay_scale=longer(args.decay_scale))
    big = replace(big, params=big.master.to(big.grads.dtype))
    one, split = _clone(big), _clone(big)
    native.update(one, lib=tuned)
    monkeypatch.setattr(native, "MIN_ELEMS_PER_THREAD", 64 * 7)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert len(native._ranges(n)) == 3 and all(s % native.RANGE_ALIGN == 0 for s, _ in native._ranges(n))
        native.update(split, lib=tuned)
    finally:
        torch.set_num_threads(threads)
    _assert_same_bits(split, one, "3 threads")
    want = _clone(big)
    reference(want)
    _assert_same_bits(split, want, "reference")


def test_fp32_weights_in_a_buffer_of_their_own_get_the_master(tuned):
    """The flat buffers make fp32 weights the master itself; a separate buffer is written as on the GPU."""
    args = next(a for label, a in selfcheck.cases(torch.device("cpu"))
                if label.startswith("sgd storage float32 state float32 offset 0 l2"))
    for skip in (0.0, 1.0):
        a = replace(_clone(args), params=args.master.clone(), found_inf=torch.tensor([skip]))
        before = a.params.clone()
        want = _clone(replace(args, found_inf=torch.tensor([skip])))
        reference(want)
        native.update(a, lib=tuned)
        assert torch.equal(_bits(a.master), _bits(want.master))
        assert torch.equal(_bits(a.params), _bits(before if skip else want.master)), skip


def test_bad_layouts_are_refused_before_the_call(tuned):
    n = 10
    good = UpdateArgs(rule="sgd", grads=torch.zeros(n, dtype=torch.bfloat16), master=torch.zeros(n),
                      params=torch.zeros(n, dtype=torch.bfloat16), state=(torch.zeros(n),), grad_coef=torch.ones(1),
                      found_inf=torch.zeros(1), hyper=Hyper(lr=0.1))
    with pytest.raises(RuntimeError, match="master must be a contiguous 1-D tensor of 10 elements"):
        native.update(replace(good, master=torch.zeros(2 * n)[::2]), lib=tuned)
    with pytest.raises(RuntimeError, match="params has dtype torch.float16"):
        native.update(replace(good, params=torch.zeros(n, dtype=torch.float16)), lib=tuned)
    with pytest.raises(RuntimeError, match=r"rule adam keeps its state in \(torch.float32,\)"):
        native.update(replace(good, rule="adam", state=(torch.zeros(n, dtype=torch.float16),) * 2), lib=tuned)


def test_a_scalar_count_that_is_not_the_rules_is_refused(tuned):
    n = 4
    g, p = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    w, h = torch.zeros(n), torch.zeros(n)
    one, zero = torch.ones(1), torch.zeros(1)
    floats = np.zeros(4, dtype=np.float32)  # sgd has 4 fp32 scalars (lr, momentum, weight_decay, wd_lr)
    args = (0, 2, 0, g.data_ptr(), w.data_ptr(), p.data_ptr(), h.data_ptr(), None, None, None, one.data_ptr(),
            zero.data_ptr(), None, floats.ctypes.data)
    assert tuned.dptrain_cpu_update(*args, 4, 0, n) == 0
    assert tuned.dptrain_cpu_update(*args, 5, 0, n) == -1 and tuned.dptrain_cpu_update(*args, 3, 0, n) == -1


@needs_cxx
def test_cpu_tensors_dispatch_to_the_library_unless_told_otherwise(fresh, monkeypatch):
    t = torch.zeros(4)
    assert kernels.kernel_backend(t) == "native"
    for choice, backend in (("inplace", "inplace"), ("torch", "torch"), ("cupy", "torch"), ("native", "native")):
        monkeypatch.setenv(kernels.KERNELS_ENV, choice)
        assert kernels.kernel_backend(t) == backend, choice


def test_the_compiled_pass_and_the_gradient_norm_never_build_the_library(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    monkeypatch.setenv(kernels.KERNELS_ENV, "native")
    t = torch.ones(4)
    with caplog.at_level(logging.WARNING, logger="dptrain.kernels"):
        assert kernels.update_backend(t, cpu_fused=True) == "compiled"
        assert float(kernels.grad_norm(t)) == 2.0  # the reference, whatever DPTRAIN_KERNELS says
    assert not caplog.records and not native._state


def test_no_compiler_falls_back_to_the_in_place_passes_with_one_warning(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with caplog.at_level(logging.WARNING, logger="dptrain.kernels"):
        assert kernels.kernel_backend(torch.zeros(4)) == "inplace"
        assert kernels.kernel_backend(torch.zeros(4)) == "inplace"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no-such-compiler-here" in warnings[0] and "in-place" in warnings[0]
    monkeypatch.setenv(kernels.KERNELS_ENV, "native")
    with pytest.raises(SetupError, match="DPTRAIN_KERNELS=native but the CPU update library cannot be used: "
                                         "RuntimeError: no C\\+\\+ compiler 'no-such-compiler-here'"):
        kernels.kernel_backend(torch.zeros(4))


@needs_cxx
def test_a_compiler_that_refuses_the_tuning_flag_builds_untuned(fresh, monkeypatch):
    monkeypatch.setattr(native, "TUNE_FLAGS", ("-march=no-such-cpu",))
    with pytest.raises(RuntimeError, match="could not build update_cpu.cc"):
        native.build()
    assert native.unusable() is None and kernels.kernel_backend(torch.zeros(4)) == "native"


@needs_cxx
def test_a_library_that_fails_its_self_check_is_not_used(fresh, monkeypatch, caplog):
    monkeypatch.setattr(native, "self_check",
                        lambda lib: "sgd storage bfloat16 ...: master differs from the torch reference")
    with caplog.at_level(logging.WARNING, logger="dptrain.kernels"):
        assert kernels.kernel_backend(torch.zeros(4)) == "inplace"
    assert "master differs from the torch reference" in caplog.text


def test_a_failing_build_names_the_compiler_error_and_leaves_no_file(fresh, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    with pytest.raises(RuntimeError, match="false could not build update_cpu.cc"):
        native.build(tmp_path / "c")
    assert not list((tmp_path / "c").glob("*.so")) and not list((tmp_path / "c").glob("*.tmp"))


def test_solvers_starting_together_build_once(tmp_path, monkeypatch):
    """The second builder waits on the lock, then finds the first one's library."""
    calls = []

    def slow_compile(target, **kw):
        calls.append(target)
        time.sleep(0.3)
        target.write_bytes(b"built")

    monkeypatch.setattr(native_build, "_compile", slow_compile)
    source = tmp_path / "x.c"
    source.write_text("int x;\n")
    kw = dict(name="x", main=source, sources=(source,), command=["cc"], flags=("-shared",), directory=tmp_path / "c")
    results = []
    threads = [threading.Thread(target=lambda: results.append(native_build.build_library(**kw))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1] == calls[0]


def test_build_is_cached_and_keyed_by_every_source_the_architecture_and_the_cpu(tmp_path, monkeypatch):
    compiled = []

    def fake_compile(target, **kw):  # keying and caching only: no compiler run
        compiled.append(target)
        target.write_bytes(b"library")
        target.chmod(0o755)

    monkeypatch.setattr(native_build, "_compile", fake_compile)
    monkeypatch.setenv("CXX", "sh")  # any command on PATH
    cache = tmp_path / "c"
    first = native.build(cache)
    mtime = first.stat().st_mtime_ns
    assert native.build(cache) == first and first.stat().st_mtime_ns == mtime and len(compiled) == 1
    assert first.stat().st_mode & 0o755 == 0o755
    untuned = native.build(cache, tune=False)
    with monkeypatch.context() as m:  # another architecture sharing the cache builds its own, tuned or not
        m.setattr(native_build.platform, "machine", lambda: "riscv64")
        assert native.build(cache, tune=False) not in (untuned, first)
    if native.TUNE_FLAGS:  # another CPU of this architecture builds its own tuned library
        with monkeypatch.context() as m:
            m.setattr(native_build, "host_cpu", lambda: b"model name : another cpu")
            assert native.build(cache) not in (first, untuned)
    header = tmp_path / "host_half.h"  # an edited source
    header.write_text(native.SOURCES[2].read_text() + "\n// edited\n")
    monkeypatch.setattr(native, "SOURCES", (*native.SOURCES[:2], header))
    assert native.build(cache) not in compiled[:-1]
    assert len(compiled) == len(set(compiled)) == (5 if native.TUNE_FLAGS else 4)


def test_update_cu_still_holds_the_cuda_kernels_behind_its_guard():
    """The host build stops before the kernels; NVRTC and nvcc (which define __CUDACC__) see them
    all (tests/unit/test_cuda_compile.py compiles and lowers every name)."""
    text = native.SOURCES[1].read_text()
    guard = text.index("#if defined(__CUDACC__)  // the kernels")
    kernels_at = [m.start() for m in re.finditer(r"^__global__ ", text, flags=re.MULTILINE)]
    assert len(kernels_at) == len(RULES) + 1 and min(kernels_at) > guard  # one per rule, and the norm
