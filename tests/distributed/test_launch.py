"""launch/run-local with 2 CPU processes runs the digits recipe end to end (the demo's path)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_a_bad_record_on_one_rank_ends_the_job_with_one_line_per_rank_and_exit_2(tmp_path):
    """The failing rank names the LMDB key, the other says a peer failed first, and the launcher
    (dptrain.torchrun) exits 2 without torchrun's traceback."""
    import numpy as np

    from dptrain.data.caffe.datum import encode_datum, hwc_to_raw
    from dptrain.data.caffe.writer import write_lmdb

    rng = np.random.default_rng(0)
    values = []
    for i in range(64):
        raw, c, h, w = hwc_to_raw(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
        values.append(encode_datum(label=i % 10, data=raw, channels=c, height=h, width=w))
    values[1] = b"\xff\xff\xff"  # rank 0's second sample; not among the records probed at open
    write_lmdb(tmp_path / "db", iter(zip([f"{i:08d}_r{i}".encode() for i in range(64)], values, strict=True)), 64)
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f'[model]\nname = "lenet"\n[data]\nsource = "lmdb"\npath = "{tmp_path / "db"}"\nbatch_size = 4\n'
                   f'shuffle = "none"\n[solver]\nmax_iter = 5\n[train]\nrun_dir = "{tmp_path / "run"}"\n')
    env = {**os.environ, "PYTHON": sys.executable, "NPROC": "2", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(REPO / "launch" / "run-local"), "train", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "dptrain: error (rank 0): LMDB" in proc.stderr and "key '00000001_r1'" in proc.stderr
    rank1 = [ln for ln in proc.stderr.splitlines() if ln.startswith("dptrain: error (rank 1)")]
    assert all("another rank failed or hung first" in ln for ln in rank1)  # when it speaks before torchrun stops it
    assert "dptrain: 2 solver process(es) failed" in proc.stderr


def test_run_multinode_refuses_bad_topology_flags_in_one_line_before_launching():
    """Each would otherwise be a torchrun traceback, a usage dump, or (node rank >= nnodes) a hang."""
    script = str(REPO / "launch" / "run-multinode")
    for flags, fragment in ((["--master-port", "abc"], "must be a port number 1-65535"),
                            (["--node-rank", "5"], "must be 0..0 for --nnodes 1, got '5'"),
                            (["--max-restarts", "x"], "must be an integer >= 0, got 'x'")):
        proc = subprocess.run([script, "--nnodes", "1", "--master-addr", "localhost", *flags, "train", "--config", "x"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and fragment in proc.stderr, proc.stderr


@pytest.fixture()
def silent_listener():
    """A real listener on a free loopback port: it holds the port and completes connections (the kernel's
    backlog), and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s.getsockname()[1]
    s.close()


def _launch(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    """One launcher run with a bounded wait; its stderr holds nothing but dptrain's line."""
    env = {**os.environ, "PYTHON": sys.executable, "NPROC": "2", **env}
    env.pop("OMP_NUM_THREADS", None)  # the launcher must not let torchrun's warning about it through either
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def test_a_taken_master_port_is_one_line_and_exit_2(silent_listener):
    """The static rendezvous of dptrain.torchrun and of run-multinode (node rank 0 creates the store)."""
    want = (f"dptrain: error: rendezvous port {silent_listener} is in use on this host (another program listens on "
            f"it); choose another port with --master-port or MASTER_PORT\n")
    direct = _launch([sys.executable, "-m", "dptrain.torchrun", "--nproc-per-node=2",
                      f"--master-port={silent_listener}", "-m", "dptrain", "train", "--config", "x.toml"])
    multinode = _launch([str(REPO / "launch" / "run-multinode"), "train", "--config", "x.toml"], NNODES="1",
                        NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(silent_listener))
    for proc in (direct, multinode):
        assert (proc.returncode, proc.stderr) == (2, want), proc.stderr[-3000:]


def test_a_rendezvous_endpoint_that_never_answers_is_one_line_within_the_bound(silent_listener):
    """c10d rendezvous on a port a silent program holds: torch's store client would wait forever. The bound
    is --rdzv-conf read_timeout (here through PET_RDZV_CONF, torchrun's environment form, for run-multinode)."""
    want = ("accepts connections but does not answer as a rendezvous store within 1 s: another program holds that "
            "port; stop it, or choose another port (--master-port / MASTER_PORT, or --rdzv-endpoint)\n")
    direct = _launch([sys.executable, "-m", "dptrain.torchrun", "--nproc-per-node=2", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint=localhost:{silent_listener}", "--rdzv-conf=read_timeout=1", "-m", "dptrain",
                      "train", "--config", "x.toml"])
    multinode = _launch([str(REPO / "launch" / "run-multinode"), "train", "--config", "x.toml"], NNODES="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(silent_listener), PET_RDZV_CONF="read_timeout=1")
    for proc, host in ((direct, "localhost"), (multinode, "127.0.0.1")):
        assert (proc.returncode, proc.stderr) == (2, f"dptrain: error: rendezvous endpoint {host}:{silent_listener} "
                                                     f"{want}"), proc.stderr[-3000:]


def _parent_of(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def test_a_launcher_killed_with_sigkill_takes_its_solvers_with_it(tmp_path):
    """PR_SET_PDEATHSIG: a SIGKILLed torchrun leaves no orphans training; each solver gets a
    SIGTERM, so they snapshot at an agreed iteration and exit."""
    import signal
    import time

    cfg = tmp_path / "long.toml"
    cfg.write_text(f'[model]\nname = "lenet"\n[data]\nsource = "digits"\nbatch_size = 16\n'
                   f'[solver]\nmax_iter = 1000000\ndisplay = 10\nsnapshot = 0\n[train]\nrun_dir = "{tmp_path / "run"}"\n')
    env = {**os.environ, "PYTHON": sys.executable, "NPROC": "2", "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([str(REPO / "launch" / "run-local"), "train", "--config", str(cfg)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.2)
    solvers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent_of(p) == launcher.pid]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    try:
        assert len(solvers) == 2, solvers
        deadline = time.monotonic() + 60
        while any(Path(f"/proc/{p}").exists() for p in solvers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(Path(f"/proc/{p}").exists() for p in solvers), "solvers outlived their launcher"
        assert list((tmp_path / "run").glob("snapshot_iter_*.pt")), "no snapshot on the way out"
    finally:
        for p in solvers:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
