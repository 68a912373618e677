"""model.compile with 2 gloo solvers: the fallback agreed over the ranks, the loss against eager over
200 iterations, buckets launched during a compiled backward, and a bit-exact resume under compile.
One spawn for all of it: the first compile is the expensive part (tens of seconds on 2 cores)."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from dist_harness import run_ranks
from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.errors import ConfigError
from dptrain.inductor import prepare as prepare_inductor
from dptrain.observe.trace import Tracer
from dptrain.train import Trainer

BASE = ["model.name=lenet", "data.source=digits", "data.batch_size=16", "solver.base_lr=0.005", "solver.display=0",
        "solver.test_interval=0", "reducer.bucket_mb=0.05", "reducer.first_bucket_mb=0.01",
        "model.compile_graphs=segments"]
"""Small buckets: lenet's 4 layers become 4 compiled segments (the CPU's "auto" would compile one
graph) and at least 3 buckets."""
ITERS, WINDOW = 200, 20


def _trainer(out: str, *sets: str, tracer: Tracer | None = None) -> Trainer:
    cfg = load_config(None, [*BASE, f"train.run_dir={json.dumps(out)}", *sets])
    return Trainer(cfg, Communicator.from_initialized(torch.device("cpu")), tracer=tracer)


def _losses(t: Trainer, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t.train_step()
        out.append(float(t._iter_loss))
    return out


def _windows(losses: list[float]) -> list[float]:
    return [sum(losses[i:i + WINDOW]) / WINDOW for i in range(0, len(losses), WINDOW)]


def _masters(t: Trainer) -> list[torch.Tensor]:
    return [g.master.clone() for g in t.flat.groups]


def _fallback(rank: int, out: str) -> dict:
    """Rank 1's compiler fails: both ranks train eagerly; rank 0 warns once, naming rank 1."""
    prepare_inductor()
    import torch._inductor.compile_fx as compile_fx

    real = compile_fx.compile_fx
    if rank == 1:
        compile_fx.compile_fx = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected on rank 1"))
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("dptrain.train.compiled").addHandler(handler)
    try:
        t = _trainer(f"{out}/fallback", "model.compile=true")
        compiled = t.compiled is not None
        t.train_step()
        t.close()
    finally:
        compile_fx.compile_fx = real
        logging.getLogger("dptrain.train.compiled").removeHandler(handler)
        torch._dynamo.reset()
    return {"compiled": compiled, "warnings": records}


def _refused(out: str) -> str:
    """model.compile = "reduce-overhead" with 2 solvers: the ConfigError each rank raises (exit 2)."""
    try:
        _trainer(f"{out}/graphs", "model.compile=reduce-overhead").close()
    except ConfigError as e:
        return str(e)
    return ""


def _compile_rank(rank: int, world: int, out: str) -> None:
    got = {"fallback": _fallback(rank, out), "refused": _refused(out)}
    eager = _trainer(f"{out}/eager", "model.compile=false")
    got["eager"] = _windows(_losses(eager, ITERS))
    eager.close()

    tracer = Tracer(rank)
    run = _trainer(f"{out}/compiled", "model.compile=true", tracer=tracer)
    got["segments"] = run.compiled.names if run.compiled else None
    got["cache_files"] = sum(len(files) for _, _, files in os.walk(prepare_inductor()))  # dptrain's cache folder
    losses = _losses(run, ITERS // 2)
    run.save()  # iteration 100, taken under compile
    tracer.events.clear()
    losses += _losses(run, 1)  # a traced compiled step: do the buckets launch while backward runs?
    events = tracer.events
    backward = next(e for e in events if e["name"] == "backward")
    reduces = sorted((e for e in events if e["name"] == "allreduce"), key=lambda e: e["args"]["bucket"])
    got["buckets"] = len(run.reducer.plan.buckets)
    got["launch_order"] = [b for b, _ in run.reducer.launch_log]
    got["first_launch_before_backward_end"] = reduces[0]["ts"] < backward["ts"] + backward["dur"]
    losses += _losses(run, ITERS - len(losses))
    got["compiled"] = _windows(losses)
    straight = _masters(run)
    at = run.iteration
    run.close()

    again = _trainer(f"{out}/compiled", "model.compile=true")
    again.resume(Path(out) / "compiled" / "snapshot_iter_100.pt")
    while again.iteration < at:
        again.train_step()
    got["resume_bit_exact"] = all(torch.equal(a, b) for a, b in zip(straight, _masters(again), strict=True))
    again.close()
    torch.save(got, Path(out) / f"rank{rank}.pt")


def test_compiled_training_tracks_eager_overlaps_and_resumes_bit_exact(tmp_path):
    run_ranks(2, _compile_rank, str(tmp_path), timeout_s=300)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["fallback"]["compiled"] is False and r1["fallback"]["compiled"] is False, "every rank falls back"
    for r in (r0, r1):  # refused alike on every rank, before any rank waits in a collective
        assert r["refused"].startswith('model.compile = "reduce-overhead" replays forward and backward as CUDA '
                                       "graphs with one solver only (2 here"), r["refused"]
    assert len(r0["fallback"]["warnings"]) == 1 and r1["fallback"]["warnings"] == []
    assert "model.compile failed on rank 1 (RuntimeError: injected on rank 1)" in r0["fallback"]["warnings"][0]
    assert r0["cache_files"] > 0
    assert r0["segments"] == ["features.0", "features.2", "classifier.1", "classifier.3"]
    assert r0["buckets"] >= 3 and r0["launch_order"] == list(range(r0["buckets"]))
    assert r0["first_launch_before_backward_end"], "bucket 0's allreduce starts while the compiled backward runs"
    eager, compiled = r0["eager"], r0["compiled"]
    assert len(compiled) == len(eager) == ITERS // WINDOW
    assert eager[0] > 1.5 * eager[-1], f"the eager run did not train: {eager}"
    mean_e, mean_c = sum(eager) / len(eager), sum(compiled) / len(compiled)
    assert abs(mean_c - mean_e) <= 0.01 * mean_e, f"mean loss over {ITERS} iterations: {mean_c} vs eager {mean_e}"
    for i, (e, c) in enumerate(zip(eager, compiled, strict=True)):  # fp32 rounding differs, so the runs drift apart slowly
        assert abs(c - e) <= 0.01 * eager[0], f"window {i}: compiled loss {c:.5f} vs eager {e:.5f}"
    assert r0["resume_bit_exact"] and r1["resume_bit_exact"]
