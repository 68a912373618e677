"""Scaling study: ``dptrain bench`` over world sizes, weak and strong scaling.

Each run is ``python -m torch.distributed.run --standalone --nproc-per-node=N -m dptrain
bench ...``; rank 0's JSON line is parsed. Weak scaling keeps the per-solver batch fixed;
strong scaling keeps the global batch fixed (per-solver batch = G / (N * iter_size), an
error if it does not divide). Each point is the median of ``--repeats`` runs by images/s;
the repeats go round-robin over the runs, so a slow spell on a shared host does not land
on one point only.
Outputs in ``--out``: ``scaling_<tag>_<yyyymmdd>.{csv,md,png,jsonl}`` (CSV, markdown table
with the machine description, plot of throughput and efficiency, raw JSON lines).

    python -m benchmarks.scaling.scaling --dry-run                       # print the commands only
    python -m benchmarks.scaling.scaling                                 # CPU: world sizes 1,2 (gloo)
    python -m benchmarks.scaling.scaling --config launch/configs/resnet50_synthetic.toml --synthetic \
        --world-sizes 1,2,4,8 --mode weak                        # one DGX node

Efficiency at world size N, relative to the smallest world size b of the study:
``(images_per_s(N) / images_per_s(b)) / (N / b)``, for weak and strong scaling alike (for
strong scaling this equals ``T_b * b / (T_N * N)`` in step time).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import logging
import os
import platform
import re
import subprocess
import sys
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[2]
Mode = Literal["weak", "strong"]
PHASE_KEYS = ("data_wait_ms", "forward_ms", "backward_ms", "exposed_comm_ms", "update_ms")
EFFICIENCY_TARGET = 0.8
"""Drawn on the efficiency plot; below it we call scaling broken (as in the scaling model's report, benchmarks.scaling.EFFICIENCY_FLOOR)."""

log = logging.getLogger("scaling")


@dataclass(frozen=True)
class Run:
    """One planned ``dptrain bench`` invocation."""

    mode: Mode
    world_size: int
    batch_size: int
    cmd: list[str]


@dataclass
class Row:
    """One point of the study (the median run of its repeats); a CSV row."""

    mode: str
    world_size: int
    batch_size: int
    global_batch: int
    images_per_s: float
    images_per_s_per_solver: float
    step_ms_median: float
    step_ms_p90: float
    data_wait_ms: float
    forward_ms: float
    backward_ms: float
    exposed_comm_ms: float
    update_ms: float
    repeats: int
    device: str
    speedup: float = 1.0
    efficiency: float = 1.0
    images_per_s_min: float = 0.0
    """Slowest and fastest repeat: the spread shows how noisy the host was."""
    images_per_s_max: float = 0.0


CSV_COLUMNS = [f.name for f in fields(Row)]
_REQUIRED_COLUMNS = [f.name for f in fields(Row) if f.default is MISSING]


def parse_world_sizes(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; sorted, unique, each >= 1."""
    try:
        sizes = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError as e:
        raise ValueError(f"--world-sizes must be comma-separated integers, got {text!r}") from e
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--world-sizes must list integers >= 1, got {text!r}")
    return sizes


def per_solver_batch(mode: Mode, world_size: int, *, batch_size: int, global_batch: int, iter_size: int = 1) -> int:
    """Per-solver batch for one run: fixed for weak scaling, G / (N * iter_size) for strong."""
    if mode == "weak":
        return batch_size
    per_step = world_size * iter_size
    if global_batch % per_step:
        raise ValueError(
            f"--global-batch {global_batch} is not divisible by world_size*iter_size ({world_size}*{iter_size}); "
            "pick a global batch that is a multiple of every world size in --world-sizes")
    return global_batch // per_step


def build_command(world_size: int, batch_size: int, *, config: str, steps: int, warmup: int,
                  synthetic: bool = False, sets: list[str] | None = None, python: str = sys.executable) -> list[str]:
    """The torchrun command line of one ``dptrain bench`` run."""
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
           "-m", "dptrain", "bench", "--config", config, "--steps", str(steps), "--warmup", str(warmup)]
    if synthetic:
        cmd.append("--synthetic")
    for s in [*(sets or []), f"data.batch_size={batch_size}"]:
        cmd += ["--set", s]
    return cmd


def plan_runs(modes: list[Mode], world_sizes: list[int], *, batch_size: int, global_batch: int, iter_size: int,
              **cmd_kwargs: Any) -> list[Run]:
    """Every run of the study, in order (all batch sizes are checked before anything runs)."""
    runs = []
    for mode in modes:
        for n in world_sizes:
            b = per_solver_batch(mode, n, batch_size=batch_size, global_batch=global_batch, iter_size=iter_size)
            runs.append(Run(mode, n, b, build_command(n, b, **cmd_kwargs)))
    return runs


def parse_bench_output(stdout: str) -> dict[str, Any]:
    """Rank 0's JSON line from a bench run's stdout (the last line that is a JSON object with images_per_s)."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "images_per_s" in rec:
            return rec
    tail = " | ".join(stdout.strip().splitlines()[-3:])
    raise ValueError(f"no bench JSON line (with images_per_s) in the output; last lines: {tail!r}")


def summarize(mode: Mode, records: list[dict[str, Any]]) -> Row:
    """The row of one point: the run with the median images/s (lower middle for an even count)."""
    if not records:
        raise ValueError(f"no records for a {mode} point")
    rec = sorted(records, key=lambda r: r["images_per_s"])[(len(records) - 1) // 2]
    return Row(mode=mode, world_size=int(rec["world_size"]), batch_size=int(rec["batch_size"]),
               global_batch=int(rec["global_batch"]), images_per_s=float(rec["images_per_s"]),
               images_per_s_per_solver=float(rec["images_per_s_per_solver"]),
               step_ms_median=float(rec["step_ms_median"]), step_ms_p90=float(rec["step_ms_p90"]),
               **{k: float(rec.get(k, 0.0)) for k in PHASE_KEYS}, repeats=len(records), device=str(rec["device"]),
               images_per_s_min=min(r["images_per_s"] for r in records),
               images_per_s_max=max(r["images_per_s"] for r in records))


def add_efficiency(rows: list[Row]) -> list[Row]:
    """Fill speedup and efficiency per mode, relative to that mode's smallest world size."""
    for mode in {r.mode for r in rows}:
        mine = [r for r in rows if r.mode == mode]
        base = min(mine, key=lambda r: r.world_size)
        for r in mine:
            r.speedup = r.images_per_s / base.images_per_s
            r.efficiency = r.speedup / (r.world_size / base.world_size)
    return rows


def write_csv(rows: list[Row], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(r).items()})


def read_csv(path: Path) -> list[Row]:
    """Rows from a CSV written by :func:`write_csv` (unknown columns are ignored; optional ones may be absent)."""
    types = {f.name: f.type for f in fields(Row)}
    conv = {"int": int, "float": float, "str": str}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = set(_REQUIRED_COLUMNS) - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing CSV column(s) {sorted(missing)}")
        return [Row(**{k: conv[str(types[k])](v) for k, v in rec.items() if k in types}) for rec in reader]


def machine_description(records: list[dict[str, Any]]) -> dict[str, str]:
    """What the study ran on, from the bench records and this host."""
    first = records[0] if records else {}
    v = first.get("versions", {})
    return {
        "device": str(first.get("device", "?")),
        "host": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, {platform.system()})",
        "versions": ", ".join(f"{k} {v[k]}" for k in ("torch", "cuda", "nccl", "cupy", "python") if v.get(k)),
        "model": f"{first.get('model', '?')}, precision {first.get('precision', '?')}",
        "git_commit": str(first.get("git_commit", "?")),
        "config_hash": ", ".join(sorted({str(r.get("config_hash")) for r in records})) or "?",
    }


def markdown_table(rows: list[Row], machine: dict[str, str], title: str = "Scaling study") -> str:
    """A markdown section: the machine, then one table per mode."""
    out = [f"## {title}", ""]
    out += [f"- **{k}**: {v}" for k, v in machine.items()]
    out.append("")
    for mode in ("weak", "strong"):
        mine = sorted((r for r in rows if r.mode == mode), key=lambda r: r.world_size)
        if not mine:
            continue
        what = "fixed per-solver batch" if mode == "weak" else f"fixed global batch {mine[0].global_batch}"
        out += [f"### {mode.capitalize()} scaling ({what})", "",
                "| world size | batch/solver | global batch | images/s (min-max) | images/s/solver | "
                "step ms (median / p90) | fwd / bwd / exposed comm / update ms | speedup | efficiency |",
                "|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
        for r in mine:
            spread = f" ({r.images_per_s_min:.0f}-{r.images_per_s_max:.0f})" if r.repeats > 1 else ""
            out.append(f"| {r.world_size} | {r.batch_size} | {r.global_batch} | {r.images_per_s:.1f}{spread} | "
                       f"{r.images_per_s_per_solver:.1f} | {r.step_ms_median:.2f} / {r.step_ms_p90:.2f} | "
                       f"{r.forward_ms:.2f} / {r.backward_ms:.2f} / {r.exposed_comm_ms:.2f} / {r.update_ms:.2f} | "
                       f"{r.speedup:.2f} | {r.efficiency:.2f} |")
        out.append("")
    out.append("Efficiency = (images/s at N / images/s at the smallest N) / (N / smallest N); "
               "each point is the median of its repeats by images/s (spread: slowest-fastest repeat).")
    return "\n".join(out) + "\n"


def plot(rows: list[Row], path: Path, title: str = "") -> Path:
    """PNG: throughput (with ideal linear scaling) and efficiency against world size, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, color in (("weak", "tab:blue"), ("strong", "tab:orange")):
        mine = sorted((r for r in rows if r.mode == mode), key=lambda r: r.world_size)
        if not mine:
            continue
        ns = [r.world_size for r in mine]
        base = mine[0]
        ax_t.plot(ns, [r.images_per_s for r in mine], "o-", color=color, label=f"{mode} scaling")
        ax_t.plot(ns, [base.images_per_s * n / base.world_size for n in ns], "--", color=color, alpha=0.5,
                  label=f"{mode}: ideal")
        ax_e.plot(ns, [r.efficiency for r in mine], "o-", color=color, label=f"{mode} scaling")
    ax_e.axhline(1.0, color="grey", lw=0.8)
    ax_e.axhline(EFFICIENCY_TARGET, color="grey", lw=0.8, ls=":", label=f"{EFFICIENCY_TARGET:.0%}")
    all_ns = sorted({r.world_size for r in rows})
    for ax, ylabel in ((ax_t, "images/s (global)"), (ax_e, "scaling efficiency")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_ns, [str(n) for n in all_ns])
        ax.set_xlabel("world size (solver processes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_e.set_ylim(0, max(1.1, max(r.efficiency for r in rows) * 1.05))
    fig.suptitle(title or f"dptrain scaling: {rows[0].device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def hardware_tag(device: str) -> str:
    """A filename-safe tag: the GPU name, or cpu<cores>."""
    if device.startswith("cpu"):
        return f"cpu{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()}"
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")[:40] or "unknown"


def run_one(run: Run, timeout_s: float) -> dict[str, Any]:
    """Run one bench command; return rank 0's record; raise RuntimeError naming the run on failure."""
    log.info("%s scaling, world size %d, batch %d: %s", run.mode, run.world_size, run.batch_size, " ".join(run.cmd))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        p = subprocess.run(run.cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{run.mode} run at world size {run.world_size} took over {timeout_s} s; "
                           "raise --timeout-s or lower --steps") from e
    if p.returncode != 0:
        tail = "\n".join(p.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"{run.mode} run at world size {run.world_size} exited with {p.returncode}:\n{tail}")
    return parse_bench_output(p.stdout)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="launch/configs/digits.toml", help="recipe (default: %(default)s)")
    ap.add_argument("--world-sizes", help="comma-separated, e.g. 1,2,4,8 (default: 1,2,4,... up to the "
                                          "GPU count; 1,2 on CPU)")
    ap.add_argument("--mode", choices=("weak", "strong", "both"), default="both")
    ap.add_argument("--batch-size", type=int, help="weak scaling: per-solver batch (default: the config's)")
    ap.add_argument("--global-batch", type=int,
                    help="strong scaling: global batch (default: the config's batch_size x the largest world size)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="runs per point; the median by images/s is kept")
    ap.add_argument("--synthetic", action="store_true", help="pass --synthetic to bench")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="passed to bench")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="output directory")
    ap.add_argument("--tag", help="hardware tag in the file names (default: GPU name or cpu<cores>)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and run nothing")
    return ap.parse_args(argv)


