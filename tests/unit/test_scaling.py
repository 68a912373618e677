"""benchmarks/scaling/scaling.py: run planning, JSON parsing, efficiency, table and plot. No torchrun is started."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.scaling import scaling

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"


def _rec(world_size: int, ips: float, batch: int = 32, **extra: object) -> dict[str, object]:
    return {"images_per_s": ips, "images_per_s_per_solver": ips / world_size, "step_ms_median": 10.0,
            "step_ms_p90": 12.0, "data_wait_ms": 0.1, "forward_ms": 3.0, "backward_ms": 5.0, "exposed_comm_ms": 0.5,
            "update_ms": 1.0, "world_size": world_size, "batch_size": batch, "global_batch": batch * world_size,
            "device": "cpu (test)", **extra}


def _row(mode: str, world_size: int, ips: float) -> scaling.Row:
    return scaling.summarize(mode, [_rec(world_size, ips)])  # type: ignore[arg-type]


def test_dry_run_prints_one_torchrun_command_per_mode_and_world_size(tmp_path, capsys):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text("[data]\nbatch_size = 16\n")
    assert scaling.main(["--dry-run", "--config", str(cfg), "--world-sizes", "1,2", "--steps", "7"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if not x.startswith("#")]
    assert len(lines) == 4  # {weak, strong} x {1, 2}
    assert all("-m torch.distributed.run --standalone" in x and "-m dptrain bench" in x for x in lines)
    assert all(f"--config {cfg}" in x and "--steps 7" in x for x in lines)
    # weak: 16 per solver at both sizes; strong: global 16*2 = 32 -> 32 at N=1, 16 at N=2
    expect = [(1, 16), (2, 16), (1, 32), (2, 16)]
    for line, (n, b) in zip(lines, expect, strict=True):
        assert f"--nproc-per-node={n}" in line and line.endswith(f"--set data.batch_size={b}")


def test_dry_run_rejects_a_global_batch_that_does_not_divide(tmp_path, capsys):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text("[data]\nbatch_size = 16\n")
    rc = scaling.main(["--dry-run", "--config", str(cfg), "--world-sizes", "1,2,4", "--mode", "strong",
                       "--global-batch", "6"])
    assert rc == 2
    assert "--global-batch 6 is not divisible by world_size*iter_size (4*1)" in capsys.readouterr().err


@pytest.mark.parametrize("flags, fragment", [
    (["--repeats", "0"], "--repeats must be >= 1, got 0"), (["--steps", "0"], "--steps must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"), (["--global-batch", "0"], "--global-batch must be >= 1"),
])
def test_counts_below_one_are_refused_not_replaced_by_the_config(capsys, flags, fragment):
    assert scaling.main(["--dry-run", *flags]) == 2
    assert fragment in capsys.readouterr().err


def test_per_solver_batch_weak_is_fixed_and_strong_divides():
    assert scaling.per_solver_batch("weak", 8, batch_size=32, global_batch=0) == 32
    assert scaling.per_solver_batch("strong", 4, batch_size=0, global_batch=256, iter_size=2) == 32  # 256/(4*2)
    with pytest.raises(ValueError, match=r"--global-batch 100 is not divisible by world_size\*iter_size \(8\*1\)"):
        scaling.per_solver_batch("strong", 8, batch_size=0, global_batch=100)


def test_build_command_is_the_exact_torchrun_line():
    cmd = scaling.build_command(4, 64, config="c.toml", steps=20, warmup=3, synthetic=True,
                                sets=["precision.storage=bf16"], python="py")
    assert cmd == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "dptrain",
                   "bench", "--config", "c.toml", "--steps", "20", "--warmup", "3", "--synthetic",
                   "--set", "precision.storage=bf16", "--set", "data.batch_size=64"]


def test_parse_world_sizes_sorts_and_rejects_bad_input():
    assert scaling.parse_world_sizes("4,1,2,2") == [1, 2, 4]
    with pytest.raises(ValueError, match="comma-separated integers"):
        scaling.parse_world_sizes("1,two")
    with pytest.raises(ValueError, match=">= 1"):
        scaling.parse_world_sizes("0,2")


def test_parse_bench_output_takes_the_json_line_among_log_noise():
    rec = _rec(2, 123.0)
    out = "some log\n{not json\n" + json.dumps(rec) + "\n{\"other\": 1}\n"
    assert scaling.parse_bench_output(out) == rec
    with pytest.raises(ValueError, match="no bench JSON line"):
        scaling.parse_bench_output("only\nlogs\n")


def test_summarize_keeps_the_median_run_of_the_repeats():
    row = scaling.summarize("weak", [_rec(2, 90.0), _rec(2, 110.0), _rec(2, 100.0)])
    assert (row.images_per_s, row.repeats, row.world_size, row.global_batch) == (100.0, 3, 2, 64)
    assert (row.images_per_s_min, row.images_per_s_max) == (90.0, 110.0)
    # even count: the lower middle, so the row is one real run, not an average
    assert scaling.summarize("weak", [_rec(1, 10.0), _rec(1, 30.0)]).images_per_s == 10.0


def test_efficiency_is_speedup_over_ideal_per_mode():
    rows = scaling.add_efficiency([_row("weak", 1, 100.0), _row("weak", 2, 180.0), _row("weak", 4, 320.0),
                                   _row("strong", 2, 200.0), _row("strong", 4, 300.0)])
    by = {(r.mode, r.world_size): r for r in rows}
    assert by["weak", 2].speedup == pytest.approx(1.8) and by["weak", 2].efficiency == pytest.approx(0.9)
    assert by["weak", 4].efficiency == pytest.approx(0.8)  # 320/100 / 4
    # strong study starting at 2: base is world size 2; 4 solvers give 1.5x of an ideal 2x
    assert by["strong", 2].efficiency == pytest.approx(1.0)
    assert by["strong", 4].speedup == pytest.approx(1.5) and by["strong", 4].efficiency == pytest.approx(0.75)


def test_markdown_table_has_machine_and_one_table_per_mode():
    rows = scaling.add_efficiency([_row("weak", 1, 100.0), _row("weak", 2, 180.0)])
    md = scaling.markdown_table(rows, {"device": "cpu (test)", "git_commit": "abc123"})
    assert "- **device**: cpu (test)" in md and "- **git_commit**: abc123" in md
    assert "### Weak scaling (fixed per-solver batch)" in md and "Strong scaling" not in md
    assert "| 2 | 32 | 64 | 180.0 | 90.0 | 10.00 / 12.00 | 3.00 / 5.00 / 0.50 / 1.00 | 1.80 | 0.90 |" in md


def test_plot_png_from_the_fixture_csv(tmp_path):
    rows = scaling.read_csv(FIXTURES / "scaling_fixture.csv")
    assert [(r.mode, r.world_size) for r in rows][:3] == [("weak", 1), ("weak", 2), ("weak", 4)]
    assert rows[4].efficiency == pytest.approx(0.8333)
    out = scaling.plot(rows, tmp_path / "scaling.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_csv_round_trip_and_missing_column(tmp_path):
    rows = scaling.add_efficiency([_row("weak", 1, 100.0), _row("weak", 2, 150.0)])
    scaling.write_csv(rows, tmp_path / "s.csv")
    back = scaling.read_csv(tmp_path / "s.csv")
    assert [(r.world_size, r.images_per_s, r.efficiency) for r in back] == [(1, 100.0, 1.0), (2, 150.0, 0.75)]
    (tmp_path / "bad.csv").write_text("mode,world_size\nweak,1\n")
    with pytest.raises(ValueError, match="missing CSV column"):
        scaling.read_csv(tmp_path / "bad.csv")


def test_output_names_keep_a_dotted_tag_and_the_date(tmp_path):
    stem = tmp_path / "scaling_v1.5_20261123"
    assert scaling.output_file(stem, ".csv").name == "scaling_v1.5_20261123.csv"
