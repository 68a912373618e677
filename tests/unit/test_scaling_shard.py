"""benchmarks/scaling/ with ``reducer.shard = "optimizer"``: reduce-scatter and all-gather costs, the sharded
step (exposed reduce-scatter, gathers against the next forward, the update on 1/N), the padding, the memory
per GPU, the ViT-L/16 workload and the command's sharded section and JSON.

Expected values are worked out by hand in the comments, on toy profiles whose buckets divide by N x 64
elements (no padding) unless the padding is what is tested.
"""
from __future__ import annotations

import json

import pytest

import benchmarks.scaling as sm
from benchmarks.scaling.allreduce import ring_scatter_gather, scatter_gather_cost, wire_bytes
from benchmarks.scaling.memory import ALIGN_ELEMS, memory_per_gpu, padded_numel
from benchmarks.scaling.shard import compare_rows, forward_need_ms, simulate_gathers, simulate_sharded_step
from benchmarks.scaling.workload import load_workload, vit_l16_params

# The toy machine of test_scaling_model.py: 4 GPUs per node; NVLink 10 GB/s busbw, 5 us per hop; network
# 2 GB/s per node, 20 us per hop; no launch cost, no NVLS.
TOY = sm.Machine("toy", 4, nvlink=sm.Link(10.0, 5.0, "test"), network=sm.Link(2.0, 20.0, "test"))


def _toy_profile() -> sm.Profile:
    # 2 B gradients: 2,048,000, 4,096,000 and 1,024,000 elements, multiples of N x 64 for N up to 16
    # (1,024,000 = 16 x 64 x 1000): no padding at those counts
    return sm.Profile(forward_ms=10.0, backward_ms=20.0, update_ms=2.0, batch_size=32,
                      buckets=(sm.BucketTiming(4_096_000, 5.0), sm.BucketTiming(8_192_000, 8.0),
                               sm.BucketTiming(2_048_000, 25.0)))


@pytest.mark.parametrize("n", [2, 3, 8, 512])
def test_reduce_scatter_plus_all_gather_put_an_allreduce_on_the_wire(n):
    s = 1e8
    rs, ag, ar = wire_bytes("reduce_scatter", s, n), wire_bytes("all_gather", s, n), wire_bytes("allreduce", s, n)
    assert rs == ag == pytest.approx((n - 1) / n * s)
    assert rs + ag == pytest.approx(ar) and ar == pytest.approx(2 * (n - 1) / n * s)
    assert wire_bytes("allreduce", s, 1) == 0.0
    # the ring's time too: a reduce-scatter is half a ring allreduce at the same bus bandwidth, latency included
    half, whole = ring_scatter_gather(s, n, 5.0, 10.0), sm.ring_allreduce(s, n, 5.0, 10.0)
    assert (2 * half.latency_ms, 2 * half.transfer_ms) == pytest.approx((whole.latency_ms, whole.transfer_ms))


def test_scatter_gather_cost_by_hand():
    # one node of 4: ring 3 hops x 5 us = 0.015 ms; 3/4 x 1e8 B / 1e10 B/s = 7.5 ms
    c = scatter_gather_cost(1e8, TOY, 1)
    assert c.algorithm == "ring" and c.total_ms == pytest.approx(7.515)
    # 2 nodes x 4 = 8 ranks: 7 steps, nodes - 1 = 1 over the network: 6 x 5 + 20 = 50 us;
    # 7/8 x 1e8 / min(10, 2) GB/s = 43.75 ms. NCCL has no tree reduce-scatter: "tree" leaves the ring
    assert scatter_gather_cost(1e8, TOY, 2).total_ms == pytest.approx(0.05 + 43.75)
    assert scatter_gather_cost(1e8, TOY, 2, "tree").algorithm == "ring"
    # with NVLS on the node (20 GB/s, 10 us once): 0.01 + 3/4 x 1e8 / 2e10 = 3.76 ms, faster than the ring
    nvls = sm.Machine("toy-nvls", 4, TOY.nvlink, TOY.network, nvls=sm.Link(20.0, 10.0, "test"))
    assert scatter_gather_cost(1e8, nvls, 1).algorithm == "nvls"
    assert scatter_gather_cost(1e8, nvls, 1).total_ms == pytest.approx(3.76)
    assert scatter_gather_cost(1e8, nvls, 1, "ring").total_ms == pytest.approx(7.515)
    assert scatter_gather_cost(1e8, TOY, 1, gpus_per_node=1).total_ms == 0.0
    with pytest.raises(ValueError, match="has no network entry"):
        scatter_gather_cost(1e8, sm.Machine("box", 2, TOY.nvlink, None), 2)


