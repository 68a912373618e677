"""`dptrain bench` prints one JSON line with the documented schema."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dptrain.cli import main
from dptrain.kernels import native

SCHEMA = {
    "images_per_s": float, "images_per_s_per_solver": float, "step_ms_median": float, "step_ms_p90": float,
    "data_wait_ms": float, "forward_ms": float, "backward_ms": float, "exposed_comm_ms": float,
    "update_ms": float, "gather_ms": float, "peak_mem_bytes": int, "bytes_per_param": dict, "versions": dict, "device": str,
    "world_size": int, "batch_size": int, "global_batch": int, "iter_size": int, "model": str,
    "precision": str, "config_hash": str, "git_commit": str, "steps": int, "warmup": int, "startup_s": float,
    "compiled": bool,
}


def test_bench_json_schema(tmp_path, capsys):
    cfg = tmp_path / "b.toml"
    cfg.write_text(f'[model]\nname = "lenet"\n[data]\nbatch_size = 8\nimage_size = 32\n'
                   f'[precision]\nstorage = "bf16"\n[train]\nrun_dir = "{tmp_path}"\n')
    trace = tmp_path / "trace"
    assert main(["bench", "--config", str(cfg), "--synthetic", "--steps", "3", "--warmup", "1",
                 "--phase-steps", "2", "--trace", str(trace)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert len(lines) == 1
    rec = json.loads(lines[0])
    for key, tp in SCHEMA.items():
        assert isinstance(rec[key], tp), (key, rec[key])
    assert rec["compiled"] is False and rec["compile_s"] is None and rec["startup_s"] > 0  # model.compile "auto": CPU
    assert rec["images_per_s"] > 0 and rec["step_ms_p90"] >= rec["step_ms_median"] > 0
    assert rec["forward_ms"] > 0 and rec["backward_ms"] > 0 and rec["update_ms"] > 0
    assert set(rec["bytes_per_param"]) == {"weights", "masters", "momentum", "grads", "total"}
    # the host build of update.cu (test_native_update.py), or the in-place passes without a C++ compiler
    assert rec["update_kernel"] == ("inplace" if native._compiler() is None else "native")
    assert rec["solver"] == "sgd" and rec["bytes_per_param"]["total"] == pytest.approx(sum(
        v for k, v in rec["bytes_per_param"].items() if k != "total"), abs=0.01)
    assert rec["bytes_per_param"]["weights"] < 2.1 and rec["bytes_per_param"]["masters"] >= 4.0  # bf16 + fp32
    assert set(rec["versions"]) >= {"torch", "cuda", "nccl", "cupy"}
    assert rec["world_size"] == 1 and rec["global_batch"] == 8 and rec["data"] == "synthetic"
    assert len(rec["compute_ms_per_rank"]) == len(rec["wait_ms_per_rank"]) == 1  # the straggler fields, as in metrics
    assert rec["compute_ms_per_rank"][0] > 0 and rec["slowest_rank"] == 0 and rec["straggler_gap_ms"] == 0
    events = json.loads((tmp_path / "trace.rank0.json").read_text())["traceEvents"]
    assert {"forward", "backward", "update"} <= {e["name"] for e in events}


def test_bench_on_the_users_model_prints_the_zoo_models_fields(tmp_path, capsys):
    records = {}
    for name in ("lenet", "byo_models:AuxHeads"):
        cfg = tmp_path / "b.toml"
        cfg.write_text(f'[model]\nname = "{name}"\n[data]\nbatch_size = 4\nimage_size = 32\n'
                       f'[train]\nrun_dir = "{tmp_path}"\n')
        assert main(["bench", "--config", str(cfg), "--synthetic", "--steps", "2", "--warmup", "1",
                     "--phase-steps", "1"]) == 0
        records[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(records["lenet"]) == set(records["byo_models:AuxHeads"])
    assert records["byo_models:AuxHeads"]["model"] == "byo_models:AuxHeads"


def test_single_solver_trace_has_bucket_ready_events(tmp_path, capsys):
    cfg = tmp_path / "b.toml"
    cfg.write_text(f'[model]\nname = "lenet"\n[data]\nbatch_size = 4\nimage_size = 32\n'
                   f'[reducer]\nbucket_mb = 0.05\nfirst_bucket_mb = 0.01\n[train]\nrun_dir = "{tmp_path}"\n')
    assert main(["bench", "--config", str(cfg), "--synthetic", "--steps", "1", "--warmup", "0",
                 "--phase-steps", "1", "--trace", str(tmp_path / "t")]) == 0
    events = json.loads((tmp_path / "t.rank0.json").read_text())["traceEvents"]
    ready = [e["args"]["bucket"] for e in events if e["name"] == "bucket_ready"]
    assert sorted(ready) == list(range(len(ready))) and len(ready) >= 3  # the profile the scaling model reads
    from benchmarks.scaling import profile_from_trace

    profile = profile_from_trace(json.loads((tmp_path / "t.rank0.json").read_text()), batch_size=4)
    assert len(profile.buckets) == len(ready)


def test_throughput_dry_run_lists_every_case_and_its_peer():
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    script = [sys.executable, "-m", "benchmarks.throughput.throughput"]
    out = subprocess.run([*script, "--dry-run", "--allow-slow-dtypes"],
                         capture_output=True, text=True, check=True, cwd=repo).stdout.splitlines()
    ours = [ln for ln in out if " -m dptrain bench " in ln]
    peers = [ln for ln in out if " -m benchmarks.throughput.peer " in ln]
    assert len(ours) == 8 and len(peers) == 4  # 4 peer cases + 4 bucket sizes
    assert all("--nproc-per-node=2" in ln for ln in peers[2:])
    sweep = subprocess.run([*script, "--dry-run", "--allow-slow-dtypes", "--only", "bucket sweep"],
                           capture_output=True, text=True, check=True, cwd=repo).stdout.splitlines()
    assert [ln.split("reducer.bucket_mb=")[1].split()[0] for ln in sweep] == ["1", "5", "25", "100"]
    buckets = subprocess.run([*script, "--dry-run", "--suite", "buckets", "--warmup", "2"],
                             capture_output=True, text=True, check=True, cwd=repo).stdout.splitlines()
    from dptrain.distributed.buckets.probe import (
        AUTO_DONE_ITER,  # every case warms up as long as auto's probe and check
    )

    assert len(buckets) == 6 and all(f"--warmup={AUTO_DONE_ITER} " in ln for ln in buckets)


def test_a_failed_run_costs_its_own_figure_not_the_others(tmp_path, monkeypatch, capsys):
    """throughput.py --suite gpu with the compiled peer's run failing: the other runs still run and
    print their progress lines (with what session_summary.py reads: compiled, peak memory), the table
    shows "-" for the missing side, and the exit code is 1."""
    from benchmarks.throughput import throughput

    runs = []

    def fake_run(argv, env=None):
        runs.append(argv)
        if "--compile=default" in argv:
            raise RuntimeError("benchmarks.throughput.peer failed (1):\nRuntimeError: CUDA out of memory")
        if "benchmarks.throughput.peer" in argv:
            return {"images_per_s": 6000.0, "peer": "autocast fp16", "peak_mem_bytes": 11e9}
        return {"images_per_s": 7000.0, "exposed_comm_ms": 0.0, "compiled": True, "cuda_graphs": False,
                "peak_mem_bytes": 10e9, "device": "NVIDIA H200", "versions": {"torch": "2.11.0"}}

    monkeypatch.setattr(throughput, "run_json", fake_run)
    monkeypatch.setattr(sys, "argv", ["throughput.py", "--suite", "gpu", "--repeats", "1", "--out", str(tmp_path),
                                      "--only", "fp16 vs torch AMP,fp16 vs torch.compile + torch AMP"])
    assert throughput.main() == 1
    assert len(runs) == 3  # dptrain's run serves both cases; each peer once
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert {"case": "ResNet-50 fp16 vs torch.compile + torch AMP (autocast + GradScaler)", "peer": None,
            "error": "RuntimeError: CUDA out of memory"} in lines
    assert {"case": "ResNet-50 fp16 vs torch AMP (autocast + GradScaler)", "dptrain": 7000.0, "compiled": True,
            "cuda_graphs": False, "peak_mem_bytes": 10e9} in lines
    table = next(tmp_path.glob("throughput_gpu_nvidia_h200_*.md")).read_text()
    assert "| ResNet-50 fp16 vs torch AMP (autocast + GradScaler) | 1 | 7000.0 | autocast fp16 | 6000.0 | 1.167x |" in table
    assert "| ResNet-50 fp16 vs torch.compile + torch AMP (autocast + GradScaler) | 1 | 7000.0 | - | - | - |" in table

    def dptrain_fails(argv, env=None):  # the run both cases share fails: once, reported for each
        runs.append(argv)
        if "benchmarks.throughput.peer" in argv:
            return {"images_per_s": 6000.0, "peer": "autocast fp16"}
        raise RuntimeError("bench failed (1):\nSetupError: no GPU")

    runs.clear()
    monkeypatch.setattr(throughput, "run_json", dptrain_fails)
    assert throughput.main() == 1
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert len(runs) == 3 and sum(ln.get("dptrain", 0) is None for ln in lines) == 2


def test_no_phase_steps_means_no_phase_times_rather_than_zeros(tmp_path, capsys):
    cfg = tmp_path / "b.toml"
    cfg.write_text(f'[model]\nname = "lenet"\n[data]\nbatch_size = 4\nimage_size = 32\n[train]\nrun_dir = "{tmp_path}"\n')
    assert main(["bench", "--config", str(cfg), "--synthetic", "--steps", "1", "--warmup", "0",
                 "--phase-steps", "0"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert all(rec[k] is None for k in ("data_wait_ms", "forward_ms", "backward_ms", "exposed_comm_ms", "update_ms"))
    assert rec["images_per_s"] > 0


def test_p90_is_the_nearest_rank_percentile():
    import numpy as np

    from dptrain.tools.bench import _percentile

    for n in range(1, 40):  # round() half-to-even gave 5 of 1..6 (and 23 of 1..26)
        xs = [float(i) for i in range(1, n + 1)]
        assert _percentile(xs, 0.9) == np.percentile(xs, 90, method="inverted_cdf"), n


def test_op_profile_profiles_both_sides_doing_the_same_convolutions(capsys):
    from benchmarks.throughput import op_profile
    assert op_profile.main(["--model", "lenet", "--width", "8", "--rounds", "2", "--steps", "1", "--warmup", "1",
                            "--top", "60"]) == 0
    out = capsys.readouterr().out
    rows = {ln.split("|")[1].strip(" `"): [c.strip() for c in ln.split("|")[2:6]]
            for ln in out.splitlines() if ln.startswith("| `")}
    assert rows["aten::convolution_backward"][0] == rows["aten::convolution_backward"][2] == "2"  # LeNet's 2 convs
    assert "Median dptrain / peer operator time per step" in out and out.count("\n| 1 |") == 1  # rounds 0 and 1
    assert op_profile.main(["--rounds", "0"]) == 2
