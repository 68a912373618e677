"""precision.mode = "autocast" (O1 beside O2) with 2 gloo solvers: the loss scale applied before a
16-bit reduce, the overflow skip on every rank, a bit-exact resume, a cross-mode resume refused; and
every zoo model trains a step in that mode."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dist_harness import run_ranks
from dptrain.cli import main
from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.distributed.reducer import Reducer
from dptrain.errors import ConfigError, SnapshotError
from dptrain.models import MODELS
from dptrain.topology import Topology
from dptrain.train import Trainer

BASE = ["data.source=digits", "data.batch_size=8", "solver.display=0", "solver.base_lr=0.01",
        "precision.mode=autocast", "reducer.bucket_mb=0.005", "reducer.first_bucket_mb=0.001"]


def _trainer(model: str, overrides: list[str], out: str, world: int = 2) -> Trainer:
    cfg = load_config(None, [f"model.name={json.dumps(model)}", *BASE, f"train.run_dir={json.dumps(out)}",
                             *overrides])
    comm = Communicator.from_initialized(torch.device("cpu")) if world > 1 else \
        Communicator.from_env(Topology(), 60, torch.device("cpu"))
    return Trainer(cfg, comm)


# ---------------------------------------------------------------- the wire: scaled, then 16 bits

def _wire_rank(rank, world, out):
    t = _trainer("byo_models:Shared", ["precision.storage=fp16"], out)
    reference = copy.deepcopy(t.model)
    scale = float(t.scaler.scale)
    sent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    real_launch, real_allreduce = Reducer._launch, t.reducer._collective.allreduce_async
    wire: dict[int, torch.Tensor] = {}

    def allreduce(tensor, tag=-1):  # what goes on the wire, before the sum replaces it
        wire[tag] = tensor.clone()
        return real_allreduce(tensor, tag=tag)

    def launch(self, b):  # the local fp32 bucket as launched, and what went on the wire
        view = self.flat.groups[b.group].grads[b.start : b.stop].clone()
        real_launch(self, b)
        sent[b.index] = (view, wire[b.index])

    t.reducer._collective.allreduce_async = allreduce
    Reducer._launch = launch
    batch = {}
    real_next = t._next_batch

    def next_batch():
        batch["xy"] = real_next()
        return batch["xy"]

    t._next_batch = next_batch
    try:
        t.train_step()
    finally:
        Reducer._launch = real_launch
    x, y = batch["xy"]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(reference(x).float(), y)
    loss.backward()
    local = {n: p.grad for n, p in reference.named_parameters()}
    torch.save({"sent": sent, "scale": scale, "local": local,
                "segments": [(s.name, s.offset, s.numel) for g in t.flat.groups for s in g.segments],
                "buckets": [(b.index, b.start, b.stop) for b in t.reducer.plan.buckets]}, Path(out) / f"rank{rank}.pt")
    t.close()
    _resume_rank(rank, world, f"{out}/resume")  # the same processes: resume, and across modes


def test_autocast_reduces_loss_scaled_gradients_in_fp16_resumes_bit_exactly_and_refuses_other_modes(tmp_path):
    (tmp_path / "resume").mkdir()
    run_ranks(2, _wire_rank, str(tmp_path))
    _check_resume(tmp_path / "resume")
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["scale"] == 65536.0 and got["sent"], "dynamic loss scaling, buckets launched"
        start = {i: s for i, s, _ in got["buckets"]}
        for i, (local, wire) in got["sent"].items():
            assert local.dtype == torch.float32 and wire.dtype == torch.float16
            assert torch.equal(wire, local.half())  # the scaled fp32 gradient, rounded once to fp16
            for name, offset, numel in got["segments"]:  # the loss scale was applied before the reduce
                lo, hi = offset - start[i], offset - start[i] + numel
                if 0 <= lo and hi <= local.numel():  # the same gradient, times the scale (fp16 matmuls: ~1e-3)
                    want = got["local"][name].flatten() * got["scale"]
                    assert (local[lo:hi] - want).norm() <= 1e-2 * want.norm(), name


# ---------------------------------------------------------------- resume, and across modes

def _resume_rank(rank, world, out):
    sets = ["precision.storage=bf16", "solver.momentum=0.9"]
    whole = _trainer("lenet", sets, f"{out}/whole")
    for _ in range(4):
        whole.train_step()
    first = _trainer("lenet", sets, f"{out}/first")
    for _ in range(2):
        first.train_step()
    first.save()
    torch.distributed.barrier()
    second = _trainer("lenet", sets, f"{out}/second")
    second.resume(Path(out) / "first" / "snapshot_iter_2.pt")
    for _ in range(2):
        second.train_step()
    storage = _trainer("lenet", [*sets, "precision.mode=storage"], f"{out}/storage")
    try:
        storage.resume(Path(out) / "first" / "snapshot_iter_2.pt")
    except SnapshotError as e:
        Path(out, f"refused{rank}.txt").write_text(str(e))
    assert whole.flat.groups[0].params.dtype == torch.float32 and whole.flat.groups[0].master is whole.flat.groups[0].params
    torch.save({"whole": {**whole.flat.master_state(), **whole.flat.state_dict()["momentum"]},
                "resumed": {**second.flat.master_state(), **second.flat.state_dict()["momentum"]}},
               Path(out) / f"rank{rank}.pt")


def _check_resume(tmp_path: Path) -> None:
    """Resumed in autocast mode, bit-exactly; a storage-mode run refuses the autocast snapshot."""
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        for name, v in got["whole"].items():
            assert torch.equal(got["resumed"][name], v), f"rank {r}: {name}"
        msg = (tmp_path / f"refused{r}.txt").read_text()
        assert "was written with precision.mode = 'autocast', this run has 'storage'" in msg, msg


# ---------------------------------------------------------------- config, and every zoo model

def test_autocast_needs_a_16_bit_dtype_and_fp16_on_the_wire_needs_loss_scaling():
    with pytest.raises(ConfigError, match="precision.mode = \"autocast\" computes in precision.storage's 16-bit"):
        load_config(None, ["precision.mode=autocast", "precision.storage=fp32"])
    with pytest.raises(ConfigError, match="reducer.dtype = \"fp16\" without loss scaling"):
        load_config(None, ["precision.mode=autocast", "precision.storage=bf16", "reducer.dtype=fp16"])
    with pytest.raises(ConfigError, match="reducer.dtype = \"bf16\" with precision.storage = \"fp16\""):
        load_config(None, ["precision.storage=fp16", "reducer.dtype=bf16"])
    cfg = load_config(None, ["precision.mode=autocast", "precision.storage=bf16"])
    assert cfg.wire_dtype() == "bf16" and cfg.precision.weights == "fp32"


ZOO_INPUT = {"alexnet": 64, "googlenet": 64}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_zoo_model_trains_a_step_under_autocast(tmp_path, capsys, name):
    size = ZOO_INPUT.get(name, 32)
    (tmp_path / "r.toml").write_text("")
    sets = [f"model.name={name}", "model.width=8", "data.source=synthetic", f"data.image_size={size}",
            "data.batch_size=2", "precision.mode=autocast", "precision.storage=bf16", "solver.max_iter=2",
            "solver.display=1", "solver.test_iter=1", f"train.run_dir={json.dumps(str(tmp_path / 'run'))}"]
    assert main(["train", "--config", str(tmp_path / "r.toml"), *[a for s in sets for a in ("--set", s)]]) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in lines if "loss" in r] == [1, 2] and all(r["loss"] > 0 for r in lines if "loss" in r)
