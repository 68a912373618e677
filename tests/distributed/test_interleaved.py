"""benchmarks/throughput/interleaved.py: both sides in the same 2 gloo processes, timed in paired blocks."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.throughput import interleaved as il

REPO = Path(__file__).resolve().parents[2]


def test_two_gloo_ranks_time_both_sides_in_abba_pairs_and_write_the_report(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.throughput.interleaved", "--suite", "cpu", "--quick",
                           "--only", "fp32 vs DDP fp32", "--pairs", "2", "--block", "2", "--warmup", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = next(tmp_path.glob("interleaved_cpu_cpu*_*.md")).read_text()
    assert "| 2 solvers, fp32 vs DDP fp32 | no |" in report
    rec = json.loads(next(ln for ln in report.splitlines() if ln.startswith("{")))
    assert rec["world_size"] == 2 and rec["pairs"] == 2 and rec["peer_compile"] is None
    # ABBA: pair 0 dptrain first, pair 1 the peer first; every block two timed steps on the CPU
    assert [(b["pair"], b["side"]) for b in rec["blocks"]] == [(0, "dptrain"), (0, "peer"), (1, "peer"),
                                                              (1, "dptrain")]
    assert all(len(b["steps_s"]) == 2 and 0 < sum(b["steps_s"]) <= b["s"] for b in rec["blocks"])
    assert rec["dptrain_ips_median"] > 0 and rec["peer_ips_median"] > 0 and rec["typical_step_ratio"] > 0


def test_pair_stats_are_per_pair_ratios_of_images_per_s():
    blocks = [{"pair": 0, "side": "dptrain", "s": 1.0, "steps_s": [0.5, 0.5]},
              {"pair": 0, "side": "peer", "s": 2.0, "steps_s": [0.6, 1.4]},
              {"pair": 1, "side": "peer", "s": 1.0, "steps_s": [0.5, 0.5]},
              {"pair": 1, "side": "dptrain", "s": 1.25, "steps_s": [0.5, 0.75]},
              {"pair": 2, "side": "dptrain", "s": 3.0, "steps_s": [1.5, 1.5]},  # a slow spell, on both sides
              {"pair": 2, "side": "peer", "s": 3.3, "steps_s": [1.6, 1.7]}]
    s = il.pair_stats(blocks, images_per_block=64)
    assert s["pairs"] == 3 and s["dptrain_won"] == 2
    assert (s["ratio_q1"], s["ratio_median"], s["ratio_q3"]) == (0.95, 1.1, 1.55)  # of 0.8, 1.1, 2.0 (inclusive)
    assert s["dptrain_ips_median"] == 51.2 and s["peer_ips_median"] == 32.0  # 64 / 1.25, 64 / 2.0
    assert s["typical_step_ratio"] == 1.6  # medians of the pooled steps: peer 1.0, dptrain 0.625


def test_cases_whose_sides_need_their_own_environment_are_left_out(capsys):
    sys_argv = sys.argv
    try:
        sys.argv = ["interleaved.py", "--suite", "layout", "--only", "malloc settings,DPTRAIN_KERNELS", "--dry-run",
                    "--allow-slow-dtypes"]
        assert il.main() == 2
    finally:
        sys.argv = sys_argv
    err = capsys.readouterr().err
    assert "left out (4: no peer, a side-specific environment or CUDA graphs)" in err and "no case to run" in err


def test_cuda_graph_cases_are_left_out_and_the_others_of_the_gpu_suite_are_not():
    kept = [c.name for c in il.SUITES["gpu"](False) if il.interleavable(c)]
    assert kept and not any("reduce-overhead" in name for name in kept)
    assert any(c.peer_compile == "default" for c in il.SUITES["gpu"](False) if il.interleavable(c))
