"""The layer that overflowed: a skipped step is attributed to the parameters whose reduced
gradient was not finite, in metrics, in the log, and in the error of a collapsed loss scale."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.errors import LossScaleError
from dptrain.overflow import OverflowLocator, first_nonfinite_layer
from dptrain.topology import Topology
from dptrain.train import Trainer

FP16 = ["model.name=lenet", "data.source=digits", "data.batch_size=8", "precision.storage=fp16",
        "solver.display=2", "solver.test_interval=0", "solver.snapshot=0"]
PLANTED = "classifier.1.weight"
"""The parameter whose gradient gets the inf (LeNet's first fully connected layer)."""


def _trainer(tmp_path: Path, *extra: str) -> Trainer:
    cfg = load_config(None, [*FP16, f"train.run_dir={json.dumps(str(tmp_path))}", *extra])
    return Trainer(cfg, Communicator.from_env(Topology(), cfg.reducer.timeout_s, torch.device("cpu")))


def _plant_inf(t: Trainer, at: set[int] | None) -> None:
    """After the reduce (the reduced gradient), put an inf into PLANTED's gradient at the
    iterations ``at`` (None: every iteration)."""
    seg, group = next((s, g) for g in t.flat.groups for s in g.segments if s.name == PLANTED)  # StopIteration: renamed
    real_wait = t.reducer.wait

    def wait() -> None:
        real_wait()
        if at is None or t.iteration in at:
            group.grads[seg.offset + 3] = float("inf")

    t.reducer.wait = wait


def test_a_skipped_step_names_the_parameter_whose_gradient_overflowed(tmp_path, caplog):
    t = _trainer(tmp_path / "run", "solver.max_iter=6")
    _plant_inf(t, {1, 4})
    with caplog.at_level(logging.WARNING, logger="dptrain.train"):
        t.fit()
    t.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = {r["iter"]: r for r in lines if "loss" in r}
    assert train[2]["overflow_params"] == [PLANTED] and train[2]["skipped_steps"] == 1
    assert "overflow_params" not in train[4]  # iterations 2 and 3 were clean
    assert train[6]["overflow_params"] == [PLANTED] and train[6]["skipped_steps"] == 2
    warned = [r.getMessage() for r in caplog.records if "skipped for overflow" in r.getMessage()]
    assert len(warned) == 2 and all(w.endswith(f"in: {PLANTED}") for w in warned), warned


def test_a_collapsed_loss_scale_names_the_layer_that_overflowed_most(tmp_path):
    t = _trainer(tmp_path, "solver.max_iter=20", "precision.loss_scale.init_scale=4",
                 "precision.loss_scale.min_scale=1")
    _plant_inf(t, None)
    with pytest.raises(LossScaleError, match=rf"most often in {PLANTED} \(4 steps\)\); lower solver.base_lr"):
        t.fit()  # scale 4 -> 2 -> 1, the floor at the third overflow: the display at iteration 4 ends it
    t.close()


def test_the_per_step_cuda_count_agrees_with_the_cpu_search(tmp_path):
    """The CUDA path counts every step with device ops; the CPU path looks only on a skipped
    step. Both must name the same parameters (the CUDA branch is run here on CPU tensors)."""
    names = {}
    for cuda in (False, True):
        t = _trainer(tmp_path / str(cuda), "solver.max_iter=4")
        t.overflow._cuda = cuda
        _plant_inf(t, {0, 2})
        for _ in range(4):
            t.train_step()
        names[cuda] = (t.overflow.collect(), t.overflow.most_often())
        t.close()
    assert names[False] == names[True] == ([PLANTED], f"{PLANTED} (2 steps)")


def test_locator_off_without_loss_scaling_names_nothing(tmp_path):
    t = _trainer(tmp_path, "precision.storage=fp32", "solver.max_iter=2")
    assert not t.overflow.enabled
    for _ in range(2):
        t.train_step()
    assert t.overflow.collect() == [] and t.overflow.most_often() == ""
    t.close()


def test_counts_survive_a_relayout_by_name(tmp_path):
    t = _trainer(tmp_path, "solver.max_iter=2")
    loc: OverflowLocator = t.overflow
    _plant_inf(t, {0})
    t.train_step()
    g = t.flat.groups[0]
    names = [s.name for s in g.segments]
    t.flat.reorder([list(reversed(names)) if i == 0 else [s.name for s in gr.segments]
                    for i, gr in enumerate(t.flat.groups)], list(reversed(t.flat.layout_order)))
    t.train_step()  # a new layout: the counts move to the host by name first
    assert loc.most_often() == f"{PLANTED} (1 step)"
    t.close()


def test_first_nonfinite_layer_names_the_layer_and_why():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.ones(2, 4)
    assert first_nonfinite_layer(model, x) == "every layer's output is finite on the next batch"
    with torch.no_grad():
        model[2].weight.fill_(3e38)  # finite weights whose products overflow fp32
    assert first_nonfinite_layer(model, x + 1e3) == "2 (Linear) gives non-finite output, from finite inputs and weights"
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    assert first_nonfinite_layer(model, x) == "0 (Linear) gives non-finite output, its weights are not finite"
    assert first_nonfinite_layer(model, torch.full((2, 4), float("inf"))).endswith("its input is not finite")
