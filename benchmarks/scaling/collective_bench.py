"""Allreduce timing over message sizes on local gloo processes, for calibrating the scaling model (benchmarks.scaling).

Spawns ``world_size`` processes (torch.multiprocessing, spawn), joins them through a
``file://`` rendezvous in a temporary directory (nothing listens on the network), and times
``dist.all_reduce`` of a float32 tensor per size: ``warmup`` untimed calls, then ``iters``
timed calls, each after a barrier so the ranks start together. Rank 0's median per size
is returned.

    python -m benchmarks.scaling.collective_bench --sizes 4096,1048576,16777216
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FLOAT32_BYTES = 4


def _worker(rank: int, world_size: int, init_file: str, sizes: list[int], iters: int, warmup: int,
            out_file: str, timeout_s: float) -> None:
    torch.set_num_threads(1)  # the ranks share the host's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))  # a hung peer fails instead of blocking
    try:
        medians = []
        for nbytes in sizes:
            t = torch.ones(max(1, nbytes // FLOAT32_BYTES))  # [nbytes / 4] float32
            for _ in range(warmup):
                dist.all_reduce(t)
            times = []
            for _ in range(iters):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times))
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(medians, f)
    finally:
        dist.destroy_process_group()


def measure_allreduce(sizes_bytes: list[int], *, world_size: int = 2, iters: int = 20, warmup: int = 3,
                      timeout_s: float = 60.0) -> list[tuple[int, float]]:
    """(bytes, median seconds) of a gloo allreduce on ``world_size`` local processes, per size."""
    if world_size < 2 or iters < 1 or not sizes_bytes or min(sizes_bytes) < FLOAT32_BYTES:
        raise ValueError(f"need world_size >= 2, iters >= 1 and sizes >= 4 bytes; got {world_size}, {iters}, "
                         f"{sizes_bytes}")
    sizes = [s - s % FLOAT32_BYTES for s in sizes_bytes]
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "medians.json")
        mp.spawn(_worker, args=(world_size, os.path.join(tmp, "rdzv"), sizes, iters, warmup, out_file, timeout_s),
                 nprocs=world_size)
        with open(out_file) as f:
            medians = json.load(f)
    return list(zip(sizes, medians, strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4096,65536,1048576,16777216", help="message sizes in bytes")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    for nbytes, t in measure_allreduce([int(s) for s in args.sizes.split(",")], world_size=args.world_size,
                                       iters=args.iters):
        print(json.dumps({"bytes": nbytes, "median_ms": round(t * 1e3, 4), "world_size": args.world_size}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
