"""Start from weights (train --weights), score (dptrain test) and export, on one process."""
from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from dptrain.cli import main
from dptrain.config import config_to_dict, load_config
from dptrain.distributed.comm import Communicator
from dptrain.errors import SnapshotError
from dptrain.flat import FlatParams
from dptrain.models import build_model
from dptrain.observe.metrics import read_metrics
from dptrain.snapshots import SNAPSHOT_FORMAT, RunDir, load_snapshot, save_snapshot
from dptrain.topology import Topology
from dptrain.train import Trainer
from dptrain.weights import from_torchvision, load_weights, to_torchvision

LENET = ['model.name="lenet"', 'data.source="digits"', "data.batch_size=32", "solver.base_lr=0.01",
         'solver.lr_policy="fixed"', "solver.display=10", "solver.test_interval=0", "solver.snapshot=0"]
RESNET50_PARAMS = 25_557_032
"""ResNet-50's published parameter count with 1000 classes (torchvision's resnet50 too)."""


def _sets(run: Path, *extra: str) -> list[str]:
    return [f"--set={s}" for s in (*LENET, f"train.run_dir={json.dumps(str(run))}", *extra)]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A LeNet snapshot after 40 iterations on the digits (0.91 test top-1)."""
    tmp = tmp_path_factory.mktemp("pretrained")
    (tmp / "c.toml").write_text("")
    assert main(["train", "--config", str(tmp / "c.toml"), *_sets(tmp / "run", "solver.max_iter=40")]) == 0
    return tmp / "run" / "snapshot_iter_40.pt"


@pytest.fixture()
def cfg(tmp_path) -> str:
    (tmp_path / "c.toml").write_text("")
    return str(tmp_path / "c.toml")


def _one_json_line(capsys) -> dict:
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dptrain: error: "), err
    return err[0]


# ----------------------------------------------------------------------------- train --weights


def test_fine_tune_from_a_snapshot_with_a_new_head_beats_training_from_scratch(pretrained, cfg, tmp_path):
    short = ("model.num_classes=12", "solver.max_iter=10", "solver.display=5")  # a new 12-way head
    tuned = ["train", "--config", cfg, "--weights", str(pretrained), "--weights-skip", "classifier.3.*"]
    assert main([*tuned, *_sets(tmp_path / "tuned", *short)]) == 0
    assert main(["train", "--config", cfg, *_sets(tmp_path / "scratch", *short)]) == 0
    tuned_lines, scratch_lines = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("tuned", "scratch"))
    assert [r["iter"] for r in tuned_lines if "loss" in r] == [5, 10]  # the iteration count started at 0
    assert sorted(p.name for p in (tmp_path / "tuned").glob("snapshot_*")) == ["snapshot_iter_10.pt"]
    tuned_top1, scratch_top1 = tuned_lines[-1]["test_top1"], scratch_lines[-1]["test_top1"]
    # measured 0.92 vs 0.61 after 10 iterations: the features come from the snapshot, only the head is new
    assert tuned_top1 > 0.85 and tuned_top1 > scratch_top1 + 0.15, (tuned_top1, scratch_top1)


def test_weights_load_the_model_only_and_everything_else_starts_fresh(pretrained, tmp_path):
    snap = load_snapshot(pretrained)
    assert any(bool(v.abs().sum() > 0) for v in snap["optimizer"]["state"]["momentum"].values())
    c = load_config(None, [*LENET, f"train.run_dir={json.dumps(str(tmp_path))}", "precision.storage=bf16"])
    t = Trainer(c, Communicator.from_env(Topology(), 60, torch.device("cpu")))
    rng = torch.get_rng_state()
    load_weights(t.model, t.flat, pretrained, model_name="lenet")
    masters = t.flat.master_state()
    for name, w in masters.items():
        assert w.dtype == torch.float32 and torch.equal(w, snap["model"][name]), name  # the fp32 masters, exactly
    for name, p in t.model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, snap["model"][name].bfloat16()), name
    assert t.iteration == 0 and torch.equal(torch.get_rng_state(), rng)
    assert all(not bool(g.state["momentum"].any()) for g in t.flat.groups)
    t.close()


def test_weights_errors_are_one_line(pretrained, cfg, tmp_path, capsys):
    run = _sets(tmp_path / "run")
    assert main(["train", "--config", cfg, "--weights", str(pretrained), "--resume", "auto", *run]) == 2
    assert "--weights starts a new run from a model's weights and --resume continues a run" in _one_error_line(capsys)
    assert main(["train", "--config", cfg, "--weights-skip", "fc.*", *run]) == 2
    assert "--weights-skip names weights not to load, so it needs --weights PATH" in _one_error_line(capsys)
    assert main(["train", "--config", cfg, "--weights", str(pretrained), "--weights-skip", "fc.*", *run]) == 2
    line = _one_error_line(capsys)
    assert "--weights-skip 'fc.*' matches no name of the model or of --weights" in line
    assert "names look like features.0.weight, features.0.bias" in line
    assert main(["train", "--config", cfg, "--weights", str(pretrained), *run, "--set=model.num_classes=12"]) == 2
    line = _one_error_line(capsys)
    assert ("(the model of dptrain snapshot iteration 40) does not fit this model: 2 of another shape (file vs "
            "model: classifier.3.weight [10, 500] vs [12, 500], classifier.3.bias [10] vs [12])") in line
    assert "pass --weights-skip GLOB" in line
    assert RunDir(tmp_path / "run").earlier_run() == []  # nothing trained, nothing written: a retry may start there


def test_mismatched_names_are_listed_and_counted(pretrained, tmp_path):
    model = build_model("lenet", num_classes=10)
    flat = FlatParams(model, state_dtype=torch.float32)
    renamed = {f"net.{k}": v for k, v in load_snapshot(pretrained)["model"].items()}  # another model's names
    renamed["fc.weight"] = torch.zeros(2)
    torch.save(renamed, tmp_path / "renamed.pt")
    with pytest.raises(SnapshotError) as e:
        load_weights(model, flat, tmp_path / "renamed.pt", model_name="lenet")
    assert ("(a state_dict) does not fit this model: 8 missing (features.0.weight, features.0.bias, features.2.weight, "
            "features.2.bias, classifier.1.weight and 3 more); 9 unexpected (net.features.0.weight, ") in str(e.value)


def test_wrapper_prefixes_and_training_checkpoints_load_as_their_state_dict(pretrained, tmp_path):
    """DDP's ``module.`` and torch.compile's ``_orig_mod.`` on every name, and a training script's
    checkpoint with the state_dict under "model" (torchvision's references) or "state_dict"."""
    want = load_snapshot(pretrained)["model"]
    saved = {
        "ddp.pt": {f"module.{k}": v for k, v in want.items()},
        "compiled_ddp.pt": {f"module._orig_mod.{k}": v for k, v in want.items()},
        "reference.pt": {"model": {f"module.{k}": v for k, v in want.items()}, "optimizer": {}, "epoch": 3},
        "lightning.pt": {"state_dict": dict(want), "epoch": 3},
    }
    for name, obj in saved.items():
        torch.save(obj, tmp_path / name)
        model = build_model("lenet", num_classes=10)
        flat = FlatParams(model, state_dtype=torch.float32)
        load_weights(model, flat, tmp_path / name, model_name="lenet")
        got = model.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in got if not k.endswith("num_batches_tracked")), name


