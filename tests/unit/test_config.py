"""Config loading: types, choices, ranges, overrides, round trip, and the shipped recipes."""
from __future__ import annotations

import glob
from pathlib import Path

import pytest

from dptrain.config import TrainConfig, dump_toml, load_config
from dptrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.toml"
    p.write_text(text)
    return p


def test_defaults_and_sections(tmp_path):
    cfg = load_config(write(tmp_path, "[solver]\nbase_lr = 0.1\n"))
    assert isinstance(cfg, TrainConfig)
    assert cfg.solver.base_lr == 0.1 and cfg.data.batch_size == 64 and cfg.reducer.bucket_mb == 25.0


def test_int_accepted_for_float_but_bool_is_not_int(tmp_path):
    assert load_config(write(tmp_path, "[solver]\nbase_lr = 1\n")).solver.base_lr == 1.0
    with pytest.raises(ConfigError, match=r"data\.batch_size must be an integer, got True"):
        load_config(write(tmp_path, "[data]\nbatch_size = true\n"))


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['reducer\.bucket_mbs'\]; valid: .*'bucket_mb'"):
        load_config(write(tmp_path, "[reducer]\nbucket_mbs = 5\n"))


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['solverr'\]"):
        load_config(write(tmp_path, "[solverr]\nbase_lr = 5\n"))


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ConfigError, match=r"solver\.base_lr must be a number, got 'fast'"):
        load_config(write(tmp_path, "[solver]\nbase_lr = \"fast\"\n"))


