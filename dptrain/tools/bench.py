"""``dptrain bench``: training throughput with a per-phase breakdown, as one JSON line.

Three stages: ``warmup`` untimed steps (with ``reducer.bucket_mb = "auto"``, as many more as
its probe and check take, so the chosen plan is what is timed; ``warmup`` in the record counts
them); ``steps`` timed steps (a device sync closes each
step, so step times are real); then ``phase_steps`` steps timed phase by phase
(``trace.PhaseTimer``: host times on the CPU, CUDA events on the compute stream on a GPU,
which do not disturb the overlap), giving data_wait, forward, backward, exposed_comm (the
compute stream, or the host on gloo, waiting for the allreduces after backward) and update.
On the CPU, rank 0's exposed_comm is also split, step by step, into ``backward_skew_ms``
(its wait for the rank that finished backward last) and ``comm_after_slowest_ms`` (the
communication still exposed after that, the least wait over the ranks): the first is
straggling, the second the cost of the collectives themselves
(``straggler.StragglerMonitor.line_up``).
Throughput figures come from the untimed-phase steps only. ``startup_s`` is the time from the
start of the command's work (after Python and torch imported) to the first timed step: process
group, data, model, the ``model.compile`` compile (``compile_s``) and the warm-up steps.
"""
from __future__ import annotations

import logging
import math
import platform
import resource
import statistics
import time
from typing import Any

import torch

from dptrain import kernels
from dptrain.config import TrainConfig, add_config_arguments, config_hash, load_config
from dptrain.errors import ConfigError
from dptrain.observe.provenance import git_commit
from dptrain.observe.trace import NullTracer, Tracer
from dptrain.precision import cpu_native_support
from dptrain.run import open_communicator
from dptrain.topology import Topology
from dptrain.train import Trainer

log = logging.getLogger(__name__)

PHASES = ("data_wait", "forward", "backward", "exposed_comm", "update", "gather")
"""The timed phases of a step; "gather" launches the updated weights' all-gathers (``reducer.shard``; 0 unsharded)."""


def versions() -> dict[str, str | None]:
    """torch, CUDA, NCCL, CuPy and Python versions (None where absent)."""
    out: dict[str, str | None] = {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": None,
                                  "cupy": None, "python": platform.python_version()}
    if torch.cuda.is_available():
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    try:
        import cupy

        out["cupy"] = cupy.__version__
    except ImportError:
        pass
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    native = [d for d in ("bf16", "fp16") if cpu_native_support(d)]
    return (f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
            f"{torch.backends.cpu.get_cpu_capability()}, native {'/'.join(native) or 'fp32 only'})")


