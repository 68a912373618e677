"""benchmarks/gpu_session.sh reports a failed stage in its exit code (a lent GPU's only verdict)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, stages: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "STAGES": stages, "PYTHON": sys.executable,
           "BANDWIDTH_ARGS": "--numel 4096 --iters 1 --repeats 1 --warmup 0 --device cpu"}
    return subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_session.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_failing_stage_makes_the_session_fail_even_when_a_later_one_passes(tmp_path):
    # no GPU here: the self-check stage fails; the bandwidth stage then passes on the CPU
    proc = _run(tmp_path, "selfcheck bandwidth")
    status = dict(line.split("\t") for line in (tmp_path / "out" / "status.tsv").read_text().splitlines()
                  if "\t" in line)
    assert status["selfcheck"] != "0" and status["bandwidth"] == "0", status
    assert proc.returncode == int(status["selfcheck"]) != 0, proc.stdout[-2000:]
    assert (tmp_path / "out" / "selfcheck.log").is_file() and (tmp_path / "out" / "env.txt").is_file()


def test_all_stages_passing_exits_0(tmp_path):
    proc = _run(tmp_path, "bandwidth")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "worst stage status: 0" in (tmp_path / "out" / "status.tsv").read_text()
