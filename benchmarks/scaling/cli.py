"""``python -m benchmarks.scaling``: predictions for the machines and node counts asked, from a profile or
the reference one, and with ``--calibrate`` gloo's alpha and beta measured on this host."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

from benchmarks.scaling.allreduce import fit_alpha_beta
from benchmarks.scaling.machine import MACHINES, PROFILES, InputPath, input_path_from_data_bench
from benchmarks.scaling.profile import (
    BatchCost,
    Profile,
    batch_points,
    fit_batch_cost,
    last_json_line,
    load_profile,
    profile_to_json,
    rebucket,
)
from benchmarks.scaling.report import calibration_report, emit_report, report_predictions, shard_report
from benchmarks.scaling.shard import compare_rows, gpu_counts, rows_to_json, sweep_caps
from benchmarks.scaling.workload import MODELS, Workload, load_workload, reference_profile

DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB = 25.0, 1.0
"""dptrain's reducer.bucket_mb / first_bucket_mb defaults (as DDP), used to plan a per-parameter profile."""


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    # the package docstring: the model, its modules and the usage
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=sys.modules[__package__].__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machines", default="dgx-h100", help=f"comma-separated from {sorted(MACHINES)} "
                    "(benchmarks/scaling/profiles/machines/<key>.toml; add your own file there)")
    ap.add_argument("--profile", help="trace (PATH.rank0.json) or profile JSON; default: the reference ResNet-50")
    ap.add_argument("--profile-batch", type=int, default=0, help="per-solver batch of --profile")
    ap.add_argument("--workload", default=str(PROFILES / "workloads" / "resnet50.toml"),
                    help="comma-separated workload profiles, by path or by name in benchmarks/scaling/profiles/workloads/ "
                         "(resnet50, vit_l): one-GPU rates, jitter, input ceilings")
    ap.add_argument("--bucket-mb", type=float, help="re-bucket the profile (default: its own plan; "
                                                     f"{DEFAULT_BUCKET_MB:g} for a per-parameter profile)")
    ap.add_argument("--first-bucket-mb", type=float, default=DEFAULT_FIRST_BUCKET_MB)
    ap.add_argument("--nodes", default="1,4,16,64")
    ap.add_argument("--global-batch", type=int, default=8192, help="strong scaling (Goyal et al. 2017's largest)")
    ap.add_argument("--batch-points", help="one-solver `dptrain bench` JSON lines at >= 3 batch sizes of the profiled "
                    "model: strong scaling uses the fitted step(b) = fixed + b x per_image instead of a step linear "
                    "in the batch")
    ap.add_argument("--input-bench", help="a `dptrain data-bench` JSON line measured on one node of the machine: "
                    "the real-data column uses it (CPU ms per image x the machine's cores; images/s per process) "
                    "instead of the workload's input path")
    ap.add_argument("--sweep-mb", default="1,2,5,10,25,50,100,200")
    ap.add_argument("--algorithm", default="best", choices=("best", "ring", "tree", "hierarchical"))
    ap.add_argument("--shard", default="none", choices=("none", "optimizer"),
                    help="optimizer: also price the run with reducer.shard = \"optimizer\" (reduce-scatter, update on "
                         "1/N, all-gather), against unsharded, with the memory per GPU of each")
    ap.add_argument("--gather-wait", default="forward", choices=("forward", "step"),
                    help="with --shard optimizer: reducer.gather_wait, when the updated weights' all-gathers are waited for")
    ap.add_argument("--json", help="also write the per-GPU-count predictions and memory per GPU as JSON here")
    ap.add_argument("--calibrate", action="store_true", help="measure gloo allreduce with 2 local processes and fit")
    ap.add_argument("--sizes", default="4096,65536,262144,1048576,4194304,16777216", help="calibration bytes")
    ap.add_argument("--iters", type=int, default=20, help="calibration repetitions per size")
    ap.add_argument("--measured-bench", help="with --calibrate: file with a 2-process `dptrain bench` JSON line")
    ap.add_argument("--bench-profile", help="trace or profile JSON of the --measured-bench run, for its predicted step")
    ap.add_argument("--write-profile", help="also write the profile used for the first machine as JSON here")
    ap.add_argument("--out", help="write the report to OUT/scaling_model_<yyyymmdd>.md")
    return ap.parse_args(argv)


