"""The user's own model in one solver: by import path, with arguments, from Python (``dptrain.fit``),
and every way it can be wrong as one line and exit 2 with nothing left in the run_dir."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import byo_models
import dptrain
from dptrain.cli import main
from dptrain.config import dump_toml, load_config
from dptrain.errors import ConfigError
from dptrain.models import build_model
from dptrain.precision import apply_precision
from dptrain.train.outputs import split_output, training_loss

DIGITS = ["data.source=digits", "data.batch_size=16", "solver.display=0", "solver.max_iter=2", "solver.test_iter=1"]


def _train(tmp_path: Path, model: str, *sets: str) -> int:
    run = tmp_path / "run"
    args = ["train", "--config", str(_recipe(tmp_path)), "--set", f"model.name={json.dumps(model)}",
            "--set", f"train.run_dir={json.dumps(str(run))}"]
    for s in [*DIGITS, *sets]:
        args += ["--set", s]
    return main(args)


def _recipe(tmp_path: Path) -> Path:
    p = tmp_path / "r.toml"
    p.write_text("[model]\nnum_classes = 10\n")
    return p


def test_a_model_by_import_path_takes_its_args_and_is_recorded(tmp_path, capsys):
    assert _train(tmp_path, "byo_models:AuxHeads", "model.args.as_dict=true") == 0
    written = load_config(tmp_path / "run" / "config.toml")
    assert written.model.name == "byo_models:AuxHeads" and written.model.args == {"as_dict": True}
    assert "[model.args]" in dump_toml(written)
    m = build_model("byo_models:AuxHeads", num_classes=7, args={"as_dict": True})
    assert m.head.out_features == 7 and m.as_dict  # num_classes passed, args as keywords


def test_timm_names_go_through_create_model(monkeypatch):
    import sys
    import types

    calls = []
    fake = types.ModuleType("timm")
    fake.create_model = lambda name, **kw: calls.append((name, kw)) or torch.nn.Linear(2, kw["num_classes"])
    monkeypatch.setitem(sys.modules, "timm", fake)
    assert isinstance(build_model("timm:convnext_tiny", num_classes=5, args={"drop_path_rate": 0.1}), torch.nn.Linear)
    assert calls == [("convnext_tiny", {"drop_path_rate": 0.1, "num_classes": 5})]


@pytest.mark.parametrize("model, sets, expect", [
    ("no_such_module:Net", [], "model.name 'no_such_module:Net': cannot import module 'no_such_module'"),
    ("byo_models:NoSuchNet", [], "module 'byo_models' has no 'NoSuchNet'"),
    ("byo_models:Frozen", ["model.args.depth=50"], "model.args {'depth': 50} do not fit byo_models:Frozen"),
    ("byo_models:not_a_module", [], "returned a str, not an nn.Module"),
    ("byo_models:wide_output", [], "returned logits of shape [16, 1000] for a batch of 16; dptrain needs [16, 10]"),
    ("byo_models:FixedSize", ["data.source=synthetic", "data.image_size=8"], "cannot take the data's 8x8 samples"),
    ("byo_models:MetaHostile", ["data.source=synthetic", "data.image_size=8"], "cannot take the data's 8x8 samples"),
    ("byo_models:raises_value", [], "model.name 'byo_models:raises_value' raised ValueError while building the model "
                                    "at "),
    ("byo_models:buggy_factory", [], "raised TypeError while building the model at "),
    ("byo_models:NoParams", [], "the model has no parameters at all"),
    ("byo_models:ComplexParam", [], "model parameter 'z' is complex64; dptrain trains real"),
])
def test_a_bad_model_is_one_line_and_exit_2_with_nothing_written(tmp_path, capsys, model, sets, expect):
    assert _train(tmp_path, model, *sets) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dptrain: error: ") and expect in err[0], err
    assert not (tmp_path / "run").exists(), sorted(p.name for p in (tmp_path / "run").iterdir())


def test_a_bad_model_name_in_the_config_is_refused_at_load():
    with pytest.raises(ConfigError, match="is not \"package.module:callable\""):
        load_config(None, ['model.name="a b:c"'])
    with pytest.raises(ConfigError, match=r"model.args applies to a model given by import path"):
        load_config(None, ["model.name=lenet", "model.args.depth=2"])
    with pytest.raises(ConfigError, match="model.freeze glob 'nothing.*' matches no parameter"):
        from dptrain.assemble import _freeze

        _freeze(byo_models.Frozen(10), ["nothing.*"])


def test_resuming_another_model_is_refused(tmp_path, capsys):
    assert _train(tmp_path, "byo_models:Frozen", "solver.snapshot=1") == 0
    snap = tmp_path / "run" / "snapshot_iter_1.pt"
    assert main(["train", "--config", str(_recipe(tmp_path)), "--resume", str(snap), "--set",
                 f"train.run_dir={json.dumps(str(tmp_path / 'run'))}", *[x for s in DIGITS for x in ("--set", s)],
                 "--set", "solver.max_iter=4", "--set", 'model.name="byo_models:Shared"']) == 2
    assert "was written with model.name = 'byo_models:Frozen', this run has 'byo_models:Shared'" in \
        capsys.readouterr().err


def test_a_callable_that_raises_is_one_line_with_where_it_raised(monkeypatch):
    import sys
    import types

    fake = types.ModuleType("timm")

    def create_model(name, **kw):
        raise RuntimeError(f"Unknown model ({name})")

    fake.create_model = create_model
    monkeypatch.setitem(sys.modules, "timm", fake)
    with pytest.raises(ConfigError, match=r"model.name 'timm:convnext_tinyy' raised RuntimeError while building the "
                                          r"model at .*test_model_by_import_path.py:\d+: Unknown model \(convnext_tinyy\)"):
        build_model("timm:convnext_tinyy", num_classes=5)
    fake.create_model = lambda name, **kw: byo_models.Frozen(**kw)  # a keyword passed on and refused by the callee
    with pytest.raises(ConfigError, match=r"model.args \{'depth': 3\} were refused by timm:x: .*unexpected keyword"):
        build_model("timm:x", num_classes=5, args={"depth": 3})


def test_eval_mode_logits_are_checked_at_the_first_test(tmp_path, capsys):
    assert _train(tmp_path, "byo_models:EvalWide", "solver.test_interval=2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "returned logits of shape [100, 1000] for a batch of 100 in evaluation mode" in err[0], err


def test_parameters_created_in_another_dtype_are_trained_and_said_once(tmp_path, caplog):
    assert _train(tmp_path, "byo_models:Fp64Head") == 0
    said = [r.getMessage() for r in caplog.records if "created in float64" in r.getMessage()]
    assert len(said) == 1 and "(head.weight, head.bias) are trained as fp32 masters" in said[0], said


@pytest.mark.parametrize("given, expect", [
    (byo_models.Frozen(10), "model= got a built Frozen instance; pass the class or a factory"),
    (__import__("functools").partial(byo_models.Frozen), "model= got a functools.partial of 'Frozen'"),
    (lambda num_classes: byo_models.Frozen(num_classes), "which has no import path; define the class"),
])
def test_fit_refuses_what_has_no_import_path_in_one_line(given, expect):
    with pytest.raises(ConfigError, match=expect):
        dptrain.fit(None, model=given, overrides=DIGITS)


def test_fit_trains_a_callable_from_python(tmp_path):
    result = dptrain.fit(None, model=byo_models.Normed, overrides=[*DIGITS, f"train.run_dir={json.dumps(str(tmp_path))}"])
    assert 0.0 <= result["test_top1"] <= 1.0
    assert load_config(tmp_path / "config.toml").model.name == "byo_models:Normed"


def test_outputs_give_the_logits_and_weigh_the_auxiliary_losses():
    torch.manual_seed(0)
    model, y = byo_models.AuxHeads(10).train(), torch.randint(0, 10, (4,))
    out = model(torch.randn(4, 3, 32, 32))
    logits, aux = split_output(out)
    assert logits is out.logits and len(aux) == 2
    ce = torch.nn.functional.cross_entropy
    want = ce(out.logits, y) + 0.3 * (ce(out.aux_logits2, y) + ce(out.aux_logits1, y))
    torch.testing.assert_close(training_loss(out, y, label_smoothing=0.0, aux_weight=0.3), want)
    d = {"out": logits, "mask": torch.zeros(4, 1)}  # "out": torchvision's name; other shapes take no part
    assert split_output(d) == (logits, [])
    with pytest.raises(ConfigError, match="dptrain takes the logits from 'logits' or 'out'"):
        split_output({"features": logits})


def test_every_normalisation_stays_fp32_by_default():
    from dptrain.config import PrecisionConfig

    net = byo_models.Normed(10)
    islands = apply_precision(net, PrecisionConfig(storage="fp16"))
    assert set(islands) == {"gn", "ln"} and net.ln.weight.dtype == net.gn.weight.dtype == torch.float32
    assert net.conv.weight.dtype == torch.float16
    assert net(torch.randn(2, 3, 32, 32).half()).dtype == torch.float16  # islands cast back