def test_a_missing_weights_file_is_reported_before_anything_is_built(cfg, tmp_path, capsys, monkeypatch):
    import dptrain.run as run_module

    def never(*a, **k):
        raise AssertionError("built a process group before checking --weights PATH")

    monkeypatch.setattr(run_module.Communicator, "from_env", never)
    assert main(["train", "--config", cfg, "--weights", str(tmp_path / "w.pt"), *_sets(tmp_path / "run")]) == 2
    assert "w.pt': no such file; pass a dptrain snapshot_iter_<N>.pt or a file saved with" in _one_error_line(capsys)
    assert main(["test", "--config", cfg, "--weights", str(tmp_path / "w.pt"), *_sets(tmp_path / "run")]) == 2
    assert "w.pt': no such file" in _one_error_line(capsys)


def test_weights_files_that_hold_code_or_no_state_dict_are_refused(tmp_path):
    model = build_model("lenet", num_classes=10)
    flat = FlatParams(model, state_dtype=torch.float32)

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"conv.weight": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(SnapshotError, match=r"evil\.pt' holds a posix\.system, .* does not run code from a file; save "
                                            r"the weights with torch\.save\(model\.state_dict\(\), PATH\)"):
        load_weights(model, flat, tmp_path / "evil.pt", model_name="lenet")
    torch.save({"weights": model.state_dict(), "epoch": 3}, tmp_path / "wrapped.pt")
    with pytest.raises(SnapshotError, match=r"wrapped\.pt' holds a dict with keys \['weights', 'epoch'\], neither "
                                            r"a dptrain snapshot nor a state_dict"):
        load_weights(model, flat, tmp_path / "wrapped.pt", model_name="lenet")
    torch.save(list(model.state_dict().values()), tmp_path / "list.pt")
    with pytest.raises(SnapshotError, match=r"list\.pt' holds a list, neither a dptrain snapshot nor a state_dict"):
        load_weights(model, flat, tmp_path / "list.pt", model_name="lenet")
    (tmp_path / "junk.pt").write_bytes(bytes(range(256)) * 20)
    with pytest.raises(SnapshotError, match=r"junk\.pt' cannot be read .*; it is torn or not a torch\.save file"):
        load_weights(model, flat, tmp_path / "junk.pt", model_name="lenet")


