"""reducer.bucket_mb = "auto" on 2 gloo ranks: every rank switches to rank 0's plan at the same
iteration, logs predicted vs measured exposed communication, and trains bit-exactly like a
run that uses the same bucket boundaries from its first iteration."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dist_harness import run_ranks
from dptrain.comm import Communicator
from dptrain.config import load_config
from dptrain.reducer import AUTO_PROBE_ITERS, AUTO_WARMUP_ITERS
from dptrain.train import Trainer

BASE = ["model.name=resnet18_cifar", "model.width=4", "data.source=synthetic", "data.image_size=16",
        "data.batch_size=4", "solver.base_lr=0.01", "solver.lr_policy=fixed", "solver.display=0",
        "solver.momentum=0.9", "reducer.bucket_mb=auto"]
STEPS = AUTO_WARMUP_ITERS + 2 * AUTO_PROBE_ITERS + 1


def _trainer(out: str) -> Trainer:
    cfg = load_config(None, [*BASE, f"train.run_dir={json.dumps(out)}"])
    return Trainer(cfg, Communicator.from_initialized(torch.device("cpu")))


def _auto_rank(rank: int, world: int, out: str) -> None:
    auto = _trainer(f"{out}/auto")
    probe_buckets = len(auto.reducer.plan.buckets)
    digests = []
    for _ in range(STEPS):
        auto.train_step()
        digests.append(auto.reducer.plan.digest())
    switched = AUTO_WARMUP_ITERS + AUTO_PROBE_ITERS  # the plan changes at the end of this iteration
    assert len(set(digests[:switched - 1])) == 1 and digests[switched - 1] == digests[-1] != digests[0]
    state = auto.reducer.state_dict()
    assert state["bucket_cuts"] and state["bucket_cuts"][0] == 0
    assert len(auto.reducer.plan.buckets) < probe_buckets == sum(len(g.segments) for g in auto.flat.groups)
    report = auto.reducer.auto_report
    assert report["buckets"] == len(auto.reducer.plan.buckets) and report["measured_exposed_ms"] >= 0
    assert report["predicted_exposed_ms"] >= 0 and report["beta_ms_per_mb"] >= 0
    assert 0 <= report["measured_after_slowest_ms"] <= report["measured_exposed_ms"]  # the least wait over the ranks

    fixed = _trainer(f"{out}/fixed")
    fixed.reducer.load_state_dict(state)  # the same boundaries from iteration 1, no probe
    assert fixed.reducer.plan.digest() == digests[-1] and fixed.reducer.state_dict() == state
    for _ in range(STEPS):
        fixed.train_step()
    assert fixed.reducer.plan.digest() == digests[-1], "a fixed plan must not be re-planned"
    torch.save({"auto": auto.flat.master_state(), "fixed": fixed.flat.master_state(),
                "momentum": (auto.flat.state_dict()["momentum"], fixed.flat.state_dict()["momentum"]),
                "digest": digests[-1]}, Path(out) / f"rank{rank}.pt")


def test_auto_buckets_train_bit_exactly_like_the_same_fixed_plan(tmp_path):
    run_ranks(2, _auto_rank, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["digest"] == ranks[1]["digest"], "every rank holds rank 0's plan"
    for r in ranks:
        for name, w in r["auto"].items():
            assert torch.equal(r["fixed"][name], w), f"{name}: auto differs from the same fixed plan"
            assert torch.equal(ranks[0]["auto"][name], w), f"{name}: ranks differ"
        for name, v in r["momentum"][0].items():
            assert torch.equal(r["momentum"][1][name], v), name
