"""The scaling model against published 1-to-N GPU tables: fit on some rows, check on the others.

Rows come from ``benchmarks/profiles/published/*.toml``, each with its source. A row's role:
"fit" rows set the workload's ``jitter_cv`` (least squares over a grid), "fit-input" rows set
their machine's input ceiling per node (the row is input-bound: ceiling = its N-GPU images/s
per node, so its own error is 0 by construction), "check" rows are predicted with what the
fit rows set and never influence it. Each row is predicted with its own one-GPU rate, batch
and 4 B gradients (the published runs are PyTorch DDP with fp32 gradients; DDP broadcasts
the BatchNorm buffers before forward, so that collective is exposed), and the error is
predicted minus published weak-scaling efficiency, in percentage points. The plain overlap
model (the 2026-11-23 model) is shown beside it.

    python benchmarks/scaling_validate.py --out benchmarks/results
"""
from __future__ import annotations

import argparse
import datetime
import sys
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scaling_model as sm  # noqa: E402

GOAL_PP = 5.0
"""The issue's target: every cited row within 5 percentage points of efficiency."""
DDP_GRAD_BYTES = 4
JITTER_GRID = [i / 2000 for i in range(201)]  # cv 0 .. 0.1 in steps of 0.0005


@dataclass(frozen=True)
class Row:
    label: str
    machine: str
    gpus: int
    batch_size: int
    images_per_s_1: float
    images_per_s_n: float
    role: str
    source: str
    pipeline: str = "pytorch-dataloader"
    """Input ceilings are fitted per (machine, pipeline): another framework's loader is another ceiling."""

    @property
    def efficiency(self) -> float:
        return self.images_per_s_n / (self.gpus * self.images_per_s_1)


def load_rows(*paths: Path) -> list[Row]:
    rows = [Row(**r) for path in paths for r in tomllib.loads(path.read_text())["rows"]]
    bad = [r.label for r in rows if r.role not in ("fit", "fit-input", "check") or r.machine not in sm.MACHINES]
    if bad:
        raise ValueError(f"{', '.join(map(str, paths))}: rows {bad} need role fit|fit-input|check and a machine in "
                         f"{sorted(sm.MACHINES)}")
    return rows


Ceilings = dict[tuple[str, str], float]
"""(machine, pipeline) -> input images/s per node."""


