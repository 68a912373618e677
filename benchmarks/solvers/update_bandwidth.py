"""Effective memory bandwidth of the fused master-weight update and the gradient norm, against a device copy.

Times ``kernels.update`` (rule "sgd") over one flat buffer the size of ResNet-50 (25,557,032
parameters; fp16 storage, fp32 masters and momentum by default) with the kernel (CuPy on
CUDA; on the CPU ``update.cu`` built for the host, and the in-place torch passes it falls
back to) and with the torch reference, plus the gradient-norm pass, and prints one JSON line.

Effective bandwidth = the bytes a pass must move / time. For the update, per element: read
the gradient, master and momentum (and the LARC multiplier when used); write master,
momentum, the storage-dtype weight (unless it *is* the master, fp32 storage) and the zeroed
gradient. For fp16 storage with fp32 master and momentum: 2+4+4 read + 4+4+2+2 written = 22 B.
The norm reads the gradient once (2 B). The reference is charged the same bytes (its
temporaries are its own overhead), so the bandwidths compare as times.

The yardstick is a device-to-device copy (``dst.copy_(src)``) that moves as many bytes
(read + written) as each pass, timed in the same run: the practical ceiling, where the
datasheet peak (also reported) is not reached by any kernel. Goals (issue 32, on H100/H200,
by kernel time): the update >= 90 % of the copy's bandwidth, the norm >= 75 %.

The copy reads half its bytes and writes half, like the update (12 B read, 10 B written), but
the norm only reads; a read-only stream usually runs faster than a copy, so the norm's fraction
of the copy flatters it and can exceed 1. A second yardstick therefore reads the norm's bytes
and writes nothing (``x.view(torch.int32).sum(dtype=torch.int64)``, torch's reduction):
``norm_fraction_of_read`` is the norm against a pass of its own kind (reported, no goal).

Two times per pass on CUDA:
* ``*_ms``: wall clock around ``--iters`` back-to-back calls with a device sync on either side,
  so host dispatch is included (a pass that launches faster than the host can dispatch it is
  host-bound, and this is the time it costs a step);
* ``*_kernel_ms``: CUDA events around the same calls, queued while the GPU spins
  (``torch.cuda._sleep``), so the device runs them back to back and the events time the
  kernels, not the host (``*_dispatch_hidden`` says whether the spin outlasted the queueing).
  The fractions of the copy come from these. On the CPU there is only the wall time.

Calls in a row take their turns over several copies of the buffers, enough that together they
span ``--footprint-mb`` (256 MB, five times an H100's 50 MB L2): the norm reads 51 MB of ResNet-50
gradients, which a second call in a row would otherwise find partly in L2, and so would the
copy of the same bytes, each by its own share. ``buffers_rotated`` in the record says how many
copies each pass used (the update moves 562 MB per call and needs none). On the CPU the same
keeps the last-level cache out of a small ``--numel``'s times.

    python -m benchmarks.solvers.update_bandwidth                     # CUDA: kernel + reference + copy
    python -m benchmarks.solvers.update_bandwidth --device cpu --storage bf16 --numel 10000000
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dptrain import kernels
from dptrain.kernels import Hyper, UpdateArgs, native
from dptrain.observe.provenance import git_commit
from dptrain.tools.bench import device_name, versions

RESNET50_PARAMS = 25_557_032
"""torchvision ResNet-50 parameter count (also what dptrain.models builds)."""

# Peak DRAM bandwidth in bytes/s, matched in order as case-insensitive substrings of
# torch.cuda.get_device_name(); the first match wins, so specific names come first.
PEAK_BANDWIDTH: tuple[tuple[str, float, str], ...] = (
    ("H200", 4.8e12, "NVIDIA H200 Tensor Core GPU datasheet: 4.8 TB/s HBM3e"),
    ("H100 NVL", 3.9e12, "NVIDIA H100 Tensor Core GPU datasheet: H100 NVL 3.9 TB/s"),
    ("H100 PCIe", 2.0e12, "NVIDIA H100 Tensor Core GPU datasheet: H100 PCIe 2 TB/s"),
    ("H100", 3.35e12, "NVIDIA H100 Tensor Core GPU datasheet: H100 SXM 3.35 TB/s HBM3"),
    ("A100-SXM4-80GB", 2.039e12, "NVIDIA A100 Tensor Core GPU datasheet: A100 80GB SXM 2,039 GB/s"),
    ("A100 80GB PCIe", 1.935e12, "NVIDIA A100 Tensor Core GPU datasheet: A100 80GB PCIe 1,935 GB/s"),
    ("A100-SXM4-40GB", 1.555e12, "NVIDIA A100 Tensor Core GPU datasheet: A100 40GB 1,555 GB/s"),
    ("A100-PCIE-40GB", 1.555e12, "NVIDIA A100 Tensor Core GPU datasheet: A100 40GB 1,555 GB/s"),
)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

GOALS = {"update": 0.90, "norm": 0.75}
"""Issue 32: bandwidth by kernel time as a fraction of a same-size device copy's, on H100/H200."""
FOOTPRINT_MB = 256
"""Bytes the rotated copies of a pass's buffers span together, at least (module docstring)."""
MAX_COPIES = 16
"""At most this many copies per pass (a tiny ``--numel`` would otherwise ask for thousands)."""
SPIN_CYCLES = 50_000_000
"""torch.cuda._sleep length before the event-timed calls (~25-35 ms at 1.5-2 GHz): far longer
than the host needs to queue 20 calls of either pass, so the GPU never waits for the host."""