# ----------------------------------------------------------------------------- torchvision names


def torchvision_resnet50_shapes(num_classes: int = 1000) -> dict[str, tuple[int, ...]]:
    """The state_dict of torchvision.models.resnet50, name -> shape, written out from torchvision's
    naming (no torchvision needed): conv1/bn1 stem, layerI.J.{conv,bn}{1,2,3}, a downsample.{0,1}
    projection in each stage's first block, fc."""
    shapes: dict[str, tuple[int, ...]] = {"conv1.weight": (64, 3, 7, 7)}

    def bn(prefix: str, c: int) -> None:
        shapes.update({f"{prefix}.weight": (c,), f"{prefix}.bias": (c,), f"{prefix}.running_mean": (c,),
                       f"{prefix}.running_var": (c,), f"{prefix}.num_batches_tracked": ()})

    bn("bn1", 64)
    cin = 64
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True), start=1):
        for j in range(blocks):
            p = f"layer{stage}.{j}"
            shapes[f"{p}.conv1.weight"] = (width, cin, 1, 1)
            bn(f"{p}.bn1", width)
            shapes[f"{p}.conv2.weight"] = (width, width, 3, 3)
            bn(f"{p}.bn2", width)
            shapes[f"{p}.conv3.weight"] = (4 * width, width, 1, 1)
            bn(f"{p}.bn3", 4 * width)
            if j == 0:
                shapes[f"{p}.downsample.0.weight"] = (4 * width, cin, 1, 1)
                bn(f"{p}.downsample.1", 4 * width)
            cin = 4 * width
    shapes.update({"fc.weight": (num_classes, 2048), "fc.bias": (num_classes,)})
    return shapes


def _random_state(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randint(0, 100, s, dtype=torch.int64, generator=g) if k.endswith("num_batches_tracked")
            else torch.randn(s, generator=g) for k, s in shapes.items()}


