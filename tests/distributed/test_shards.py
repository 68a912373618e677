"""reducer.shard = "optimizer" (ZeRO-1, ``dptrain.distributed.shards``) with 2 and 3 gloo solvers: the
padded slices, training as unsharded does (with clipping and LAMB's norms), the overflow skip, snapshots
resumed at other world sizes and unsharded, and a rank that dies in a gather named by the others."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_harness import inf_in_one_gradient, run_ranks
from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.flat import ALIGN_ELEMS
from dptrain.snapshots import load_snapshot
from dptrain.topology import Topology
from dptrain.train import Trainer

REPO = Path(__file__).resolve().parents[2]
BASE = ["model.name=lenet", "data.source=digits", "data.batch_size=8", "solver.display=0",
        "reducer.bucket_mb=0.05", "reducer.first_bucket_mb=0.003"]


def _trainer(overrides: list[str], out: str, world: int) -> Trainer:
    cfg = load_config(None, [*BASE, f"train.run_dir={json.dumps(out)}", *overrides])
    comm = Communicator.from_initialized(torch.device("cpu")) if world > 1 else \
        Communicator.from_env(Topology(), 60, torch.device("cpu"))
    return Trainer(cfg, comm)


# ---------------------------------------------------------------- layout, and training as unsharded

SOLVERS = {"adamw + clip": ["solver.type=adamw", "solver.base_lr=0.001", "solver.clip_gradients=0.5"],
           "lamb": ["solver.type=lamb", "solver.base_lr=0.001"],
           "sgd bf16": ["solver.base_lr=0.01", "precision.storage=bf16"]}


def _equal_rank(rank, world, out):
    got = {}
    for name, sets in SOLVERS.items():
        runs = {}
        for shard in ("none", "optimizer"):
            t = _trainer([*sets, f"reducer.shard={shard}"], f"{out}/{shard}", world)
            if shard == "optimizer" and name == "adamw + clip":
                unit = world * ALIGN_ELEMS
                layout = [(b.start, b.stop, *t.shards.owned(b)) for b in t.reducer.plan.buckets]
                parts = [(p.start, p.stop) for g in t.flat.groups for p in g.parts]
                got["layout"] = {"unit": unit, "buckets": layout, "parts": parts, "bytes": t.flat.state_bytes()}
            for _ in range(6):
                t.train_step()
            t.weights_whole()
            runs[shard] = t.flat.master_state()
            got.setdefault("bytes", {}).setdefault(name, {})[shard] = t.flat.state_bytes()
            t.close()
        got[name] = runs
    torch.save(got, Path(out) / f"rank{rank}.pt")
    if world == 2:  # the same processes check the overflow skip and the auto plan
        _overflow_rank(rank, world, f"{out}/overflow")
        _auto_rank(rank, world, f"{out}/auto")


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_slices_are_padded_and_aligned_and_train_as_unsharded(tmp_path, world):
    """With 2 ranks the same run also skips an overflow on every rank (``_overflow_rank``) and lets the
    auto plan re-lay out a sharded run (``_auto_rank``)."""
    for sub in ("overflow", "auto"):
        (tmp_path / sub).mkdir()
    run_ranks(world, _equal_rank, str(tmp_path))
    if world == 2:
        _check_auto(tmp_path / "auto")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r, got in enumerate(ranks):
        lay = got["layout"]
        for start, stop, lo, hi in lay["buckets"]:  # every bucket divides into equal aligned slices
            assert (stop - start) % lay["unit"] == 0 and hi - lo == (stop - start) // world
            assert lo == start + r * (hi - lo) and lo % ALIGN_ELEMS == 0
        assert lay["parts"] == [(lo, hi) for _, _, lo, hi in lay["buckets"]] or \
            sorted(lay["parts"]) == sorted((lo, hi) for _, _, lo, hi in lay["buckets"])
        for name in SOLVERS:
            bytes_ = got["bytes"][name]
            assert bytes_["optimizer"] <= 0.55 * bytes_["none"] if world == 2 else bytes_["optimizer"] < bytes_["none"]
            a, b = got[name]["none"], got[name]["optimizer"]
            for k in a:  # the sums run in another order: fp32 ~1e-7 per step; bf16 weights round alike
                rel = float((a[k] - b[k]).norm() / a[k].norm())
                assert rel <= (1e-2 if "bf16" in name else 1e-5), (name, k, rel)
    for name in SOLVERS:  # every rank holds the same weights
        assert all(torch.equal(ranks[0][name]["optimizer"][k], r[name]["optimizer"][k])
                   for r in ranks[1:] for k in ranks[0][name]["optimizer"]), name


# ---------------------------------------------------------------- the overflow skip

def _overflow_rank(rank, world, out):
    t = _trainer(["precision.storage=fp16", "precision.loss_scale.init_scale=1024", "reducer.shard=optimizer",
                  "solver.momentum=0.9"], out, world)
    t.train_step()
    t.weights_whole()
    before = t.flat.master_state()
    if rank == 1:  # only rank 1 sees an inf, in one gradient element, in rank 0's slice or its own
        handle = inf_in_one_gradient(t.model.classifier[3].weight)
    t.train_step()
    if rank == 1:
        handle.remove()
    t.weights_whole()
    after = t.flat.master_state()
    assert all(torch.equal(before[k], after[k]) for k in before), f"rank {rank}: weights moved on overflow"
    assert t.scaler.stats() == {"loss_scale": 512.0, "skipped_steps": 1}, t.scaler.stats()
    t.train_step()
    t.weights_whole()
    assert not all(torch.equal(after[k], v) for k, v in t.flat.master_state().items())


# ---------------------------------------------------------------- snapshots across world sizes

SNAP = ["solver.type=adamw", "solver.base_lr=0.001", "solver.snapshot=3", "solver.max_iter=3"]


def _write_rank(rank, world, out, shard="optimizer"):
    t = _trainer([*SNAP, f"reducer.shard={shard}"], out, world)
    t.fit()
    if shard == "optimizer":  # the snapshot's whole state is views of what was gathered, not a second copy
        storages = {v.untyped_storage().data_ptr() for per in t.flat.state_dict().values() for v in per.values()}
        assert len(storages) == len(t.flat.groups) * len(t.flat.groups[0].state), storages
    t.close()


def _resume_rank(rank, world, out, shard):
    for source in ("sharded", "unsharded"):
        t = _trainer([*SNAP, f"reducer.shard={shard}", "solver.max_iter=5"], f"{out}/resumed{world}{shard}{source}",
                     world)
        t.resume(Path(out) / source / "snapshot_iter_3.pt")
        loaded = (t.flat.master_state(), t.flat.state_dict())
        t.train_step()
        t.weights_whole()
        finite = all(bool(torch.isfinite(v).all()) for v in t.flat.master_state().values())
        t.close()
        if rank == 0:
            torch.save({"loaded": loaded, "finite": finite}, Path(out) / f"loaded{world}{shard}{source}.pt")


def test_a_sharded_snapshot_is_whole_and_resumes_at_any_world_size_sharded_or_not(tmp_path):
    """Written by 2 sharded solvers, resumed by 3 sharded and by 1 unsharded; and the other way round,
    written by 1 unsharded solver, resumed by 3 sharded."""
    run_ranks(2, _write_rank, str(tmp_path / "sharded"))
    _write_rank(0, 1, str(tmp_path / "unsharded"), "none")
    run_ranks(3, _resume_rank, str(tmp_path), "optimizer")
    _resume_rank(0, 1, str(tmp_path), "none")
    for source in ("sharded", "unsharded"):
        snap = load_snapshot(tmp_path / source / "snapshot_iter_3.pt")
        masters, state = snap["model"], snap["optimizer"]["state"]
        assert set(state) == {"exp_avg", "exp_avg_sq"}
        for world, shard in ((3, "optimizer"), (1, "none")):
            got = torch.load(tmp_path / f"loaded{world}{shard}{source}.pt")
            loaded_masters, loaded_state = got["loaded"]
            for k, v in loaded_masters.items():
                assert torch.equal(v, masters[k].float()), (source, world, shard, k)
            for name, per in loaded_state.items():
                assert all(torch.equal(per[k], state[name][k]) for k in per), (source, world, shard, name)
            assert got["finite"]


# ---------------------------------------------------------------- a rank dies in a gather

def test_a_rank_that_dies_in_a_gather_is_named_by_the_others(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[model]\nname = "lenet"\n[data]\nsource = "digits"\nbatch_size = 8\n[solver]\nmax_iter = 1000\n'
                   f'display = 0\n[reducer]\nshard = "optimizer"\ntimeout_s = 5\n[train]\nrun_dir = "{tmp_path / "run"}"\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIE_RANK": "2", "DIE_ITERATION": "5",
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    proc = subprocess.run([sys.executable, "-m", "dptrain.torchrun", "--standalone", "--nproc-per-node=3",
                           "-m", "die_in_gather", "train", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=120, env=env)
    for r in (0, 1):
        line = next((ln for ln in proc.stderr.splitlines() if ln.startswith(f"dptrain: error (rank {r})")), "")
        assert re.search(rf"rank {r}: waiting in all_gather_async of bucket \d+ \(#\d+, iteration 5", line), \
            proc.stderr[-3000:]
        assert "rank 2 never arrived" in line or "rank 2 stopped answering" in line, line
        flight = json.loads((tmp_path / "run" / f"flight.rank{r}.json").read_text())
        assert flight["never_arrived"] == [2] and flight["waiting_in"]["op"] == "all_gather_async"


# ---------------------------------------------------------------- the auto planner re-lays out a sharded run

def _auto_rank(rank, world, out):
    got = {}
    for wait in ("forward", "step"):
        t = _trainer(["reducer.bucket_mb=auto", "reducer.shard=optimizer", f"reducer.gather_wait={wait}",
                      "solver.type=adamw", "solver.base_lr=0.001"], f"{out}/{wait}", world)
        while t.bucket_tuner.pending:
            t.train_step()
        for _ in range(2):
            t.train_step()
        t.weights_whole()
        got[wait] = {"masters": t.flat.master_state(), "sizes": [b.stop - b.start for b in t.reducer.plan.buckets],
                     "probe": len(t.reducer.plan.buckets), "bytes": t.flat.state_bytes()}
        t.close()
    torch.save(got, Path(out) / f"rank{rank}.pt")


def _check_auto(tmp_path: Path) -> None:
    """The auto plan re-lays out a sharded run (padded buckets), the gathers waited in forward or at the step."""
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for got in ranks:
        for wait, g in got.items():
            assert all(size % (2 * ALIGN_ELEMS) == 0 for size in g["sizes"]), (wait, g["sizes"])
    for wait in ("forward", "step"):
        a, b = ranks[0][wait]["masters"], ranks[1][wait]["masters"]
        assert all(torch.equal(a[k], b[k]) for k in a), wait
