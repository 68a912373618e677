"""Overflow agreement, plan mismatch, failure propagation, overlap evidence, test scores."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from dist_harness import inf_in_one_gradient, run_ranks, start_ranks
from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.observe.trace import Tracer
from dptrain.train import Trainer

BASE = ["model.name=lenet", "data.source=digits", "solver.base_lr=0.01", "solver.display=0", "data.batch_size=4"]


def _trainer(overrides, out, tracer=None):
    cfg = load_config(None, [*BASE, f"train.run_dir={json.dumps(out)}", *overrides])
    return Trainer(cfg, Communicator.from_initialized(torch.device("cpu")), tracer=tracer)


def _bits(t: Trainer) -> list[torch.Tensor]:
    return [x.clone() for g in t.flat.groups for x in (g.params, g.master, g.state["momentum"])]


def _overflow_rank(rank, world, out, mode):
    t = _trainer(["precision.storage=fp16", "precision.loss_scale.mode=dynamic",
                  "precision.loss_scale.init_scale=1024", f"precision.mode={mode}"], out)
    t.train_step()  # one clean step, so momentum is non-zero
    before = _bits(t)
    if rank == 1:  # only rank 1 sees an inf, in one gradient element
        handle = inf_in_one_gradient(t.model.classifier[3].weight)
    t.train_step()
    if rank == 1:
        handle.remove()
    after = _bits(t)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), f"rank {rank}: state changed on overflow"
    stats = t.scaler.stats()
    assert stats == {"loss_scale": 512.0, "skipped_steps": 1}, (rank, stats)
    t.train_step()  # and training goes on with a clean step
    assert not all(torch.equal(a, b) for a, b in zip(after, _bits(t), strict=True))
    torch.save(t.flat.master_state(), Path(out) / f"rank{rank}.pt")


@pytest.mark.parametrize("mode", ["storage", "autocast"])
def test_overflow_on_one_rank_skips_on_every_rank(tmp_path, mode):
    run_ranks(2, _overflow_rank, str(tmp_path), mode)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert all(torch.equal(r0[k], r1[k]) for k in r0)


def _mismatch_rank(rank, world, out):
    with pytest.raises(RuntimeError, match=r"bucket plan differs across ranks \(rank 1: \d+ buckets.*rank 0: \d+ "
                                           r"buckets.*check that every rank builds the same model"):
        _trainer([f"reducer.bucket_mb={0.05 if rank else 1000}"], out)


def test_bucket_plan_mismatch_names_both_ranks(tmp_path):
    run_ranks(2, _mismatch_rank, str(tmp_path))


def _overlap_rank(rank, world, out):
    tracer = Tracer(rank)
    t = _trainer(["reducer.bucket_mb=0.05", "reducer.first_bucket_mb=0.01"], out, tracer)
    assert len(t.reducer.plan.buckets) >= 3
    t.train_step()
    events = tracer.events
    backward = next(e for e in events if e["name"] == "backward")
    backward_end = backward["ts"] + backward["dur"]
    reduces = sorted((e for e in events if e["name"] == "allreduce"), key=lambda e: e["args"]["bucket"])
    assert [e["args"]["bucket"] for e in reduces] == list(range(len(t.reducer.plan.buckets)))
    assert reduces[0]["ts"] < backward_end, "first bucket's allreduce must launch before backward ends"
    launches = [b for b, _ in t.reducer.launch_log]
    assert launches == sorted(launches), "buckets launch strictly in plan order"
    ready = [e for e in events if e["name"] == "bucket_ready"]
    assert ready and ready[0]["ts"] < backward_end


def test_first_allreduce_launches_during_backward(tmp_path):
    run_ranks(2, _overlap_rank, str(tmp_path))


def _test_scores_rank(rank, world, out):
    t = _trainer(["data.test_batch_size=50"], out)
    res = t.test()
    assert res["test_samples"] == 297  # every held-out digit counted once across ranks
    Path(out, f"top1_{rank}.json").write_text(json.dumps(res))


def test_test_scores_count_every_sample_once(tmp_path):
    run_ranks(3, _test_scores_rank, str(tmp_path))
    results = [json.loads((tmp_path / f"top1_{r}.json").read_text()) for r in range(3)]
    assert all(r == results[0] for r in results)


def _raising_rank(rank, world, out):
    t = _trainer(["reducer.timeout_s=20"], out)
    t.train_step()
    if rank == 1:
        raise RuntimeError("injected failure on rank 1")
    t.train_step()  # rank 0 blocks in the allreduce until the dead peer is noticed


def test_rank_raising_makes_others_exit_fast(tmp_path):
    start = time.monotonic()
    procs, tmp = start_ranks(2, _raising_rank, str(tmp_path), timeout_s=20)
    for p in procs:
        p.join(timeout=60)
    elapsed = time.monotonic() - start
    try:
        assert all(p.exitcode is not None for p in procs), "a rank hung"
        assert all(p.exitcode != 0 for p in procs), [p.exitcode for p in procs]
        assert elapsed < 30, elapsed  # well inside reducer.timeout_s + startup
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        tmp.cleanup()
