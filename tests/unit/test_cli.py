"""CLI: user errors are one line naming the key, exit code 2, no traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest

from dptrain.cli import main
from dptrain.errors import LossScaleError, RunDirError


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
        ("", ["solver.lr_policy=triangular"], "solver.lr_policy must be one of ('fixed', 'step'"),
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


def test_missing_snapshot_on_resume_is_reported_before_anything_is_built(cfg, capsys, tmp_path, monkeypatch):
    import dptrain.run as run_module

    def never(*a, **k):
        raise AssertionError("built a model/process group before checking --resume PATH")

    monkeypatch.setattr(run_module, "Trainer", never)
    monkeypatch.setattr(run_module.Communicator, "from_env", never)
    run = tmp_path / "run"
    args = ["train", "--config", cfg(""), f"--set=train.run_dir=\"{run}\"", "--resume", str(tmp_path / "x.pt")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume '" in err[0] and "x.pt': no such snapshot file" in err[0], err


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
    for cmd in ("train", "test", "export", "bench", "demo"):
        assert cmd in out


def test_make_lmdb_prints_one_json_line(tmp_path, capsys):
    import json

    assert main(["make-lmdb", "--digits", str(tmp_path / "digits")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0]) == {"out": str(tmp_path / "digits"), "records": {"train": 1500, "test": 297},
                                    "encoded": False}


def _tiny_lmdb(path, n: int = 24, size: int = 32, channels: int = 3) -> str:
    import numpy as np

    from dptrain.data.caffe.datum import encode_datum, hwc_to_raw
    from dptrain.data.caffe.writer import write_lmdb

    rng = np.random.default_rng(0)
    values = []
    for i in range(n):
        raw, c, h, w = hwc_to_raw(rng.integers(0, 256, (size, size, channels), dtype=np.uint8))
        values.append(encode_datum(label=i % 10, data=raw, channels=c, height=h, width=w))
    write_lmdb(path, iter(zip([f"{i:08d}_r{i}".encode() for i in range(n)], values, strict=True)), n)
    return str(path)


def _lmdb_cfg(cfg, tmp_path, db: str, extra: str = "") -> str:
    return cfg(f'[model]\nname = "lenet"\n[data]\nsource = "lmdb"\npath = "{db}"\nbatch_size = 4\n{extra}'
               f'[solver]\nmax_iter = 4\ndisplay = 2\nsnapshot = 2\n[train]\nrun_dir = "{tmp_path / "run"}"\n')


def test_a_grey_lmdb_trains_and_no_test_db_means_no_test_phase(cfg, tmp_path, capsys):
    import json

    db = _tiny_lmdb(tmp_path / "grey", channels=1)  # make-lmdb --gray output: the model takes 1 channel
    assert main(["train", "--config", _lmdb_cfg(cfg, tmp_path, db)]) == 0
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records and not any("test_top1" in r for r in records)  # no data.test_path: no made-up 0 % accuracy


def test_a_record_without_a_label_is_one_line_and_exit_2_at_budget_0(cfg, tmp_path, capsys):
    import lmdb

    from dptrain.data.caffe.datum import Datum

    db = _tiny_lmdb(tmp_path / "db")
    with lmdb.open(db, subdir=True) as env, env.begin(write=True) as txn:
        unlabelled = Datum(data=b"\x00" * 3 * 32 * 32, channels=3, height=32, width=32)  # as a buggy writer leaves it
        txn.put(b"00000006_r6", unlabelled.SerializeToString())
    assert main(["train", "--config", _lmdb_cfg(cfg, tmp_path, db)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dptrain: error: rank 0: LMDB {db!r} key '00000006_r6': unparsable record: the Datum has no label "
                   f"field (number 5), which would read as class 0; re-create the DB with a label for every record "
                   f"(dptrain make-lmdb)"], err


@pytest.mark.parametrize("extra, fragment", [
    ("crop_size = 28\n", "model.name 'lenet' cannot take the data's 28x28 samples with 3 channel(s)"),
    ("resize = [64, 64]\n", "model.name 'lenet' cannot take the data's 64x64 samples"),
])
def test_samples_the_model_cannot_take_are_a_config_error(cfg, tmp_path, capsys, extra, fragment):
    db = _tiny_lmdb(tmp_path / "db")
    assert main(["train", "--config", _lmdb_cfg(cfg, tmp_path, db, extra)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0] and "set data.crop_size / data.resize" in err[0], err


def test_run_dir_on_a_file_and_resume_into_another_model_are_one_line_errors(cfg, tmp_path, capsys):
    db = _tiny_lmdb(tmp_path / "db")
    (tmp_path / "afile").write_text("x")
    bad = cfg(f'[model]\nname = "lenet"\n[data]\nsource = "lmdb"\npath = "{db}"\nbatch_size = 4\n'
              f'[train]\nrun_dir = "{tmp_path / "afile" / "sub"}"\n')
    assert main(["train", "--config", bad]) == 2
    assert "afile' is a file; choose another run_dir" in capsys.readouterr().err
    good = _lmdb_cfg(cfg, tmp_path, db)
    assert main(["train", "--config", good]) == 0
    capsys.readouterr()
    snap = str(tmp_path / "run" / "snapshot_iter_2.pt")
    assert main(["train", "--config", good, "--set=model.num_classes=12", "--resume", snap]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "snapshot_iter_2.pt': 'classifier.3.weight' is [10, 500] there but [12, 500] in this model" \
        in err[0] and "--weights PATH --weights-skip 'classifier.3.weight'" in err[0], err
    (tmp_path / "junk.pt").write_bytes(bytes(range(256)) * 20)
    assert main(["train", "--config", good, "--resume", str(tmp_path / "junk.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "junk.pt' cannot be read" in err[0] and "use an older one" in err[0], err


def test_demo_refuses_a_negative_process_count(capsys):
    assert main(["demo", "--builtin", "--nproc", "-1"]) == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err


def test_loss_scale_floor_is_one_line_and_exit_2(cfg, capsys, tmp_path, monkeypatch):
    from dptrain.train import Trainer

    def floor(self):
        raise LossScaleError("loss scale fell to precision.loss_scale.min_scale = 1.0: gradients overflow")

    monkeypatch.setattr(Trainer, "fit", floor)
    args = ["train", "--config", cfg(""), f"--set=train.run_dir=\"{tmp_path / 'run'}\""]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dptrain: error: loss scale fell to precision.loss_scale.min_scale = 1.0: gradients overflow"]


def test_a_fresh_run_refuses_a_run_dir_holding_an_earlier_run(cfg, capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "snapshot_iter_400.pt").write_bytes(b"x")
    (run / "metrics.jsonl").write_text('{"iter": 400}\n')
    assert main(["train", "--config", cfg(""), f"--set=train.run_dir=\"{run}\""]) == 2
    err = capsys.readouterr().err
    assert "holds an earlier run (metrics.jsonl, snapshot_iter_400.pt); continue it with --resume auto" in err
    assert (run / "snapshot_iter_400.pt").read_bytes() == b"x"  # untouched


def test_data_bench_does_not_need_the_test_lmdb(cfg, capsys, tmp_path):
    from dptrain.tools.make_lmdb import make_digits_lmdb

    make_digits_lmdb(tmp_path / "lmdb", encoded=True)
    text = (f'[model]\nname = "lenet"\n[data]\nsource = "lmdb"\npath = "{tmp_path / "lmdb" / "train"}"\n'
            f'test_path = "{tmp_path / "missing"}"\nbatch_size = 16\n')
    assert main(["data-bench", "--config", cfg(text), "--batches", "2", "--warmup", "0", "--repeats", "1"]) == 0
    assert '"images_per_s"' in capsys.readouterr().out


def test_demo_starts_its_own_run_over_but_never_deletes_another_run(tmp_path, capsys, monkeypatch):
    from dptrain.tools.demo import DEMO_MARK, _start_demo_run

    mine = tmp_path / "demo"
    _start_demo_run(mine)
    (mine / "snapshot_iter_400.pt").write_bytes(b"x")
    (mine / "metrics.jsonl").write_text('{"iter": 400}\n')
    _start_demo_run(mine)  # a rerun: its own earlier outputs go
    assert sorted(p.name for p in mine.iterdir()) == [DEMO_MARK]
    theirs = tmp_path / "digits"
    theirs.mkdir()
    (theirs / "snapshot_iter_20.pt").write_bytes(b"y")
    with pytest.raises(RunDirError, match=r"holds an earlier run \(snapshot_iter_20\.pt\)"):
        _start_demo_run(theirs)
    assert (theirs / "snapshot_iter_20.pt").read_bytes() == b"y"


def test_internal_error_keeps_its_traceback(cfg, monkeypatch):
    """A broken invariant (RuntimeError, even one whose text reads like a config message) is a
    bug: it must reach the user with its traceback, not as a one-line 'error: ... exit 2'."""
    def broken(args):
        raise RuntimeError("model.name must be one of [...]: an invariant, not the user's input")

    monkeypatch.setattr("dptrain.run.main", broken)
    with pytest.raises(RuntimeError, match="an invariant"):
        main(["train", "--config", cfg("")])


@pytest.mark.parametrize("exc, code, fragment", [
    (RunDirError("train.run_dir 'x' is locked"), 2, "dptrain: error: train.run_dir 'x' is locked"),
    (LossScaleError("loss scale fell to"), 2, "dptrain: error: loss scale fell to"),
])
def test_user_errors_are_one_line_with_their_exit_code(cfg, monkeypatch, capsys, exc, code, fragment):

    def fail(args):
        raise exc

    monkeypatch.setattr("dptrain.run.main", fail)
    assert main(["train", "--config", cfg("")]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [fragment]


def test_rank_failure_exits_1_naming_the_rank(cfg, monkeypatch, capsys):
    from dptrain.errors import RankFailure

    def fail(args):
        raise RankFailure("rank 1: allreduce of bucket 0 failed")

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("dptrain.run.main", fail)
    assert main(["train", "--config", cfg("")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dptrain: error (rank 1): another rank failed or hung first: rank 1: allreduce of "
                   "bucket 0 failed"]


def test_a_user_error_names_its_rank_once(monkeypatch):
    from dptrain.cli import error_line
    from dptrain.errors import DataError

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    e = DataError("undecodable image", path="/d", key="cat/1.jpg", rank=1, kind="image folder")
    assert error_line(e) == "dptrain: error (rank 1): image folder '/d' file 'cat/1.jpg': undecodable image"
    assert error_line(DataError("x", rank=0)) == "dptrain: error (rank 1): rank 0: data: x"  # another rank's: kept


def test_subprocess_internal_error_prints_a_traceback(tmp_path):
    """Through the real entry point: a RuntimeError from inside training is not turned into exit 2."""
    script = ("import sys, dptrain.cli as cli, dptrain.run as run\n"
              "def broken(args):\n    raise RuntimeError('flat buffer invariant broken')\n"
              "run.main = broken\n"
              f"sys.exit(cli.main(['train', '--config', {str(tmp_path / 'c.toml')!r}]))\n")
    (tmp_path / "c.toml").write_text("")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "flat buffer invariant broken" in proc.stderr


def test_an_error_line_goes_out_in_one_write(monkeypatch, tmp_path):
    """Solvers that fail together share the launcher's stderr pipe; `print` wrote the text and its
    newline apart, so two ranks' lines ran together (seen in CI). `say` makes one write per line."""
    from dptrain import launcher

    writes = []
    with open(tmp_path / "err", "w") as f:
        monkeypatch.setattr(launcher.sys, "stderr", f)
        real = launcher.os.write
        monkeypatch.setattr(launcher.os, "write", lambda fd, data: writes.append(bytes(data)) or real(fd, data))
        launcher.say("dptrain: error (rank 1): another rank failed or hung first: x")
    assert writes == [b"dptrain: error (rank 1): another rank failed or hung first: x\n"]
    assert (tmp_path / "err").read_text() == writes[0].decode()
