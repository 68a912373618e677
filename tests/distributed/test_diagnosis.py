"""Why a run is slow or stuck: the straggler named at the displays, and the flight record of a hang or a death."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist_harness import run_ranks
from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.train import Trainer

BASE = ["model.name=lenet", "data.source=digits", "data.batch_size=8", "solver.display=4", "solver.max_iter=16",
        "solver.test_interval=0", "solver.snapshot=0"]
BUSY_S = 0.1
"""Time every rank spends per step outside the CPU (a sleep in forward), so that LeNet's ~10 ms
of compute, which 3 processes on 2 cores share unevenly, stays well under the 10 % threshold."""
SLOW_S = 0.06
"""Extra time per step on the slowed rank: 60 % of the others' step, far above that noise."""


def _straggler_rank(rank: int, world: int, out: str, slow_rank: int) -> None:
    cfg = load_config(None, [*BASE, f"train.run_dir={json.dumps(out)}"])
    t = Trainer(cfg, Communicator.from_initialized(torch.device("cpu")))
    real = t._forward
    busy_s = BUSY_S + (SLOW_S if rank == slow_rank else 0.0)  # the slow rank: e.g. a busy host

    def busy_forward(x):
        time.sleep(busy_s)
        return real(x)

    t._forward = busy_forward
    warnings = []
    import dptrain.train.trainer as train

    real_warning = train.log.warning
    train.log.warning = lambda fmt, *a: warnings.append(fmt % a) or real_warning(fmt, *a)
    try:
        t.fit()
    finally:
        train.log.warning = real_warning
        t.close()
    if rank == 0:
        lines = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()]
        torch.save({"records": [r for r in lines if "compute_ms_per_rank" in r], "warnings": warnings},
                   Path(out) / "rank0.pt")


@pytest.mark.parametrize("slow_rank", [1, None], ids=["one-slow", "balanced"])
def test_the_slow_rank_is_named_and_a_balanced_run_names_nobody(tmp_path, slow_rank):
    run_ranks(3, _straggler_rank, str(tmp_path), slow_rank if slow_rank is not None else -1)
    got = torch.load(tmp_path / "rank0.pt")
    records, warnings = got["records"], got["warnings"]
    assert len(records) == 4 and all(len(r["compute_ms_per_rank"]) == 3 for r in records)
    straggler_lines = [w for w in warnings if "has been the slowest" in w]
    if slow_rank is None:
        assert straggler_lines == [], straggler_lines
        return
    assert all(r["slowest_rank"] == 1 for r in records), records
    assert all(r["straggler_gap_ms"] > 0.5 * SLOW_S * 1e3 for r in records), records
    assert all(r["wait_ms_per_rank"][0] > r["wait_ms_per_rank"][1] for r in records)  # the others wait for it
    assert len(straggler_lines) == 1, warnings
    assert straggler_lines[0].startswith("rank 1 (host ") and "slowest for 3 displays" in straggler_lines[0]
    assert "costs about" in straggler_lines[0]


def _line_up_rank(rank: int, world: int, out: str) -> None:
    cfg = load_config(None, [*BASE, f"train.run_dir={json.dumps(out)}"])
    t = Trainer(cfg, Communicator.from_initialized(torch.device("cpu")))
    real = t._forward
    t._forward = lambda x: time.sleep(SLOW_S if rank == 1 else 0.0) or real(x)  # rank 1 ends backward late
    t.train_step()
    t.clock.host_marks = []
    for _ in range(6):
        t.train_step()
    split = t.stragglers.line_up(t.clock.host_marks)
    waits = [(end - backward) * 1e3 for backward, end in t.clock.host_marks]
    t.close()
    torch.save({"split": split, "waits": waits}, Path(out) / f"line_up{rank}.pt")


def test_rank_0s_wait_splits_into_the_wait_for_the_slowest_and_the_communication_after_it(tmp_path):
    """bench's backward_skew_ms and comm_after_slowest_ms: rank 1 is 60 ms late every step, so rank 0's
    wait is mostly skew, and what is left is the least wait, rank 1's own."""
    run_ranks(2, _line_up_rank, str(tmp_path))
    got = [torch.load(tmp_path / f"line_up{r}.pt") for r in range(2)]
    assert got[0]["split"] == got[1]["split"], "every rank computes the same split"
    split = got[0]["split"]
    assert split["backward_skew_ms"] > 0.5 * SLOW_S * 1e3, split
    least = [min(a, b) for a, b in zip(got[0]["waits"], got[1]["waits"], strict=True)]
    assert split["comm_after_slowest_ms"] == round(torch.tensor(least, dtype=torch.float64).median().item(), 3)
    assert split["comm_after_slowest_ms"] < split["backward_skew_ms"], split


# --------------------------------------------------------------------------------------- flight record

CONFIG = """[model]
name = "lenet"
[data]
source = "digits"
batch_size = 8
[solver]
max_iter = 1000000
display = 10
snapshot = 0
[reducer]
timeout_s = {timeout_s}
[train]
run_dir = "{run_dir}"
"""
TIMEOUT_S = 5.0


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for torchrun to reap it has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK=")).split(b"=")[1])


@pytest.mark.parametrize("how", ["SIGSTOP", "SIGKILL"], ids=["hang", "death"])
def test_a_hung_or_dead_rank_is_named_by_the_others_with_a_flight_record(tmp_path, how):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(timeout_s=TIMEOUT_S, run_dir=tmp_path / "run"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "dptrain.torchrun", "--standalone", "--nproc-per-node=3",
                                 "-m", "dptrain", "train", "--config", str(cfg)],
                                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines, culprit, struck, survivors = [], None, None, []
    try:
        for line in launcher.stderr:
            lines.append(line)
            if culprit is None and re.search(r"iter 20 loss", line):
                kids = [int(p) for p in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                                       text=True).stdout.split()]
                culprit = next(p for p in kids if _rank_of(p) == 2)
                survivors = [p for p in kids if p != culprit]
                os.kill(culprit, getattr(signal, how))
                struck = time.monotonic()
            if struck is not None and len(re.findall(r"dptrain: error \(rank [01]\)", "".join(lines))) == 2:
                break
        while any(_alive(p) for p in survivors) and time.monotonic() - struck < TIMEOUT_S + 10:
            time.sleep(0.1)  # the survivors exit by themselves, the hung rank still stopped
        took = time.monotonic() - struck
        assert not any(_alive(p) for p in survivors), "a survivor did not exit"
        if how == "SIGSTOP":
            os.kill(culprit, signal.SIGKILL)  # let torchrun end
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if culprit is not None:
            try:
                os.kill(culprit, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = "".join(lines)
    assert took < TIMEOUT_S + 10, f"{took:.1f} s\n{text[-3000:]}"
    for r in (0, 1):
        found = [ln for ln in text.splitlines() if ln.startswith(f"dptrain: error (rank {r})")]
        assert found, f"rank {r} printed no error line:\n{text[-3000:]}"
        line = found[0]
        assert f"rank {r}: waiting in " in line, line
        assert "rank 2 never arrived" in line or "rank 2 stopped answering" in line, line
        flight = json.loads((tmp_path / "run" / f"flight.rank{r}.json").read_text())
        assert flight["never_arrived"] == [2] and flight["rank"] == r
        waiting = flight["waiting_in"]
        assert waiting is not None and f"#{waiting['seq']}, iteration {waiting['iteration']}" in line
        assert waiting["op"] in line and flight["collectives"][-1]["seq"] >= waiting["seq"]
        if "never arrived" in line:
            assert int(flight["progress"]["2"][0]) < waiting["seq"]  # the culprit's last collective is behind
