"""CLI: user errors are one line naming the key, exit code 2, no traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest

from dptrain.cli import main


@pytest.fixture()
def cfg(tmp_path):
    def write(text: str) -> str:
        p = tmp_path / "c.toml"
        p.write_text(text)
        return str(p)

    return write


@pytest.mark.parametrize(
    "text, sets, fragment",
    [
        ("[reducer]\nbucket_mbs = 5\n", [], "unknown key(s) ['reducer.bucket_mbs']; valid:"),
        ("[data]\nbatch_size = \"big\"\n", [], "data.batch_size must be an integer"),
        ("", ["solver.base_lr=-1"], "solver.base_lr must be > 0, got -1"),
        ("", ["data.batch_size=0"], "data.batch_size must be > 0, got 0"),
        ("", ["model.name=vgg"], "model.name must be one of"),
        ("", ["solver.lr_policy=cosine"], "solver.lr_policy must be one of ('fixed', 'step'"),
    ],
)
def test_bad_config_exits_2_with_one_line(cfg, capsys, text, sets, fragment):
    args = ["train", "--config", cfg(text)] + [f"--set={s}" for s in sets]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dptrain: error: ") and fragment in err[0], err


def test_missing_config_file(capsys, tmp_path):
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml' not found" in capsys.readouterr().err


def test_missing_snapshot_on_resume(cfg, capsys, tmp_path):
    run = tmp_path / "run"
    args = ["train", "--config", cfg(""), f"--set=train.run_dir=\"{run}\"", "--resume", str(tmp_path / "x.pt")]
    assert main(args) == 2
    assert "x.pt' not found" in capsys.readouterr().err


def test_subprocess_exit_code_and_no_traceback(cfg):
    proc = subprocess.run([sys.executable, "-m", "dptrain", "train", "--config", cfg("[solver]\nmax_iter = -5\n")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "solver.max_iter must be > 0" in proc.stderr


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("train", "bench", "demo"):
        assert cmd in out


def test_make_lmdb_prints_one_json_line(tmp_path, capsys):
    import json

    assert main(["make-lmdb", "--digits", str(tmp_path / "digits")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0]) == {"out": str(tmp_path / "digits"), "records": {"train": 1500, "test": 297},
                                    "encoded": False}
