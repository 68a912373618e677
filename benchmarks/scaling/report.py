"""The markdown reports: weak and strong scaling tables, the bucket-cap sweep, where efficiency first
falls below :data:`EFFICIENCY_FLOOR` and why, and the gloo calibration against its measurements."""
from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.scaling.allreduce import Algorithm, allreduce_cost, comm_fn, ring_allreduce
from benchmarks.scaling.machine import MACHINES, Link, Machine
from benchmarks.scaling.profile import MIB, BatchCost, Profile, rebucket, scale_to_batch
from benchmarks.scaling.simulation import (
    StepPrediction,
    Terms,
    auto_plan,
    comm_step_ms,
    one_solver_ms,
    simulate_step,
    sweep_bucket_sizes,
    weak_efficiency,
)

EFFICIENCY_FLOOR = 0.8
"""Below this efficiency we say scaling has broken down."""


def _pow2_up_to(limit: int) -> list[int]:
    return [2**k for k in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def explain(p: Profile, pred: StepPrediction, m: Machine, nodes: int, algorithm: Algorithm,
            cost: BatchCost | None = None) -> str:
    """Why the efficiency is what it is: exposed comm, latency vs bandwidth, replicated update, and
    with ``cost`` the part of the step that does not shrink with the batch."""
    costs = [allreduce_cost(b.nbytes, m, nodes, algorithm) for b in p.buckets]
    lat, xfer = sum(c.latency_ms for c in costs), sum(c.transfer_ms for c in costs)
    bound = "latency-bound" if lat > xfer else "bandwidth-bound"
    return (f"exposed comm {pred.exposed_ms:.2f} ms = {pred.exposed_ms / pred.step_ms:.0%} of the {pred.step_ms:.2f} ms "
            f"step; {len(costs)} allreduces take {lat + xfer:.2f} ms per step against {p.backward_ms:.2f} ms of "
            f"backward, {lat:.2f} ms of it latency ({bound}); the update ({p.update_ms:.2f} ms, "
            f"{p.update_ms / pred.step_ms:.0%}) runs on every GPU and does not shrink with more GPUs"
            + (f"; the step's fixed part ({cost.fixed_ms:.2f} ms, {cost.fixed_ms / pred.step_ms:.0%} of the step) "
               "does not shrink with the batch" if cost else ""))


TermsFn = Callable[[int], Terms]
"""Node count -> the per-step terms at that scale."""


def plain_terms(m: Machine) -> TermsFn:
    """The overlap model alone (no contention, jitter, input ceiling or host floor)."""
    return lambda nodes: Terms(world_size=nodes * m.gpus_per_node, gpus_per_node=m.gpus_per_node)


def weak_rows(p: Profile, m: Machine, nodes_list: list[int], algorithm: Algorithm,
              terms: TermsFn | None = None) -> list[dict[str, Any]]:
    terms = terms or plain_terms(m)
    rows = []
    for nodes in nodes_list:
        t = terms(nodes)
        pred = simulate_step(p, comm_fn(m, nodes, algorithm), t)
        biggest = max(p.buckets, key=lambda b: b.nbytes)
        c = allreduce_cost(biggest.nbytes, m, nodes, algorithm)
        n = nodes * m.gpus_per_node
        rows.append({"nodes": nodes, "gpus": n, "pred": pred, "eff": weak_efficiency(p, pred, t),
                     "ips": n * p.batch_size / pred.step_ms * 1e3 if p.batch_size else None,
                     "big": f"{biggest.nbytes / MIB:.1f} MiB: {c.total_ms:.3f} ms ({c.algorithm})"})
    return rows


def strong_rows(p: Profile, m: Machine, nodes_list: list[int], global_batch: int, algorithm: Algorithm,
                terms: TermsFn | None = None, cost: BatchCost | None = None) -> list[dict[str, Any]]:
    """Rows for every node count whose per-GPU batch G / (nodes g) is a whole number >= 1; compute
    scales with the per-GPU batch as ``cost`` says (None: linearly)."""
    terms = terms or plain_terms(m)
    full = scale_to_batch(p, global_batch, cost)
    t1 = one_solver_ms(full, replace(terms(1), world_size=1))
    rows = []
    for nodes in nodes_list:
        n = nodes * m.gpus_per_node
        if global_batch % n:
            continue
        q = scale_to_batch(p, global_batch / n, cost)
        pred = simulate_step(q, comm_fn(m, nodes, algorithm), terms(nodes))
        rows.append({"nodes": nodes, "gpus": n, "batch": global_batch // n, "pred": pred, "q": q,
                     "eff": t1 / (n * pred.step_ms), "ips": global_batch / pred.step_ms * 1e3})
    return rows


def report_predictions(raw: Profile, key: str, nodes_list: list[int], *, bucket_mb: float | None,
                       first_bucket_mb: float, global_batch: int, sweep_mb: list[float], algorithm: Algorithm,
                       terms: TermsFn | None = None, real_data: TermsFn | None = None,
                       cost: BatchCost | None = None, input_name: str = "the input path",
                       title: str | None = None) -> str:
    """Markdown: weak scaling at ``nodes_list``, bucket sweep, strong scaling and where scaling breaks.

    ``raw`` is re-bucketed to ``bucket_mb`` (None: keep its plan); the sweep re-buckets ``raw``.
    ``terms``: the per-step terms with synthetic data; ``real_data``: with the input ceiling too;
    ``cost``: the step time in the batch for strong scaling (None: compute linear in the batch);
    ``title``: the section heading (default: the machine's name).
    """
    m = MACHINES[key]
    terms = terms or plain_terms(m)
    p = rebucket(raw, bucket_mb, first_bucket_mb) if bucket_mb else raw
    real = {r["nodes"]: r for r in weak_rows(p, m, nodes_list, algorithm, real_data)} if real_data else {}
    out = [f"### {title or m.name}", "", f"Profile: {p.source}. Forward {p.forward_ms:.2f} ms, backward {p.backward_ms:.2f} ms, "
           f"update {p.update_ms:.2f} ms, {p.total_bytes / MIB:.1f} MiB of gradients in {len(p.buckets)} buckets; "
           f"algorithm {algorithm}.", "",
           "| nodes | GPUs | largest bucket allreduce | comm busy ms | exposed ms | contention ms | jitter ms | step ms "
           f"| weak efficiency, synthetic data | fed by {input_name} | images/s (synthetic) |",
           "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in weak_rows(p, m, nodes_list, algorithm, terms):
        ips = f"{r['ips']:,.0f}" if r["ips"] else "-"
        pr = r["pred"]
        ceiling = f"{real[r['nodes']]['eff']:.3f}" if r["nodes"] in real else "-"
        out.append(f"| {r['nodes']} | {r['gpus']} | {r['big']} | {pr.comm_busy_ms:.3f} | {pr.exposed_ms:.3f} | "
                   f"{pr.contention_ms:.3f} | {pr.jitter_ms:.2f} | {pr.step_ms:.2f} | {r['eff']:.3f} | {ceiling} | {ips} |")
    out += ["", "What the communication adds to a step, exposed + contention (ms), by bucket cap (MiB; first bucket "
            f"min(cap, {first_bucket_mb:g} MiB)) and with the auto plan (`reducer.bucket_mb = \"auto\"`, planned on "
            "this timeline with the machine's contention), best cap in bold:",
            "", "| case | " + " | ".join(f"{c:g}" for c in sweep_mb) + " | auto |", "|---|" + "---:|" * (len(sweep_mb) + 1)]
    cases = [(nodes_list[0], raw), (nodes_list[-1], raw)]
    if raw.batch_size >= 8:
        cases.append((nodes_list[-1], scale_to_batch(raw, raw.batch_size / 8, cost)))
    for nodes, q in cases:
        comm, t = comm_fn(m, nodes, algorithm), terms(nodes)
        sw = {cap: pred for cap, _, pred in sweep_bucket_sizes(q, comm, sweep_mb, first_bucket_mb, t)}
        best = min(sw, key=lambda c: (round(comm_step_ms(sw[c]), 6), sw[c].comm_end_ms))
        cells = [f"**{comm_step_ms(sw[c]):.3f}**" if c == best else f"{comm_step_ms(sw[c]):.3f}" for c in sweep_mb]
        auto = auto_plan(q, comm, t) if q.granularity == "parameter" else None
        cells.append(f"{comm_step_ms(simulate_step(auto, comm, t)):.3f} ({len(auto.buckets)} buckets)" if auto else "-")
        out.append(f"| {nodes} node(s), batch {q.batch_size or '?'}/GPU | " + " | ".join(cells) + " |")
    out += ["", *breakdown_lines(p, m, global_batch, algorithm, terms, cost)]
    return "\n".join(out) + "\n"


def breakdown_lines(p: Profile, m: Machine, global_batch: int, algorithm: Algorithm,
                    terms: TermsFn | None = None, cost: BatchCost | None = None) -> list[str]:
    """Where efficiency first falls below EFFICIENCY_FLOOR: nodes (weak), per-GPU batch, nodes (strong)."""
    terms = terms or plain_terms(m)
    out = []
    weak = weak_rows(p, m, _pow2_up_to(1024), algorithm, terms)
    bad = next((r for r in weak if r["eff"] < EFFICIENCY_FLOOR), None)
    out.append(f"- Weak scaling at batch {p.batch_size or '?'}/GPU: " + (
        f"efficiency falls below {EFFICIENCY_FLOOR} at {bad['nodes']} nodes ({bad['gpus']} GPUs, {bad['eff']:.2f}): "
        + explain(p, bad["pred"], m, bad["nodes"], algorithm) if bad else
        f"efficiency stays >= {EFFICIENCY_FLOOR} up to 1024 nodes ({1024 * m.gpus_per_node} GPUs; "
        f"{weak[-1]['eff']:.3f} there): the allreduces hide behind backward."))
    if not p.batch_size:
        return out + ["- Strong scaling: needs the profile's batch size (--profile-batch)."]
    for b in (p.batch_size // 2**k for k in range(int(math.log2(p.batch_size)) + 1)):
        q = scale_to_batch(p, b, cost)
        pred = simulate_step(q, comm_fn(m, 64, algorithm), terms(64))
        if weak_efficiency(q, pred, terms(64)) < EFFICIENCY_FLOOR:
            out.append(f"- At 64 nodes, weak scaling falls below {EFFICIENCY_FLOOR} once the per-GPU batch is "
                       f"{b} ({weak_efficiency(q, pred, terms(64)):.2f}): " + explain(q, pred, m, 64, algorithm, cost))
            break
    strong = strong_rows(p, m, _pow2_up_to(max(1, global_batch // m.gpus_per_node)), global_batch, algorithm, terms,
                         cost)
    bad = next((r for r in strong if r["eff"] < EFFICIENCY_FLOOR), None)
    out.append(f"- Strong scaling at global batch {global_batch}: " + ", ".join(
        f"{r['nodes']} nodes (batch {r['batch']}/GPU) {r['eff']:.2f}" for r in strong) + ". " + (
        f"Below {EFFICIENCY_FLOOR} from {bad['nodes']} nodes: " + explain(bad["q"], bad["pred"], m, bad["nodes"],
                                                                        algorithm, cost) if bad else ""))
    return out


def calibration_report(points: list[tuple[int, float]], n: int, alpha_us: float, busbw_gbs: float,
                       bench: dict[str, Any] | None = None, profile: Profile | None = None) -> str:
    """Markdown: fitted alpha/beta, model vs measurement per size, and predicted vs measured step."""
    out = [f"Fitted ring model on {n} gloo processes: alpha = {alpha_us:.1f} us per step, B = {busbw_gbs:.3f} GB/s "
           f"(beta = 1/B = {1e3 / busbw_gbs:.1f} us/MB); T = {2 * (n - 1)}*alpha + {2 * (n - 1)}/{n}*S/B.", "",
           "| bytes | measured ms | model ms | error |", "|---:|---:|---:|---:|"]
    for nbytes, t in points:
        pred = ring_allreduce(nbytes, n, alpha_us, busbw_gbs).total_ms
        out.append(f"| {nbytes:,} | {t * 1e3:.3f} | {pred:.3f} | {(pred - t * 1e3) / (t * 1e3):+.0%} |")
    if bench is not None and profile is not None:
        local = Machine("this host (gloo)", n, Link(busbw_gbs, alpha_us, "calibrated"), None)
        pred = simulate_step(profile, comm_fn(local, 1, "ring"))
        out += ["", f"Step at world size {bench.get('world_size')} ({bench.get('model')}, batch {bench.get('batch_size')}"
                f"/solver, profile: {profile.source}):", "",
                "| | step ms | exposed comm ms |", "|---|---:|---:|",
                f"| predicted | {pred.step_ms:.2f} | {pred.exposed_ms:.2f} |",
                f"| measured (bench: step median; phase-timed exposed) | {bench['step_ms_median']:.2f} | "
                f"{bench.get('exposed_comm_ms', float('nan')):.2f} |"]
    return "\n".join(out) + "\n"


def emit_report(text: str, out: str | None, stem: str) -> None:
    """Print a markdown report and, with ``out``, write it to OUT/<stem>_<yyyymmdd>.md."""
    print(text)
    if out:
        path = Path(out) / f"{stem}_{datetime.date.today():%Y%m%d}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")


def shard_report(p: Profile, m: Machine, rows: list[dict[str, Any]], *, update_bytes_per_param: int,
                 gather_wait: str = "forward", caps: list[dict[str, Any]] | None = None) -> str:
    """Markdown: the sharded step against the unsharded one per GPU count (:func:`benchmarks.scaling.shard.compare_rows`
    rows), by bucket cap at the largest count (``caps``: :func:`benchmarks.scaling.shard.sweep_caps`), and the
    memory per GPU for SGD-momentum and Adam-type state, sharded and not."""
    wait = ("each bucket's all-gather waited for just before the first layer that needs it runs in the next "
            "forward (`gather_wait = \"forward\"`)" if gather_wait == "forward" else
            "every all-gather waited for before the next forward (`gather_wait = \"step\"`)")
    out = ["#### Sharded optimizer state (`reducer.shard = \"optimizer\"`) against unsharded", "",
           f"The same {len(p.buckets)} buckets, each padded to a multiple of N x 64 elements; reduce-scatter in "
           "backward and all-gather after the update priced as NCCL runs them (ring, or NVLS on one node: each "
           f"(n-1)/n of the bucket on the wire, an allreduce's bytes together); {wait}; the "
           "per-step norm allreduce exposed. The update moves "
           f"{update_bytes_per_param} B per parameter at {m.hbm_gbs:g} GB/s: {p.update_ms:.2f} ms unsharded, "
           "divided by N sharded. Weak efficiency = T_1 / T_N against the same one-GPU step.", "",
           "| GPUs | nodes | step ms, unsharded | sharded | weak efficiency, unsharded | sharded | exposed comm ms, "
           "unsharded (allreduce) | sharded (reduce-scatter + norm + all-gather) | update ms, unsharded | sharded "
           "| padding KiB |",
           "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        u, s = r["unsharded"], r["sharded"]
        out.append(f"| {r['gpus']} | {r['nodes']} | {u['step_ms']:.2f} | {s['step_ms']:.2f} | {u['efficiency']:.3f} | "
                   f"{s['efficiency']:.3f} | {u['exposed_ms']:.3f} | {s['exposed_ms']:.3f} ({s['scatter_exposed_ms']:.3f}"
                   f" + {s['norm_ms']:.3f} + {s['gather_exposed_ms']:.3f}) | {u['update_ms']:.3f} | "
                   f"{s['update_ms']:.3f} | {s['padding_bytes'] / 1024:.1f} |")
    if caps:
        out += ["", f"Step ms at {rows[-1]['gpus']} GPUs by bucket cap (MiB; the bucket count in brackets), best "
                "sharded cap in bold:", "",
                "| | " + " | ".join(f"{c['cap_mb']:g} ({c['buckets']})" for c in caps) + " |",
                "|---|" + "---:|" * len(caps)]
        best = min(caps, key=lambda c: c["sharded_step_ms"])
        out += ["| sharded | " + " | ".join(f"**{c['sharded_step_ms']:.2f}**" if c is best else
                                            f"{c['sharded_step_ms']:.2f}" for c in caps) + " |",
                "| unsharded | " + " | ".join(f"{c['unsharded_step_ms']:.2f}" for c in caps) + " |"]
    out += ["", "Memory per GPU for the parameters, GB (1e9 B; activations and workspace not counted, they do not "
            "depend on N): 16-bit weights and gradients whole on every GPU; fp32 masters (4 B per parameter) and "
            "the optimizer state divided by N when sharded, the padding included.", ""]
    for opt, what in (("sgd", "SGD with momentum (4 B of state per parameter)"),
                      ("adam", "Adam, AdamW, LAMB (8 B of state per parameter)")):
        out += [f"{what}:", "",
                "| GPUs | weights | grads | masters | state | total | masters, sharded | state, sharded | "
                "total, sharded | saved |", "|---:|" + "---:|" * 9]
        for r in rows:
            u, s = r["unsharded"]["memory"][opt].gb(), r["sharded"]["memory"][opt].gb()
            out.append(f"| {r['gpus']} | {u['weights']:.3f} | {u['grads']:.3f} | {u['masters']:.3f} | {u['state']:.3f} | "
                       f"{u['total']:.3f} | {s['masters']:.3f} | {s['state']:.3f} | {s['total']:.3f} | "
                       f"{round(u['total'] - s['total'], 3) + 0.0:.3f} |")  # + 0.0: no "-0.000"
        out.append("")
    return "\n".join(out)
