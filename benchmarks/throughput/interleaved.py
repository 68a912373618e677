"""dptrain and its peer in the same processes, in interleaved blocks of steps: a paired comparison a drifting host cannot tilt.

throughput.py alternates whole processes: dptrain's run, then the peer's, each with its own
start-up. On the 2-core VM one side's run swings by up to 1.7x within a round
(benchmarks/results/compile_cpu2_20261127.md), more than the margins being measured, because
the host drifts on the time scale of one run. Here every rank builds both sides, dptrain's
Trainer and the peer's step (benchmarks/throughput/peer.py: DDP + torch.amp, optionally under
torch.compile), warms both up, and then times them in alternating blocks of ``--block`` steps.
Block ``2i`` and ``2i + 1`` form pair ``i``: one block of each side, seconds apart, in the order
dptrain-peer for even pairs and peer-dptrain for odd ones (ABBA). A pair gives one ratio,
dptrain's images/s over the peer's; the report is the median ratio with its quartiles and how
many pairs dptrain won.

Both sides share, so the comparison leaves out: the process and its thread count, the host
allocator settings (dptrain's ``train.host_malloc`` applies to the peer's steps too), the gloo or
NCCL process group and inductor's caches. Cases whose sides differ in their environment cannot
share a process and are left out (throughput.py measures those), and so are CUDA-graph cases
(torch.compile's "reduce-overhead"): cudagraph trees are one per device and process, and two models
replayed in turn would each end the other's step. Written and run on the CPU; not yet run on a GPU.

    python -m benchmarks.throughput.interleaved --suite layout --only "model.compile=true" --pairs 16
    python -m benchmarks.throughput.interleaved --suite gpu --only "vs torch.compile + torch AMP" --dry-run

Results: ``benchmarks/results/interleaved_<suite>_<hardware>_<yyyymmdd>[_tag].md`` with every
block's time.
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import subprocess
import sys
import time

from benchmarks.throughput.throughput import (
    BASE_CONFIG,
    GPU_SUITES,
    REPO,
    SUITES,
    Case,
    dptrain_sets,
    launcher,
    report_path,
    run_json,
    select,
)


def interleavable(c: Case) -> bool:
    """Whether both sides of ``c`` can share a process: it has a peer, no side-specific environment and
    no CUDA graphs (module docstring)."""
    graphs = c.peer_compile == "reduce-overhead" or "model.compile=reduce-overhead" in c.extra_sets
    return c.peer and not c.env and not c.peer_env and not graphs


def pair_stats(blocks: list[dict], images_per_block: int) -> dict:
    """The paired figures from the timed blocks (``{"pair", "side", "s"}``, both sides of every pair,
    and on the CPU ``"steps_s"``, each step's seconds). ``ratio_*``: dptrain's images/s over the peer's
    per pair, the throughput comparison. ``typical_step_ratio`` (CPU): the peer's median step time over
    dptrain's, all steps pooled; the spikes a shared host puts into some steps of either side (a rank
    descheduled while the other waits in the allreduce) move it less than they move a block's time."""
    by_pair: dict[int, dict[str, float]] = {}
    for b in blocks:
        by_pair.setdefault(b["pair"], {})[b["side"]] = b["s"]
    ratios = sorted(p["peer"] / p["dptrain"] for p in by_pair.values())  # images/s ratio = inverse time ratio
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    ips = {side: statistics.median(images_per_block / b["s"] for b in blocks if b["side"] == side)
           for side in ("dptrain", "peer")}
    steps = {side: [t for b in blocks if b["side"] == side for t in b.get("steps_s", [])] for side in ips}
    typical = (round(statistics.median(steps["peer"]) / statistics.median(steps["dptrain"]), 4)
               if steps["peer"] and steps["dptrain"] else None)
    return {"ratio_median": round(q[1], 4), "ratio_q1": round(q[0], 4), "ratio_q3": round(q[2], 4),
            "pairs": len(ratios), "dptrain_won": sum(r > 1.0 for r in ratios),
            "dptrain_ips_median": round(ips["dptrain"], 2), "peer_ips_median": round(ips["peer"], 2),
            "typical_step_ratio": typical}


def worker(args: argparse.Namespace) -> int:
    """One rank (under torchrun): both sides built, warmed up and timed in interleaved blocks."""
    import torch
    import torch.distributed as dist

    from benchmarks.throughput.peer import make_step
    from dptrain.config import load_config
    from dptrain.run import open_communicator
    from dptrain.tools.bench import device_name, versions, warm_up
    from dptrain.topology import Topology
    from dptrain.train import Trainer

    c = next(c for c in SUITES[args.suite](args.quick) if c.name == args.case)
    started = time.perf_counter()
    cfg = load_config(str(BASE_CONFIG), [*dptrain_sets(c), 'data.source="synthetic"'])
    comm = open_communicator(cfg, Topology.from_env())
    device = comm.device
    trainer = Trainer(cfg, comm)
    peer_layout = c.peer_channels_last if c.peer_channels_last is not None else bool(c.channels_last)
    peer_step = make_step(c.model, c.width, c.num_classes, c.precision, c.batch_size, c.image_size, peer_layout,
                          device, comm.rank, comm.world_size, compile_mode=c.peer_compile, model_args=c.model_args)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if comm.world_size > 1:
            dist.barrier()

    def run(side: str, n: int) -> dict:
        """One block: its seconds, and on the CPU (where a step ends when its work does) each step's."""
        step = trainer.train_step if side == "dptrain" else peer_step
        sync()
        t0 = last = time.perf_counter()
        each = []
        for _ in range(n):
            step()
            if device.type == "cpu":
                now = time.perf_counter()
                each.append(round(now - last, 5))
                last = now
        sync()
        return {"s": round(time.perf_counter() - t0, 5), **({"steps_s": each} if each else {})}

    try:
        warm_up(trainer, args.warmup)
        for _ in range(args.warmup):
            peer_step()
        startup_s = time.perf_counter() - started
        blocks = []
        for i in range(args.pairs):
            for side in (("dptrain", "peer") if i % 2 == 0 else ("peer", "dptrain")):
                blocks.append({"pair": i, "side": side, **run(side, args.block)})
        compiled = trainer.compiled is not None
    finally:
        trainer.close()
    comm.close()
    if comm.rank == 0:
        rec = {"case": c.name, **pair_stats(blocks, args.block * cfg.data.batch_size * comm.world_size),
               "block_steps": args.block, "warmup": args.warmup, "dptrain_compiled": compiled,
               "peer_compile": c.peer_compile, "startup_s": round(startup_s, 2), "world_size": comm.world_size,
               "device": device_name(device), "versions": versions(), "blocks": blocks}
        print(json.dumps(rec), flush=True)
    return 0