def test_sharded_step_on_a_toy_profile_by_hand():
    # 4 solvers; reduce-scatter and all-gather 1 ms per MB; norm allreduce 0.3 ms
    #   reduce-scatters (ready 5, 8, 25 -> 20): 5 -> 9.096; 9.096 -> 17.288; 20 -> 22.048: exposed 2.048
    #   forward needs the buckets at 10 x (1 - ready/20) = 7.5, 6, 0 ms; gathered first layers first
    #   (bucket 2, 1, 0): ends 2.048, 10.24, 14.336; stalls 2.048, 4.24, 6.836: exposed 6.836
    #   update 2 / 4 = 0.5; step = 10 + 20 + 0.5 + 2.048 + 0.3 + 6.836 = 39.684
    p = _toy_profile()
    assert forward_need_ms(p) == pytest.approx([7.5, 6.0, 0.0])
    t = sm.Terms(world_size=4, gpus_per_node=4)
    s = simulate_sharded_step(p, lambda b: b / 1e6, t, norm_ms=0.3)
    assert (s.scatter_exposed_ms, s.gather_exposed_ms, s.update_ms) == pytest.approx((2.048, 6.836, 0.5))
    assert (s.scatter_busy_ms, s.gather_busy_ms, s.padding_bytes) == pytest.approx((14.336, 14.336, 0))
    assert s.exposed_ms == pytest.approx(2.048 + 0.3 + 6.836) and s.step_ms == pytest.approx(39.684)
    # gather_wait = "step": all 14.336 ms of gathers before forward
    assert simulate_sharded_step(p, lambda b: b / 1e6, t, norm_ms=0.3, gather_wait="step").step_ms == pytest.approx(
        30.5 + 2.048 + 0.3 + 14.336)
    # contention 0.5 on what overlaps: reduce-scatters 4.096 + 8.192 in backward (up to 20 ms; the third
    # starts at 20), gathers 14.336 - 6.836 = 7.5 in forward -> + 0.5 x 19.788
    s = simulate_sharded_step(p, lambda b: b / 1e6, sm.Terms(contention=0.5, world_size=4, gpus_per_node=4), norm_ms=0.3)
    assert s.contention_ms == pytest.approx(0.5 * (12.288 + 7.5)) and s.step_ms == pytest.approx(39.684 + s.contention_ms)
    with pytest.raises(ValueError, match="stats_exposed prices DDP's buffer broadcast"):
        simulate_sharded_step(p, lambda b: b / 1e6, sm.Terms(stats_exposed=True, stats_bytes=8, world_size=4))


def test_gathers_that_arrive_in_time_expose_nothing():
    # needed at 0, 5, 9 ms; 1 ms each in order: ends 1, 2, 3: only the first stalls forward, 1 ms
    assert simulate_gathers([0.0, 5.0, 9.0], [1.0, 1.0, 1.0]).exposed_ms == pytest.approx(1.0)
    # a later bucket that is late pushes the whole rest: ends 1, 7 against need 0, 2 -> 5 ms
    assert simulate_gathers([0.0, 2.0], [1.0, 6.0]).exposed_ms == pytest.approx(5.0)
    assert simulate_gathers([0.0, 2.0], [1.0, 6.0], "step").exposed_ms == pytest.approx(7.0)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_the_update_falls_by_n_and_one_solver_runs_no_collective(n):
    p = _toy_profile()
    s = simulate_sharded_step(p, lambda b: b / 1e6, sm.Terms(world_size=n, gpus_per_node=min(n, 4)), norm_ms=0.3)
    assert s.update_ms == pytest.approx(p.update_ms / n) and s.padding_bytes == 0
    if n == 1:  # no reduce-scatter, gather or norm: the one-solver step
        assert s.exposed_ms == 0.0 and s.step_ms == pytest.approx(p.compute_ms) == sm.one_solver_ms(p)