@pytest.mark.parametrize(
    "text, match",
    [
        ("[solver]\nbase_lr = -0.1\n", r"solver\.base_lr must be > 0, got -0\.1"),
        ("[data]\nbatch_size = 0\n", r"data\.batch_size must be > 0, got 0"),
        ("[model]\nname = \"vgg99\"\n", r"model\.name must be one of \[.*'lenet'.*\], got 'vgg99'"),
        ("[solver]\nlr_policy = \"onecycle\"\n", r"solver\.lr_policy must be one of \('fixed', .*'sigmoid', 'cosine'\), "
                                                 r"got 'onecycle'"),
        ("[solver]\nmin_lr = 0.5\n", r"solver\.min_lr must be in \[0, solver\.base_lr = 0\.01\], got 0\.5"),
        ("[solver]\nlabel_smoothing = 1.0\n", r"solver\.label_smoothing must be in \[0, 1\), got 1\.0"),
        ("[solver]\nlabel_smoothing = -0.1\n", r"solver\.label_smoothing must be in \[0, 1\), got -0\.1"),
        ("[solver]\nlr_policy = \"sigmoid\"\ngamma = 0\n", r"solver\.gamma must be non-zero with solver\.lr_policy = "
                                                      r"\"sigmoid\" \(negative: lr falls"),
        ("[solver]\nlr_policy = \"step\"\ngamma = -0.1\n", r"solver\.gamma must be > 0, got -0\.1"),
        ("[precision]\nstorage = \"fp8\"\n", r"precision\.storage must be one of \('fp32', 'fp16', 'bf16'\)"),
        ("[solver]\nmomentum = 1.5\n", r"solver\.momentum must be in \[0, 1\)"),
        ("[precision.loss_scale]\nhysteresis = 0\n", r"precision\.loss_scale\.hysteresis must be > 0"),
        ("[data]\nsource = \"lmdb\"\n", r"data\.path must name a training LMDB"),
        ("[solver]\nlr_policy = \"multistep\"\n", r"solver\.stepvalue must list iterations"),
        ("[solver]\nsnapshot_keep = -1\n", r"solver\.snapshot_keep must be >= 0, got -1"),
    ],
)
def test_out_of_range_and_choices(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, text))


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match=r"config file '.*nope\.toml' not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(write(tmp_path, "[solver\n"))


def test_overrides_take_precedence_and_are_checked(tmp_path):
    p = write(tmp_path, "[solver]\nbase_lr = 0.1\n")
    cfg = load_config(p, ["solver.base_lr=0.5", "model.name=lenet", "data.resize=[40, 40]",
                          "precision.loss_scale.mode=static"])
    assert cfg.solver.base_lr == 0.5 and cfg.model.name == "lenet" and cfg.data.resize == [40, 40]
    assert cfg.precision.loss_scale.mode == "static"
    with pytest.raises(ConfigError, match=r"solver\.max_iter must be > 0"):
        load_config(p, ["solver.max_iter=0"])
    with pytest.raises(ConfigError, match="--set expects section.key=value"):
        load_config(p, ["solver"])
    with pytest.raises(ConfigError, match=r"--set 'data.resize=\[40, 40': the value is not valid TOML"):
        load_config(p, ["data.resize=[40, 40"])  # not silently the string "[40, 40"
    assert load_config(p, ["model.name=lenet"]).model.name == "lenet"  # a bare word is a string
    with pytest.raises(ConfigError, match=r"config file '.*' is a folder, not a TOML file"):
        load_config(tmp_path, [])


def test_configs_are_frozen():
    cfg = load_config(None)
    with pytest.raises(Exception, match="cannot assign"):
        cfg.solver.base_lr = 3.0  # type: ignore[misc]


def test_dump_round_trip(tmp_path):
    cfg = load_config(None, ["data.mean_value=[1.0, 2.0, 3.0]", "precision.storage=bf16"])
    p = tmp_path / "resolved.toml"
    p.write_text(dump_toml(cfg))
    assert load_config(p) == cfg


def test_loss_scale_auto_resolves_by_storage():
    assert load_config(None, ["precision.storage=fp16"]).precision.resolved_loss_scale_mode() == "dynamic"
    assert load_config(None, ["precision.storage=bf16"]).precision.resolved_loss_scale_mode() == "none"


def test_dynamic_init_scale_must_lie_between_min_and_max():
    with pytest.raises(ConfigError, match=r"precision\.loss_scale\.init_scale \(1\.07374e\+09\) is outside"):
        load_config(None, ["precision.storage=fp16", "precision.loss_scale.init_scale=1073741824"])
    bf16 = load_config(None, ["precision.storage=bf16", "precision.loss_scale.max_scale=1024"])
    assert bf16.precision.resolved_loss_scale_mode() == "none"  # no scaling: the range does not apply
    with pytest.raises(ConfigError, match=r"init_scale \(0\.5\) is outside \[min_scale, max_scale\] = \[1, "):
        load_config(None, ["precision.loss_scale.mode=dynamic", "precision.loss_scale.init_scale=0.5"])
    static = load_config(None, ["precision.loss_scale.mode=static", "precision.loss_scale.init_scale=0.5"])
    assert static.precision.loss_scale.init_scale == 0.5  # min/max bound only the dynamic scale


@pytest.mark.parametrize("path", sorted(glob.glob(str(REPO / "launch" / "configs" / "*.toml"))))
def test_shipped_recipes_load(path):
    cfg = load_config(path)
    assert cfg.model.num_classes > 0


@pytest.mark.parametrize("override, match", [
    ("solver.base_lr=nan", r"solver\.base_lr must be a finite number, got nan"),
    ("reducer.timeout_s=inf", r"reducer\.timeout_s must be a finite number, got inf"),
    ("data.mean_value=[nan]", r"data\.mean_value\[0\] must be a finite number"),
    ("data.rrc_ratio=[1.0, inf]", r"data\.rrc_ratio\[1\] must be a finite number"),
    ("solver.power=-1", r"solver\.power must be > 0, got -1"),
    ("data.scale=-1", r"data\.scale must be > 0, got -1"),
    ("train.seed=18446744073709551616", r"train\.seed must fit in a signed 64-bit integer"),
])
def test_non_finite_out_of_range_and_oversized_values_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_a_config_file_that_is_not_text_names_the_file(tmp_path):
    p = tmp_path / "binary.toml"
    p.write_bytes(b"\xff\xfe\x00[solver]")
    with pytest.raises(ConfigError, match=r"config file '.*binary\.toml' is not UTF-8 text"):
        load_config(p)
