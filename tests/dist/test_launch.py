"""launch/run-local with 2 CPU processes runs the digits recipe end to end (the demo's path)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_run_local_two_cpu_solvers(tmp_path):
    cfg = tmp_path / "digits.toml"
    cfg.write_text(f'[model]\nname = "lenet"\n[data]\nsource = "digits"\nbatch_size = 32\n'
                   f'[solver]\nbase_lr = 0.01\nmax_iter = 120\ndisplay = 40\nlr_policy = "poly"\n'
                   f'[train]\nrun_dir = "{tmp_path / "run"}"\n')
    env = {**os.environ, "PYTHON": sys.executable, "NPROC": "2"}
    proc = subprocess.run([str(REPO / "launch" / "run-local"), "train", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world_size 2" in proc.stderr  # the startup plan line, logged by rank 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in lines if "loss" in r] == [40, 80, 120]
    final = [r for r in lines if "test_top1" in r][-1]
    assert final["test_samples"] == 297 and final["test_top1"] > 0.9
    assert (tmp_path / "run" / "snapshot_iter_120.pt").is_file()
