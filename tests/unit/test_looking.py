"""Looking, not reading: TensorBoard event files and `dptrain plot` from a short digits run."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from dptrain.cli import main
from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.topology import Topology
from dptrain.train import Trainer

RUN = ["model.name=lenet", "data.source=digits", "data.batch_size=16", "solver.max_iter=20", "solver.display=5",
       "solver.test_interval=10", "solver.snapshot=0", "train.tensorboard=true"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("looking") / "run"
    cfg = load_config(None, [*RUN, f"train.run_dir={json.dumps(str(out))}"])
    t = Trainer(cfg, Communicator.from_env(Topology(), cfg.reducer.timeout_s, torch.device("cpu")))
    t.fit()
    t.close()
    return out


def test_tensorboard_event_file_reads_back_with_tensorboards_reader(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/loss_scale", "train/images_per_s", "test/top1", "test/top5",
            "ranks/straggler_gap_ms", "ranks/compute_ms/rank0"} <= tags, tags
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    loss = {r["iter"]: r["loss"] for r in metrics if "loss" in r}
    events = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(events) == [5, 10, 15, 20]
    assert all(events[i] == pytest.approx(loss[i], rel=1e-6) for i in events)  # float32 in the event file
    top1 = {e.step: e.value for e in acc.Scalars("test/top1")}
    assert sorted(top1) == [10, 20] and 0.5 < top1[20] <= 1.0


def test_plot_writes_a_png_that_is_not_blank(run_dir, capsys):
    assert main(["plot", str(run_dir)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["plot"]
    assert out == str(run_dir / "metrics.png")
    with Image.open(out) as im:
        assert im.format == "PNG" and im.width >= 400 and im.height >= 800
        pixels = np.asarray(im.convert("L"), dtype=np.float32)
    assert pixels.std() > 10  # curves, labels and frames on white; a blank figure has std 0
    assert (pixels < 128).mean() > 0.005


def test_plot_of_a_folder_without_metrics_is_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl' does not exist; give the train.run_dir of a run" in err[0], err
