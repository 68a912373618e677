"""The CUDA path proven as far as a CPU can: NVRTC compiles it, and the first-use self-check decides.

The compile check runs NVRTC (the ``nvidia-cuda-nvrtc`` wheel of the test extra; no GPU, no
driver) on ``dptrain/csrc/update.cu`` exactly as a solver does at first use on a GPU:
``kernels.cuda.compile_module``, the same options, headers and name expressions. It must
pass here for the GPUs dptrain targets (A100 sm_80, H100/H200 sm_90), and it fails on any
compile error. The self-check's decision (use the kernels, fall back with one warning,
or stop) is tested with injected failures.
"""
from __future__ import annotations

import contextlib
import logging
import re
from types import SimpleNamespace

import pytest
import torch

from dptrain import kernels
from dptrain.errors import SetupError
from dptrain.kernels import cuda, nvrtc, selfcheck
from dptrain.kernels.spec import RULES, UpdateArgs, reference

ELF_MAGIC = b"\x7fELF"


@pytest.fixture(scope="module")
def library() -> str:
    """NVRTC from the test extra; a missing one fails the check rather than skipping it."""
    return nvrtc.find_library()


@pytest.fixture(scope="module")
def ptx90(library) -> nvrtc.Compiled:
    """update.cu as PTX for sm_90, as a solver compiles it: compiled once for the PTX checks (~2 s each)."""
    return cuda.compile_module("compute_90", library)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_update_cu_compiles_for_each_target_gpu_and_every_name_lowers(library, arch, tmp_path, monkeypatch):
    """Compiled as a solver does (through the cache); the second process's load comes from the cache."""
    monkeypatch.setenv("DPTRAIN_CACHE", str(tmp_path))
    compiled, cached = cuda.compile_module_cached(arch, library)
    assert not cached and compiled.binary.startswith(ELF_MAGIC), "a cubin for the target GPU"
    assert set(compiled.lowered) == set(cuda.name_expressions())
    for expr, low in compiled.lowered.items():
        assert low.startswith("_Z") or low == expr, f"{expr} did not lower to a mangled name: {low}"
    assert "error" not in compiled.log.lower() and "warning" not in compiled.log.lower(), compiled.log
    assert compiled.options[:len(cuda.NVRTC_OPTIONS)] == cuda.NVRTC_OPTIONS  # nothing added before ours
    monkeypatch.setattr(cuda, "compile_module", lambda *a: pytest.fail("compiled again, not loaded from the cache"))
    again, cached = cuda.compile_module_cached(arch, library)
    assert cached and (again.binary, again.lowered) == (compiled.binary, compiled.lowered)


