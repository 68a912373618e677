"""The one place that starts ranks for multi-process tests (gloo on CPU).

Ranks are forked from a forkserver that has imported torch once, not spawned: a spawned rank
imports torch again (about 2.5 s on 2 cores, which its peers share), and the suite starts ranks
some 50 times. A forked rank takes the test's environment, working directory and ``sys.path``
as they are when it starts (a monkeypatched variable, a ``chdir``), which the forkserver, started
once, would not have: :func:`_entry` sets them first. Nothing of dptrain is preloaded, so every
rank imports it afresh, as a spawned one does.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dptrain.distributed.comm import import_dynamo_first

START_METHOD = "forkserver"


def _context() -> multiprocessing.context.BaseContext:
    ctx = mp.get_context(START_METHOD)
    ctx.set_forkserver_preload(["torch"])  # read when the server starts: the first call's
    return ctx


def _where() -> tuple[dict[str, str], str, list[str]]:
    """What a rank takes from the test that starts it: environment, working directory, import path."""
    return dict(os.environ), os.getcwd(), list(sys.path)


def _entry(rank, world_size, init_file, backend, timeout_s, fn, args, where=None):
    if where is not None:
        env, cwd, path = where
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path
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
    _context()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world_size, os.path.join(tmp, "rdzv"), backend, timeout_s, fn, args,
                                         _where()), nprocs=world_size, start_method=START_METHOD)


def start_ranks(world_size, fn, *args, timeout_s=10):
    """Start ranks without joining (for failure tests); returns (processes, tmpdir handle)."""
    tmp = tempfile.TemporaryDirectory()
    ctx = _context()
    procs = [ctx.Process(target=_entry, args=(r, world_size, os.path.join(tmp.name, "rdzv"), "gloo", timeout_s,
                                              fn, args, _where())) for r in range(world_size)]
    for p in procs:
        p.start()
    return procs, tmp


def inf_in_one_gradient(param: torch.Tensor):
    """Put an inf into element [0, 0] of ``param``'s gradient in each backward; returns the hook's handle."""
    return param.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])),
                                                     torch.tensor(float("inf"), dtype=g.dtype)))
