"""Data-parallel behaviour on gloo with 2 and 3 CPU ranks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_harness import run_ranks
from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.errors import SnapshotError
from dptrain.snapshots import check_same_start
from dptrain.topology import Topology
from dptrain.train import Trainer

BASE = ["model.name=lenet", "data.source=digits", "solver.base_lr=0.01", "solver.lr_policy=fixed",
        "solver.display=0", "solver.weight_decay=0.0005", "solver.momentum=0.9"]


def _trainer(overrides: list[str], out: str, world: int, tracer=None) -> Trainer:
    cfg = load_config(None, [*BASE, f"train.run_dir={json.dumps(out)}", *overrides])
    comm = Communicator.from_initialized(torch.device("cpu")) if world > 1 else \
        Communicator.from_env(Topology(), 60, torch.device("cpu"))
    return Trainer(cfg, comm, tracer=tracer)


def _masters(t: Trainer) -> dict[str, torch.Tensor]:
    return t.flat.master_state()


# ---------------------------------------------------------------- equivalence

def _equiv_rank(rank, world, out, overrides, steps):
    t = _trainer(overrides, out, world)
    for _ in range(steps):
        t.train_step()
    torch.save(_masters(t), Path(out) / f"rank{rank}.pt")


BUCKETS = {"one bucket": ["reducer.bucket_mb=1000", "reducer.first_bucket_mb=1000"],
           "mixed": ["reducer.bucket_mb=0.05", "reducer.first_bucket_mb=0.01"],
           "per parameter": ["reducer.bucket_mb=0.000001", "reducer.first_bucket_mb=0.000001"]}


@pytest.mark.parametrize("buckets", list(BUCKETS))
def test_two_ranks_match_one_rank_with_double_batch(tmp_path, buckets):
    steps, b = 10, 16
    run_ranks(2, _equiv_rank, str(tmp_path), [f"data.batch_size={b}", *BUCKETS[buckets]], steps)
    ref = _trainer([f"data.batch_size={2 * b}"], str(tmp_path / "ref"), 1)
    for _ in range(steps):
        ref.train_step()
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for name, w in _masters(ref).items():
        assert torch.equal(r0[name], r1[name]), f"{name}: ranks differ"  # bit-identical across ranks
        # fp32 sums in a different order (2 partial means vs one mean): ~1e-7 relative per step
        torch.testing.assert_close(r0[name], w, rtol=1e-5, atol=1e-7, msg=f"{name} vs 1 rank x 2B")


def test_three_ranks_iter_size_and_replan_match_reference(tmp_path):
    # 3 ranks x 8 x iter_size 2 == 1 rank x 48: the allreduce runs on the last micro-batch only
    steps = 6
    run_ranks(3, _equiv_rank, str(tmp_path), ["data.batch_size=8", "solver.iter_size=2", "reducer.replan=true",
                                               "reducer.bucket_mb=0.05", "reducer.first_bucket_mb=0.01"], steps)
    ref = _trainer(["data.batch_size=24", "solver.iter_size=2"], str(tmp_path / "ref"), 1)
    for _ in range(steps):
        ref.train_step()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    for name, w in _masters(ref).items():
        assert all(torch.equal(ranks[0][name], r[name]) for r in ranks[1:]), name
        torch.testing.assert_close(ranks[0][name], w, rtol=1e-5, atol=1e-7, msg=name)


# ---------------------------------------------------------------- resume and running statistics

BN_NET = ["model.name=resnet18_cifar", "model.width=4", "data.batch_size=4", "reducer.replan=true",
          "reducer.bucket_mb=0.005", "reducer.first_bucket_mb=0.001"]


def _resume_rank(rank, world, out, overrides, steps):
    whole = _trainer(overrides, f"{out}/whole", world)
    for _ in range(steps):
        whole.train_step()
    first = _trainer(overrides, f"{out}/first", world)
    for _ in range(steps // 2):
        first.train_step()
    first.save()  # rank 0 writes what every rank resumes from
    torch.distributed.barrier()
    second = _trainer(overrides, f"{out}/second", world)
    second.resume(Path(out) / "first" / f"snapshot_iter_{steps // 2}.pt")
    for _ in range(steps - steps // 2):
        second.train_step()
    stats = {k: v for k, v in second.model.state_dict().items() if "running" in k}
    torch.save({"whole": {**_masters(whole), **whole.flat.state_dict()["momentum"],
                          **{k: v for k, v in whole.model.state_dict().items() if "running" in k}},
                "resumed": {**_masters(second), **second.flat.state_dict()["momentum"], **stats},
                "layouts_equal": whole.flat.layout_order == second.flat.layout_order}, Path(out) / f"rank{rank}.pt")


def test_three_rank_resume_with_replan_and_batchnorm_is_bit_exact(tmp_path):
    """The resumed run re-applies the replanned bucket layout at once (with 3 ranks the bucket
    boundaries decide gloo's summation order), and BatchNorm statistics are averaged over the
    ranks every iteration, so rank 0's snapshot is every rank's state."""
    run_ranks(3, _resume_rank, str(tmp_path), BN_NET, 4)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    stats = [k for k in ranks[0]["whole"] if "running" in k]
    assert stats, "the test model must have BatchNorm statistics"
    for r in ranks:
        assert r["layouts_equal"]
        for name, w in r["whole"].items():
            assert torch.equal(r["resumed"][name], w), f"{name}: resumed differs from uninterrupted"
    for name in stats:  # one set of statistics on every rank
        assert all(torch.equal(ranks[0]["whole"][name], r["whole"][name]) for r in ranks[1:]), name


def _start_rank(rank, world, out):
    first = _trainer(["reducer.replan=true"], f"{out}/first", world)  # replan: resume runs collectives
    first.train_step()
    first.train_step()
    first.save()
    t = _trainer(["reducer.replan=true"], out, world)
    try:  # as if only rank 0's node-local run dir held the snapshot
        if rank == 0:
            t.resume(Path(out) / "first" / "snapshot_iter_2.pt")
        else:
            check_same_start(t.comm, 0)
    except SnapshotError as e:
        Path(out, f"rank{rank}.txt").write_text(str(e))


def test_ranks_resuming_at_different_iterations_all_stop(tmp_path):
    run_ranks(2, _start_rank, str(tmp_path))
    for r in range(2):
        msg = (tmp_path / f"rank{r}.txt").read_text()
        assert "the ranks resumed at different iterations (rank 0: 2, rank 1: 0)" in msg, msg


# ---------------------------------------------------------------- gradient hand-over

def _handover_rank(rank, world, out, handover, steps):
    from dptrain.flat import FlatParams
    if not handover:  # accumulate into the zeroed views, as before the hand-over
        FlatParams.release_grads = lambda self: None
    t = _trainer(["data.batch_size=8", "solver.iter_size=2", *BUCKETS["per parameter"]], out, world)
    for _ in range(steps):
        t.train_step()
    torch.save(_masters(t), Path(out) / f"{'handover' if handover else 'accumulate'}{rank}.pt")


def test_two_ranks_hand_over_gradients_bit_exactly_like_accumulation(tmp_path):
    # per-parameter buckets: each allreduce launches from the hook right after its copy, so a
    # reducer hook that ran before the hand-over's would reduce a zero bucket
    for handover in (True, False):
        run_ranks(2, _handover_rank, str(tmp_path), handover, 4)
    for r in range(2):
        a, b = torch.load(tmp_path / f"handover{r}.pt"), torch.load(tmp_path / f"accumulate{r}.pt")
        assert all(torch.equal(a[k], b[k]) for k in a), f"rank {r}"
