"""benchmarks/scaling/ (the scaling model): collective costs, overlap simulation, re-bucketing, trace profile, α-β fit.

Expected values are worked out by hand in the comments. One test spawns 2 gloo processes
(tiny messages, ~2 s) to check the calibration measurement end to end.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import benchmarks.scaling as sm

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"

MIB = 1024 * 1024
# A toy machine: 4 GPUs per node; NVLink 10 GB/s busbw, 5 us per hop; network 2 GB/s per node, 20 us per hop.
TOY = sm.Machine("toy", 4, nvlink=sm.Link(10.0, 5.0, "test"), network=sm.Link(2.0, 20.0, "test"))


def _toy_profile() -> sm.Profile:
    return sm.Profile(forward_ms=10.0, backward_ms=20.0, update_ms=2.0, batch_size=32,
                      buckets=(sm.BucketTiming(4_000_000, 5.0), sm.BucketTiming(8_000_000, 8.0),
                               sm.BucketTiming(2_000_000, 25.0)))


def test_ring_and_tree_formulas():
    # ring, n=4, S=1e8 B, alpha=5 us, B=10 GB/s: 2*3*5 us = 0.03 ms; 2*3/4 * 1e8/1e10 s = 15 ms
    r = sm.ring_allreduce(1e8, 4, 5.0, 10.0)
    assert (r.latency_ms, r.transfer_ms) == pytest.approx((0.03, 15.0))
    # tree, n=5: 2*ceil(log2 5)=6 hops * 5 us = 0.03 ms; 2 * 1e8/1e10 s = 20 ms
    t = sm.tree_allreduce(1e8, 5, 5.0, 10.0)
    assert (t.latency_ms, t.transfer_ms) == pytest.approx((0.03, 20.0))
    assert sm.ring_allreduce(1e8, 1, 5.0, 10.0).total_ms == 0.0


def test_allreduce_cost_one_node_and_two_nodes_by_hand():
    # one node, 4 GPUs: ring 0.03 + 15 = 15.03 ms; chain "tree" 2*3*5 us + 2*1e8/1e10 = 20.03 ms -> ring
    c = sm.allreduce_cost(1e8, TOY, 1)
    assert c.algorithm == "ring" and c.total_ms == pytest.approx(15.03)
    # 2 nodes x 4 = 8 ranks, bandwidth min(10, 2) = 2 GB/s:
    # ring: 2*7 = 14 hops, 2*2 = 4 cross nodes: 10*5 + 4*20 = 130 us; 2*7/8 * 1e8/2e9 = 87.5 ms
    assert sm.allreduce_cost(1e8, TOY, 2, "ring").total_ms == pytest.approx(0.13 + 87.5)
    # tree: 2*(3*5 + ceil(log2 2)*20) = 70 us; 2 * 1e8/2e9 = 100 ms
    assert sm.allreduce_cost(1e8, TOY, 2, "tree").total_ms == pytest.approx(0.07 + 100.0)
    # hierarchical: NVLink ring over 4 (0.03 + 15 ms) + per-rail ring of 1e8/4 over 2 nodes at 2/4 GB/s:
    # 2*1*20 us = 0.04 ms; 2*1/2 * 2.5e7/5e8 = 50 ms -> 65.07 ms, the best of the three
    best = sm.allreduce_cost(1e8, TOY, 2)
    assert best.algorithm == "hierarchical" and best.total_ms == pytest.approx(65.07)
    with pytest.raises(ValueError, match="algorithm 'nvls' does not apply to 2 node"):
        sm.allreduce_cost(1e8, TOY, 2, "nvls")
    with pytest.raises(ValueError, match="has no network entry"):
        sm.allreduce_cost(1e8, sm.Machine("box", 2, TOY.nvlink, None), 2)


def test_simulated_step_on_a_toy_profile():
    # comm 1 ms per MB, one channel, in order. Ready times clamp to backward (25 -> 20):
    #   bucket 0: start 5,             end 5 + 4 = 9
    #   bucket 1: start max(8, 9) = 9,  end 9 + 8 = 17
    #   bucket 2: start max(20, 17)=20, end 20 + 2 = 22
    # exposed = 22 - 20 = 2; step = 10 + 20 + 2 + 2 = 34; busy = 14; weak efficiency = 32/34
    p = _toy_profile()
    pred = sm.simulate_step(p, lambda nbytes: nbytes / 1e6)
    assert (pred.comm_end_ms, pred.exposed_ms, pred.step_ms, pred.comm_busy_ms) == pytest.approx((22, 2, 34, 14))
    assert sm.weak_efficiency(p, pred) == pytest.approx(32 / 34)
    # strong: one solver at G = 4 x 32 computes 4*(10+20) + 2 = 122 ms; 4 solvers at 34 ms -> 122 / (4*34)
    assert sm.strong_efficiency(sm.scale_compute(p, 4), pred, 4) == pytest.approx(122 / 136)


def test_simulated_step_with_the_toy_machine():
    # 2 nodes, hierarchical is the best algorithm for every bucket here:
    #   hier(S) = latency 0.03 + 0.04 ms + S * (2*3/4 / 1e10 + 2*1/2 * 1/4 / 5e8) s = 0.07 ms + 0.65 ms per 1e6 B
    #   (ring for 4e6 B: 0.13 + 3.5 = 3.63 ms; tree: 0.07 + 4 = 4.07 ms; hier: 2.67 ms)
    #   bucket 0 (4e6 B): 2.67 ms, 5 -> 7.67; bucket 1 (8e6 B): 5.27 ms, 8 -> 13.27;
    #   bucket 2 (2e6 B): 1.37 ms, 20 -> 21.37; exposed 1.37; step 32 + 1.37 = 33.37
    pred = sm.simulate_step(_toy_profile(), sm.comm_fn(TOY, 2))
    assert pred.exposed_ms == pytest.approx(1.37) and pred.step_ms == pytest.approx(33.37)


def test_rebucket_parameters_follows_dptrain_rule():
    # params (MiB, ready ms): (0.5, 1) (0.75, 2) (1, 3) (2, 5); first cap 1 MiB, then 2 MiB:
    # 0.5+0.75 > 1 -> close [0.5 @1]; 0.75+1 = 1.75 <= 2, +2 > 2 -> close [1.75 @3]; [2 @5]
    mib = [(0.5, 1.0), (0.75, 2.0), (1.0, 3.0), (2.0, 5.0)]
    p = sm.Profile(1.0, 6.0, 1.0, tuple(sm.BucketTiming(int(m * MIB), t) for m, t in mib), granularity="parameter")
    q = sm.rebucket(p, 2.0, 1.0)
    assert [(b.nbytes / MIB, b.ready_ms) for b in q.buckets] == [(0.5, 1.0), (1.75, 3.0), (2.0, 5.0)]
    assert q.granularity == "bucket" and q.total_bytes == p.total_bytes


def test_rebucket_buckets_interpolates_ready_times():
    # ready curve knots (MiB, ms): (0,0) (4,4) (8,12); 2 MiB cuts end at 2, 4, 6, 8 MiB ->
    # 2 ms, 4 ms, 4 + (6-4)/4 * (12-4) = 8 ms, 12 ms
    p = sm.Profile(1.0, 12.0, 1.0, (sm.BucketTiming(4 * MIB, 4.0), sm.BucketTiming(4 * MIB, 12.0)))
    q = sm.rebucket(p, 2.0)
    assert [(b.nbytes / MIB, b.ready_ms) for b in q.buckets] == [(2, 2.0), (2, 4.0), (2, 8.0), (2, 12.0)]
    with pytest.raises(ValueError, match="bucket sizes must be > 0"):
        sm.rebucket(p, 0.0)


def test_bucket_sweep_ranks_least_exposed_first():
    # backward 20 ms; 10 MiB ready at 10 ms, 10 MiB at 20 ms; comm = 2 ms + 1 ms per MiB, one channel.
    #   cap 20: one bucket ready at 20, 22 ms -> exposed 22
    #   cap 10: 10 -> 22; start max(20, 22) -> 34: exposed 14
    #   cap 5: ready 5, 10, 15, 20 (linear), 7 ms each: 12, 19, 26, 33: exposed 13
    #   cap 1: ready 1..20, 3 ms each, back to back from 1: ends 1 + 3k -> 61: exposed 41
    p = sm.Profile(10.0, 20.0, 2.0, (sm.BucketTiming(10 * MIB, 10.0), sm.BucketTiming(10 * MIB, 20.0)))
    sweep = sm.sweep_bucket_sizes(p, lambda nbytes: 2.0 + nbytes / MIB, [1, 5, 10, 20])
    assert [(cap, count) for cap, count, _ in sweep] == [(5, 4), (10, 2), (20, 1), (1, 20)]
    assert [pred.exposed_ms for _, _, pred in sweep] == pytest.approx([13, 14, 22, 41])
    # contention 1 at overlap rate 1: each overlapped ms costs backward a ms, so the order is the total
    # allreduce time's: 20 (22 ms), 10 (24), 5 (28: exposed 13 + overlapped 7 + 7 + 1), 1 (60)
    sweep = sm.sweep_bucket_sizes(p, lambda nbytes: 2.0 + nbytes / MIB, [1, 5, 10, 20], t=sm.Terms(contention=1.0))
    assert [cap for cap, _, _ in sweep] == [20, 10, 5, 1]
    assert [sm.comm_step_ms(pred) for _, _, pred in sweep] == pytest.approx([22, 24, 28, 60])


def test_profile_from_the_fixture_trace():
    # two steps: forward 3 and 5 ms, backward 6 and 8 ms, update 0.5 and 1.5 ms (medians 4, 7, 1);
    # bucket 0 ready 1 ms after backward start in both; bucket 1 at 4 and 6 ms (median 5);
    # bucket 2 has no bucket_ready instant, so it is ready when backward ends (7 ms)
    p = sm.load_profile(FIXTURES / "scaling_trace.rank0.json", batch_size=16)
    assert (p.forward_ms, p.backward_ms, p.update_ms, p.batch_size) == pytest.approx((4.0, 7.0, 1.0, 16))
    assert [(b.nbytes, b.ready_ms) for b in p.buckets] == [(1000, 1.0), (4000, 5.0), (2000, 7.0)]
    assert p.granularity == "bucket"


def test_profile_from_trace_errors_name_the_fix():
    with pytest.raises(ValueError, match="no 'forward' events"):
        sm.profile_from_trace({"traceEvents": []})
    no_buckets = {"traceEvents": [{"ph": "X", "name": n, "ts": t, "dur": 1.0, "pid": 0, "tid": "compute", "args": {}}
                                for n, t in (("forward", 0.0), ("backward", 2.0), ("update", 4.0))]}
    with pytest.raises(ValueError, match="no .bucket_ready. or .allreduce. events; record it with"):
        sm.profile_from_trace(no_buckets)


def test_profile_json_round_trip_and_missing_key():
    p = sm.reference_profile("dgx-h100")
    assert sm.profile_from_json(json.loads(json.dumps(sm.profile_to_json(p)))) == p
    with pytest.raises(ValueError, match="lacks key 'buckets'"):
        sm.profile_from_json({"forward_ms": 1, "backward_ms": 1, "update_ms": 1})


def test_reference_resnet50_profile():
    # torchvision ResNet-50 has 25,557,032 parameters; FP16 gradients are 2 bytes each
    assert sum(n for _, n, _ in sm.resnet50_params()) == 25_557_032
    p = sm.reference_profile("dgx-h100")
    assert p.total_bytes == 2 * 25_557_032
    # step = 256 / 7050 s; update = 25,557,032 * 20 B / 3.35e12 B/s; fwd:bwd = 1:2 of the rest
    update_ms = 25_557_032 * 20 / 3.35e12 * 1e3
    assert p.update_ms == pytest.approx(update_ms)
    assert p.compute_ms == pytest.approx(256 / 7050 * 1e3) and p.backward_ms == pytest.approx(2 * p.forward_ms)
    ready = [b.ready_ms for b in p.buckets]
    assert ready == sorted(ready) and ready[-1] == pytest.approx(p.backward_ms)  # conv1 is last


@pytest.mark.parametrize("n", [2, 4])
def test_alpha_beta_fit_recovers_known_values(n):
    alpha_us, busbw_gbs = 50.0, 2.0
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7, 1e8]
    times = [sm.ring_allreduce(s, n, alpha_us, busbw_gbs).total_ms / 1e3 for s in sizes]
    a, b = sm.fit_alpha_beta(sizes, times, n)
    assert a == pytest.approx(alpha_us, rel=1e-6) and b == pytest.approx(busbw_gbs, rel=1e-6)
    a, b = sm.fit_alpha_beta(sizes, times, n, relative=False)
    assert b == pytest.approx(busbw_gbs, rel=1e-6)


def test_alpha_beta_fit_errors():
    with pytest.raises(ValueError, match="at least 2 distinct message sizes"):
        sm.fit_alpha_beta([1e6, 1e6], [1e-3, 1e-3], 2)
    with pytest.raises(ValueError, match="do not grow with size"):
        sm.fit_alpha_beta([1e3, 1e6], [2e-3, 1e-3], 2)
    with pytest.raises(ValueError, match=">= 2 ranks"):
        sm.fit_alpha_beta([1e3, 1e6], [1e-3, 2e-3], 1)


def test_main_writes_a_report_with_predictions_and_breakdown(tmp_path, capsys):
    assert sm.main(["--nodes", "1,64", "--out", str(tmp_path), "--write-profile", str(tmp_path / "p.json")]) == 0
    text = next(tmp_path.glob("scaling_model_*.md")).read_text()
    assert "DGX H100" in text and "| 64 | 512 |" in text and "Strong scaling at global batch 8192" in text
    assert sm.profile_from_json(json.loads((tmp_path / "p.json").read_text())).granularity == "parameter"
    assert sm.main(["--machines", "dgx-x"]) == 2
    assert "unknown ['dgx-x']" in capsys.readouterr().err


def test_gloo_calibration_measures_two_processes():
    from benchmarks.scaling.collective_bench import measure_allreduce

    points = measure_allreduce([4096, 65536], world_size=2, iters=3, warmup=1)
    assert [s for s, _ in points] == [4096, 65536]
    assert all(0 < t < 5 and math.isfinite(t) for _, t in points)
    with pytest.raises(ValueError, match="world_size >= 2"):
        measure_allreduce([4096], world_size=1)


# ---------------------------------------------------------------- profiles, terms, validation (issue 21)

def test_machine_profiles_are_data_files_and_a_bad_one_is_named(tmp_path):
    assert {"dgx-h100", "dgx-a100", "dgx-1-v100", "dgx-2-v100"} <= set(sm.MACHINES)
    h100 = sm.MACHINES["dgx-h100"]
    assert (h100.gpus_per_node, h100.nvlink.busbw_gbs, h100.hbm_gbs) == (8, 370.0, 3350.0)
    assert dict(h100.sources)["contention_source"].startswith("Assumed")
    bad = tmp_path / "box.toml"
    bad.write_text('name = "box"\ngpus_per_node = 2\n')
    with pytest.raises(ValueError, match=r"box.toml: not a machine profile .*start from machines/dgx-h100.toml"):
        sm.load_machine(bad)


def test_terms_by_hand():
    # toy profile (compute 32 ms, backward 20 ms), comm 1 ms per MB: exposed 2, overlapped 4 + 8 + 0 = 12 ms.
    # contention 0.5 -> 6 ms; jitter 0.01 * 32 * E[max of 2] (0.5642) = 0.1805 ms; step 32 + 6 + 2 + 0.1805
    p = _toy_profile()
    t = sm.Terms(contention=0.5, jitter_cv=0.01, world_size=2, gpus_per_node=2)
    pred = sm.simulate_step(p, lambda nbytes: nbytes / 1e6, t)
    assert (pred.contention_ms, pred.exposed_ms) == pytest.approx((6.0, 2.0))
    assert pred.jitter_ms == pytest.approx(0.32 / math.sqrt(math.pi), rel=1e-3)
    assert pred.step_ms == pytest.approx(40.0 + 0.32 / math.sqrt(math.pi), rel=1e-4)
    # input ceiling 1000 img/s per node: 2 solvers x 32 images = 64 ms per step binds; one solver: 32 ms
    t = sm.Terms(input_images_per_s_per_node=1000.0, world_size=2, gpus_per_node=2)
    pred = sm.simulate_step(p, lambda nbytes: nbytes / 1e6, t)
    assert (pred.input_ms, pred.step_ms) == pytest.approx((64.0, 64.0))
    assert sm.weak_efficiency(p, pred, t) == pytest.approx(32 / 64)


def test_auto_plan_is_never_worse_than_a_fixed_cap():
    p = sm.reference_profile("dgx-a100")
    for nodes in (1, 64):
        comm = sm.comm_fn(sm.MACHINES["dgx-a100"], nodes)
        auto = sm.simulate_step(sm.auto_plan(p, comm), comm)
        best_cap = sm.sweep_bucket_sizes(p, comm, [1, 2, 5, 10, 25, 50, 100], 1.0)[0][2]
        assert auto.comm_end_ms <= best_cap.comm_end_ms + 1e-9
        t = sm.Terms(contention=sm.MACHINES["dgx-a100"].contention)  # with contention: on the same objective
        auto = sm.simulate_step(sm.auto_plan(p, comm, t), comm, t)
        best_cap = sm.sweep_bucket_sizes(p, comm, [1, 2, 5, 10, 25, 50, 100], 1.0, t)[0][2]
        assert sm.comm_step_ms(auto) <= sm.comm_step_ms(best_cap) + 1e-9


def test_validation_fits_nothing_on_a_check_row_and_states_every_error(capsys):
    from benchmarks.scaling import scaling_validate as sv

    rows = sv.load_rows(*sorted((sm.PROFILES / "published").glob("*.toml")))
    wl = sm.load_workload()
    f = sv.fit(rows, wl)
    assert f.jitter_cv == pytest.approx(wl.jitter_cv)  # the workload file holds the fitted values
    for key, fixed in f.fixed.items():
        assert fixed == pytest.approx(wl.machines[key]["step_fixed_ms"], abs=0.005)
    assert set(f.leave_one_out) == {r.label for r in rows if r.role == "fit" and not r.strong}
    # a check row moves nothing: change every check row's result, and the fit is the same
    moved = [replace(r, images_per_s_n=r.images_per_s_n * 0.5) if r.role == "check" else r for r in rows]
    assert sv.fit(moved, wl) == f
    checks = [r for r in rows if r.role == "check"]
    assert len(checks) == 25 and sum(r.strong for r in checks) >= 5
    assert any(r.strong and r.gpus >= 64 and r.gpus_1 >= 8 for r in checks)  # multi-node, fixed global batch
    errors = {r.label: (sv.prediction(r, wl, f) - r.efficiency) * 100 for r in checks}
    # the H100 strong-scaling checks, predicted with the fixed cost fitted on the v3.0 pair, hold the goal
    for r in checks:
        if r.machine == "dgx-h100":
            assert abs(errors[r.label]) <= sv.GOAL_PP, r.label
    text = sv.report(rows, wl, [sm.PROFILES / "published" / "resnet50_mlperf.toml"])
    assert "NOT met on 8" in text and "Check rows: 25" in text
    a100_amp = next(r for r in rows if r.label == "DGX A100 80GB, AMP")
    assert a100_amp.efficiency == pytest.approx(16621 / (8 * 2470))
    assert a100_amp.input_modelled and not next(r for r in rows if r.pipeline == "mxnet-dali-gpu").input_modelled
    assert sv.predict(a100_amp, wl, plain=True) > 0.99  # the overlap model alone misses by 16 points


def test_a_row_s_efficiency_is_per_gpu_against_its_base_run():
    from benchmarks.scaling import scaling_validate as sv

    r = sv.Row(label="x", machine="dgx-h100", gpus=64, batch_size=50, images_per_s_1=56076.0,
               images_per_s_n=294792.0, role="check", source="s", gpus_1=8, batch_size_1=400)
    assert r.strong and r.base_batch == 400
    assert r.efficiency == pytest.approx((294792 / 64) / (56076 / 8))
    cost = sv.batch_cost(r, 3.0)
    assert cost.ms(400) == pytest.approx(400 / (56076 / 8) * 1e3) and cost.fixed_ms == 3.0
    # a larger fixed cost can only lower the prediction of a row whose batch falls
    wl = sm.load_workload()
    assert sv.predict(r, wl, {"dgx-h100": 6.0}) < sv.predict(r, wl, {"dgx-h100": 3.0}) < sv.predict(r, wl, {})


def test_bad_workload_and_rows_are_named(tmp_path):
    from benchmarks.scaling import scaling_validate as sv

    wl = tmp_path / "w.toml"
    wl.write_text('model = "resnet50"\n')
    with pytest.raises(ValueError, match=r"w.toml: workload profile lacks 'update_bytes_per_param'"):
        sm.load_workload(wl)
    rows = tmp_path / "rows.toml"
    rows.write_text('[[rows]]\nlabel = "x"\nmachine = "dgx-x"\ngpus = 8\nbatch_size = 1\nimages_per_s_1 = 1.0\n'
                    'images_per_s_n = 8.0\nrole = "fit-input"\nsource = "s"\n')
    with pytest.raises(ValueError, match=r"rows \['x'\] need role fit\|check, a machine in"):
        sv.load_rows(rows)
    good = sm.PROFILES / "workloads" / "resnet50.toml"
    wl.write_text(good.read_text().replace('input = "dptrain"', "input_images_per_s_per_node = 16621.0", 1))
    with pytest.raises(ValueError, match=r"input_images_per_s_per_node is no longer read .*input = "):
        sm.load_workload(wl)
    wl.write_text(good.read_text().replace('input = "dptrain"', 'input = "dali"', 1))
    with pytest.raises(ValueError, match=r"input = 'dali' is not in .*inputs.toml"):
        sm.load_workload(wl)
    paths = tmp_path / "inputs.toml"
    paths.write_text('[paths.x]\ncpu_ms_per_image = 1.0\n')
    with pytest.raises(ValueError, match=r"inputs.toml: not an input-paths file .*needs a source"):
        sm.load_inputs(paths)


# ---------------------------------------------------------------- input ceilings (issue 36)

def test_input_rates_are_stated_or_derived_from_cpu_time_never_fitted():
    stated = sm.InputPath("a", images_per_s_per_node=5000.0, cpu_ms_per_image=2.0, source="s")
    assert sm.input_rates(stated, 128) == (5000.0, 0.0)  # a stated node rate wins over the CPU time
    measured = sm.InputPath("b", cpu_ms_per_image=2.0, process_images_per_s=3000.0, source="s")
    assert sm.input_rates(measured, 100) == (50000.0, 3000.0)  # 100 cores x 1000 / 2 ms
    assert sm.input_rates(measured, 0) == (0.0, 3000.0)  # cores unknown: only the process ceiling
    assert sm.input_rates(None, 100) == (0.0, 0.0)
    assert not sm.InputPath("c", source="s").stated and measured.stated
    assert set(sm.INPUTS) >= {"dptrain", "pytorch-dataloader", "mxnet-dali-gpu"}
    assert all(m.cpu_cores > 0 for m in sm.MACHINES.values())


def test_the_input_time_takes_the_tighter_of_the_node_and_the_process_ceiling():
    t = sm.Terms(input_images_per_s_per_node=8000.0, input_images_per_s_per_process=500.0)
    assert sm.input_ms(100, 8, t) == pytest.approx(200.0)  # process: 100 / 500 s; node: 800 / 8000 s = 100 ms
    assert sm.input_ms(100, 8, replace(t, input_images_per_s_per_process=0.0)) == pytest.approx(100.0)
    assert sm.input_ms(100, 8, sm.Terms()) == 0.0
    p = _toy_profile()  # compute 32 ms at batch 32: a process ceiling of 500 img/s (64 ms) binds from one GPU on
    t = sm.Terms(input_images_per_s_per_process=500.0, world_size=2, gpus_per_node=2)
    assert sm.one_solver_ms(p, t) == pytest.approx(64.0)
    assert sm.simulate_step(p, lambda nbytes: 0.0, t).step_ms == pytest.approx(64.0)


def test_a_data_bench_line_measured_on_the_node_becomes_its_input_path(tmp_path, capsys):
    line = tmp_path / "data.jsonl"
    line.write_text("starting\n" + json.dumps({"images_per_s": 900.0, "cpu_ms_per_image": 40.0, "host_cores": 16}) + "\n")
    path = sm.input_path_from_data_bench(line)
    assert (path.cpu_ms_per_image, path.process_images_per_s) == (40.0, 900.0)
    assert sm.input_rates(path, 112) == (2800.0, 900.0)  # 112 cores x 1000 / 40 ms binds under 8 x 900
    # so slow a pipeline binds on DGX H100: one solver waits on its process (256 / 900 s), eight on the
    # node (8 x 256 / 2800 s), and the real-data column is their ratio
    assert sm.main(["--machines", "dgx-h100", "--nodes", "1", "--input-bench", str(line)]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| 1 | 8 |"))
    synthetic, fed = (float(c) for c in row.split("|")[9:11])
    assert fed == pytest.approx((256 / 900) / (8 * 256 / 2800), abs=0.001) and synthetic > 0.9
    (tmp_path / "empty.jsonl").write_text("{}\n")
    assert sm.main(["--input-bench", str(tmp_path / "empty.jsonl")]) == 2
    assert "no `dptrain data-bench` JSON line" in capsys.readouterr().err


def test_the_workload_prices_dptrain_s_input_path_with_the_machine_s_cores():
    wl = sm.load_workload()
    t = wl.terms("dgx-h100", 1)
    path = sm.INPUTS["dptrain"]
    assert t.input_images_per_s_per_node == pytest.approx(112 * 1e3 / path.cpu_ms_per_image)
    assert t.input_images_per_s_per_process == path.process_images_per_s
    assert wl.terms("dgx-h100", 1, synthetic=True).input_images_per_s_per_node == 0.0
    cost = wl.batch_cost("dgx-h100")
    assert cost.fixed_ms == wl.machines["dgx-h100"]["step_fixed_ms"]
    assert cost.ms(256) == pytest.approx(256 / wl.machines["dgx-h100"]["images_per_s"] * 1e3)
    assert wl.batch_cost("dgx-1-v100") is None  # no fit row: linear in the batch


# ---------------------------------------------------------------- calibration statistics (scaling_calibrate)

def _waits_trace(path: Path, waits_ms: list[float]) -> None:
    """A trace with one ``exposed_comm`` span per step (what least_waits reads), in time order."""
    events = [{"ph": "X", "name": "exposed_comm", "ts": 1e6 * i, "dur": w * 1e3, "pid": 0, "tid": "compute"}
              for i, w in enumerate(waits_ms)]
    events.append({"ph": "X", "name": "backward", "ts": 5.0, "dur": 3.0, "pid": 0, "tid": "compute"})  # ignored
    path.write_text(json.dumps({"traceEvents": events[::-1]}))  # out of order on purpose


def test_least_waits_line_up_the_ranks_step_by_step(tmp_path):
    from benchmarks.scaling import scaling_calibrate as sc

    # rank 0 waits 5, 2, 9 ms; rank 1 waits 3, 4, 1: the rank that ended backward last waits least
    _waits_trace(tmp_path / "t.rank0.json", [5.0, 2.0, 9.0])
    _waits_trace(tmp_path / "t.rank1.json", [3.0, 4.0, 1.0])
    least, skew = sc.least_waits(tmp_path, "t.rank0.json", 2)
    assert least == pytest.approx([3.0, 2.0, 1.0])
    assert skew == pytest.approx([2.0, 0.0, 8.0])  # rank 0's wait beyond the least
    assert sc.least_waits(tmp_path, "t.rank0.json", 1) == (pytest.approx([5.0, 2.0, 9.0]), [0.0, 0.0, 0.0])
    _waits_trace(tmp_path / "t.rank1.json", [3.0, 4.0])
    with pytest.raises(ValueError, match=r"t.rank0.json: the ranks' traces hold \[3, 2\] phase-timed steps"):
        sc.least_waits(tmp_path, "t.rank0.json", 2)
    with pytest.raises(ValueError, match=r"t.rank2.json is missing: .* rerun it with --run"):
        sc.least_waits(tmp_path, "t.rank0.json", 3)


def test_repeat_bootstrap_resamples_whole_runs():
    from benchmarks.scaling import scaling_calibrate as sc

    assert sc.repeat_bootstrap([[2.0, 2.0]] * 3) == (2.0, 2.0)  # no spread: a point
    assert all(math.isnan(x) for x in sc.repeat_bootstrap([[2.0, 2.0], [3.0, 3.0]]))  # two runs: no interval
    # 4 runs at 1 ms, one at 10 ms: resampled runs give pooled medians of 1 or 10 (never between: each
    # draw's median is one run's value), so the 90 % interval is [1, 10] and stays so with the seed
    runs = [[1.0] * 5] * 4 + [[10.0] * 5]
    lo, hi = sc.repeat_bootstrap(runs)
    assert (lo, hi) == (1.0, 10.0) == sc.repeat_bootstrap(runs)
    # one run in ten off: a draw with 6 of its 10 runs the slow one is too rare to reach the interval
    assert sc.repeat_bootstrap([[1.0] * 5] * 9 + [[10.0] * 5]) == (1.0, 1.0)
    # the pooled mean (the report's statistic) moves with every slow run drawn: k of 5 draws slow gives
    # 1 + 9k/5; k ~ Binomial(5, 0.2) has P(k <= 2) = 0.942 < 0.95, so the interval's top is k = 3
    lo, hi = sc.repeat_bootstrap(runs, stat=np.mean)
    assert lo == pytest.approx(1.0) and hi == pytest.approx(6.4)


# ---------------------------------------------------------------------------- step time in the batch

def test_a_fit_of_step_time_in_the_batch_recovers_the_fixed_part():
    # step(b) = 12 ms + b * 0.5 ms, measured exactly at 4 batches
    cost = sm.fit_batch_cost([(b, 12.0 + 0.5 * b) for b in (8, 16, 32, 64)], "toy")
    assert (cost.fixed_ms, cost.per_image_ms) == pytest.approx((12.0, 0.5))
    assert cost.ms(128) == pytest.approx(76.0) and cost.max_error == pytest.approx(0.0, abs=1e-12)
    # noise below a step that is all per-image work: no negative fixed part, a line through 0
    noisy = sm.fit_batch_cost([(8, 3.9), (16, 8.1), (32, 16.2)])
    assert noisy.fixed_ms == 0.0 and noisy.per_image_ms == pytest.approx((8 * 3.9 + 16 * 8.1 + 32 * 16.2) / 1344)
    with pytest.raises(ValueError, match=r"3 or more batch sizes, got \[8, 16\]"):
        sm.fit_batch_cost([(8, 1.0), (16, 2.0), (16, 2.1)])
    with pytest.raises(ValueError, match="does not grow with the batch"):
        sm.fit_batch_cost([(8, 5.0), (16, 5.0), (32, 4.0)])


def test_at_a_falling_batch_the_fixed_part_stays():
    p = _toy_profile()  # batch 32: forward 10 + backward 20 ms, update 2 ms
    cost = sm.BatchCost(fixed_ms=16.0, per_image_ms=0.5)  # the whole step: 32 ms at batch 32 (as p), 20 at 8
    q = sm.scale_to_batch(p, 8, cost)  # forward + backward: (20 - 2) / (32 - 2) = 0.6 of 30 ms
    assert (q.forward_ms, q.backward_ms, q.update_ms, q.batch_size) == pytest.approx((6.0, 12.0, 2.0, 8))
    assert q.compute_ms == pytest.approx(cost.ms(8))  # the update is counted once
    assert [b.ready_ms for b in q.buckets] == pytest.approx([5.0 * 0.6, 8.0 * 0.6, 25.0 * 0.6])
    linear = sm.scale_to_batch(p, 8)
    assert (linear.forward_ms, linear.backward_ms) == pytest.approx((2.5, 5.0))  # a quarter of the work
    assert sm.scale_to_batch(p, 32, cost) == p
    with pytest.raises(ValueError, match="not longer than the profile's update"):
        sm.scale_to_batch(p, 8, sm.BatchCost(fixed_ms=0.0, per_image_ms=0.05))


ONE = sm.Machine("one", 1, nvlink=sm.Link(10.0, 5.0, "test"), network=sm.Link(2.0, 20.0, "test"))


@pytest.mark.parametrize("cost", [None, sm.BatchCost(16.0, 0.5)], ids=["linear", "fixed+per_image"])
def test_strong_and_weak_scaling_agree_on_one_gpu(cost):
    p = _toy_profile()
    weak = sm.weak_rows(p, ONE, [1], "best")[0]
    strong = sm.strong_rows(p, ONE, [1], p.batch_size, "best", cost=cost)[0]
    assert strong["pred"].step_ms == pytest.approx(weak["pred"].step_ms)
    assert strong["eff"] == pytest.approx(1.0) and weak["eff"] == pytest.approx(1.0)


def test_a_fixed_part_lowers_strong_scaling_below_the_linear_model():
    p = _toy_profile()
    linear = {r["nodes"]: r["eff"] for r in sm.strong_rows(p, TOY, [1, 2, 4], 256, "best")}
    fixed = {r["nodes"]: r["eff"] for r in sm.strong_rows(p, TOY, [1, 2, 4], 256, "best",
                                                          cost=sm.BatchCost(16.0, 0.5))}  # p's 32 ms at 32
    assert all(fixed[n] < linear[n] for n in (1, 2, 4))
    assert fixed[4] < fixed[2] < fixed[1]
    # by hand at 4 nodes of 4 GPUs, batch 16/GPU: one solver at 256 takes 16 + 128 = 144 ms; a step at
    # 16/GPU at least 16 + 8 = 24 ms, so the fixed part alone caps the efficiency at 144 / (16 x 24) = 0.375
    # (the linear model: 0.67, communication alone)
    assert fixed[4] <= 144 / (16 * 24) + 1e-9 and linear[4] > 0.6


def test_batch_points_read_one_solver_bench_lines(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_text("\n".join(json.dumps({"batch_size": b, "step_ms_median": 10.0 + b, "world_size": 1})
                           for b in (8, 16, 32)) + "\nnot json\n")
    assert sm.batch_points(f) == [(8, 18.0), (16, 26.0), (32, 42.0)]
    f.write_text(json.dumps({"batch_size": 8, "step_ms_median": 1.0, "world_size": 2}))
    with pytest.raises(ValueError, match="one-solver bench lines; one has world_size 2"):
        sm.batch_points(f)
    f.write_text("\n".join(json.dumps({"batch_size": 8, "step_ms_median": 1.0, "model": m}) for m in ("a", "b")))
    with pytest.raises(ValueError, match="mix models, precisions or devices"):
        sm.batch_points(f)
