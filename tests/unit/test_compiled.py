"""model.compile's pieces on one process (dptrain.train.compiled): the segments, the "auto" rule, and
the fallback to eager when the compiler fails. The compiled training itself: tests/distributed/test_compile.py."""
from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.inductor import cpu_compile_options
from dptrain.inductor import prepare as prepare_inductor
from dptrain.models import MODELS, build_model
from dptrain.topology import Topology
from dptrain.train import Trainer
from dptrain.train.compiled import (
    CPU_COMPILE_AUTO,
    CUDA_GRAPH_WARMUPS,
    MIN_SEGMENTS,
    CompiledModel,
    resolve_compile,
    segment_cap,
    segments,
)

MB = 2**20


@pytest.mark.parametrize("cap_mb, want", [
    (10, [""]),  # the whole model fits in a bucket: one segment
    (0.2, ["features", "classifier.1", "classifier.3"]),
    (0.05, ["features.0", "features.2", "classifier.1", "classifier.3"]),  # a layer bigger than the cap is one
])
def test_a_segment_is_the_largest_module_that_fits_a_bucket_and_pools_stay_eager(cap_mb, want):
    model = build_model("lenet", num_classes=10, width=8, in_channels=1)  # fp32: conv2 100 KB, fc1 2.5 MB
    assert [n for n, _ in segments(model, cap_mb * MB)] == want


def test_a_resnet_splits_at_its_blocks():
    model = build_model("resnet50", num_classes=1000, width=64, in_channels=3).half()  # 51 MB of fp16
    names = [n for n, _ in segments(model, 25 * MB)]
    assert names == ["stem", "layer1", "layer2", "layer3", "layer4.0", "layer4.1", "layer4.2", "fc"]


def test_one_solver_compiles_the_whole_model_and_several_split_even_a_model_smaller_than_a_bucket():
    model = build_model("resnet18_cifar", num_classes=10, width=32, in_channels=3).to(torch.bfloat16)  # 5.6 MB
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert segment_cap(model, 25.0, world_size=1) == math.inf
    assert [n for n, _ in segments(model, segment_cap(model, 25.0, world_size=1))] == [""]
    cap = segment_cap(model, 25.0, world_size=2)
    assert cap == total / MIN_SEGMENTS
    names = [n for n, _ in segments(model, cap)]
    assert len(names) >= MIN_SEGMENTS and names[-1] == "fc", names  # the head's gradients come first
    assert segment_cap(model, 0.5, world_size=2) == 0.5 * MB and segment_cap(model, "auto", world_size=2) == cap
    # "auto" compiles one graph on the CPU, where segment graphs ran slower; "whole" and "segments" force it
    assert segment_cap(model, 25.0, world_size=2, device_type="cpu") == math.inf
    assert segment_cap(model, 25.0, world_size=2, graphs="whole") == math.inf
    assert segment_cap(model, 25.0, world_size=1, graphs="segments", device_type="cpu") == cap


def test_a_block_past_the_cap_stays_whole_and_only_containers_split():
    model = build_model("resnet18_cifar", num_classes=10, width=32, in_channels=3).to(torch.bfloat16)
    names = [n for n, _ in segments(model, segment_cap(model, 25.0, world_size=2))]
    assert names == ["stem", "layer1", "layer2", "layer3", "layer4.0", "layer4.1", "fc"]  # not layer4.0.conv1, ...


def test_a_transformer_splits_at_its_blocks_through_an_encoder_with_its_own_forward():
    """torchvision's ViT tree: the encoder's own forward is glue around a Sequential of blocks, so it is
    split; a block (attention, and an MLP that is a Sequential) is not, nor the GoogLeNet branches."""
    import byo_models

    model = byo_models.TvViT(10, dim=32, depth=4)
    block = sum(p.numel() * 4 for p in model.encoder.layers[0].parameters())
    names = [n for n, _ in segments(model, 1.5 * block)]
    assert names == ["conv_proj", "encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1",
                     "encoder.layers.encoder_layer_2", "encoder.layers.encoder_layer_3", "encoder.ln", "heads"], names
    vit = build_model("examples.vit:VisionTransformer", num_classes=10, args={"depth": 3})
    names = [n for n, _ in segments(vit, segment_cap(vit, 25.0, world_size=2))]
    assert names[-3:] == ["blocks.2", "norm", "head"] and "blocks.0" in names, names
    googlenet = build_model("googlenet", num_classes=1000)
    assert all(n.count(".") == 1 for n, _ in segments(googlenet, 0.2 * MB) if n.startswith("inception"))  # whole


def test_auto_compiles_on_cuda_in_16_bits_and_on_the_cpu_as_measured():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_compile("auto", "fp16", cuda) and resolve_compile("auto", "bf16", cuda)
    assert not resolve_compile("auto", "fp32", cuda)
    assert resolve_compile("auto", "bf16", cpu) is CPU_COMPILE_AUTO
    assert resolve_compile(True, "fp32", cpu) and not resolve_compile(False, "fp16", cuda)