def test_the_nvrtc_cache_compiles_again_when_what_makes_the_cubin_changes(tmp_path, monkeypatch):
    """A changed source, header, option or NVRTC is a new entry; an entry without its names (a
    process killed while writing) or whose cubin is not one is compiled again. NVRTC itself is
    stood in for."""
    monkeypatch.setenv("DPTRAIN_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "update.cu").write_text("// v1")
    (src / "host_half.h").write_text("// h1")
    monkeypatch.setattr(cuda, "SOURCE", src / "update.cu")
    monkeypatch.setattr(nvrtc, "version", lambda lib: (13, 0))
    builds = []

    def fake_compile(arch, lib):
        builds.append(arch)
        return nvrtc.Compiled(arch, ELF_MAGIC + f"cubin {len(builds)}".encode(),
                              {n: f"_Z{i}" for i, n in enumerate(cuda.name_expressions())}, "", ())

    def build(arch="sm_90", **kw) -> tuple[bytes, bool]:
        compiled, cached = cuda.compile_module_cached(arch, "libnvrtc.so", **kw)
        return compiled.binary.removeprefix(ELF_MAGIC), cached

    monkeypatch.setattr(cuda, "compile_module", fake_compile)
    assert build() == (b"cubin 1", False) and build() == (b"cubin 1", True)
    (src / "host_half.h").write_text("// h2")
    assert build() == (b"cubin 2", False)
    monkeypatch.setattr(nvrtc, "version", lambda lib: (13, 1))
    assert build() == (b"cubin 3", False)
    monkeypatch.setattr(cuda, "NVRTC_OPTIONS", (*cuda.NVRTC_OPTIONS, "-lineinfo"))
    assert build() == (b"cubin 4", False)
    assert build("sm_80") == (b"cubin 5", False) and build("sm_80") == (b"cubin 5", True)
    cache = tmp_path / "cache" / "nvrtc"
    for names in cache.glob("update-sm_80-*.json"):
        names.unlink()
    assert build("sm_80") == (b"cubin 6", False)
    for cubin in cache.glob("update-sm_80-*.cubin"):
        cubin.write_bytes(b"")  # a crash before the data reached the disk
    assert build("sm_80") == (b"cubin 7", False) and build("sm_80") == (b"cubin 7", True)
    assert build("sm_80", reuse=False) == (b"cubin 8", False)
    assert not list(cache.glob("*.tmp")) and len(builds) == 8


def test_a_cached_cubin_the_driver_refuses_is_compiled_again_once(monkeypatch):
    """CuPy failing to load the cached cubin (a stand-in for the driver) costs one fresh compile;
    failing to load a fresh one is the error it is."""
    fresh = nvrtc.Compiled("sm_90", ELF_MAGIC + b"fresh", {"f": "_Zf"}, "", ())
    stale = nvrtc.Compiled("sm_90", ELF_MAGIC + b"stale", {"f": "_Zf"}, "", ())
    calls = []

    def cached(arch, lib, reuse=True):
        calls.append(reuse)
        return (stale, True) if reuse else (fresh, False)

    class RawModule:
        def __init__(self, path):
            if open(path, "rb").read().endswith(b"stale"):
                raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")

        def get_function(self, name):
            return name

    fake = SimpleNamespace(RawModule=RawModule, cuda=SimpleNamespace(Device=lambda i: contextlib.nullcontext()))
    monkeypatch.setattr(cuda, "cupy_module", lambda: fake)
    monkeypatch.setattr(cuda, "compile_module_cached", cached)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(nvrtc, "find_library", lambda major=None: "libnvrtc.so")
    loaded = cuda._Loaded(0)
    assert calls == [True, False] and loaded.functions == {"f": "_Zf"}
    monkeypatch.setattr(cuda, "compile_module_cached", lambda arch, lib, reuse=True: (stale, False))
    with pytest.raises(RuntimeError, match="INVALID_IMAGE"):
        cuda._Loaded(0)


def test_ptx_keeps_subnormals_and_rounds_every_multiply_and_add(library, ptx90):
    """The reference rounds each fp32 op and keeps subnormals: no .ftz, no fused multiply-add.
    The same source with CuPy's -ftz=true appended does flush, so this check can fail."""
    ptx = ptx90.binary.decode(errors="replace")
    assert ".ftz" not in ptx
    assert "fma.rn.f32" not in ptx and "mul.rn.f32" in ptx
    flushed = nvrtc.compile_cuda(cuda.SOURCE.read_text(), name="update.cu",
                                 options=(*cuda.NVRTC_OPTIONS, f"-I{nvrtc.find_include(library)}", "-ftz=true"),
                                 name_expressions=cuda.name_expressions(), arch="compute_90", library=library)
    assert ".ftz.f32" in flushed.binary.decode(errors="replace")


def _entries(ptx: str) -> dict[str, str]:
    """Each kernel entry's PTX body, by mangled name."""
    return {part.split("(", 1)[0]: part for part in re.split(r"\.entry\s+", ptx)[1:]}


@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_16_bit_streams_move_16_bytes_per_access_and_the_norm_keeps_4_loads_in_flight(ptx90, storage):
    """Packs of 8 fp16/bf16 elements load and store as 128-bit accesses (``v4.u32``), where packs of 4
    were 64-bit (``v4.u16``); the norm's unrolled loop issues 4 of them before it sums any."""
    compiled = ptx90
    entries = _entries(compiled.binary.decode(errors="replace"))
    vec = cuda.vector_elems(storage)
    assert vec == 8
    update = entries[compiled.lowered[cuda.update_kernel_name(RULES["sgd"], storage, torch.float32, vec)]]
    assert re.search(r"ld\.global\.v4\.u32", update) and re.search(r"st\.global\.v4\.u32", update)
    assert "v4.u16" not in update
    norm = entries[compiled.lowered[cuda.norm_kernel_name(storage, vec)]]
    wide = re.findall(r"ld\.global\.v4\.u32", norm)
    assert len(wide) == 4 + 1, norm  # the unrolled trip, and the loop over a thread's last packs


def test_the_norm_is_one_kernel_whose_last_block_sums_the_partials(ptx90):
    """One launch per norm: each block publishes its partial behind a fence (``membar.gl``) and counts
    itself in (``atom.global.inc``, which wraps the counter back to 0); the last block reads the
    partials past L1 (``ld.global.cg``) and no float is added atomically, so the sum order stays fixed."""
    compiled = ptx90
    entries = _entries(compiled.binary.decode(errors="replace"))
    assert not [name for name in cuda.name_expressions() if "sumsq" in name or "finish" in name]
    for storage in cuda.STORAGE_DTYPES:
        norm = entries[compiled.lowered[cuda.norm_kernel_name(storage, cuda.vector_elems(storage))]]
        assert len(re.findall(r"atom\.global\.inc\.u32", norm)) == 1, norm
        assert "membar.gl" in norm and re.search(r"ld\.global\.cg\.f32", norm)
        assert not re.search(r"atom\.global\.add\.f32|red\.global\.add\.f32", norm)


def test_a_source_that_does_not_compile_fails_with_nvrtc_s_log(library):
    broken = cuda.SOURCE.read_text().replace("namespace dpt {", "namespace dpt { this is not C++;", 1)
    with pytest.raises(nvrtc.NvrtcError, match=r"compiling update\.cu for sm_90 failed: NVRTC_ERROR_COMPILATION\n"
                                                r".*error"):
        nvrtc.compile_cuda(broken, name="update.cu", options=(*cuda.NVRTC_OPTIONS, f"-I{nvrtc.find_include(library)}"),
                           name_expressions=cuda.name_expressions(), arch="sm_90", library=library)


def test_a_name_expression_that_does_not_exist_fails(library):
    with pytest.raises(nvrtc.NvrtcError, match="dptrain_nosuch_update"):
        nvrtc.compile_cuda(cuda.SOURCE.read_text(), name="update.cu",
                           options=(*cuda.NVRTC_OPTIONS, f"-I{nvrtc.find_include(library)}"),
                           name_expressions=("dptrain_nosuch_update<float, float, 4>",), arch="sm_90",
                           library=library)


def test_nvrtc_matching_torch_s_cuda_major_is_preferred(monkeypatch):
    libs = ["/x/nvidia/cu13/lib/libnvrtc.so.13", "/x/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"]
    monkeypatch.delenv(nvrtc.NVRTC_ENV, raising=False)
    monkeypatch.setattr(nvrtc, "_candidates", lambda: libs)
    assert nvrtc.find_library(12) == libs[1]
    assert nvrtc.find_library(13) == libs[0]
    assert nvrtc.find_library(None) == libs[0]  # the newest
    monkeypatch.setattr(nvrtc, "_candidates", lambda: [])
    monkeypatch.setattr(nvrtc.ctypes.util, "find_library", lambda name: None)
    with pytest.raises(nvrtc.NvrtcError, match="NVRTC not found: pip install nvidia-cuda-nvrtc"):
        nvrtc.find_library(13)


# --------------------------------------------------------------------------------------- self-check


def test_self_check_cases_cover_every_rule_dtype_alignment_and_a_skip():
    labels = [label for label, _ in selfcheck.cases(torch.device("cpu"))]
    for rule in RULES.values():
        for storage in ("float16", "bfloat16", "float32"):
            for state in rule.state_dtypes:
                mine = [x for x in labels if f"{rule.name} storage {storage} state {str(state)[6:]} " in x]
                assert any("offset 0" in x for x in mine) and any("offset 1" in x for x in mine), mine
                assert any("skipped" in x for x in mine) and any("lr_scale" in x for x in mine), mine


def test_self_check_passes_a_kernel_equal_to_the_reference_and_names_a_wrong_one():
    cpu = torch.device("cpu")
    assert selfcheck.compare(reference, kernels.grad_norm_reference, cpu) is None

    def off_by_one_ulp(a: UpdateArgs) -> None:
        reference(a)
        a.master.view(torch.int32)[5] += 1

    why = selfcheck.compare(off_by_one_ulp, kernels.grad_norm_reference, cpu)
    assert why is not None and why.startswith("sgd storage float16 state float32 offset 0 l2: master differs"), why

    def flushes(a: UpdateArgs) -> None:  # what -ftz=true would do to a subnormal history
        reference(a)
        for s in a.state:
            s.masked_fill_(s.abs() < 1.2e-38, 0.0)

    why = selfcheck.compare(flushes, kernels.grad_norm_reference, cpu)
    assert why is not None and "state momentum differs" in why, why


@pytest.fixture()
def fake_gpu(monkeypatch):
    """A CUDA tensor stand-in and an importable 'CuPy', with the per-device verdict cache cleared."""
    monkeypatch.setattr(cuda, "cupy_module", lambda: SimpleNamespace())
    kernels.cuda_unusable.cache_clear()
    kernels._warn_fallback.cache_clear()
    yield SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    kernels.cuda_unusable.cache_clear()
    kernels._warn_fallback.cache_clear()


@pytest.mark.parametrize("failure, fragment", [
    (lambda i: "sgd storage float16 state float32 offset 1 decoupled lr_scale: master differs from the torch "
               "reference", "master differs from the torch reference"),
    (lambda i: (_ for _ in ()).throw(nvrtc.NvrtcError("CUDA headers (cuda_fp16.h, cuda_bf16.h) not found")),
     "NvrtcError: CUDA headers (cuda_fp16.h, cuda_bf16.h) not found"),
    (lambda i: (_ for _ in ()).throw(RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU")),
     "RuntimeError: CUDA_ERROR_NO_BINARY_FOR_GPU"),
])
def test_auto_falls_back_to_the_reference_with_one_warning_and_cupy_stops(fake_gpu, monkeypatch, caplog, failure,
                                                                         fragment):
    monkeypatch.setattr(selfcheck, "run", failure)
    monkeypatch.setenv(kernels.KERNELS_ENV, "auto")
    with caplog.at_level(logging.WARNING, logger="dptrain.kernels"):
        assert kernels.kernel_backend(fake_gpu) == "torch"
        assert kernels.kernel_backend(fake_gpu) == "torch"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and fragment in warnings[0] and "torch reference" in warnings[0], warnings
    monkeypatch.setenv(kernels.KERNELS_ENV, "cupy")
    with pytest.raises(SetupError) as e:
        kernels.kernel_backend(fake_gpu)
    assert str(e.value).startswith("DPTRAIN_KERNELS=cupy but the CuPy update kernels cannot run on cuda:0: ")
    assert fragment in str(e.value) and str(e.value).endswith("; fix that or set DPTRAIN_KERNELS=auto")


def test_a_passing_self_check_selects_the_kernels_once_per_device(fake_gpu, monkeypatch):
    runs = []
    monkeypatch.setattr(selfcheck, "run", lambda i: runs.append(i))
    assert kernels.kernel_backend(fake_gpu) == "cupy"
    assert kernels.kernel_backend(fake_gpu) == "cupy"
    assert runs == [0]
    monkeypatch.setenv(kernels.KERNELS_ENV, "torch")
    assert kernels.kernel_backend(fake_gpu) == "torch"


# --------------------------------------------------------------------------------------- cupy-nccl and threads


def test_known_value_allreduce_check():
    from dptrain.distributed.cupy_nccl import known_sum_mismatch

    assert known_sum_mismatch(torch.full((7,), 6.0), world_size=3) is None  # 1 + 2 + 3
    bad = torch.full((7,), 6.0)
    bad[4] = 3.0  # e.g. one rank's contribution missing
    assert known_sum_mismatch(bad, world_size=3) == "1 of 7 elements differ from 6, e.g. element 4 = 3.0"


def test_cupy_nccl_passes_the_unique_id_as_cupy_made_it(monkeypatch):
    """CuPy 14's get_unique_id() returns bytes and NcclCommunicator rejects a tuple; CuPy 13's is a
    tuple. Whatever rank 0's CuPy made reaches every rank's NcclCommunicator unchanged."""
    import dptrain.distributed.cupy_nccl as nc

    made = []

    class FakeNccl:
        available = True

        def __init__(self, uid_value):
            self.uid_value = uid_value

        def get_unique_id(self):
            return self.uid_value

        def get_version(self):
            return 22000

        def NcclCommunicator(self, ndev, uid, rank):  # noqa: N802 - CuPy's name
            made.append(uid)
            raise RuntimeError("stop here: the id is what this test checks")

    from dptrain.distributed.flight import FlightRecorder

    comm = SimpleNamespace(device=torch.device("cuda", 0), rank=0, world_size=2,
                           broadcast_object=lambda obj, src=0: obj, flight=FlightRecorder(0, 2))
    monkeypatch.setattr(nc.torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    for uid in (b"\x01" * 128, tuple(range(128))):
        monkeypatch.setattr(nc, "_nccl", lambda uid=uid: FakeNccl(uid))
        with pytest.raises(RuntimeError, match="stop here"):
            nc.CupyNcclCommunicator(comm, timeout_s=5)
        assert made[-1] is uid


def test_threads_that_touch_cuda_bind_to_their_solver_s_gpu(monkeypatch):
    from dptrain.distributed import comm

    bound = []
    monkeypatch.setattr(comm.torch.cuda, "set_device", lambda d: bound.append(d))
    comm.bind_thread_to_device(torch.device("cuda", 3))
    comm.bind_thread_to_device(torch.device("cpu"))
    comm.bind_thread_to_device(None)
    assert bound == [torch.device("cuda", 3)]
    watcher = comm.CompletionWatcher("test-watcher", torch.device("cuda", 5))
    done = []
    watcher.watch(lambda: True, done.append)
    for _ in range(200):
        if done:
            break
        __import__("time").sleep(0.01)
    watcher.close()
    assert done and bound[-1] == torch.device("cuda", 5)  # set in the watcher thread, before its first query