def predict(row: Row, wl: sm.Workload, ceilings: Ceilings, plain: bool = False) -> float:
    """Predicted weak-scaling efficiency of ``row`` (plain: the overlap model alone)."""
    m = sm.MACHINES[row.machine]
    p = sm.reference_profile(row.machine, row.batch_size, images_per_s=row.images_per_s_1,
                             grad_bytes=DDP_GRAD_BYTES, workload=wl)
    p = sm.rebucket(p, sm.DEFAULT_BUCKET_MB, sm.DEFAULT_FIRST_BUCKET_MB)
    nodes = max(1, row.gpus // m.gpus_per_node)
    t = sm.plain_terms(m)(nodes) if plain else replace(
        wl.terms(row.machine, nodes, stats_exposed=True),
        input_images_per_s_per_node=ceilings.get((row.machine, row.pipeline), 0.0))
    pred = sm.simulate_step(p, sm.comm_fn(m, nodes, gpus_per_node=min(row.gpus, m.gpus_per_node)), t)
    return sm.weak_efficiency(p, pred, t)


def fit(rows: list[Row], wl: sm.Workload) -> tuple[float, Ceilings]:
    """(jitter_cv, input ceiling per machine and pipeline) from the fit rows."""
    ceilings = {(r.machine, r.pipeline): r.images_per_s_n / max(1, r.gpus // sm.MACHINES[r.machine].gpus_per_node)
                for r in rows if r.role == "fit-input"}
    fit_rows = [r for r in rows if r.role == "fit"]

    def sse(cv: float) -> float:
        w = replace(wl, jitter_cv=cv)
        return sum((predict(r, w, ceilings) - r.efficiency) ** 2 for r in fit_rows)

    return min(JITTER_GRID, key=sse), ceilings


def report(rows: list[Row], wl: sm.Workload, sources: list[Path]) -> str:
    cv, ceilings = fit(rows, wl)
    fitted = replace(wl, jitter_cv=cv)
    out = [f"# Scaling model vs published 1-to-N tables ({datetime.date.today():%Y-%m-%d})", "",
           "`python benchmarks/scaling_validate.py --out benchmarks/results`; rows: "
           + ", ".join(f"`{p.relative_to(sm.PROFILES.parent.parent)}`" for p in sources) + ".",
           "", f"Fitted on the fit rows: jitter_cv = {cv:g} (the workload file holds {wl.jitter_cv:g}); input ceiling "
           "per node: " + ", ".join(f"{m} ({pipe}) {v:,.0f} img/s" for (m, pipe), v in ceilings.items()) + ". Contention per machine file "
           "(assumed 0.15, see below).", "",
           "| row | role | GPUs | published img/s, 1 -> N | published efficiency | overlap model only (2026-11-23) "
           "| corrected model | error (points) |", "|---|---|---:|---|---:|---:|---:|---:|"]
    errors = []
    for r in rows:
        new, old = predict(r, fitted, ceilings), predict(r, fitted, ceilings, plain=True)
        err = (new - r.efficiency) * 100
        if r.role == "check":
            errors.append(abs(err))
        out.append(f"| {r.label} | {r.role} | {r.gpus} | {r.images_per_s_1:,.0f} -> {r.images_per_s_n:,.0f} | "
                   f"{r.efficiency:.3f} | {old:.3f} ({(old - r.efficiency) * 100:+.1f}) | {new:.3f} | {err:+.1f} |")
    worst = max(abs(predict(r, fitted, ceilings) - r.efficiency) for r in rows) * 100
    lo = max(abs(_with_contention(r, fitted, ceilings, 0.0) - r.efficiency) for r in rows) * 100
    hi = max(abs(_with_contention(r, fitted, ceilings, 1.0) - r.efficiency) for r in rows) * 100
    out += ["", f"Check rows: largest error {max(errors):.1f} points, mean {sum(errors) / len(errors):.1f} "
            f"({len(errors)} rows); goal {GOAL_PP:g} points: {'met' if max(errors) <= GOAL_PP else 'NOT met'}. "
            f"Largest error over all rows {worst:.1f} points; with contention 0 instead: {lo:.1f}, "
            f"with contention 1: {hi:.1f} (the tables do not identify it).", "",
            "A fit-input row is reproduced because its machine's input ceiling was fitted to it: the model does "
            "not predict that ceiling, it carries it from a measurement to the other rows of that machine.", "",
            "Sources of the rows:", ""] + [f"- {r.label}: {r.source}" for r in rows]
    return "\n".join(out) + "\n"


def _with_contention(row: Row, wl: sm.Workload, ceilings: Ceilings, contention: float) -> float:
    m = sm.MACHINES[row.machine]
    sm.MACHINES[row.machine] = replace(m, contention=contention)
    try:
        return predict(row, wl, ceilings)
    finally:
        sm.MACHINES[row.machine] = m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(str(p) for p in sorted((sm.PROFILES / "published").glob("*.toml"))),
                    help="comma-separated published-rows files")
    ap.add_argument("--workload", default=str(sm.PROFILES / "workloads" / "resnet50.toml"))
    ap.add_argument("--out", help="write OUT/scaling_validation_<yyyymmdd>.md")
    args = ap.parse_args(argv)
    try:
        sources = [Path(p).resolve() for p in args.rows.split(",")]
        rows, wl = load_rows(*sources), sm.load_workload(Path(args.workload))
    except (ValueError, OSError, TypeError) as e:
        print(f"scaling_validate.py: error: {e}", file=sys.stderr)
        return 2
    text = report(rows, wl, sources)
    sm.emit_report(text, args.out, "scaling_validation")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