def test_the_torchvision_names_written_out_are_resnet50():
    shapes = torchvision_resnet50_shapes()
    params = [k for k in shapes if not k.rsplit(".", 1)[-1].startswith(("running_", "num_batches"))]
    assert sum(torch.Size(shapes[k]).numel() for k in params) == RESNET50_PARAMS
    ours = build_model("resnet50", num_classes=1000).state_dict()
    assert {k: tuple(v.shape) for k, v in to_torchvision("resnet50", ours).items()} == shapes
    assert list(from_torchvision("resnet50", to_torchvision("resnet50", ours))) == list(ours)  # inverse, same order


def test_a_torchvision_resnet50_state_dict_loads_with_a_new_head(tmp_path):
    tv = _random_state(torchvision_resnet50_shapes(1000))
    torch.save(tv, tmp_path / "resnet50_tv.pt")
    model = build_model("resnet50", num_classes=10)
    flat = FlatParams(model, state_dtype=torch.float32)
    fresh_fc = model.fc.weight.detach().clone()
    with pytest.raises(SnapshotError, match=r"of another shape \(file vs model: fc\.weight \[1000, 2048\] vs "
                                            r"\[10, 2048\], fc\.bias \[1000\] vs \[10\]\)"):
        load_weights(model, flat, tmp_path / "resnet50_tv.pt", model_name="resnet50")
    load_weights(model, flat, tmp_path / "resnet50_tv.pt", model_name="resnet50", skip=("fc.*",))
    loaded = to_torchvision("resnet50", model.state_dict())
    for name, want in tv.items():
        if not name.startswith("fc."):
            assert torch.equal(loaded[name], want), name
    assert torch.equal(model.fc.weight, fresh_fc)  # the skipped head keeps its initial values
    assert torch.equal(flat.master_state()["stem.0.weight"], tv["conv1.weight"])


def test_export_writes_resnet50_in_torchvision_names(tmp_path, capsys):
    model = build_model("resnet50", num_classes=1000)
    state = {k: v.float() if v.is_floating_point() else v for k, v in _random_state(
        {k: tuple(v.shape) for k, v in model.state_dict().items()}).items()}
    config = config_to_dict(load_config(None, ['model.name="resnet50"', "model.num_classes=1000"]))
    save_snapshot({"format": SNAPSHOT_FORMAT, "iteration": 7, "model": state, "optimizer": {}, "rng": [],
                   "config": config}, tmp_path / "snapshot_iter_7.pt")
    assert main(["export", str(tmp_path / "snapshot_iter_7.pt"), str(tmp_path / "out" / "resnet50.pt")]) == 0
    assert _one_json_line(capsys) == {"out": str(tmp_path / "out" / "resnet50.pt"),
                                      "snapshot": str(tmp_path / "snapshot_iter_7.pt"), "iteration": 7,
                                      "model": "resnet50", "names": "torchvision", "tensors": len(state)}
    exported = torch.load(tmp_path / "out" / "resnet50.pt", weights_only=True)
    assert {k: tuple(v.shape) for k, v in exported.items()} == torchvision_resnet50_shapes(1000)
    assert torch.equal(exported["conv1.weight"], state["stem.0.weight"])
    assert torch.equal(exported["bn1.running_var"], state["stem.1.running_var"])
    assert all(v.dtype == torch.float32 for v in exported.values() if v.is_floating_point())


# ----------------------------------------------------------------------------- dptrain test, export


