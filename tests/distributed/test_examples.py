"""examples/: a user's own model file (a small vision transformer) and its recipe, trained with 2
solvers on the built-in digits through launch/run-local, from the repository's folder (the user's
module is found in the working directory)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_example_vision_transformer_trains_on_the_digits_with_two_solvers(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "NPROC": "2"}
    env.pop("PYTHONPATH", None)  # examples.vit must come from the working directory
    proc = subprocess.run([str(REPO / "launch" / "run-local"), "train", "--config", "examples/vit_digits.toml",
                           "--set", f"train.run_dir={json.dumps(str(tmp_path / 'run'))}"],
                          capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in lines if "test_top1" in r][-1]
    assert final["test_samples"] == 297 and final["test_top1"] >= 0.95, final
