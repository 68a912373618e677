"""What a user on a cluster relies on: one run per run_dir, a stop at startup, a diverged run
stopped with its last good snapshot kept, and error lines that say what happened."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dptrain.cli import main
from dptrain.errors import RunDirError
from dptrain.launcher import failure_summary
from dptrain.snapshots import RunDir, good_snapshots, is_diverging, list_snapshots, resolve_resume, save_snapshot

DIGITS = ["model.name=\"lenet\"", "data.source=\"digits\"", "data.batch_size=16", "solver.display=5"]


def _args(run: Path, *sets: str) -> list[str]:
    out = []
    for s in (*DIGITS, f"train.run_dir={json.dumps(str(run))}", *sets):
        out += ["--set", s]
    return out


@pytest.fixture()
def empty_cfg(tmp_path) -> str:
    p = tmp_path / "c.toml"
    p.write_text("")
    return str(p)


# --------------------------------------------------------------------------------------- run_dir lock


def test_run_dir_lock_names_its_holder_and_goes_with_the_process(tmp_path):
    first = RunDir(tmp_path / "run")
    first.lock()
    with pytest.raises(RunDirError, match=rf"is in use by another run \(host {socket.gethostname()} pid "
                                          rf"{os.getpid()}\); wait for it to end or choose another"):
        RunDir(tmp_path / "run").lock()
    first.unlock()
    again = RunDir(tmp_path / "run")
    again.lock()  # released: taken at once
    again.unlock()


def test_a_disk_full_at_start_is_one_line(tmp_path, empty_cfg, capsys):
    """The lock file's line is the first byte a run writes; here the lock file is /dev/full, where every
    write fails as on a full disk (ENOSPC)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / ".dptrain.lock").symlink_to("/dev/full")
    assert main(["train", "--config", empty_cfg, *_args(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(
        rf"dptrain: error: train\.run_dir '{run}': cannot write \.dptrain\.lock \(No space left on device; [\d.]+ MiB "
        rf"free there\); free space or choose another train\.run_dir", err[0]), err
    assert os.listdir(run) == [".dptrain.lock"]  # nothing else written, and what was there is left alone


@pytest.mark.parametrize("resume", [[], ["--resume", "auto"]], ids=["fresh", "resume-auto"])
def test_two_runs_started_together_on_one_run_dir(tmp_path, empty_cfg, resume):
    """Both start at once: one trains, the other exits 2 naming the holder; nothing is interleaved."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "dptrain", "train", "--config", empty_cfg, *resume,
           *_args(run, "solver.max_iter=100000", "solver.snapshot=0")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
             for _ in range(2)]
    try:
        loser = None
        deadline = time.monotonic() + 120
        while loser is None and time.monotonic() < deadline:
            loser = next((p for p in procs if p.poll() is not None), None)
            time.sleep(0.1)
        assert loser is not None, "neither run refused the shared run_dir"
        winner = next(p for p in procs if p is not loser)
        err = loser.stderr.read().strip().splitlines()
        assert loser.returncode == 2, err
        assert len(err) == 1 and "is in use by another run (host " in err[0] and f"pid {winner.pid})" in err[0], err
        assert winner.poll() is None, "the first run must go on"
        winner.send_signal(signal.SIGTERM)
        assert winner.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert len(list_snapshots(run)) == 1  # only the winner's stop snapshot


# --------------------------------------------------------------------------------------- stops


def test_a_stop_at_startup_ends_in_a_snapshot_at_the_first_iteration(tmp_path, empty_cfg, monkeypatch, caplog):
    import logging

    import dptrain.train.trainer as train

    real = train.build_source

    def slow_startup(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)  # e.g. the scheduler preempts while the data opens
        return real(*a, **k)

    monkeypatch.setattr(train, "build_source", slow_startup)
    with caplog.at_level(logging.INFO):
        assert main(["train", "--config", empty_cfg, *_args(tmp_path / "run", "solver.max_iter=1000")]) == 0
    assert [it for it, _ in list_snapshots(tmp_path / "run")] == [1]
    assert "final test top-1" not in caplog.text and "signal SIGTERM received; snapshot at iteration 1" in caplog.text


def test_a_stop_on_a_snapshot_iteration_writes_that_snapshot_once(tmp_path, monkeypatch):
    import dptrain.snapshots.content as train
    from dptrain.config import load_config
    from dptrain.distributed.comm import Communicator
    from dptrain.topology import Topology
    from dptrain.train import Trainer

    writes = []
    monkeypatch.setattr(train, "save_snapshot", lambda state, path: writes.append(path.name) or save_snapshot(state, path))
    cfg = load_config(None, ["model.name=lenet", "data.source=digits", "data.batch_size=16", "solver.snapshot=5",
                             "solver.max_iter=100", "solver.display=0", f"train.run_dir={json.dumps(str(tmp_path))}"])
    t = Trainer(cfg, Communicator.from_env(Topology(), 60, torch.device("cpu")))
    real_step = t.train_step

    def step():
        real_step()
        if t.iteration == 4:
            t.stop.requested = True  # read back after iteration 5, which also snapshots

    t.train_step = step
    result = t.fit()
    t.close()
    assert result["stopped_by_signal"] and t.iteration == 5
    assert writes == ["snapshot_iter_5.pt"]


def test_snapshot_keep_deletes_old_snapshots_only_once_the_new_one_is_written(tmp_path, empty_cfg, monkeypatch):
    """solver.snapshot_keep = 2 keeps the newest two; when the write of a new one fails (a full disk), the
    ones it would have replaced are all still there."""
    import dptrain.snapshots.content as content

    run = tmp_path / "run"
    keep = ("solver.max_iter=10", "solver.snapshot=2", "solver.snapshot_keep=2")
    assert main(["train", "--config", empty_cfg, *_args(run, *keep)]) == 0
    assert [it for it, _ in list_snapshots(run)] == [10, 8]

    def full_at_8(state, path):
        if path.name == "snapshot_iter_8.pt":
            raise RunDirError(f"cannot write snapshot {str(path)!r} (OSError: No space left on device)")
        return save_snapshot(state, path)

    monkeypatch.setattr(content, "save_snapshot", full_at_8)
    assert main(["train", "--config", empty_cfg, *_args(tmp_path / "full", *keep)]) == 2
    assert [it for it, _ in list_snapshots(tmp_path / "full")] == [6, 4]


def test_pruning_keeps_the_newest_and_the_last_good_one_and_nothing_past_the_newest(tmp_path, caplog):
    from dptrain.snapshots import mark_diverging, prune_snapshots

    for it in (2, 4, 6, 8, 10, 20):
        (tmp_path / f"snapshot_iter_{it}.pt").write_bytes(b"x")
    for it in (4, 8, 10):
        mark_diverging(tmp_path / f"snapshot_iter_{it}.pt", "a test mark")
    (tmp_path / "snapshot_iter_1.pt").mkdir()  # cannot be unlinked: logged, and it stays
    assert prune_snapshots(tmp_path, 10, 0) == []
    deleted = prune_snapshots(tmp_path, 10, 2)  # 20: left by a run resumed from an earlier snapshot
    assert deleted == [tmp_path / "snapshot_iter_4.pt", tmp_path / "snapshot_iter_2.pt"]
    assert [it for it, _ in list_snapshots(tmp_path)] == [20, 10, 8, 6, 1]  # 6: the last good one before 10
    assert [it for it, _ in good_snapshots(tmp_path)] == [20, 6, 1]
    assert not (tmp_path / "snapshot_iter_4.pt.diverging").exists()  # its marker went with it
    assert "cannot delete " in caplog.text and "snapshot_iter_1.pt for solver.snapshot_keep = 2" in caplog.text
    (tmp_path / "snapshot_iter_1.pt").rmdir()
    (tmp_path / "snapshot_iter_12.pt").write_bytes(b"x")  # good, as far as is known when it is written
    assert prune_snapshots(tmp_path, 12, 1) == [tmp_path / f"snapshot_iter_{it}.pt" for it in (10, 8)]
    assert [it for it, _ in list_snapshots(tmp_path)] == [20, 12, 6]  # 6 stays in case the next losses mark 12


def test_resuming_on_other_data_warns_with_both_values_and_goes_on(tmp_path, empty_cfg, caplog):
    """digits -> an LMDB of the same digits (make-lmdb --digits): allowed, as a moved or converted data set
    must be, with one warning naming the old and new data.source and data.path."""
    import logging

    from dptrain.tools.make_lmdb import make_digits_lmdb

    run = tmp_path / "run"
    assert main(["train", "--config", empty_cfg, *_args(run, "solver.max_iter=2")]) == 0
    make_digits_lmdb(tmp_path / "lmdb", encoded=False)
    lmdb = [f"data.source={json.dumps('lmdb')}", f"data.path={json.dumps(str(tmp_path / 'lmdb' / 'train'))}"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--config", empty_cfg, "--resume", "auto", *_args(run, "solver.max_iter=3", *lmdb)]) == 0
    warned = [r.getMessage() for r in caplog.records if "resuming on other data" in r.getMessage()]
    assert warned == [f"resuming on other data than the snapshot's (data.source 'digits' -> 'lmdb', data.path '' -> "
                      f"{str(tmp_path / 'lmdb' / 'train')!r}): training goes on from the snapshot's iteration on this "
                      f"data, which continues the interrupted run only if it holds the same samples; to start a new "
                      f"run from the snapshot's weights instead, use --weights PATH"], caplog.text[-3000:]
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the same data again: nothing to say
        assert main(["train", "--config", empty_cfg, "--resume", "auto", *_args(run, "solver.max_iter=4", *lmdb)]) == 0
    assert "resuming on other data" not in caplog.text


def test_a_resume_from_an_earlier_or_another_runs_snapshot_sets_the_other_branch_aside(tmp_path, empty_cfg, caplog):
    """Resuming snapshot 2 of a run that reached 4 starts another branch: snapshot 4 moves into a
    superseded_ folder with a copy of metrics.jsonl, instead of being overwritten when the branch passes
    iteration 4 or picked over it by --resume auto; resuming another run's snapshot sets all aside."""
    import logging

    run = tmp_path / "run"
    assert main(["train", "--config", empty_cfg, *_args(run, "solver.max_iter=4", "solver.snapshot=2")]) == 0
    first4 = (run / "snapshot_iter_4.pt").read_bytes()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--config", empty_cfg, "--resume", str(run / "snapshot_iter_2.pt"),
                     *_args(run, "solver.max_iter=3", "solver.snapshot=2", "solver.base_lr=0.001")]) == 0
    aside, = run.glob("superseded_*")
    assert (aside / "snapshot_iter_4.pt").read_bytes() == first4 and (aside / "metrics.jsonl").is_file()
    assert [i for i, _ in list_snapshots(run)] == [3, 2] and "moved 1 snapshot(s) of another branch" in caplog.text
    assert resolve_resume("auto", run) == run / "snapshot_iter_3.pt"
    other = tmp_path / "other"
    assert main(["train", "--config", empty_cfg, "--resume", str(run / "snapshot_iter_2.pt"),
                 *_args(other, "solver.max_iter=3")]) == 0  # an empty run_dir: nothing to set aside
    assert not list(other.glob("superseded_*"))
    assert main(["train", "--config", empty_cfg, "--resume", str(other / "snapshot_iter_3.pt"),
                 *_args(run, "solver.max_iter=4")]) == 0
    assert len(list(run.glob("superseded_*"))) == 2 and [i for i, _ in list_snapshots(run)] == [4]


def test_a_snapshot_of_other_image_folder_classes_is_refused_by_resume_and_test(tmp_path, empty_cfg, capsys):
    """Labels follow the sorted class folders: a class removed from data.path would shift them."""
    import io

    from PIL import Image

    for split in ("train", "val"):
        for k, c in enumerate(("cat", "dog", "emu")):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(4):
                buf = io.BytesIO()
                Image.new("RGB", (32, 32), (40 * k, 10 * i, 90)).save(buf, "PNG")
                (tmp_path / split / c / f"{i}.png").write_bytes(buf.getvalue())
    run = tmp_path / "run"
    folder = [f"data.source={json.dumps('folder')}", f"data.path={json.dumps(str(tmp_path / 'train'))}",
              f"data.test_path={json.dumps(str(tmp_path / 'val'))}", "model.num_classes=3", "data.batch_size=4",
              "solver.test_iter=1", "solver.base_lr=0.001"]
    assert main(["train", "--config", empty_cfg, *_args(run, "solver.max_iter=2", *folder)]) == 0
    capsys.readouterr()
    import shutil

    shutil.rmtree(tmp_path / "train" / "cat")
    shutil.rmtree(tmp_path / "val" / "cat")
    snap = str(run / "snapshot_iter_2.pt")
    assert main(["train", "--config", empty_cfg, "--resume", snap, *_args(run, "solver.max_iter=3", *folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "snapshot_iter_2.pt' was trained on 3 image-folder classes and data.path has 2 (gone: " \
        "['cat']); labels follow the sorted class folders" in err[0], err
    assert main(["test", "--config", empty_cfg, "--weights", snap, *_args(run, *folder)]) == 2
    assert "was trained on 3 image-folder classes and data.path has 2" in capsys.readouterr().err


# --------------------------------------------------------------------------------------- divergence


DIVERGES = ["solver.max_iter=2000", "solver.base_lr=50.0", "solver.momentum=0.99", "solver.max_nonfinite=3"]


def test_a_non_finite_loss_without_loss_scaling_stops_with_exit_2(tmp_path, empty_cfg, capsys):
    run = tmp_path / "run"
    assert main(["train", "--config", empty_cfg, *_args(run, "solver.snapshot=0", *DIVERGES)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("dptrain: error: the loss was not finite on 1 rank(s) at iteration "), line
    assert "3 iteration(s) in a row since" in line and "(solver.max_nonfinite = 3; those steps were skipped)" in line
    # the layer named is one whose output overflows from finite weights: the skipped steps kept them finite
    assert re.search(r"first non-finite layer: [\w.]+ \(\w+\) gives non-finite output, from finite inputs and "
                     r"weights; ", line), line
    assert re.search(r"lower solver\.base_lr or set solver\.clip_gradients, then resume; no good snapshot was written "
                     r"\(it began with the weights of iteration \d+\)$", line), line
    stopped_at = int(line.split("at iteration ")[1].split(",")[0])
    assert stopped_at < 2000 and list_snapshots(run) == []


def test_a_diverged_run_keeps_its_last_good_snapshot_and_never_writes_a_non_finite_one(tmp_path, empty_cfg, capsys):
    run = tmp_path / "run"
    assert main(["train", "--config", empty_cfg, *_args(run, "solver.snapshot=2", *DIVERGES)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    snaps, good = list_snapshots(run), good_snapshots(run)
    named = f"the last good snapshot is {good[0][1]} (it began" if good else "no good snapshot was written (it began"
    assert snaps and named in line, line
    for _, path in snaps:
        state = torch.load(path, weights_only=True)
        assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point()), path
    assert "the loss was not finite on 1 rank(s)" in line  # skipped steps keep the weights finite


def test_a_finite_loss_that_explodes_starts_the_divergence_and_taints_the_snapshots_after_it(tmp_path, empty_cfg,
                                                                                              capsys, caplog):
    """fp32 at base_lr 1e6 (the probe's case): the loss explodes to ~1e17 while still finite, and only
    later turns inf. The weights that gave the first exploding loss and every snapshot after them are
    marked diverging; the stop names the newest snapshot from before, and --resume auto takes it,
    not the newest file."""
    run = tmp_path / "run"
    sets = ["solver.base_lr=1e6", "precision.storage=\"fp32\"", "solver.snapshot=1", "solver.display=1",
            "solver.max_iter=30", "data.batch_size=32", "solver.warmup_iter=20", "data.mean_value=[77.75]",
            "data.scale=0.015625"]  # the digits recipe's: its warm-up lets the first steps stay sane
    assert main(["train", "--config", empty_cfg, *_args(run, *sets)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    captured = caplog.text
    found = re.search(r"the run may be diverging: the loss of iteration (\d+) \(([\d.e+]+)\) is [\d.e+]+x the median",
                      captured)
    assert found and float(found.group(2)) > 1e6, captured[-3000:]  # finite, exploding: before any inf
    since = int(found.group(1)) - 1
    snaps = sorted(list_snapshots(run))
    assert len(snaps) >= 3 and all(is_diverging(p) == (it >= since) for it, p in snaps), snaps
    good = good_snapshots(run)
    assert good and line.endswith(f"the last good snapshot is {good[0][1]} (it began with the weights of "
                                  f"iteration {since})"), line
    assert resolve_resume("auto", run) == good[0][1] != snaps[-1][1]


def test_divergence_watch_on_synthetic_losses():
    from dptrain.train.health import LOSS_WINDOW, DivergenceWatch

    w = DivergenceWatch()
    assert w.observe(1, 2.3) is None and w.observe(2, 2.1) is None and w.observe(3, 20.0) is None  # 8.7x: in range
    assert "iteration 4 (300) is 130x the median of the 3 before it (2.3)" in w.observe(4, 300.0)
    assert w.since == 3 and w.suspect(3) and not w.suspect(2)
    assert w.observe(5, float("inf")) is None and w.since == 3  # already diverging: no second start
    for step in range(6, 6 + LOSS_WINDOW):  # back in range long enough: it was a spike
        assert w.observe(step, 2.0) is None
    assert w.since is None and not w.suspect(100)
    assert w.observe(50, float("nan")) == "the loss of iteration 50 is not finite" and w.since == 49
    tiny = DivergenceWatch()
    for step in range(1, 5):
        tiny.observe(step, 1e-6)
    assert tiny.observe(5, 0.5) is None  # under 10 x the floor of 0.1: a near-perfect fit's ordinary loss


# --------------------------------------------------------------------------------------- lines


def test_launcher_summary_points_at_errors_only_where_a_solver_printed_one():
    assert failure_summary({0: 2, 1: -15}) == ("dptrain: 2 solver process(es) failed (rank 0 exit 2, rank 1 killed by "
                                               "SIGTERM); the error line of rank 0 is above")
    only_killed = failure_summary({0: -9, 1: -9})
    assert "rank 0 killed by SIGKILL, rank 1 killed by SIGKILL" in only_killed
    assert "above" not in only_killed and "none of them printed an error" in only_killed


def test_disk_full_reports_the_free_space_after_removing_the_partial_file(tmp_path, monkeypatch):
    import shutil

    import dptrain.snapshots.files as ck

    seen = []
    real_usage = shutil.disk_usage

    def usage(folder):
        seen.append(sorted(p.name for p in Path(folder).iterdir()))
        return real_usage(folder)

    def full(state, f):
        f.write(b"x" * 1000)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck.shutil, "disk_usage", usage)
    monkeypatch.setattr(ck.torch, "save", full)
    with pytest.raises(RunDirError, match="No space left on device.*MiB free there"):
        save_snapshot({"x": 1}, tmp_path / "snapshot_iter_3.pt")
    assert seen == [[]]  # the temporary was gone when the free space was measured


def test_a_permission_error_on_a_snapshot_names_permissions_not_space(tmp_path, monkeypatch):
    import dptrain.snapshots.files as ck

    def denied(obj, f):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ck.torch, "save", denied)
    with pytest.raises(RunDirError, match=r"no permission to write in .*give this user write access") as info:
        save_snapshot({"x": 1}, tmp_path / "snapshot_iter_3.pt")
    assert "free" not in str(info.value)


def test_resume_checks_a_torn_file_first_and_says_so_when_every_snapshot_is_torn(tmp_path):
    from dptrain.errors import SnapshotError

    run = tmp_path / "run"
    run.mkdir()
    torn = run / "snapshot_iter_4.pt"
    torn.write_bytes(b"PK\x03\x04 not a whole zip")
    with pytest.raises(SnapshotError, match="snapshot_iter_4.pt"):
        resolve_resume(str(torn), run)  # before anything is built: run_training calls this first
    with pytest.raises(SnapshotError, match=r"--resume auto: none of the 1 snapshot\(s\) .* can be resumed "
                                            r"\(snapshot_iter_4.pt \(unreadable\)\)"):
        resolve_resume("auto", run)
    assert resolve_resume("auto", tmp_path / "empty") is None  # no snapshot at all: a fresh start


def test_resume_given_a_folder_takes_its_newest_good_snapshot(tmp_path, empty_cfg, caplog):
    """--resume DIR means "continue from what DIR holds": its newest readable snapshot not marked diverging,
    as --resume auto picks in train.run_dir; a folder without any snapshot is refused in one line."""
    import logging

    from dptrain.errors import SnapshotError
    from dptrain.snapshots import mark_diverging

    run = tmp_path / "run"
    assert main(["train", "--config", empty_cfg, *_args(run, "solver.max_iter=4", "solver.snapshot=2")]) == 0
    mark_diverging(run / "snapshot_iter_4.pt", "a test mark")
    assert resolve_resume(str(run), tmp_path / "elsewhere") == run / "snapshot_iter_2.pt"
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main(["train", "--config", empty_cfg, "--resume", str(run), *_args(run, "solver.max_iter=6")]) == 0
    assert f"--resume {run} is a folder: resuming from its newest good snapshot, snapshot_iter_2.pt" in caplog.text
    assert f"resumed from {run / 'snapshot_iter_2.pt'} at iteration 2" in caplog.text
    (tmp_path / "empty").mkdir()
    with pytest.raises(SnapshotError, match=r"--resume '.*empty' is a folder without a snapshot_iter_<N>\.pt; pass "
                                            r"a snapshot file, or --resume auto for train\.run_dir"):
        resolve_resume(str(tmp_path / "empty"), run)