def test_a_failing_compiler_falls_back_to_eager_with_one_warning(tmp_path, monkeypatch, caplog):
    prepare_inductor()  # inductor's quiet first import (dptrain.inductor)
    import torch._inductor.compile_fx as compile_fx

    def broken(*args, **kwargs):
        raise RuntimeError("injected: no C++ compiler")

    monkeypatch.setattr(compile_fx, "compile_fx", broken)  # what dynamo's inductor backend calls
    cfg = load_config(None, ["model.name=lenet", "data.source=digits", "data.batch_size=8", "model.compile=true",
                             f"train.run_dir={json.dumps(str(tmp_path))}"])
    with caplog.at_level(logging.WARNING):
        t = Trainer(cfg, Communicator.from_env(Topology(), 60, torch.device("cpu")))
    try:
        assert t.compiled is None
        assert all("forward" not in m.__dict__ for m in t.model.modules()), "a segment kept its compiled forward"
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "model.compile failed on rank 0" in warnings[0] and "injected: no C++ compiler" in warnings[0]
        assert "training eagerly" in warnings[0]
        t.train_step()  # eager from here
        assert torch.isfinite(t._iter_loss)
    finally:
        t.close()
        torch._dynamo.reset()


@pytest.mark.parametrize("device_type, cuda_graphs", [("cpu", False), ("cuda", False), ("cuda", True)])
def test_each_segment_compiles_with_the_cpu_partition_pass_on_the_cpu_only(monkeypatch, device_type, cuda_graphs):
    """The pass that keeps boolean masks out of the CPU partition (dptrain/inductor.py, whose test checks
    what it does) is a per-function option: every compile and recompile of a segment has it."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: (calls.append(kw), fn)[1])
    model = build_model("lenet", num_classes=10, width=8, in_channels=1)
    CompiledModel(model, 0.2 * MB, cuda_graphs=cuda_graphs).compile(device_type)
    assert len(calls) == 3
    for kw in calls:
        if device_type == "cpu":
            assert kw["options"] == cpu_compile_options("cpu") != {} and "mode" not in kw
        else:
            assert kw.get("options") is None and kw.get("mode") == ("reduce-overhead" if cuda_graphs else None)


def test_reduce_overhead_is_refused_with_several_solvers_before_anything_compiles():
    from types import SimpleNamespace

    from dptrain.errors import ConfigError
    from dptrain.train.compiled import compile_for_training

    model = build_model("lenet", num_classes=10, width=8, in_channels=1)
    comm = SimpleNamespace(world_size=2, rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r'model.compile = "reduce-overhead" replays forward and backward as CUDA '
                                          r"graphs with one solver only \(2 here.*set model.compile = true"):
        compile_for_training(model, "reduce-overhead", storage="bf16", bucket_mb=25.0, forward=model,
                             batch_shape=(2, 1, 28, 28), dtype=torch.float32, channels_last=False, flat=None,
                             comm=comm)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert resolve_compile("reduce-overhead", "fp32", torch.device("cpu"))


def test_reduce_overhead_trains_one_solver_and_marks_each_step(tmp_path, monkeypatch, caplog):
    """On the CPU the mode compiles as true (CUDA graphs are CUDA's); the step marks come once per
    micro-batch, before its forward, and the run trains. Inductor counts each CPU graph as a skipped
    CUDA graph, the count a GPU run's warning and bench's ``cuda_graphs`` read; no warning here."""
    prepare_inductor()
    caplog.set_level(logging.WARNING, logger="dptrain")
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    cfg = load_config(None, ["model.name=lenet", "data.source=digits", "data.batch_size=16", "solver.iter_size=2",
                             "model.compile=reduce-overhead", f"train.run_dir={json.dumps(str(tmp_path))}"])
    t = Trainer(cfg, Communicator.from_env(Topology(), 60, torch.device("cpu")))
    try:
        assert t.compiled is not None and t.compiled.cuda_graphs and t.compiled.names == ["<model>"]
        assert len(marks) == CUDA_GRAPH_WARMUPS  # the start-up passes: run, record, replay
        ours = [r for r in caplog.records if r.name.startswith("dptrain")]
        assert t.compiled.cuda_graph_skips >= 1 and not ours  # counted (a GPU run warns), not warned
        losses = []
        for _ in range(8):
            t.train_step()
            losses.append(float(t._iter_loss))
        assert len(marks) == CUDA_GRAPH_WARMUPS + 8 * 2
        assert losses[-1] < losses[0], losses
    finally:
        t.close()
        torch._dynamo.reset()


ZOO_INPUT = {"alexnet": 64, "googlenet": 64}
"""The smallest sample side each zoo model takes (32 for the rest)."""


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_zoo_model_trains_compiled_with_eagers_loss(tmp_path, name):
    """Two compiled training steps at a small input against eager: the same loss within 1 %. Dropout
    (AlexNet, GoogLeNet) draws eager's masks: inductor's own generator would draw others."""
    prepare_inductor()
    size = ZOO_INPUT.get(name, 32)
    losses = {}
    for compiled in (False, True):
        losses[compiled] = _two_steps(tmp_path / str(compiled), name, size, compiled)
    for e, c in zip(losses[False], losses[True], strict=True):
        assert abs(c - e) <= 0.01 * e, (name, losses)


def _two_steps(run_dir, name: str, size: int, compiled: bool) -> list[float]:
    cfg = load_config(None, [f"model.name={name}", "model.width=8", "model.num_classes=10", "data.source=synthetic",
                             f"data.image_size={size}", "data.batch_size=4", "solver.base_lr=0.001",
                             f"model.compile={str(compiled).lower()}", f"train.run_dir={json.dumps(str(run_dir))}"])
    with torch._inductor.config.patch(fallback_random=True):
        t = Trainer(cfg, Communicator.from_env(Topology(), 60, torch.device("cpu")))
        try:
            assert (t.compiled is not None) == compiled
            out = []
            for _ in range(2):
                t.train_step()
                out.append(float(t._iter_loss))
            return out
        finally:
            t.close()
