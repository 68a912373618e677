"""Single-process trainer: learning, bit-exact resume, outputs, snapshots."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.errors import RunDirError, SnapshotError
from dptrain.snapshots import SNAPSHOT_FORMAT, list_snapshots, load_snapshot, resolve_resume, save_snapshot
from dptrain.topology import Topology
from dptrain.train import Trainer

SMALL = [
    "model.name=lenet", "data.source=digits", "data.batch_size=32", "solver.base_lr=0.01",
    "solver.lr_policy=fixed", "solver.display=5", "solver.weight_decay=0.0005",
]


def make_trainer(tmp_path: Path, *extra: str) -> Trainer:
    cfg = load_config(None, [*SMALL, f"train.run_dir={json.dumps(str(tmp_path))}", *extra])
    return Trainer(cfg, Communicator.from_env(Topology(), cfg.reducer.timeout_s, torch.device("cpu")))


def masters(t: Trainer) -> dict[str, torch.Tensor]:
    return t.flat.master_state()


def test_digits_learns_and_writes_outputs(tmp_path):
    t = make_trainer(tmp_path, "solver.max_iter=60", "solver.test_interval=30", "solver.snapshot=30")
    result = t.fit()
    t.close()
    assert result["test_top1"] > 0.85, result  # 60 iterations x 32 images: well past chance (0.10)
    assert (tmp_path / "config.toml").is_file()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in lines if "loss" in r]
    assert [r["iter"] for r in train_lines] == list(range(5, 61, 5))
    for r in train_lines:
        assert {"iter", "epoch", "loss", "lr", "images_per_s", "loss_scale", "skipped_steps"} <= set(r)
    assert train_lines[-1]["loss"] < train_lines[0]["loss"]
    tests = [r for r in lines if "test_top1" in r]
    assert [r["iter"] for r in tests] == [30, 60] and all("test_top5" in r for r in tests)
    assert [it for it, _ in list_snapshots(tmp_path)] == [60, 30]


@pytest.mark.parametrize("storage, solver", [("fp32", "sgd"), ("bf16", "sgd"), ("fp32", "lamb")])
def test_resume_is_bit_exact(tmp_path, storage, solver):
    extra = (f"precision.storage={storage}", "solver.lr_policy=step", "solver.stepsize=7", "solver.display=0",
             f"solver.type={solver}", *(() if solver == "sgd" else ('solver.no_decay=["bias"]',)))
    straight = make_trainer(tmp_path / "a", "solver.max_iter=20", *extra)
    for _ in range(20):
        straight.train_step()

    first = make_trainer(tmp_path / "b", "solver.max_iter=20", *extra)
    for _ in range(10):
        first.train_step()
    path = first.save()
    assert path is not None and path.name == "snapshot_iter_10.pt"
    resumed = make_trainer(tmp_path / "c", "solver.max_iter=20", *extra)
    resumed.resume(path)
    assert resumed.iteration == 10
    for _ in range(10):
        resumed.train_step()
    for name, w in masters(straight).items():
        assert torch.equal(w, masters(resumed)[name]), name
    for g_a, g_b in zip(straight.flat.groups, resumed.flat.groups, strict=True):
        assert g_a.state.keys() == g_b.state.keys() and len(g_a.state) == (1 if solver == "sgd" else 2)
        for name in g_a.state:
            assert torch.equal(g_a.state[name], g_b.state[name]), name
        assert torch.equal(g_a.params, g_b.params)


def test_snapshot_holds_fp32_masters_and_state(tmp_path):
    t = make_trainer(tmp_path, "precision.storage=bf16", "solver.max_iter=2")
    t.train_step()
    state = load_snapshot(t.save())
    assert state["iteration"] == 1
    assert all(v.dtype == torch.float32 for k, v in state["model"].items() if v.is_floating_point())
    assert set(state["optimizer"]) == {"rule", "state", "scaler"}
    assert state["data"]["micro_step"] == 1 and state["config"]["precision"]["storage"] == "bf16"


def test_torn_snapshot_never_replaces_good_one(tmp_path, monkeypatch):
    good = save_snapshot({"format": SNAPSHOT_FORMAT, "iteration": 1, "model": {}, "optimizer": {}, "rng": [], "config": {}},
                         tmp_path / "snapshot_iter_1.pt")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(RunDirError, match="cannot write snapshot .*disk full"):
        save_snapshot({"iteration": 2}, tmp_path / "snapshot_iter_1.pt")
    assert load_snapshot(good)["iteration"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["snapshot_iter_1.pt"]  # no temp file left


def test_snapshot_of_an_older_format_or_with_code_in_it_is_refused_in_one_line(tmp_path):
    import os

    old = save_snapshot({"iteration": 3, "model": {}, "solver": {}, "rng": [], "config": {}}, tmp_path / "old.pt")
    with pytest.raises(SnapshotError, match=r"old\.pt' has format 1, this dptrain reads format 2; resume it with"):
        load_snapshot(old)

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"format": SNAPSHOT_FORMAT, "iteration": 1, "x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(SnapshotError) as e:
        load_snapshot(tmp_path / "evil.pt")
    assert "holds a posix.system" in str(e.value) and "does not run code from a file" in str(e.value)
    assert "weights_only" not in str(e.value) and "\n" not in str(e.value)  # never torch's advice to run it
    (tmp_path / "junk.pt").write_bytes(bytes(range(256)) * 20)
    with pytest.raises(SnapshotError, match=r"junk\.pt' cannot be read \(not a snapshot's content: Unsupported"):
        load_snapshot(tmp_path / "junk.pt")


def test_resume_auto_skips_unreadable_newest(tmp_path):
    save_snapshot({"format": SNAPSHOT_FORMAT, "iteration": 3, "model": {}, "optimizer": {}, "rng": [],
                   "config": {}},
                  tmp_path / "snapshot_iter_3.pt")
    (tmp_path / "snapshot_iter_9.pt").write_bytes(b"torn")
    assert resolve_resume("auto", tmp_path) == tmp_path / "snapshot_iter_3.pt"
    assert resolve_resume("auto", tmp_path / "empty") is None
    with pytest.raises(SnapshotError, match="cannot be read"):
        load_snapshot(tmp_path / "snapshot_iter_9.pt")



def test_signal_writes_snapshot_and_resume_continues(tmp_path):
    import os
    import signal
    import threading

    t = make_trainer(tmp_path, "solver.max_iter=100000", "solver.display=0")
    t.train_step()  # warm the first step so the signal lands mid-run
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    result = t.fit()
    t.close()
    assert result["stopped_by_signal"] is True
    snaps = list_snapshots(tmp_path)
    assert len(snaps) == 1 and 1 < snaps[0][0] < 100000
    stopped_at = snaps[0][0]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # handler uninstalled after fit

    again = make_trainer(tmp_path, f"solver.max_iter={stopped_at + 3}", "solver.display=0")
    again.resume(resolve_resume("auto", tmp_path))
    assert again.iteration == stopped_at
    again.fit()
    again.close()
    assert list_snapshots(tmp_path)[0][0] == stopped_at + 3


def test_resume_after_a_crash_keeps_metrics_identical_to_an_uninterrupted_run(tmp_path):
    """metrics.jsonl after crash + resume equals the straight run's, line for line (images_per_s aside):
    lines past the snapshot are dropped, and the running loss of a display interval cut by the
    snapshot (display 5, snapshot 7) is carried in the snapshot."""
    from dptrain.observe.metrics import read_metrics

    def strip(path: Path) -> list[dict]:
        timing = {"images_per_s", "compute_ms_per_rank", "wait_ms_per_rank", "straggler_gap_ms"}
        return [{k: v for k, v in r.items() if k not in timing} for r in read_metrics(path / "metrics.jsonl")]

    sets = ["solver.max_iter=20", "solver.snapshot=7", "solver.test_interval=10"]
    straight = make_trainer(tmp_path / "a", *sets)
    straight.fit()
    straight.close()
    crashed = make_trainer(tmp_path / "b", *sets, "solver.max_iter=13")  # writes snapshot 7, lines 5 and 10, then dies
    for _ in range(13):
        crashed.train_step()
        it = crashed.iteration
        if it % 5 == 0:
            crashed._display()  # writes its metrics.jsonl line
        if it % 10 == 0:
            crashed.metrics.write({"iter": it, **crashed.test()})
        if it % 7 == 0:
            crashed.save()
    crashed.close()
    resumed = make_trainer(tmp_path / "b", *sets)
    resumed.resume(tmp_path / "b" / "snapshot_iter_7.pt")
    resumed.fit()
    resumed.close()
    assert strip(tmp_path / "b") == strip(tmp_path / "a")
    again = make_trainer(tmp_path / "b", *sets)  # --resume auto on the finished run: nothing to do, nothing written
    again.resume(resolve_resume("auto", tmp_path / "b"))
    assert again.fit() == {}
    again.close()
    assert strip(tmp_path / "b") == strip(tmp_path / "a")


def test_a_signal_during_the_final_test_abandons_it_after_the_final_snapshot(tmp_path, monkeypatch):
    """The final snapshot is written before the final test, so a preemption notice during that
    test stops it at the next batch and loses nothing."""
    import os
    import signal

    t = make_trainer(tmp_path, "solver.max_iter=4", "solver.display=0", "data.test_batch_size=20")
    real_forward = Trainer._forward
    calls = []

    def forward_then_preempted(self, x):
        if not self.model.training:
            calls.append(x.shape[0])
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # e.g. a preemption notice during the final test
        return real_forward(self, x)

    monkeypatch.setattr(Trainer, "_forward", forward_then_preempted)
    result = t.fit()
    t.close()
    assert result.get("stopped_by_signal") is True and "test_top1" not in result
    assert len(calls) == 2  # abandoned at the next test batch: the 297 digits would take 15
    assert [n for n, _ in list_snapshots(tmp_path)] == [4]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_resuming_with_another_batch_setup_says_the_run_no_longer_continues_sample_for_sample(tmp_path, caplog):
    import logging

    t = make_trainer(tmp_path, "solver.max_iter=2")
    t.fit()
    t.close()
    other = make_trainer(tmp_path, "solver.max_iter=3", "data.batch_size=16", "solver.iter_size=2")
    with caplog.at_level(logging.WARNING, logger="dptrain.train"):
        other.resume(tmp_path / "snapshot_iter_2.pt")
    other.close()
    assert "batch_size 32 -> 16" in caplog.text and "micro_step 2 -> 4" in caplog.text


def test_ctrl_c_asks_for_a_snapshot_and_a_second_one_stops_at_once():
    import signal

    from dptrain.distributed.control import StopFlag

    flag = StopFlag()
    flag(signal.SIGINT, None)
    assert flag.requested and flag.signum == signal.SIGINT
    for second in (signal.SIGINT, signal.SIGTERM):  # torchrun turns its own second Ctrl-C into a SIGTERM
        with pytest.raises(KeyboardInterrupt):
            flag(second, None)
    term = StopFlag()
    term(signal.SIGTERM, None)
    term(signal.SIGTERM, None)  # a repeated SIGTERM still waits for the snapshot
    assert term.requested and term.signum == signal.SIGTERM


def test_stale_snapshot_temporaries_are_removed_and_write_errors_are_one_line(tmp_path, monkeypatch):
    import os

    import torch

    from dptrain.snapshots import remove_stale_temporaries, save_snapshot

    dead = tmp_path / ".snapshot_iter_5.pt.999999999.tmp"  # no such pid
    mine = tmp_path / f".snapshot_iter_6.pt.{os.getpid()}.tmp"
    for p in (dead, mine):
        p.write_bytes(b"partial")
    assert remove_stale_temporaries(tmp_path) == 1 and not dead.exists() and mine.exists()

    def full_disk(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 4000")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(RunDirError, match=r"cannot write snapshot .*snapshot_iter_7\.pt' \(RuntimeError: \[enforce.*"
                                         r"MiB free there\); free space or choose another train\.run_dir"):
        save_snapshot({"x": 1}, tmp_path / "snapshot_iter_7.pt")
    assert not list(tmp_path.glob(".snapshot_iter_7*"))


def test_run_dir_that_is_not_writable_is_a_one_line_error(tmp_path, monkeypatch):
    import os

    from dptrain.snapshots import RunDir

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    with pytest.raises(RunDirError, match=r"train\.run_dir .*run': .* is not writable"):
        RunDir(tmp_path / "run").check_usable(writer=True)
    RunDir(tmp_path / "run").check_usable(writer=False)  # ranks that write nothing there do not care
    t = make_trainer(tmp_path / "run")  # bench builds a Trainer too, and writes nothing there: no check
    t.close()


def test_torn_metrics_line_is_dropped_on_resume_and_named_when_read(tmp_path):
    from dptrain.observe.metrics import MetricsWriter, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iter": 10, "loss": 1.0}\n{"iter": 20, "loss": 0.5}\n{"iter": 30, "images_pe')
    with pytest.raises(RunDirError, match=r"metrics\.jsonl' line 3 is not JSON"):
        read_metrics(path)
    assert MetricsWriter(path).drop_after(20) == 1
    assert read_metrics(path) == [{"iter": 10, "loss": 1.0}, {"iter": 20, "loss": 0.5}]


def test_resume_auto_without_a_snapshot_drops_the_crashed_runs_metrics(tmp_path):
    from dptrain.cli import main
    from dptrain.observe.metrics import read_metrics

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iter": 10, "loss": 9.0}\n{"iter": 20, "loss": 9.0}\n')
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    args = ["train", "--config", str(cfg), "--resume", "auto", "--set", "model.name=\"lenet\"", "--set", "data.source=\"digits\"",
            "--set", "solver.max_iter=4", "--set", "solver.display=2", "--set", "solver.snapshot=0",
            "--set", f"train.run_dir={json.dumps(str(run))}", "--set", "data.batch_size=16"]
    assert main(args) == 0
    assert [r["iter"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [2, 4]


def test_metrics_file_deleted_mid_run_is_started_again(tmp_path):
    from dptrain.observe.metrics import MetricsWriter, read_metrics

    w = MetricsWriter(tmp_path / "run" / "metrics.jsonl")
    w.write({"iter": 1})
    import shutil

    shutil.rmtree(tmp_path / "run")
    w.write({"iter": 2})
    w.close()
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == [{"iter": 2}]


def test_label_smoothing_loss_is_the_formula(tmp_path):
    """solver.label_smoothing = e: loss = mean over the batch of -(1-e)*log p_y - (e/K)*sum_k log p_k."""
    import torch.nn.functional as F

    eps = 0.1
    t = make_trainer(tmp_path, f"solver.label_smoothing={eps}", "solver.max_iter=1")
    seen: dict[str, torch.Tensor] = {}
    t.model.register_forward_hook(lambda m, i, out: seen.update(logits=out.detach().float().clone()))
    next_batch = t._next_batch

    def capture() -> tuple[torch.Tensor, torch.Tensor]:
        x, y = next_batch()
        seen["y"] = y.clone()
        return x, y

    t._next_batch = capture
    t.train_step()
    t.close()
    logp, y = seen["logits"].log_softmax(dim=1), seen["y"]  # [B, K], [B]
    k = logp.shape[1]
    want = (-(1 - eps) * logp.gather(1, y[:, None]).squeeze(1) - eps / k * logp.sum(dim=1)).mean()
    assert float(t._iter_loss) == pytest.approx(float(want), rel=1e-6)  # fp32 sums over 32 x 10 terms
    assert abs(float(want) - float(F.cross_entropy(seen["logits"], y))) > 1e-3  # the smoothing term is there