def test_score_and_export_a_lenet_snapshot(pretrained, cfg, tmp_path, capsys):
    run = tmp_path / "never"
    assert main(["test", "--config", cfg, "--weights", str(pretrained), *_sets(run)]) == 0
    scored = _one_json_line(capsys)
    final = [r for r in read_metrics(pretrained.parent / "metrics.jsonl") if "test_top1" in r][-1]
    assert scored == {"test_top1": final["test_top1"], "test_top5": final["test_top5"], "test_samples": 297,
                      "weights": str(pretrained), "world_size": 1}  # the training run's own final test
    assert not run.exists()  # dptrain test writes nothing: a later train there starts fresh
    out = tmp_path / "lenet.pt"
    assert main(["export", str(pretrained), str(out)]) == 0
    assert _one_json_line(capsys)["names"] == "dptrain"
    plain = build_model("lenet", num_classes=10)
    plain.load_state_dict(torch.load(out, weights_only=True))  # strict: the same names and shapes
    x = torch.randn(4, 3, 32, 32)
    reference = build_model("lenet", num_classes=10)
    reference.load_state_dict(load_snapshot(pretrained)["model"])
    assert torch.equal(plain(x), reference(x))
    assert main(["test", "--config", cfg, "--weights", str(out), *_sets(run)]) == 0
    assert _one_json_line(capsys)["test_top1"] == final["test_top1"]


def test_export_and_test_errors_are_one_line(pretrained, cfg, tmp_path, capsys):
    assert main(["export", str(tmp_path / "none.pt"), str(tmp_path / "out.pt")]) == 2
    assert "snapshot '" in (line := _one_error_line(capsys)) and "none.pt' not found" in line
    (tmp_path / "junk.pt").write_bytes(bytes(range(256)) * 20)
    assert main(["export", str(tmp_path / "junk.pt"), str(tmp_path / "out.pt")]) == 2
    assert "junk.pt' cannot be read" in _one_error_line(capsys)
    assert main(["export", str(pretrained), str(pretrained)]) == 2
    assert "would overwrite the snapshot itself; choose another OUT path" in _one_error_line(capsys)
    import shutil

    other = tmp_path / "kept.pt"  # another snapshot, whatever its name: exporting over it would lose it
    shutil.copy(pretrained, other)
    assert main(["export", str(pretrained), str(other)]) == 2
    assert "kept.pt' is a dptrain snapshot; exporting over it would lose it" in _one_error_line(capsys)
    rot = bytearray(other.read_bytes())  # bit rot in the tensor data: torch's reader does not see it
    with zipfile.ZipFile(other) as z:
        member = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 64)
    h = member.header_offset  # the local header's name and extra lengths (torch pads the extra to align data)
    start = h + 30 + int.from_bytes(rot[h + 26:h + 28], "little") + int.from_bytes(rot[h + 28:h + 30], "little")
    rot[start + 8] ^= 0x10
    other.write_bytes(bytes(rot))
    assert main(["export", str(other), str(tmp_path / "out.pt")]) == 2
    assert f"kept.pt' is damaged: its member {member.filename!r} does not match its CRC-32" in _one_error_line(capsys)
    (tmp_path / "afile").write_text("x")
    assert main(["export", str(pretrained), str(tmp_path / "afile" / "out.pt")]) == 2
    assert "cannot write '" in (line := _one_error_line(capsys)) and "choose another OUT path" in line
    db = _lmdb_without_a_test_set(tmp_path / "db")
    assert main(["test", "--config", cfg, "--weights", str(pretrained), *_sets(tmp_path / "run"),
                 '--set=data.source="lmdb"', f"--set=data.path={json.dumps(db)}", "--set=data.batch_size=4"]) == 2
    assert "dptrain test needs a test set, and this config has none: set data.test_path" in _one_error_line(capsys)


