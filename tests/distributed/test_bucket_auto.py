"""reducer.bucket_mb = "auto" on 2 gloo ranks: every rank switches to rank 0's plan at the same
iteration, logs predicted vs measured exposed communication, and trains bit-exactly like a
run that uses the same bucket boundaries from its first iteration."""
from __future__ import annotations

import json
import time
from pathlib import Path
from statistics import median

import torch

from dist_harness import run_ranks
from dptrain.config import load_config
from dptrain.distributed.buckets.probe import AUTO_DECISION_ITER, AUTO_DONE_ITER, AUTO_PROBE_ITERS, AUTO_WARMUP_ITERS
from dptrain.distributed.comm import Communicator
from dptrain.train import Trainer

BASE = ["model.name=resnet18_cifar", "model.width=4", "data.source=synthetic", "data.image_size=16",
        "data.batch_size=4", "solver.base_lr=0.01", "solver.lr_policy=fixed", "solver.display=0",
        "solver.momentum=0.9", "reducer.bucket_mb=auto"]
STEPS = AUTO_DONE_ITER + 1
LATE_S = 0.06
"""Rank 1's extra forward time in the straggler test: rank 0 waits that long in each iteration's first collective."""


def _trainer(out: str) -> Trainer:
    cfg = load_config(None, [*BASE, f"train.run_dir={json.dumps(out)}"])
    return Trainer(cfg, Communicator.from_initialized(torch.device("cpu")))


def _auto_rank(rank: int, world: int, out: str) -> None:
    auto = _trainer(f"{out}/auto")
    probe_buckets = len(auto.reducer.plan.buckets)
    digests, held = [], []
    probe = auto.bucket_tuner.probe
    record = probe.record

    def spy(launched, n_buckets, backward_end_us, done_us, **kw):
        if probe.holding:  # every launch of a held iteration comes after its backward
            held.append(all(start >= backward_end_us for _, start, _ in launched)
                        and sorted(i for i, _, _ in launched if i is not None) == list(range(n_buckets)))
        return record(launched, n_buckets, backward_end_us, done_us, **kw)

    probe.record = spy
    for _ in range(STEPS):
        auto.train_step()
        digests.append(auto.reducer.plan.digest())
    assert held == [True] * 2 * AUTO_PROBE_ITERS, held  # buckets and running statistics, all after backward
    switched = AUTO_DECISION_ITER  # the plan changes at the end of this iteration
    assert len(set(digests[:switched - 1])) == 1 and digests[switched - 1] == digests[-1] != digests[0]
    state = auto.reducer.state_dict()
    assert state["bucket_cuts"] and state["bucket_cuts"][0] == 0
    assert len(auto.reducer.plan.buckets) < probe_buckets == sum(len(g.segments) for g in auto.flat.groups)
    report = auto.bucket_tuner.report
    assert report["buckets"] == len(auto.reducer.plan.buckets) and report["measured_exposed_ms"] >= 0
    assert report["predicted_exposed_ms"] >= 0 and report["beta_ms_per_mb"] >= 0
    assert 0 <= report["measured_after_slowest_ms"] <= report["measured_exposed_ms"]  # the least wait over the ranks
    assert 0 <= report["contention"] <= 1 and report["predicted_contention_ms"] >= 0
    assert report["contention_weighed"] == min(report["contention"], report["overlap_rate"])
    # where the contention came from: a stretch above its noise, or a note saying why it is 0
    assert report["probe_stretch_noise_ms"] >= 0 and report["probe_stretch_ms"] is not None
    assert (report["contention"] > 0) == (report["probe_stretch_ms"] > report["probe_stretch_noise_ms"]) != bool(
        report["contention_note"])
    assert report["measured_contention_ms"] is not None

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


