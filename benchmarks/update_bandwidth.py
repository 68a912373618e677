"""Effective memory bandwidth of the fused master-weight update, against the device's peak.

Times ``kernels.update`` (rule "sgd") over one flat buffer the size of ResNet-50 (25,557,032
parameters; fp16 storage, fp32 masters and momentum by default) with the kernel (CuPy on
CUDA; on the CPU ``update.cu`` built for the host, and the in-place torch passes it falls
back to) and with the torch reference, plus the gradient-norm pass, and prints one JSON line.

Effective bandwidth = the bytes the update must move / time. Per element that is: read the
gradient, master and momentum (and the LARC multiplier when used); write master, momentum,
the storage-dtype weight (unless it *is* the master, fp32 storage) and the zeroed gradient.
For fp16 storage with fp32 master and momentum: 2+4+4 read + 4+4+2+2 written = 22 B. The
reference is charged the same bytes (its temporaries are its own overhead), so the two
bandwidths compare as times. The issue's goal for the kernel is >= 80 % of peak.

On the CPU the buffers stay in the caches between calls when they fit, so use a ``--numel``
well past the last-level cache to time memory (``--storage bf16`` on a CPU with native bf16).

    python benchmarks/update_bandwidth.py                     # CUDA: kernel + reference
    python benchmarks/update_bandwidth.py --device cpu --storage bf16 --numel 10000000
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from dptrain import kernels
from dptrain.kernels import Hyper, UpdateArgs, native
from dptrain.bench import device_name, versions
from dptrain.provenance import git_commit

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


def _median_ms(fn, device: torch.device, *, iters: int, repeats: int, warmup: int) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls, warm-up excluded."""
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


def _measure(backend: str, b: dict[str, torch.Tensor], nbytes: int, device: torch.device, args,
             peak: float | None) -> dict[str, float | None]:
    os.environ[kernels.KERNELS_ENV] = backend

    update_args = UpdateArgs(rule="sgd", grads=b["grads"], master=b["master"], params=b["params"],
                             state=(b["momentum"],), grad_coef=b["grad_coef"], found_inf=b["found_inf"],
                             hyper=Hyper(lr=0.1, momentum=0.9, weight_decay=5e-5))

    def update() -> None:
        kernels.update(update_args)

    def norm() -> None:
        kernels.grad_norm(b["grads"])

    out: dict[str, float | None] = {}
    for what, fn, nb in (("update", update, nbytes), ("norm", norm, b["grads"].numel() * b["grads"].element_size())):
        ms = _median_ms(fn, device, iters=args.iters, repeats=args.repeats, warmup=args.warmup)
        bw = nb / (ms * 1e-3)
        out[f"{what}_ms"] = round(ms, 4)
        out[f"{what}_gb_per_s"] = round(bw / 1e9, 2)
        out[f"{what}_fraction_of_peak"] = round(bw / peak, 4) if peak else None
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=RESNET50_PARAMS, help="elements in the flat buffer")
    p.add_argument("--storage", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--momentum", choices=["fp32", "fp16"], default="fp32")
    p.add_argument("--iters", type=int, default=20, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats; the median is reported")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (compilation, allocator)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = p.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    storage, momentum = DTYPES[args.storage], DTYPES[args.momentum]
    name = device_name(device)
    peak_entry = peak_bandwidth(name) if cuda else None
    peak = peak_entry[0] if peak_entry else None
    nbytes = args.numel * update_bytes_per_elem(storage, momentum, larc=False)
    b = _buffers(args.numel, storage, momentum, device)
    if cuda:
        backends = ["cupy", "torch"]
    else:  # without a usable host library (no C++ compiler), the in-place passes and the reference only
        backends = [*(["native"] if native.unusable() is None else []), "inplace", "torch"]
    previous = os.environ.get(kernels.KERNELS_ENV)
    try:
        results = {bk: _measure(bk, b, nbytes, device, args, peak) for bk in backends}
    finally:
        if previous is None:
            os.environ.pop(kernels.KERNELS_ENV, None)
        else:
            os.environ[kernels.KERNELS_ENV] = previous
    kernel = results.get("cupy" if cuda else "native")
    record: dict[str, object] = {
        "bench": "update_bandwidth",
        "device": name,
        "numel": args.numel,
        "storage": args.storage,
        "momentum": args.momentum,
        "update_bytes_per_elem": update_bytes_per_elem(storage, momentum, larc=False),
        "peak_gb_per_s": peak / 1e9 if peak else None,
        "peak_source": peak_entry[1] if peak_entry else None,
        "kernel": kernel,
        "inplace": results.get("inplace"),
        "reference": results["torch"],
        "kernel_speedup": round(results["torch"]["update_ms"] / kernel["update_ms"], 2) if kernel else None,
        "timing": {"iters": args.iters, "repeats": args.repeats, "warmup": args.warmup, "stat": "median"},
        "versions": versions(),
        "git_commit": git_commit(),
    }
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