def test_a_folder_given_for_a_file_is_named_a_folder_with_its_newest_good_snapshot(pretrained, cfg, tmp_path,
                                                                                     capsys):
    """export, test --weights and train --weights refuse a folder (a state_dict could be any file in it), saying
    it is one and naming the file most likely meant; nothing is written."""
    from dptrain.snapshots import mark_diverging

    run, out = pretrained.parent, tmp_path / "out.pt"
    assert main(["export", str(run), str(out)]) == 2
    assert _one_error_line(capsys).endswith(f"snapshot {str(run)!r} is a folder, not a file; pass a file: its newest "
                                            f"good snapshot is {str(pretrained)!r}")
    for command in ("test", "train"):
        assert main([command, "--config", cfg, "--weights", str(run), *_sets(tmp_path / "run")]) == 2
        assert _one_error_line(capsys).endswith(f"--weights {str(run)!r} is a folder, not a file; pass a file: its "
                                                f"newest good snapshot is {str(pretrained)!r}")
    empty, marked = tmp_path / "empty", tmp_path / "marked"
    empty.mkdir()
    marked.mkdir()
    for it in (5, 10):
        (marked / f"snapshot_iter_{it}.pt").write_bytes(b"x")
        mark_diverging(marked / f"snapshot_iter_{it}.pt", "diverging")
    assert main(["export", str(empty), str(out)]) == 2
    assert _one_error_line(capsys).endswith("is a folder, not a file; it holds no snapshot_iter_<N>.pt; pass a "
                                            "snapshot file")
    assert main(["export", str(marked), str(out)]) == 2
    assert _one_error_line(capsys).endswith(f"is a folder, not a file; pass a file: its 2 snapshot(s) are all marked "
                                            f"diverging, the newest is {str(marked / 'snapshot_iter_10.pt')!r}")
    assert not out.exists() and not (tmp_path / "run").exists()


def _lmdb_without_a_test_set(path: Path) -> str:
    import numpy as np

    from dptrain.data.caffe.datum import encode_datum, hwc_to_raw
    from dptrain.data.caffe.writer import write_lmdb

    rng = np.random.default_rng(0)
    values = []
    for i in range(8):
        raw, c, h, w = hwc_to_raw(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
        values.append(encode_datum(label=i % 10, data=raw, channels=c, height=h, width=w))
    write_lmdb(path, iter(zip([f"{i:08d}".encode() for i in range(8)], values, strict=True)), 8)
    return str(path)



# ----------------------------------------------------------------------------- a user's model

VIT = ['model.name="examples.vit:VisionTransformer"', "model.args.dim=32", "model.args.depth=2", "model.args.heads=2",
       'model.freeze=["patch_embed.*"]', "model.attention=math"]


def test_a_user_model_goes_through_test_export_and_weights_with_its_frozen_layer(cfg, tmp_path, capsys):
    """The example ViT by import path, its patch embedding frozen: `dptrain test` scores the snapshot,
    `export` writes the model's own names (loaded strictly by the user's class, the frozen values
    exact), and `train --weights` starts a new run from it with those values."""
    from examples.vit import VisionTransformer

    assert main(["train", "--config", cfg, *_sets(tmp_path / "a", *VIT, "solver.max_iter=4", "solver.snapshot=4")]) == 0
    capsys.readouterr()
    snap = tmp_path / "a" / "snapshot_iter_4.pt"
    state = load_snapshot(snap)["model"]
    assert main(["test", "--config", cfg, "--weights", str(snap), *_sets(tmp_path / "a", *VIT)]) == 0
    scored = _one_json_line(capsys)
    assert scored["test_samples"] == 297 and 0.0 <= scored["test_top1"] <= 1.0
    assert main(["export", str(snap), str(tmp_path / "vit.pt")]) == 0
    assert _one_json_line(capsys)["names"] == "the model's own"
    model = VisionTransformer(num_classes=10, dim=32, depth=2, heads=2)
    model.load_state_dict(torch.load(tmp_path / "vit.pt", weights_only=True), strict=True)
    assert all(torch.equal(v, state[k].float()) for k, v in model.state_dict().items())
    assert main(["train", "--config", cfg, "--weights", str(snap),
                 *_sets(tmp_path / "b", *VIT, "solver.max_iter=1", "solver.snapshot=1")]) == 0
    after = load_snapshot(tmp_path / "b" / "snapshot_iter_1.pt")["model"]
    assert torch.equal(after["patch_embed.weight"], state["patch_embed.weight"])  # frozen: carried, kept exactly
    assert not torch.equal(after["head.weight"], state["head.weight"])  # trained on from the snapshot's