def test_padding_to_n_x_64_elements_is_priced_and_stated():
    # 1000 elements on 3 solvers: a multiple of 3 x 64 = 192 -> 1152; 152 spare elements = 304 B of 2 B grads
    assert ALIGN_ELEMS == 64 and padded_numel(1000, 3) == 1152 and padded_numel(1152, 3) == 1152
    p = sm.Profile(forward_ms=1.0, backward_ms=2.0, update_ms=1.0, buckets=(sm.BucketTiming(2000, 2.0),))
    seen: list[float] = []
    s = simulate_sharded_step(p, lambda b: seen.append(b) or 0.0, sm.Terms(world_size=3, gpus_per_node=3))
    assert s.padding_bytes == 304 and seen == [2304, 2304]  # the reduce-scatter and the gather move the padded bucket
    assert s.update_ms == pytest.approx(1.0 * 1152 / 1000 / 3)  # each solver updates 384 of the padded elements


def test_align_elems_is_dptrain_s():
    from dptrain.flat import ALIGN_ELEMS as DPTRAIN_ALIGN

    assert ALIGN_ELEMS == DPTRAIN_ALIGN


@pytest.mark.parametrize("optimizer, state_bytes", [("sgd", 4), ("adam", 8)])
def test_memory_per_gpu_falls_for_masters_and_state_only(optimizer, state_bytes):
    numel = [2**20, 2**21]  # divisible by N x 64 up to N = 2**14: no padding
    total = 3 * 2**20
    whole = memory_per_gpu(numel, 1, shard=False, optimizer=optimizer)
    assert (whole.weights, whole.grads, whole.masters, whole.state) == (2 * total, 2 * total, 4 * total,
                                                                        state_bytes * total)
    last = whole.total
    for n in (2, 4, 8, 16, 32, 64, 512):
        un, sh = (memory_per_gpu(numel, n, shard=s, optimizer=optimizer) for s in (False, True))
        assert un == whole  # unsharded: the same on every GPU at any count
        assert (sh.weights, sh.grads) == (whole.weights, whole.grads)  # 16-bit weights and grads stay whole
        assert (sh.masters, sh.state) == pytest.approx((whole.masters / n, whole.state / n))
        assert sh.total < last and sh.padding_elems == 0
        last = sh.total
    assert memory_per_gpu(numel, 8, shard=True, optimizer=optimizer).gb()["total"] == pytest.approx(
        (4 * total + (4 + state_bytes) * total / 8) / 1e9)


def test_memory_with_fp32_weights_padding_and_errors():
    # fp32: the weights are the masters (none extra), 4 B weights and grads whole; state sharded
    m = memory_per_gpu([1024], 4, shard=True, optimizer="adam", weight_bytes=4)
    assert (m.weights, m.grads, m.masters, m.state) == (4096, 4096, 0.0, 8 * 256)
    # a 1000-element bucket on 3 GPUs holds 1152 elements: 16-bit buffers whole, masters and state 384 each
    m = memory_per_gpu([1000], 3, shard=True, optimizer="sgd")
    assert (m.weights, m.masters, m.state, m.padding_elems) == (2304, 4 * 384, 4 * 384, 152)
    # the ViT-L: 304 M parameters hold 3.65 GB of masters and Adam state per GPU unsharded
    vit = memory_per_gpu([sum(n for _, n, _ in vit_l16_params())], 1, shard=False, optimizer="adam")
    assert (vit.masters + vit.state) / 1e9 == pytest.approx(3.652, abs=1e-3)
    with pytest.raises(ValueError, match=r"optimizer must be one of \['adam', 'sgd'\], got 'lion'"):
        memory_per_gpu([1024], 2, shard=True, optimizer="lion")
    with pytest.raises(ValueError, match="weight_bytes must be 2 .* or 4 .*, got 8"):
        memory_per_gpu([1024], 2, shard=True, optimizer="sgd", weight_bytes=8)


def test_vit_l16_layer_list_and_reference_profile():
    params = vit_l16_params()
    assert sum(n for _, n, _ in params) == 304_326_632  # timm vit_large_patch16_224: 304.33 M
    assert sum(m for _, _, m in params) / 1e9 == pytest.approx(61.6, abs=0.1)  # timm's model card: 61.6 GMACs
    assert sum(n for name, n, _ in params if name.startswith("blocks.7.")) == 12_596_224
    wl = load_workload(sm.PROFILES / "workloads" / "vit_l.toml")
    w = wl.machines["dgx-h100"]
    # the stated derivation: 6 x MACs per trained image at 28.9 % of 989.4 TFLOPS dense BF16
    assert 6 * sum(m for _, _, m in params) * w["images_per_s"] == pytest.approx(0.289 * 989.4e12, rel=5e-3)
    p = sm.reference_profile("dgx-h100", workload=wl)
    assert p.total_bytes == 2 * 304_326_632 and p.batch_size == 64
    assert p.update_ms == pytest.approx(304_326_632 * 28 / 3.35e12 * 1e3)  # AdamW: 28 B per parameter
    assert p.compute_ms == pytest.approx(64 / 774 * 1e3) and p.backward_ms == pytest.approx(2 * p.forward_ms)
    ready = [b.ready_ms for b in p.buckets]
    assert ready == sorted(ready) and ready[-1] == pytest.approx(p.backward_ms)  # the embeddings last
    # 25 MiB buckets (1 MiB first): a block is 24.0 MiB of bf16 gradients, so about one block per bucket
    q = sm.rebucket(p, 25.0, 1.0)
    assert len(q.buckets) == 26 and max(b.nbytes for b in q.buckets) <= 25 * sm.MIB