def _default_world_sizes() -> list[int]:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        return [1, 2]
    sizes = [1]
    while sizes[-1] * 2 <= gpus:
        sizes.append(sizes[-1] * 2)
    return sizes + ([gpus] if sizes[-1] != gpus else [])


def output_file(stem: Path, ext: str) -> Path:
    """``stem`` + ``ext``; not ``with_suffix``, which would cut a dotted ``--tag`` (and the date after it)."""
    return stem.with_name(stem.name + ext)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    args = _parse_args(argv)
    from dptrain.config import load_config
    from dptrain.errors import ConfigError

    for name in ("steps", "repeats", "batch_size", "global_batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"scaling.py: --{name.replace('_', '-')} must be >= 1, got {value}", file=sys.stderr)
            return 2
    if args.warmup < 0:
        print(f"scaling.py: --warmup must be >= 0, got {args.warmup}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.set)
        world_sizes = parse_world_sizes(args.world_sizes) if args.world_sizes else _default_world_sizes()
        batch = cfg.data.batch_size if args.batch_size is None else args.batch_size
        global_batch = (cfg.data.batch_size * world_sizes[-1] * cfg.solver.iter_size if args.global_batch is None
                        else args.global_batch)
        modes: list[Mode] = ["weak", "strong"] if args.mode == "both" else [args.mode]
        runs = plan_runs(modes, world_sizes, batch_size=batch, global_batch=global_batch,
                         iter_size=cfg.solver.iter_size, config=args.config, steps=args.steps,
                         warmup=args.warmup, synthetic=args.synthetic, sets=args.set)
    except (ConfigError, ValueError) as e:
        print(f"scaling.py: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for r in runs:
            print(f"# {r.mode} scaling, world size {r.world_size}, batch/solver {r.batch_size}")
            print(" ".join(r.cmd))
        return 0
    # Repeats go round-robin over the runs, so a slow spell on a shared host hits every point alike.
    per_run: list[list[dict[str, Any]]] = [[] for _ in runs]
    for k in range(args.repeats):
        for r, recs in zip(runs, per_run, strict=True):
            recs.append(run_one(r, args.timeout_s))
            log.info("-> %.1f images/s (repeat %d/%d)", recs[-1]["images_per_s"], k + 1, args.repeats)
    records = [{"mode": r.mode, **rec} for r, recs in zip(runs, per_run, strict=True) for rec in recs]  # weak and strong can share a config
    rows = add_efficiency([summarize(r.mode, recs) for r, recs in zip(runs, per_run, strict=True)])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"scaling_{args.tag or hardware_tag(rows[0].device)}_{datetime.date.today():%Y%m%d}"
    write_csv(rows, output_file(stem, ".csv"))
    output_file(stem, ".jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    md = markdown_table(rows, {**machine_description(records), "config": args.config,
                               "command": "python -m benchmarks.scaling.scaling " + " ".join(argv or sys.argv[1:])})
    output_file(stem, ".md").write_text(md)
    plot(rows, output_file(stem, ".png"))
    print(md)
    print(f"wrote {stem}.{{csv,md,png,jsonl}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