def peak_mem_bytes(device: torch.device) -> int:
    """Peak device memory allocated by torch on CUDA; peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_usage_per_step(before: resource.struct_rusage, after: resource.struct_rusage, steps: int) -> dict[str, float]:
    """Rank 0's process, per timed step: minor page faults (pages the kernel mapped in, and zeroed,
    again: see ``train.host_malloc``) and system CPU ms (those faults, and gloo's socket copies)."""
    return {"host_minor_faults_per_step": round((after.ru_minflt - before.ru_minflt) / steps, 1),
            "host_sys_ms_per_step": round((after.ru_stime - before.ru_stime) * 1000.0 / steps, 3)}


def _percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least a fraction ``q`` of the values at or below it."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def warm_up(trainer: Trainer, steps: int) -> int:
    """``steps`` untimed steps, then as many more as the auto bucket plan needs to be chosen and checked,
    so that the timed steps run the chosen plan, not the probe (every rank alike); the steps added."""
    for _ in range(steps):
        trainer.train_step()
    extra = 0
    while trainer.bucket_tuner is not None and trainer.bucket_tuner.pending:
        trainer.train_step()
        extra += 1
    return extra


def run_bench(cfg: TrainConfig, *, steps: int, warmup: int, phase_steps: int, trace: str | None) -> dict[str, Any] | None:
    """Run the benchmark on this rank; return the record on rank 0, None elsewhere."""
    if steps <= 0 or warmup < 0 or phase_steps < 0:
        raise ConfigError(f"bench needs --steps > 0 and non-negative --warmup/--phase-steps, got "
                         f"{steps}/{warmup}/{phase_steps}")
    started = time.perf_counter()
    topology = Topology.from_env()
    comm = open_communicator(cfg, topology)
    device = comm.device
    tracer = Tracer(comm.rank) if trace else NullTracer(comm.rank)
    trainer = Trainer(cfg, comm, tracer=tracer)
    try:
        trainer.time_phases(False)
        extra = warm_up(trainer, warmup)
        if extra and comm.rank == 0:
            log.info("bench: %d more warm-up step(s) until the auto bucket plan was chosen and checked", extra)
        warmup += extra
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        trainer.clock.take()  # per-rank step times over the timed steps only
        startup_s = time.perf_counter() - started
        step_ms = []
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.train_step()
            _sync(device)
            step_ms.append((time.perf_counter() - t0) * 1000.0)
        host = _host_usage_per_step(usage0, resource.getrusage(resource.RUSAGE_SELF), steps)
        graphs = trainer.compiled is not None and trainer.compiled.cuda_graphs
        skips = trainer.compiled.cuda_graph_skips if graphs else None  # at start-up and in the timed steps
        ranks = trainer.stragglers.gather(trainer.clock)  # collective: every rank, same point
        tracer.events.clear()
        trainer.time_phases(True)
        trainer.clock.host_marks = [] if device.type == "cpu" else None
        for _ in range(phase_steps):
            trainer.train_step()
        phase_ms = trainer.phase_totals_ms()
        lined_up = trainer.stragglers.line_up(trainer.clock.host_marks or [])  # collective: every rank
        if trace:
            tracer.save(trace)
    finally:
        trainer.close()
    comm.close()
    if comm.rank != 0:
        return None
    p = trainer.setup
    total_s = sum(step_ms) / 1000.0
    ips = p.global_batch * steps / total_s
    rec: dict[str, Any] = {
        "images_per_s": round(ips, 2),
        "images_per_s_per_solver": round(ips / p.world_size, 2),
        "step_ms_median": round(statistics.median(step_ms), 3),
        "step_ms_p90": round(_percentile(step_ms, 0.9), 3),
        **host,
        **ranks,
    }
    for ph in PHASES:  # None when --phase-steps 0 measured no phase (not 0.0, which would read as free)
        rec[f"{ph}_ms"] = round(phase_ms.get(ph, 0.0) / phase_steps, 3) if phase_steps else None
    rec.update(lined_up)
    rec.update({
        "peak_mem_bytes": peak_mem_bytes(device),
        "startup_s": round(startup_s, 2),
        "compiled": trainer.compiled is not None,
        # recorded and replayed: asked for, on CUDA, and no graph skipped up to the last timed step
        "cuda_graphs": graphs and trainer.device.type == "cuda" and skips == 0,
        "cuda_graph_skips": skips,
        "compile_s": round(trainer.compiled.compile_s, 2) if trainer.compiled is not None else None,
        "solver": cfg.solver.type,
        "update_kernel": kernels.update_backend(trainer.flat.groups[0].grads, cpu_fused=cfg.solver.cpu_fused_update),
        "bytes_per_param": trainer.optimizer.bytes_per_param(),
        "state_bytes_per_rank": trainer.flat.state_bytes(),
        "shard": cfg.reducer.shard,
        "num_params": trainer.flat.num_params,
        "versions": versions(),
        "device": device_name(device),
        "world_size": p.world_size,
        "batch_size": p.batch_size,
        "global_batch": p.global_batch,
        "iter_size": p.iter_size,
        "model": cfg.model.name,
        "precision": cfg.precision.storage,
        "precision_mode": cfg.precision.mode,
        "reduce_dtype": p.reduce_dtype,
        "data": cfg.data.source,
        "bucket_mb": cfg.reducer.bucket_mb,
        "auto_buckets": (trainer.bucket_tuner.report or None) if trainer.bucket_tuner is not None else None,
        "config_hash": config_hash(cfg),
        "git_commit": git_commit(),
        "steps": steps,
        "warmup": warmup,
    })
    return rec


def add_arguments(b: Any) -> None:
    """``dptrain bench``'s arguments."""
    b.description = ("Time training steps after a warm-up and print images/s, step time percentiles and a "
                     "per-phase breakdown as one JSON line.")
    add_config_arguments(b)
    b.add_argument("--synthetic", action="store_true", help="use synthetic data (takes the input pipeline out)")
    b.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    b.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps (default 5)")
    b.add_argument("--phase-steps", type=int, default=5,
                   help="extra steps timed phase by phase with device syncs (default 5)")
    b.add_argument("--trace", metavar="PATH", help="write a Chrome trace per rank of the phase-timed steps")


def main(args: Any) -> dict[str, Any] | None:
    """``dptrain bench``: the record rank 0 prints."""
    overrides = list(args.set)
    if args.synthetic:
        overrides.append('data.source="synthetic"')
    return run_bench(load_config(args.config, overrides), steps=args.steps, warmup=args.warmup,
                     phase_steps=args.phase_steps, trace=args.trace)