def _late_rank(rank: int, world: int, out: str, where: str) -> None:
    t = _trainer(f"{out}/late")
    real = t._forward

    def late_backward(x: torch.Tensor) -> torch.Tensor:  # rank 1 starts and so ends backward late
        out = real(x)
        out.register_hook(lambda g: time.sleep(LATE_S) or g)
        return out

    def late_forward(x: torch.Tensor) -> torch.Tensor:  # rank 1 launches the statistics' collective late
        time.sleep(LATE_S)
        return real(x)

    if rank == 1:
        t._forward = late_backward if where == "backward" else late_forward
    waits = []
    probe = t.bucket_tuner.probe
    record, gathered, seen = probe.record, probe.gathered, {}
    probe.record = lambda *a, **k: waits.append((a[3] - a[2]) / 1e3) or record(*a, **k)  # done - backward end
    probe.gathered = lambda *a: seen.setdefault("gathered", gathered(*a))
    for _ in range(AUTO_DECISION_ITER):
        t.train_step()
    d = probe.decision
    overlapped = waits[AUTO_WARMUP_ITERS::2]  # every other probe iteration holds its allreduces
    torch.save({"waits": overlapped, "probe_ms": d.probe_exposed_ms,
                "own_service_ms": max(x for row in probe.service for x in row if x != float("inf")),
                "collective_ms": max(ms for _, ms in seen["gathered"][0]),
                "largest_ms": d.cost(max(b.nbytes for b in t.reducer.plan.buckets))}, Path(out) / f"late{rank}.pt")
    t.close()


def test_the_auto_plan_prices_collectives_and_the_exposed_comm_without_the_wait_for_a_late_rank(tmp_path):
    """Rank 0 waits ~60 ms for rank 1 after every backward, then for the communication left (a bucket per
    parameter: ~60 small allreduces in a row). The plan's costs and its overlap fit come from the least
    over the ranks (the rank that launched last), so they hold none of the wait for rank 1."""
    run_ranks(2, _late_rank, str(tmp_path), "backward")
    r0 = torch.load(tmp_path / "late0.pt")
    late_ms = LATE_S * 1e3
    # rank 0 did wait for rank 1: in the median, since on a loaded 2-core host rank 0's own backward can run
    # tens of ms long in one iteration and so wait less there (one of 3 waited 18.8 ms in a quiet full run)
    assert median(r0["waits"]) >= late_ms * 0.8, r0
    # half the delay as the margin: the hosts' noise on a shared 2-core machine is a few ms
    assert r0["probe_ms"] <= median(r0["waits"]) - late_ms / 2, r0  # rank 1's wait: the communication alone
    assert r0["own_service_ms"] >= late_ms * 0.8, r0  # rank 0's first collective held the wait for rank 1 ...
    assert r0["collective_ms"] < late_ms / 2 and r0["largest_ms"] < late_ms / 2, r0  # ... the least over ranks not


def test_a_rank_late_in_forward_holds_back_the_statistics_collective_which_is_not_priced(tmp_path):
    """Rank 1 sleeps before its forward: rank 0's collective of the running statistics, launched before its
    backward, waits for rank 1's; rank 0's buckets queue behind it, so their service times (and the plan's
    costs) do not hold that wait."""
    run_ranks(2, _late_rank, str(tmp_path), "forward")
    r0 = torch.load(tmp_path / "late0.pt")
    late_ms = LATE_S * 1e3
    assert median(r0["waits"]) >= late_ms / 2, r0  # rank 0 did wait for rank 1 after its backward
    assert r0["own_service_ms"] < late_ms / 2, r0  # but none of its buckets was priced with that wait
    assert r0["collective_ms"] < late_ms / 2 and r0["largest_ms"] < late_ms / 2, r0


def _bench_rank(rank: int, world: int, out: str) -> None:
    import dptrain.run as run
    import dptrain.tools.bench as bench

    class Joined:  # the harness has initialised the process group: bench joins it instead of torchrun's
        @staticmethod
        def from_env(*_args, **_kwargs) -> Communicator:
            return Communicator.from_initialized(torch.device("cpu"))

    run.Communicator = Joined  # bench opens its communicator through run.open_communicator
    cfg = load_config(None, [*BASE, "train.threads=1", f"train.run_dir={json.dumps(out)}"])
    rec = bench.run_bench(cfg, steps=2, warmup=1, phase_steps=0, trace=None)
    if rank == 0:
        Path(out, "bench.json").write_text(json.dumps(rec))


def test_bench_times_the_auto_plan_after_its_probe_and_check(tmp_path):
    run_ranks(2, _bench_rank, str(tmp_path))
    rec = json.loads((tmp_path / "bench.json").read_text())
    assert rec["warmup"] == AUTO_DONE_ITER  # 1 asked for, the rest until the check ended
    auto = rec["auto_buckets"]
    assert auto["buckets"] >= 1 and auto["measured_after_slowest_ms"] is not None and 0 <= auto["contention"] <= 1
