"""examples/: a user's own model file (a small vision transformer) and its recipe, trained with 2
solvers on the built-in digits through launch/run-local, from the repository's folder (the user's
module is found in the working directory)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _train_the_example(tmp_path, *sets: str) -> dict:
    env = {**os.environ, "PYTHON": sys.executable, "NPROC": "2"}
    env.pop("PYTHONPATH", None)  # examples.vit must come from the working directory
    args = [a for s in [f"train.run_dir={json.dumps(str(tmp_path / 'run'))}", *sets] for a in ("--set", s)]
    proc = subprocess.run([str(REPO / "launch" / "run-local"), "train", "--config", "examples/vit_digits.toml", *args],
                          capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in lines if "test_top1" in r][-1]
    assert final["test_samples"] == 297
    return final


def test_the_example_vision_transformer_learns_the_digits_with_two_solvers(tmp_path):
    """A quarter of the recipe's iterations (the whole recipe is make test-slow's): far above chance
    (10 %; 53.5 % measured)."""
    final = _train_the_example(tmp_path, "solver.max_iter=100")
    assert final["test_top1"] >= 0.4, final


@pytest.mark.slow
def test_the_example_vision_transformer_reaches_95_percent_on_the_digits(tmp_path):
    """The recipe as it is: 400 iterations, 2 solvers, fp32 (the README's figure)."""
    final = _train_the_example(tmp_path)
    assert final["test_top1"] >= 0.95, final
