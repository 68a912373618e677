"""One screen about a gpu_session.sh run: each stage's status and time, the figures against their goals, the exit code.

Reads the session folder gpu_session.sh fills (status.tsv: stage, status, seconds, limit; env.txt;
<stage>.log) and prints the summary; gpu_session.sh writes it to summary.txt after every stage,
so a run cut off from outside still says how far it got. Standard library only: it must work
where the stages failed.

    python -m benchmarks.gpu.session_summary gpu_out/session --stages "selfcheck tests bandwidth data resnet50"
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
from pathlib import Path

TIMEOUT = 124
"""Status of a stage that ran past its limit (timeout(1)'s own)."""
INTERRUPTED = 143
"""Status of the stage that was running when gpu_session.sh got SIGTERM or SIGINT (128 + 15)."""
RESNET50_GOAL_EAGER = 1.25
"""dptrain bench (compiled, its CUDA default) / torch AMP eager, same run, one GPU (the compile issue's goal)."""
RESNET50_GOAL_COMPILED = 1.05
"""dptrain bench / torch.compile'd AMP in compile's default mode: what compile alone does not give
(no casts of the 16-bit weights, the fused update) must show."""


def resnet50_goal(case: str) -> float | None:
    """The goal of a resnet50 case by its peer: eager, compiled (default mode), or none (other modes,
    and the segment cut on one GPU, a diagnostic with nothing to overlap: reported)."""
    if "reduce-overhead" in case or "segments" in case:
        return None
    return RESNET50_GOAL_COMPILED if "torch.compile" in case else RESNET50_GOAL_EAGER


def _status_word(rc: int) -> str:
    return {0: "ok", TIMEOUT: "timeout", INTERRUPTED: "interrupted"}.get(rc, f"failed ({rc})")


def _json_lines(log: Path) -> list[dict]:
    """Every line of ``log`` that parses as a JSON object."""
    if not log.is_file():
        return []
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _verdict(value: float | None, goal: float, at_most: bool = False) -> str:
    if value is None:
        return "-"
    return "met" if (value <= goal if at_most else value >= goal) else "MISSED"


PROVISIONAL = ", 1 run: provisional"
"""After the verdict of a ratio of one run per side: the H200's images/s varied by about 1 % from run
to run (2026-11-27), so a ratio that close to its goal can land on either side of it; more
repeats (RESNET50_ARGS="--repeats 3 ...") settle it."""


def _figure(what: str, value: float | None, goal: float | None, fmt: str = "{:.3f}", at_most: bool = False,
            runs: int | None = None) -> str:
    """One figure's row; the goal is a floor, or with ``at_most`` a ceiling; a verdict on ``runs`` = 1
    run per side is marked provisional (:data:`PROVISIONAL`)."""
    shown = "-" if value is None else fmt.format(value)
    goal_text = "" if goal is None else f"{'<=' if at_most else '>='} {fmt.format(goal)}"
    verdict = "" if goal is None else _verdict(value, goal, at_most)
    if verdict and value is not None and runs == 1:
        verdict += PROVISIONAL
    return f"  {what:<44} {shown:>10}  {goal_text:<10} {verdict}"


def bandwidth_figures(work: Path) -> list[str]:
    """The update's and the norm's bandwidth by kernel time, as fractions of a same-size copy's."""
    rec = next((r for r in reversed(_json_lines(work / "bandwidth.log")) if r.get("bench") == "update_bandwidth"), None)
    if rec is None or not rec.get("kernel"):
        return []
    k = rec["kernel"]
    goals = rec["goals"] if rec.get("goals_met") is not None else {}  # GPU goals: no verdict on the CPU
    lines = []
    for name in ("update", "norm"):
        lines.append(_figure(f"{name} kernel / device copy bandwidth", k.get(f"{name}_fraction_of_copy"),
                             goals.get(f"{name}_fraction_of_copy")))
        if f"{name}_kernel_ms" in k:
            read = rec.get("read") or {}  # the norm only reads: against a read-only pass too (no goal)
            lines.append(f"    {k[f'{name}_kernel_ms']} ms kernel, {k[f'{name}_ms']} ms wall "
                         f"({k[f'{name}_wall_over_kernel']}x; dispatch hidden: {k[f'{name}_dispatch_hidden']}), "
                         f"{k[f'{name}_kernel_gb_per_s']} GB/s vs copy {rec['copy'].get(f'{name}_kernel_gb_per_s')}"
                         + (f", read-only {read['norm_kernel_gb_per_s']} ({k['norm_fraction_of_read']} of it)"
                            if name == "norm" and "norm_kernel_gb_per_s" in read else ""))
    return lines


def _yes_no(flag: object) -> str:
    return "?" if flag is None else ("yes" if flag else "NO")


def data_figures(work: Path) -> list[str]:
    """data-bench at the defaults and the input path it ran, and train-from-LMDB over synthetic, from
    the stage's last record (a partial one where the stage was cut off after a step)."""
    rec = next((r for r in reversed(_json_lines(work / "data.log")) if r.get("stage") == "data"), None)
    if rec is None:
        return []
    goals = rec["goals"]
    calls = rec.get("python_calls_per_image")
    threads = rec.get("data_bench_threads") or [None, None]
    lines = [_figure("data-bench images/s", rec["data_bench_images_per_s"],
                     goals["data_bench_images_per_s"], "{:.0f}"),
             f"    native render {_yes_no(rec.get('native_render'))}, crop decode {_yes_no(rec.get('crop_decode'))}, "
             f"{threads[0]} parsers + {threads[1]} renderers"
             + ("" if calls is None else f", {calls} Python calls per image"),
             _figure("train from LMDB / bench --synthetic", rec["lmdb_over_synthetic"], goals["lmdb_over_synthetic"],
                     runs=1)]
    if rec["lmdb_train_images_per_s"] is not None:
        lines.append(f"    {rec['lmdb_train_images_per_s']} / {rec['synthetic_images_per_s']} img/s; "
                     f"{rec['images']} JPEGs of {rec['size_px']} px, {rec['mean_kb']} KB each")
    if rec.get("partial"):
        lines.append("    partial: the stage stopped before "
                     + ("bench --synthetic" if rec["lmdb_train_images_per_s"] is not None else "the LMDB bench"))
    return lines


PEAK_MEMORY_GOAL = 1.0
"""dptrain's peak memory / the compiled peer's (default mode), the compile issue's: no higher."""


def resnet50_figures(work: Path) -> list[str]:
    """dptrain over its peer per case, medians of the runs that finished (a cut-off stage still
    counts; a verdict on one run per side is provisional), and against the compiled peer also peak
    memory. Below a ratio: runs that failed, and runs that were not what the case measures (dptrain's
    model.compile fell back to eager, or either side's CUDA graphs were skipped), from the fields
    throughput.py repeats in its progress lines."""
    runs: dict[str, dict[str, list[dict]]] = {}
    logs = ("resnet50.log", "resnet50_more.log", "autocast.log", "byo.log")
    for r in [rec for log in logs for rec in _json_lines(work / log)]:
        for side in ("dptrain", "peer"):
            if "case" in r and side in r:
                runs.setdefault(r["case"], {}).setdefault(side, []).append(r)
    lines = []
    for case, sides in runs.items():
        done = {side: [r for r in recs if r[side] is not None] for side, recs in sides.items()}
        model, _, precision = case.split(" vs ", 1)[0].rpartition(" ") if not case.startswith("ResNet-50 ") \
            else ("ResNet-50", "", case.removeprefix("ResNet-50 ").split(" vs ", 1)[0])
        peer = case.split(" vs ", 1)[1]
        peer = ("compiled " + ("(reduce-overhead)" if "reduce-overhead" in peer else "peer")
                if "torch.compile" in peer else "eager peer")
        eager = sum(r.get("compiled") is False for r in done.get("dptrain", []))
        goal = resnet50_goal(case) if model == "ResNet-50" and "autocast " not in precision else None
        if goal is not None and eager:  # the goals are for dptrain as it runs on CUDA, compiled
            compiled = [r for r in done["dptrain"] if r.get("compiled") is not False]
            done["dptrain"], goal = compiled or done["dptrain"], goal if compiled else None
            precision += "" if compiled else " eager"
        if done.get("dptrain") and done.get("peer"):
            ratio = (statistics.median(r["dptrain"] for r in done["dptrain"])
                     / statistics.median(r["peer"] for r in done["peer"]))
            n_runs = min(len(done["dptrain"]), len(done["peer"]))
            lines.append(_figure(f"{model} {precision}: dptrain / {peer}", ratio, goal, runs=n_runs))
            mem = [statistics.median(r["peak_mem_bytes"] for r in done[side]) if all(
                r.get("peak_mem_bytes") for r in done[side]) else None for side in ("dptrain", "peer")]
            if goal == RESNET50_GOAL_COMPILED and None not in mem:
                lines.append(_figure(f"{model} {precision}: peak memory dptrain / {peer}", mem[0] / mem[1],
                                     PEAK_MEMORY_GOAL, at_most=True, runs=n_runs))
        no_graphs = sum(r.get("cuda_graphs") is False for r in done.get("dptrain", [])
                        if "reduce-overhead" in case and r.get("compiled"))
        peer_no_graphs = sum(r.get("cuda_graphs") is False for r in done.get("peer", []) if "reduce-overhead" in case)
        if eager:
            lines.append(f"    dptrain ran eagerly in {eager} run(s), not graded: model.compile fell back (its "
                         "warning is in the log)")
        if no_graphs:
            lines.append(f"    dptrain ran without CUDA graphs in {no_graphs} run(s): cudagraph trees skipped them")
        if peer_no_graphs:
            lines.append(f"    peer ran without CUDA graphs in {peer_no_graphs} run(s): cudagraph trees skipped them")
        for side, recs in sides.items():
            errors = [r.get("error", "") for r in recs if r[side] is None]
            if errors:
                lines.append(f"    {side}: {len(errors)} run(s) failed: {errors[-1][:80]}")
    return lines


def shard_figures(work: Path) -> list[str]:
    """Sharded over unsharded dptrain on one GPU: images/s and the masters and state each rank holds."""
    recs = {r["case"]: r for r in _json_lines(work / "shard.log") if r.get("dptrain") is not None and "case" in r}
    plain = next((r for c, r in recs.items() if "unsharded" in c), None)
    sharded = next((r for c, r in recs.items() if "sharded (" in c), None)
    if plain is None or sharded is None:
        return []
    lines = [_figure("ResNet-50 fp16: sharded / unsharded img/s", sharded["dptrain"] / plain["dptrain"], None)]
    if plain.get("state_bytes_per_rank") and sharded.get("state_bytes_per_rank"):
        lines.append(_figure("ResNet-50 fp16: sharded / unsharded state bytes", sharded["state_bytes_per_rank"]
                             / plain["state_bytes_per_rank"], None))
    return lines


def sweep_figures(work: Path) -> list[str]:
    """images/s per batch size, and the step time fitted in the batch (benchmarks.scaling.fit_batch_cost)."""
    recs = [r for r in _json_lines(work / "sweep.log") if "images_per_s" in r]
    if not recs:
        return []
    lines = ["  sweep img/s by batch: " + ", ".join(f"{r.get('batch_size')}: {r['images_per_s']:.0f}" for r in recs)]
    points = [(int(r["batch_size"]), float(r["step_ms_median"])) for r in recs if "step_ms_median" in r]
    if len({b for b, _ in points}) >= 3:
        from benchmarks.scaling import fit_batch_cost

        try:
            c = fit_batch_cost(points)
            lines.append(f"  step(b) = {c.fixed_ms:.2f} ms + b x {c.per_image_ms:.4f} ms "
                         f"(largest error {c.max_error:.1%}; python -m benchmarks.scaling --batch-points sweep.log)")
        except ValueError as e:
            lines.append(f"  step(b): no fit ({e})")
    return lines


def _tests_line(work: Path) -> str:
    """pytest's closing counts, and whether pytest-timeout cut a test off."""
    log = work / "tests.log"
    if not log.is_file():
        return ""
    text = log.read_text(errors="replace")
    counts = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|deselected|errors?)\b.*?)(?: =*)?$", text, re.M)
    cut = "; a test hit pytest-timeout" if "+ Timeout +" in text else ""
    if counts:
        return counts[-1] + cut
    # cut off before its summary: pytest -v's result per test, as far as it got
    so_far = collections.Counter(re.findall(r"^\S+::\S+ (PASSED|FAILED|ERROR|SKIPPED)", text, re.M))
    done = ", ".join(f"{n} {word.lower()}" for word, n in so_far.items())
    return f"no pytest summary (cut off){'; so far ' + done if done else ''}" + cut


