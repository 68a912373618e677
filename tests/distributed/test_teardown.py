"""A finished solver leaves no gloo thread behind: close() frees the process group, so nothing of
torch.distributed runs while Python finalises (where a worker thread taking the GIL aborts the
process: "terminate called without an active exception")."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SOLVER = """
import os, sys
from dptrain.config import load_config
from dptrain.run import open_communicator
from dptrain.topology import Topology
from dptrain.train import Trainer

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return [n for n in names if "gloo" in n]

cfg = load_config(None, ["model.name=resnet18_cifar", "model.width=8", "model.num_classes=10", "data.source=synthetic",
                         "data.image_size=32", "data.batch_size=4", "precision.storage=fp32", "solver.display=0",
                         f"train.run_dir={sys.argv[1]!r}"])
comm = open_communicator(cfg, Topology.from_env())
assert gloo_threads(), "the gloo process group should run worker threads"
import torch._dynamo  # noqa: E402,F401 - what the CPU build does (the meta-device layout probe), made explicit
trainer = Trainer(cfg, comm)
for _ in range(2):
    trainer.train_step()
trainer.close()
comm.close()
left = gloo_threads()
print(f"rank {comm.rank}: gloo threads after close: {left}", flush=True)
sys.exit(3 if left else 0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc")
def test_close_frees_the_process_group_and_its_threads(tmp_path):
    """Under torchrun, not tests/dist_harness.py: the harness creates the group itself, and what is
    tested here is Communicator.from_env's order (torch._dynamo first, then the group)."""
    script = tmp_path / "solver.py"
    script.write_text(SOLVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(tmp_path / "run")], capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("gloo threads after close: []") == 2, out[-3000:]