def peak_bandwidth(name: str) -> tuple[float, str] | None:
    """(bytes/s, source) for a device name, or None when the table does not know it."""
    for pattern, peak, source in PEAK_BANDWIDTH:
        if pattern.lower() in name.lower():
            return peak, source
    return None


def update_bytes_per_elem(storage: torch.dtype, momentum: torch.dtype, larc: bool) -> int:
    """Bytes the fused update must move per element (see the module docstring)."""
    s, m = storage.itemsize, momentum.itemsize
    reads = s + 4 + m + (4 if larc else 0)
    writes = 4 + m + s + (0 if storage == torch.float32 else s)  # master, momentum, grads, params
    return reads + writes


def _buffers(n: int, storage: torch.dtype, momentum: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    master = torch.randn(n, device=device) * 0.05  # [n] fp32
    return {
        "grads": (torch.randn(n, device=device) * 1e-2).to(storage),  # [n] storage dtype
        "master": master,
        "params": master if storage == torch.float32 else master.to(storage),  # [n] storage dtype
        "momentum": torch.zeros(n, dtype=momentum, device=device),  # [n]
        "grad_coef": torch.full((1,), 2.0**-16, device=device),  # [1] fp32
        "found_inf": torch.zeros(1, device=device),  # [1] fp32
    }


def copies_for(nbytes: int, footprint_bytes: int) -> int:
    """How many copies of a pass's buffers span ``footprint_bytes`` (1 to :data:`MAX_COPIES`)."""
    return max(1, min(MAX_COPIES, math.ceil(footprint_bytes / max(nbytes, 1))))


def _in_turn(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call that runs ``calls`` in turn, one per call."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def _median_ms(fn: Callable[[], object], device: torch.device, *, iters: int, repeats: int, warmup: int) -> float:
    """Median over ``repeats`` of the mean wall time of ``iters`` back-to-back calls (host
    dispatch included), warm-up excluded."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(times)


def _kernel_ms(fn: Callable[[], object], *, iters: int, repeats: int) -> tuple[float, bool]:
    """Median over ``repeats`` of the device time per call from CUDA events, and whether the
    host's dispatch was hidden in every repeat.

    The calls are queued behind a spin kernel, so the device runs them back to back; if the
    start event has already completed when the host has queued the last call, the host was
    the slower side and the time includes its gaps (then False is returned)."""
    times, hidden = [], True
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        hidden = hidden and not start.query()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times), hidden


@dataclass(frozen=True)
class Timing:
    """One pass's times: ``nbytes`` moved per call, wall and (CUDA) kernel ms per call."""

    nbytes: int
    wall_ms: float
    kernel_ms: float | None
    dispatch_hidden: bool | None

    @property
    def ms(self) -> float:
        """The time bandwidths are judged by: the kernel time where there is one, else the wall time."""
        return self.wall_ms if self.kernel_ms is None else self.kernel_ms

    def bytes_per_s(self) -> float:
        return self.nbytes / (self.ms * 1e-3)

    def figures(self, name: str, peak: float | None, copy: Timing | None,
                read: Timing | None = None) -> dict[str, float | bool | None]:
        """The JSON fields of pass ``name``; fractions of ``peak``, of the same-size ``copy`` and of the
        same-size read-only pass ``read``."""
        out: dict[str, float | bool | None] = {
            f"{name}_ms": round(self.wall_ms, 4),
            f"{name}_gb_per_s": round(self.nbytes / (self.wall_ms * 1e-3) / 1e9, 2)}
        if self.kernel_ms is not None:
            out.update({f"{name}_kernel_ms": round(self.kernel_ms, 4),
                        f"{name}_kernel_gb_per_s": round(self.bytes_per_s() / 1e9, 2),
                        f"{name}_dispatch_hidden": self.dispatch_hidden,
                        f"{name}_wall_over_kernel": round(self.wall_ms / self.kernel_ms, 2)})
        out[f"{name}_fraction_of_peak"] = round(self.bytes_per_s() / peak, 4) if peak else None
        if copy is not None:
            out[f"{name}_fraction_of_copy"] = round(self.bytes_per_s() / copy.bytes_per_s(), 4)
        if read is not None:
            out[f"{name}_fraction_of_read"] = round(self.bytes_per_s() / read.bytes_per_s(), 4)
        return out


def _time(fn: Callable[[], object], nbytes: int, device: torch.device, args) -> Timing:
    """Wall time, and on CUDA kernel time, of ``fn`` moving ``nbytes`` per call."""
    wall = _median_ms(fn, device, iters=args.iters, repeats=args.repeats, warmup=args.warmup)
    if device.type != "cuda":
        return Timing(nbytes, wall, None, None)
    return Timing(nbytes, wall, *_kernel_ms(fn, iters=args.iters, repeats=args.repeats))


def _measure(backend: str, sets: list[dict[str, torch.Tensor]], norm_grads: list[torch.Tensor],
             nbytes: dict[str, int], device: torch.device, args) -> dict[str, Timing]:
    """The update (over the buffer ``sets`` in turn) and the norm (over ``norm_grads`` in turn)
    with ``backend``, as {pass: Timing}."""
    os.environ[kernels.KERNELS_ENV] = backend
    hyper = Hyper(lr=0.1, momentum=0.9, weight_decay=5e-5)
    updates = [UpdateArgs(rule="sgd", grads=b["grads"], master=b["master"], params=b["params"], state=(b["momentum"],),
                          grad_coef=b["grad_coef"], found_inf=b["found_inf"], hyper=hyper) for b in sets]
    update = _in_turn([functools.partial(kernels.update, u) for u in updates])
    norm = _in_turn([functools.partial(kernels.grad_norm, g) for g in norm_grads])
    return {"update": _time(update, nbytes["update"], device, args), "norm": _time(norm, nbytes["norm"], device, args)}


def _copy(nbytes: int, copies: int, device: torch.device, args) -> Timing:
    """``dst.copy_(src)`` moving ``nbytes`` (half of them read, half written), over ``copies``
    pairs in turn, timed as the passes are."""
    pairs = [(torch.ones(nbytes // 2, dtype=torch.uint8, device=device),  # [nbytes/2] bytes, read once
              torch.empty(nbytes // 2, dtype=torch.uint8, device=device)) for _ in range(copies)]  # written once
    return _time(_in_turn([functools.partial(dst.copy_, src) for src, dst in pairs]), 2 * (nbytes // 2), device, args)


def _read(nbytes: int, copies: int, device: torch.device, args) -> Timing:
    """A read-only pass over ``nbytes`` (whole int32 words; an int64 sum, nothing written per element),
    over ``copies`` buffers in turn, timed as the passes are: the norm's kind of traffic."""
    words = [torch.ones(nbytes // 4, dtype=torch.int32, device=device) for _ in range(copies)]  # [nbytes/4] int32
    return _time(_in_turn([functools.partial(torch.sum, w, dtype=torch.int64) for w in words]), 4 * (nbytes // 4),
                 device, args)


def _side(times: dict[str, Timing] | None, peak: float | None, copy: dict[str, Timing],
          read: dict[str, Timing] | None = None) -> dict[str, float | bool | None] | None:
    """One backend's JSON fields: both passes' figures against the peak, their same-size copies and
    (the norm) its same-size read-only pass."""
    if times is None:
        return None
    return {k: v for name, t in times.items()
            for k, v in t.figures(name, peak, copy.get(name), (read or {}).get(name)).items()}


def _run(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, dict[str, Timing]], dict[str, Timing],
                                                                   dict[str, Timing], dict[str, int]]:
    """Every backend's update and norm, then the same-size copies and the norm-size read: ({backend:
    {pass: Timing}}, {pass: copy Timing}, {"norm": read Timing}, {pass: copies rotated})."""
    storage, momentum = DTYPES[args.storage], DTYPES[args.momentum]
    nbytes = {"update": args.numel * update_bytes_per_elem(storage, momentum, larc=False),
              "norm": args.numel * storage.itemsize}
    rotated = {what: copies_for(nb, args.footprint_mb * 2**20) for what, nb in nbytes.items()}
    sets = [_buffers(args.numel, storage, momentum, device) for _ in range(rotated["update"])]
    norm_grads = [sets[i]["grads"] if i < len(sets) else sets[0]["grads"].clone() for i in range(rotated["norm"])]
    if device.type == "cuda":
        backends = ["cupy", "torch"]
    else:  # without a usable host library (no C++ compiler), the in-place passes and the reference only
        backends = [*(["native"] if native.unusable() is None else []), "inplace", "torch"]
    previous = os.environ.get(kernels.KERNELS_ENV)
    try:
        results = {bk: _measure(bk, sets, norm_grads, nbytes, device, args) for bk in backends}
    finally:
        if previous is None:
            os.environ.pop(kernels.KERNELS_ENV, None)
        else:
            os.environ[kernels.KERNELS_ENV] = previous
    del sets, norm_grads  # the yardsticks' buffers take the memory back
    copy = {what: _copy(nb, rotated[what], device, args) for what, nb in nbytes.items()}
    return results, copy, {"norm": _read(nbytes["norm"], rotated["norm"], device, args)}, rotated


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=RESNET50_PARAMS, help="elements in the flat buffer")
    p.add_argument("--storage", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--momentum", choices=["fp32", "fp16"], default="fp32")
    p.add_argument("--iters", type=int, default=20, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats; the median is reported")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (compilation, allocator)")
    p.add_argument("--footprint-mb", type=int, default=FOOTPRINT_MB,
                   help="calls in a row rotate over copies of the buffers spanning this many MB (0: one copy)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = p.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    name = device_name(device)
    peak_entry = peak_bandwidth(name) if cuda else None
    peak = peak_entry[0] if peak_entry else None
    results, copy, read, rotated = _run(args, device)
    kernel = _side(results.get("cupy" if cuda else "native"), peak, copy, read)
    reference = _side(results["torch"], peak, copy, read)
    record: dict[str, object] = {
        "bench": "update_bandwidth",
        "device": name,
        "numel": args.numel,
        "storage": args.storage,
        "momentum": args.momentum,
        "update_bytes_per_elem": update_bytes_per_elem(DTYPES[args.storage], DTYPES[args.momentum], larc=False),
        "peak_gb_per_s": peak / 1e9 if peak else None,
        "peak_source": peak_entry[1] if peak_entry else None,
        "kernel": kernel,
        "inplace": _side(results.get("inplace"), peak, copy, read),
        "reference": reference,
        "copy": {f"{what}_bytes": t.nbytes for what, t in copy.items()} | _side(copy, peak, {}),
        "read": {"norm_bytes": read["norm"].nbytes} | _side(read, peak, {}),
        "yardsticks": "copy: each pass's bytes, half read and half written (the update's kind); read: the norm's "
                      "bytes read only (an int32 sum). A read-only stream beats a copy, so the norm's fraction of "
                      "the copy flatters it (it can exceed 1); norm_fraction_of_read compares like with like",
        "goals": {f"{what}_fraction_of_copy": goal for what, goal in GOALS.items()},
        # the goals are the GPU kernels' (by kernel time); on the CPU the fractions are only reported
        "goals_met": ({what: kernel[f"{what}_fraction_of_copy"] >= goal for what, goal in GOALS.items()}
                      if kernel and cuda else None),
        "kernel_speedup": round(reference["update_ms"] / kernel["update_ms"], 2) if kernel else None,
        "buffers_rotated": rotated,
        "footprint_mb": args.footprint_mb,
        "timing": {"iters": args.iters, "repeats": args.repeats, "warmup": args.warmup, "stat": "median",
                   "fraction_of_copy_from": "kernel time (CUDA events)" if cuda else "wall time"},
        "versions": versions(),
        "git_commit": git_commit(),
    }
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