def render(work: Path, stages: list[str]) -> str:
    """The summary text (see the module docstring)."""
    rows, worst = {}, None
    status = work / "status.tsv"
    for line in status.read_text().splitlines() if status.is_file() else []:
        parts = line.split("\t")
        if len(parts) == 4:
            rows[parts[0]] = [int(p) if i else p for i, p in enumerate(parts)]
        elif line.startswith("worst stage status:"):
            worst = int(line.split(":", 1)[1].split()[0])
    env = (work / "env.txt").read_text(errors="replace").splitlines()[:1] if (work / "env.txt").is_file() else []
    out = [f"gpu_session summary: {env[0] if env else 'no env.txt'}", "",
           f"  {'stage':<11} {'status':<12} {'time':>6} {'limit':>6}"]
    for name in [*stages, *(s for s in rows if s not in stages)]:
        if name in rows:
            _, rc, secs, limit = rows[name]
            extra = _tests_line(work) if name == "tests" else ""
            out.append(f"  {name:<11} {_status_word(rc):<12} {secs:>5}s {limit:>5}s  {extra}".rstrip())
        else:
            out.append(f"  {name:<11} {'not run':<12}")
    figures = [*bandwidth_figures(work), *data_figures(work), *resnet50_figures(work), *shard_figures(work),
               *sweep_figures(work)]
    if figures:
        out += ["", f"  {'figure':<44} {'value':>10}  {'goal':<10} verdict", *figures]
    done = worst if worst is not None else max((r[1] for r in rows.values()), default=0)
    out += ["", f"exit code: {done} (worst stage status)" if worst is not None
            else f"run still going or cut off: worst status so far {done}"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work", type=Path, help="the session folder (status.tsv, env.txt, <stage>.log)")
    p.add_argument("--stages", default="", help="the stages asked for, in order (those not run yet are listed)")
    args = p.parse_args(argv)
    print(render(args.work, args.stages.split()))


if __name__ == "__main__":
    main()