def _workloads(spec: str) -> list[Workload]:
    """The workload files of a comma-separated list of paths or names in profiles/workloads/."""
    out = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        path = Path(item) if item.endswith(".toml") else PROFILES / "workloads" / f"{item}.toml"
        if not path.exists():
            names = sorted(q.stem for q in (PROFILES / "workloads").glob("*.toml"))
            raise ValueError(f"--workload: no file {path}; give a path or one of {names}")
        out.append(load_workload(path))
    return out


def _shard_section(raw: Profile, key: str, wl: Workload, nodes: list[int], sweep: list[float], plan_mb: float | None,
                   args: argparse.Namespace, json_out: list[dict]) -> str:
    """The sharded-against-unsharded section of one workload on one machine (markdown with --shard optimizer),
    its rows (unsharded only without it) appended to ``json_out`` for --json."""
    shard = args.shard == "optimizer"
    if not (shard or args.json):
        return ""
    m = MACHINES[key]
    p = rebucket(raw, plan_mb, args.first_bucket_mb) if plan_mb else raw
    gpus = gpu_counts(m, nodes)
    elem_bytes = int(wl.machines.get(key, {}).get("grad_bytes_per_param", 2))
    rows = compare_rows(p, m, gpus, args.algorithm, lambda n: wl.terms(key, n, synthetic=True), elem_bytes=elem_bytes,
                        shard=shard, gather_wait=args.gather_wait)
    caps = sweep_caps(raw, m, gpus[-1], sorted({*sweep, plan_mb or 0} - {0}), args.first_bucket_mb,
                      args.algorithm, lambda n: wl.terms(key, n, synthetic=True), elem_bytes=elem_bytes,
                      gather_wait=args.gather_wait) if shard else []
    json_out.append({"machine": key, "model": wl.model, "profile": p.source, "buckets": len(p.buckets),
                     "shard": args.shard, "gather_wait": args.gather_wait, "algorithm": args.algorithm,
                     "rows": rows_to_json(rows), "caps_at_largest": caps})
    return "\n" + shard_report(p, m, rows, update_bytes_per_param=wl.update_bytes_per_param,
                               gather_wait=args.gather_wait, caps=caps) if shard else ""


