"""dptrain test and dptrain export under torchrun with 2 CPU solvers (gloo)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from dptrain.cli import main
from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.models import build_model
from dptrain.topology import Topology
from dptrain.train import Trainer


def _torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two solvers share the cores
    return subprocess.run([sys.executable, "-m", "dptrain.torchrun", "--standalone", "--nproc-per-node=2",
                           "-m", "dptrain", *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def test_two_ranks_score_the_counts_of_one_and_export_writes_one_file(tmp_path, capsys):
    sets = ['model.name="lenet"', 'data.source="digits"', "data.batch_size=32", "data.test_batch_size=64",
            f"train.run_dir={json.dumps(str(tmp_path / 'run'))}"]
    t = Trainer(load_config(None, [*sets, "solver.display=0"]),
                Communicator.from_env(Topology(), 60, torch.device("cpu")))
    for _ in range(20):
        t.train_step()
    snapshot = t.save()
    t.close()
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    scoring = ["test", "--config", str(cfg), "--weights", str(snapshot), *[f"--set={s}" for s in sets]]
    assert main(scoring) == 0
    one = json.loads(capsys.readouterr().out)

    proc = _torchrun(*scoring, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout  # rank 0 alone prints
    two = json.loads(lines[0])
    # 297 samples: rank 0 scores 149 (3 batches of <= 64), rank 1 148; the sums are the one-process counts
    assert two == {**one, "world_size": 2} and one["test_samples"] == 297 and one["test_top1"] > 0.5, (one, two)

    proc = _torchrun("export", str(snapshot), str(tmp_path / "lenet.pt"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["out"] == str(tmp_path / "lenet.pt"), proc.stdout
    build_model("lenet", num_classes=10).load_state_dict(torch.load(tmp_path / "lenet.pt", weights_only=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "lenet.pt", "run"]  # no temporary file left
