"""The user's own models with 2 gloo solvers: frozen, unused and shared parameters, buffers that are
not BatchNorm statistics, tuple and dict outputs, and normalisations kept in fp32
(``dptrain.models``, ``dptrain.distributed.unused``, ``dptrain.train.outputs``)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from dist_harness import run_ranks
from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.errors import ConfigError
from dptrain.models import build_model
from dptrain.snapshots import load_snapshot
from dptrain.topology import Topology
from dptrain.train import Trainer

BASE = ["data.source=digits", "data.batch_size=8", "solver.base_lr=0.05", "solver.display=0",
        "solver.momentum=0.9", "solver.weight_decay=0.01", "reducer.bucket_mb=0.005", "reducer.first_bucket_mb=0.001"]


def _trainer(model: str, overrides: list[str], out: str, world: int) -> Trainer:
    cfg = load_config(None, [f"model.name={json.dumps(model)}", *BASE, f"train.run_dir={json.dumps(out)}", *overrides])
    comm = Communicator.from_initialized(torch.device("cpu")) if world > 1 else \
        Communicator.from_env(Topology(), 60, torch.device("cpu"))
    return Trainer(cfg, comm)


def _initial(model: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """The fp32 values every rank starts from (the same seed, built the same way)."""
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in build_model(model, num_classes=10).state_dict().items()}


def _warnings(out: str, rank: int) -> logging.Handler:
    h = logging.FileHandler(Path(out) / f"warnings{rank}.log")
    h.setLevel(logging.WARNING)
    logging.getLogger("dptrain").addHandler(h)
    return h


# ---------------------------------------------------------------- frozen parameters, outputs, fp32 norms

def _frozen_rank(rank, world, out):
    t = _trainer("byo_models:Frozen", ["precision.storage=fp16", "model.freeze=[\"trunk.0.weight\"]"], out, world)
    names = {s.name for g in t.flat.groups for s in g.segments}
    for _ in range(4):
        t.train_step()
    t.save()
    aux = _trainer("byo_models:AuxHeads", ["model.args.as_dict=true"], f"{out}/aux", world)
    for _ in range(2):
        aux.train_step()
    normed = _trainer("byo_models:Normed", ["precision.storage=bf16"], f"{out}/normed", world)
    normed.train_step()
    shared = _trainer("byo_models:Shared", [], f"{out}/shared", world)
    for _ in range(4):
        shared.train_step()
    torch.save(shared.flat.master_state(), Path(out) / f"shared{rank}.pt")
    torch.save({"trainable": sorted(names), "frozen": t.flat.master_state(), "masters": t.flat.master_state(),
                "model_bias": t.model.trunk[0].bias.detach().clone(), "aux": aux.flat.master_state(),
                "norm_dtypes": {n: p.dtype for n, p in normed.model.named_parameters()},
                "test": aux.test()}, Path(out) / f"rank{rank}.pt")


def test_frozen_shared_and_tied_parameters_outputs_and_norms(tmp_path):
    """One 2-rank run of four user models: frozen parameters, a dict output, fp32 norms, and a module
    used twice with a tied weight."""
    run_ranks(2, _frozen_rank, str(tmp_path))
    _check_shared(tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    start = _initial("byo_models:Frozen")
    frozen = ["trunk.0.weight", "trunk.0.bias"]  # the config's glob, and the model's own requires_grad=False
    for r in ranks:
        assert not set(frozen) & set(r["trainable"]), "frozen parameters must not be in the flat buffers"
        for n in frozen:  # fp16 storage, but the fp32 value is kept exactly and never updated
            assert torch.equal(r["frozen"][n], start[n]), n
        assert torch.equal(r["model_bias"], start["trunk.0.bias"].half())
        assert not torch.equal(r["masters"]["head.weight"], start["head.weight"]), "the rest trains"
    assert all(torch.equal(ranks[0]["masters"][k], ranks[1]["masters"][k]) for k in ranks[0]["masters"])
    snap = load_snapshot(tmp_path / "snapshot_iter_4.pt")
    for n in frozen:
        assert torch.equal(snap["model"][n], start[n]), f"snapshot: {n}"
    # a dict output with an aux head: the aux head trains (its loss is added), the features take no part
    aux_start = _initial("byo_models:AuxHeads")
    assert not torch.equal(ranks[0]["aux"]["aux1.weight"], aux_start["aux1.weight"])
    assert torch.equal(ranks[0]["aux"]["aux2.weight"], aux_start["aux2.weight"]), "aux2 is not in the dict output"
    assert 0.0 <= ranks[0]["test"]["test_top1"] <= 1.0 and ranks[0]["test"]["test_samples"] == 297
    dtypes = ranks[0]["norm_dtypes"]  # LayerNorm and GroupNorm stay fp32 under bf16 storage, by default
    assert dtypes["ln.weight"] == dtypes["gn.weight"] == torch.float32 and dtypes["conv.weight"] == torch.bfloat16


# ---------------------------------------------------------------- unused parameters

def _unused_rank(rank, world, out):
    for mode in ("auto", "error"):
        handler = _warnings(out, rank) if mode == "auto" else None
        try:
            t = _trainer("byo_models:Unused", [f"model.unused_parameters={mode}", "model.args.threshold=0.0"],
                         f"{out}/{mode}", world)
            for _ in range(6):
                t.train_step()
            torch.save({"masters": t.flat.master_state(), "momentum": t.flat.state_dict()["momentum"],
                        "candidates": t.unused.candidates, "taken": t.model.taken}, Path(out) / f"rank{rank}.pt")
        except ConfigError as e:
            Path(out, f"error{rank}.txt").write_text(str(e))
        finally:
            if handler is not None:
                logging.getLogger("dptrain").removeHandler(handler)


def test_unused_parameters_are_reduced_as_zeros_and_left_alone_by_the_update_or_an_error(tmp_path):
    run_ranks(2, _unused_rank, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    start = _initial("byo_models:Unused")
    for r in ranks:
        for n in ("dead.weight", "dead.bias"):  # no rank ever gives them a gradient: no decay, no momentum
            assert torch.equal(r["masters"][n], start[n]), n
            assert not r["momentum"][n].any(), n
        assert "dead.weight" in r["candidates"]
    taken = [r["taken"][-6:] for r in ranks]  # the branch was taken on some ranks and steps, not on others
    assert taken[0] != taken[1] and 0 < sum(map(sum, taken)) < 12, taken
    for k in ranks[0]["masters"]:  # whatever each rank's branch did, every rank holds the same weights
        assert torch.equal(ranks[0]["masters"][k], ranks[1]["masters"][k]), k
    assert not torch.equal(ranks[0]["masters"]["head.weight"], start["head.weight"])
    warned = (tmp_path / "warnings0.log").read_text()
    assert warned.count("got no gradient") == 1 and "dead.weight" in warned, warned
    assert (tmp_path / "warnings1.log").read_text() == ""  # rank 0 says it, once
    for r in range(2):  # model.unused_parameters = "error": every rank stops with the same line
        msg = (tmp_path / f"error{r}.txt").read_text()
        assert msg.startswith("model.unused_parameters = \"error\"") and "dead.weight" in msg, msg


def _check_shared(tmp_path: Path) -> None:
    """A module used twice and a tied weight are reduced once: 2 ranks x B train as 1 rank x 2B."""
    ref = _trainer("byo_models:Shared", ["data.batch_size=16"], str(tmp_path / "ref"), 1)
    assert ref.model.proj.weight is ref.model.back.weight
    assert sum(1 for g in ref.flat.groups for s in g.segments if s.name.endswith("proj.weight")) == 1
    for _ in range(4):
        ref.train_step()
    r0, r1 = (torch.load(tmp_path / f"shared{r}.pt") for r in range(2))
    for name, w in ref.flat.master_state().items():  # a gradient reduced twice would be twice the reference's
        assert torch.equal(r0[name], r1[name]), name
        torch.testing.assert_close(r0[name], w, rtol=1e-5, atol=1e-6, msg=f"{name} vs 1 rank x 2B")


# ---------------------------------------------------------------- buffers

def _buffers_rank(rank, world, out):
    torch.manual_seed(100 + rank)  # a rank-dependent draw anywhere before the build must not matter
    whole = _trainer("byo_models:Buffers", [], f"{out}/whole", world)
    for _ in range(4):
        whole.train_step()
    first = _trainer("byo_models:Buffers", [], f"{out}/first", world)
    for _ in range(2):
        first.train_step()
    first.save()
    torch.distributed.barrier()
    second = _trainer("byo_models:Buffers", [], f"{out}/second", world)
    second.resume(Path(out) / "first" / "snapshot_iter_2.pt")
    for _ in range(2):
        second.train_step()
    torch.save({"whole": {**whole.flat.master_state(), **dict(whole.model.named_buffers())},
                "resumed": {**second.flat.master_state(), **dict(second.model.named_buffers())}},
               Path(out) / f"rank{rank}.pt")
    _vit_rank(rank, world, f"{out}/vit")


def test_buffers_are_averaged_broadcast_or_own_and_resume_bit_exactly_and_the_example_vit_in_fp16(tmp_path):
    """One 2-rank run: the buffers' model, then the example ViT resumed in fp16 (``_vit_rank``)."""
    (tmp_path / "vit").mkdir()
    run_ranks(2, _buffers_rank, str(tmp_path))
    _check_vit(tmp_path / "vit")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        for name, v in r["whole"].items():
            assert torch.equal(r["resumed"][name], v), f"{name}: resumed differs from uninterrupted"
        assert int(r["whole"]["steps"]) == 4
    for name in ("norm.running_mean", "norm.running_var", "noise"):  # averaged (reassigned!), or rank 0's
        assert torch.equal(ranks[0]["whole"][name], ranks[1]["whole"][name]), name
    assert ranks[0]["whole"]["norm.running_mean"].abs().sum() > 0


