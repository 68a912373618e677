"""The one place that spawns ranks for multi-process tests (gloo on CPU)."""
from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dptrain.distributed.comm import import_dynamo_first


def _entry(rank, world_size, init_file, backend, timeout_s, fn, args):
    torch.set_num_threads(1)  # N ranks share 2 cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    import_dynamo_first()  # as Communicator.from_env: else the group outlives destroy_process_group (see there)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))  # hang -> failure
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world_size, fn, *args, backend="gloo", timeout_s=60):
    """Run fn(rank, world_size, *args) on world_size processes; any rank's exception fails the test."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world_size, os.path.join(tmp, "rdzv"), backend, timeout_s, fn, args),
                 nprocs=world_size)


def start_ranks(world_size, fn, *args, timeout_s=10):
    """Start ranks without joining (for failure tests); returns (processes, tmpdir handle)."""
    tmp = tempfile.TemporaryDirectory()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, world_size, os.path.join(tmp.name, "rdzv"), "gloo", timeout_s,
                                              fn, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    return procs, tmp


def inf_in_one_gradient(param: torch.Tensor):
    """Put an inf into element [0, 0] of ``param``'s gradient in each backward; returns the hook's handle."""
    return param.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])),
                                                     torch.tensor(float("inf"), dtype=g.dtype)))