def _section(raw: Profile, key: str, wl: Workload, args: argparse.Namespace, *, nodes: list[int], sweep: list[float],
             cost: BatchCost | None, measured: InputPath | None, titled: bool, json_out: list[dict]) -> str:
    """One workload on one machine: the predictions (``report_predictions``) and, with --shard optimizer,
    the sharded run against the unsharded one."""
    plan_mb = args.bucket_mb or (DEFAULT_BUCKET_MB if raw.granularity == "parameter" else None)
    path = measured or wl.input_path(key)
    has_ceiling = bool(path and path.stated)
    text = report_predictions(raw, key, nodes, bucket_mb=plan_mb, first_bucket_mb=args.first_bucket_mb,
                              global_batch=args.global_batch, sweep_mb=sweep, algorithm=args.algorithm,
                              terms=lambda n: wl.terms(key, n, synthetic=True),
                              real_data=(lambda n: wl.terms(key, n, path=path)) if has_ceiling else None,
                              cost=cost, input_name=f"{path.name}'s input path" if has_ceiling else "the input path",
                              title=f"{MACHINES[key].name}: {MODELS[wl.model][0]}" if titled and wl.model in MODELS
                              else None)
    return text + _shard_section(raw, key, wl, nodes, sweep, plan_mb, args, json_out)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        keys = [k.strip() for k in args.machines.split(",") if k.strip()]
        unknown = [k for k in keys if k not in MACHINES]
        if unknown:
            raise ValueError(f"--machines: unknown {unknown}; choose from {sorted(MACHINES)}")
        nodes = sorted({int(x) for x in args.nodes.split(",")})
        sweep = [float(x) for x in args.sweep_mb.split(",")]
        if bool(args.measured_bench) != bool(args.bench_profile):
            raise ValueError("--measured-bench and --bench-profile go together (a bench JSON line and its trace)")
        given = load_profile(args.profile, args.profile_batch) if args.profile else None
        wls = _workloads(args.workload)
        bench_profile = load_profile(args.bench_profile) if args.bench_profile else None
        cost = fit_batch_cost(batch_points(args.batch_points), args.batch_points) if args.batch_points else None
        measured = input_path_from_data_bench(args.input_bench) if args.input_bench else None
    except (ValueError, OSError) as e:
        print(f"benchmarks.scaling: error: {e}", file=sys.stderr)
        return 2
    md = [f"## Scaling model predictions ({datetime.date.today():%Y-%m-%d})", "",
          "Terms beyond the overlap model: contention and host floor from the machine and workload files, "
          f"jitter_cv {', '.join(dict.fromkeys(f'{wl.jitter_cv:g}' for wl in wls))} (fit, "
          "benchmarks/scaling/scaling_validate.py); the input ceilings of the machine's "
          "input path (benchmarks/scaling/profiles/inputs.toml: stated or measured, never fitted). The validated error of "
          "these predictions is in benchmarks/results/scaling_validation_*.md.", "",
          (f"Strong scaling: step(b) = {cost.fixed_ms:.2f} ms + b x {cost.per_image_ms:.3f} ms, fitted from "
           f"{len(cost.points)} bench runs ({cost.source}; largest error {cost.max_error:.1%})" if cost else
           "Strong scaling: step(b) = the workload file's fixed step cost per machine + b x per image, where it "
           "states one (fitted on a published strong-scaling row by scaling_validate.py), else compute linear in "
           "the per-GPU batch (optimistic at small batches)."), ""]
    json_out: list[dict] = []
    wrote_profile = False
    for wl in wls:
        for key in keys:
            if given is None and key not in wl.machines:
                md.append(f"### {MACHINES[key].name}: {MODELS.get(wl.model, (wl.model,))[0]}\n\nNot modelled: the "
                          f"workload file of {wl.model} has no [machines.{key}] entry.\n")
                continue
            raw = given or reference_profile(key, workload=wl)
            if args.write_profile and not wrote_profile:
                Path(args.write_profile).write_text(json.dumps(profile_to_json(raw), indent=1))
                wrote_profile = True
            md.append(_section(raw, key, wl, args, nodes=nodes, sweep=sweep,
                               cost=cost or (None if given else wl.batch_cost(key)), measured=measured,
                               titled=len(wls) > 1, json_out=json_out))
    if args.calibrate:
        md.append(_calibration(args, bench_profile))
    emit_report("\n".join(md), args.out, "scaling_model")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": f"{datetime.date.today():%Y-%m-%d}",
                                               "argv": sys.argv[1:] if argv is None else argv,
                                               "sections": json_out}, indent=1))
    return 0


def _calibration(args: argparse.Namespace, bench_profile: Profile | None) -> str:
    """``--calibrate``: gloo's alpha and beta measured with 2 local processes, against the model."""
    import platform

    import torch

    from benchmarks.scaling.collective_bench import measure_allreduce

    points = measure_allreduce([int(s) for s in args.sizes.split(",")], world_size=2, iters=args.iters)
    alpha_us, busbw = fit_alpha_beta([s for s, _ in points], [t for _, t in points], 2)
    bench = last_json_line(args.measured_bench, ("step_ms_median",), "dptrain bench") if args.measured_bench else None
    return "\n".join(["### Calibration on this machine", "",
                      f"Host {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, shared with other jobs), "
                      f"torch {torch.__version__}, gloo over a file:// rendezvous; median of {args.iters} timed calls "
                      "per size.", "", calibration_report(points, 2, alpha_us, busbw, bench, bench_profile)])