def test_reference_profile_errors_name_the_fix(tmp_path):
    wl = load_workload(sm.PROFILES / "workloads" / "vit_l.toml")
    with pytest.raises(ValueError, match=r"no \[machines.dgx-a100\] entry \(it has \['dgx-h100'\]\)"):
        sm.reference_profile("dgx-a100", workload=wl)
    other = sm.Workload("bert", 20, 0, 0.0, 0.0, {"dgx-h100": {}})
    with pytest.raises(ValueError, match=r"workload model 'bert' has no layer list; choose from \['resnet50', 'vit_l16'\]"):
        sm.reference_profile("dgx-h100", workload=other)


def test_rows_per_gpu_count_place_gpus_on_nodes_and_agree_at_one():
    p = _toy_profile()
    rows = compare_rows(p, TOY, [1, 2, 4, 8], "best", sm.plain_terms(TOY))
    assert [(r["gpus"], r["nodes"]) for r in rows] == [(1, 1), (2, 1), (4, 1), (8, 2)]
    one = rows[0]
    assert one["sharded"]["step_ms"] == one["unsharded"]["step_ms"] == pytest.approx(p.compute_ms)
    assert one["sharded"]["efficiency"] == one["unsharded"]["efficiency"] == 1.0
    for r in rows:
        assert r["sharded"]["update_ms"] == pytest.approx(p.update_ms / r["gpus"])
        assert r["unsharded"]["update_ms"] == p.update_ms
    with pytest.raises(ValueError, match="6 GPUs is not a whole number of toy's 4-GPU nodes"):
        compare_rows(p, TOY, [6], "best", sm.plain_terms(TOY))


def test_main_prices_sharded_runs_for_both_workloads_and_writes_json(tmp_path, capsys):
    out = tmp_path / "shard.json"
    assert sm.main(["--nodes", "1,2", "--workload", "resnet50,vit_l", "--shard", "optimizer", "--json", str(out),
                    "--out", str(tmp_path), "--sweep-mb", "25,100"]) == 0
    text = next(tmp_path.glob("scaling_model_*.md")).read_text()
    assert text.count("#### Sharded optimizer state") == 2 and "ViT-L/16" in text and "| 16 | 2 |" in text
    assert "Step ms at 16 GPUs by bucket cap" in text and "Adam, AdamW, LAMB" in text
    doc = json.loads(out.read_text())
    assert [s["model"] for s in doc["sections"]] == ["resnet50", "vit_l16"]
    vit = doc["sections"][1]["rows"]
    assert [r["gpus"] for r in vit] == [1, 2, 4, 8, 16]
    eight = vit[3]
    assert eight["sharded"]["update_ms"] == pytest.approx(eight["unsharded"]["update_ms"] / 8)
    assert eight["unsharded"]["memory"]["adam"]["total"] == pytest.approx(304_326_632 * 16 / 1e9)
    assert eight["sharded"]["memory"]["adam"]["total"] == pytest.approx(304_326_632 * (4 + 12 / 8) / 1e9, rel=1e-6)
    # the default prices no sharded run; a workload with no entry for a machine is skipped, not guessed
    capsys.readouterr()
    assert sm.main(["--nodes", "1", "--machines", "dgx-h100,dgx-a100", "--workload", "vit_l"]) == 0
    printed = capsys.readouterr().out
    assert "Sharded" not in printed and "Not modelled: the workload file of vit_l16 has no [machines.dgx-a100]" in printed
    assert sm.main(["--workload", "gpt3"]) == 2
    assert "--workload: no file" in capsys.readouterr().err