# ---------------------------------------------------------------- the example ViT, fp16, resumed

VIT = ["precision.storage=fp16", "model.args.dim=32", "model.args.depth=2", "model.args.heads=2",
       "solver.type=adamw", "solver.base_lr=0.001", "model.attention=math"]
"""``model.attention`` set: "auto" measures at each start, and the uninterrupted run compared here is
another run, whose measurement may choose another kernel (a resume keeps its own run's: test_attention)."""


def _vit_rank(rank, world, out):
    whole = _trainer("examples.vit:VisionTransformer", VIT, f"{out}/whole", world)
    for _ in range(4):
        whole.train_step()
    first = _trainer("examples.vit:VisionTransformer", VIT, f"{out}/first", world)
    for _ in range(2):
        first.train_step()
    first.save()
    torch.distributed.barrier()
    second = _trainer("examples.vit:VisionTransformer", VIT, f"{out}/second", world)
    second.resume(Path(out) / "first" / "snapshot_iter_2.pt")
    for _ in range(2):
        second.train_step()
    def state(t: Trainer) -> dict[str, torch.Tensor]:
        moments = {f"{k}/{n}": v for k, per in t.flat.state_dict().items() for n, v in per.items()}
        return {**t.flat.master_state(), **moments, "loss_scale": t.scaler.scale.clone()}

    torch.save({"whole": state(whole), "resumed": state(second)}, Path(out) / f"rank{rank}.pt")


def _check_vit(tmp_path: Path) -> None:
    """The example ViT resumes bit-exactly in fp16 (loss scale, moments and masters)."""
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        for name, v in got["whole"].items():
            assert torch.equal(got["resumed"][name], v), f"rank {r}: {name}"