def worker_cmd(c: Case, suite: str, args: argparse.Namespace) -> list[str]:
    return [*launcher(c.world_size), "-m", "benchmarks.throughput.interleaved", "--worker", f"--suite={suite}", f"--case={c.name}",
            f"--pairs={args.pairs}", f"--block={args.block}", f"--warmup={args.warmup}",
            *(["--quick"] if args.quick else [])]


def render(recs: list[dict], machine: str, date: str, args: argparse.Namespace) -> str:
    out = [f"# dptrain vs peers, interleaved in the same processes ({date})", "", f"Machine: {machine}", "",
           f"Each case: one launch; both sides built in every rank, warmed up ({args.warmup} steps each), then "
           f"{args.pairs} pairs of {args.block}-step blocks, one block of each side per pair, ABBA order "
           "(benchmarks/throughput/interleaved.py). Ratio: dptrain's images/s over the peer's within a pair; median and "
           "quartiles over the pairs. Typical step: the peer's median step time over dptrain's, all steps pooled "
           "(CPU only: steps are not synchronised one by one on a GPU).", "",
           "| case | dptrain compiled | dptrain img/s | peer img/s | ratio (median) | quartiles | pairs won | "
           "typical step |",
           "|---|---|---|---|---|---|---|---|"]
    for r in recs:
        out.append(f"| {r['case']} | {'yes' if r['dptrain_compiled'] else 'no'} | {r['dptrain_ips_median']:.1f} | "
                   f"{r['peer_ips_median']:.1f} | **{r['ratio_median']:.3f}x** | {r['ratio_q1']:.3f}-"
                   f"{r['ratio_q3']:.3f} | {r['dptrain_won']} of {r['pairs']} | "
                   f"{'-' if r['typical_step_ratio'] is None else format(r['typical_step_ratio'], '.3f') + 'x'} |")
    out += ["", "Raw JSON lines (block times in seconds):", "", "```"] + [json.dumps(r) for r in recs] + ["```", ""]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=sorted(SUITES), default="layout")
    ap.add_argument("--only", default="", help="the cases whose name contains this text (or any of several, "
                    "comma-separated)")
    ap.add_argument("--pairs", type=int, default=16, help="block pairs timed per case")
    ap.add_argument("--block", type=int, default=5, help="steps per block")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps of each side first")
    ap.add_argument("--quick", action="store_true", help="the CPU suite's tiny widths (smoke run)")
    ap.add_argument("--allow-slow-dtypes", action="store_true",
                    help="run bf16/fp16 CPU cases even where the CPU has no native kernels for them")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and run nothing")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pairs < 2 or args.pairs % 2 or args.block < 1 or args.warmup < 1:
        # an even count keeps the ABBA order balanced; a warm-up step takes each side's compile and first
        # allocations out of its first timed block
        print("interleaved.py: --pairs must be even and at least 2, --block and --warmup at least 1",
              file=sys.stderr)
        return 2
    if args.worker:
        return worker(args)
    cases = SUITES[args.suite](args.quick)
    left_out = [c.name for c in select(cases, args.only, cpu=False, allow_slow_dtypes=True) if not interleavable(c)]
    if left_out:
        print(f"left out ({len(left_out)}: no peer, a side-specific environment or CUDA graphs): "
              f"{'; '.join(left_out)}", file=sys.stderr)
    cases = select([c for c in cases if interleavable(c)], args.only, cpu=args.suite not in GPU_SUITES,
                   allow_slow_dtypes=args.allow_slow_dtypes)
    if not cases:
        print("no case to run", file=sys.stderr)
        return 2
    if args.dry_run:
        for c in cases:
            print(shlex.join(worker_cmd(c, args.suite, args)))
        return 0
    recs, failed = [], 0
    for c in cases:
        try:
            rec = run_json(worker_cmd(c, args.suite, args))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            failed += 1
            print(str(e), file=sys.stderr)
            continue
        recs.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k not in ("blocks", "versions")}), flush=True)
    if not recs:
        return 1
    device = recs[0]["device"]
    path, date = report_path(args.out, "interleaved", args.suite, device, args.tag)
    path.write_text(render(recs, f"{device}; {platform.platform()}; torch {recs[0]['versions']['torch']}", date, args))
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
