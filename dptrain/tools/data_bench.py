"""``dptrain data-bench``: the record input pipeline alone (an LMDB, an image folder or a list file) (read + decode + augment + batch, no model).

The consumer takes each batch and releases it at once, like a trainer whose step is
free, so the number is the pipeline's ceiling on this machine. It prints one JSON line.

Beside images/s it reports what limits one process on a bigger host:

* ``cpu_ms_per_image``: CPU time of the whole pipeline per image (every thread of this process;
  the pipeline has no worker processes);
* ``python_calls_per_image``: Python function calls plus calls from Python into C per image,
  counted by a profile hook on every pipeline thread over a window after warm-up (a separate,
  slower pass: the hook costs time). Each runs under the GIL, so together with the GIL hand-offs
  they cap one process's rate whatever its core count (``shared/tools/calls_per_image.py``
  counts the same from outside).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import platform
import statistics
import sys
import threading
import time
from types import FrameType
from typing import Any

import PIL

from dptrain.config import RECORD_SOURCES, DataConfig, config_to_dict, load_config
from dptrain.data import open_records
from dptrain.data.sampling import SampleOrder
from dptrain.data.sources.records import RecordSource
from dptrain.data.transforms import jpeg_crop
from dptrain.data.transforms.render import DEFAULT_RENDER, RenderOptions
from dptrain.errors import ConfigError
from dptrain.observe.provenance import git_commit
from dptrain.topology import Topology


class _CallCounter:
    """A profile hook that counts Python calls and Python-to-C calls on every thread it is set on."""

    def __init__(self) -> None:
        self.count = itertools.count()
        self.total = 0

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call" or event == "c_call":
            next(self.count)

    def read(self) -> int:
        """Events so far (itertools.count's next is atomic under the GIL; reading it costs one)."""
        return next(self.count)


def count_python_calls(src: RecordSource, plan: SampleOrder, *, batches: int, warmup: int) -> float:
    """Python calls per image of a fresh stream of ``src`` over ``batches`` batches after ``warmup``."""
    counter = _CallCounter()
    threading.setprofile(counter)  # the stream's threads start with the hook
    sys.setprofile(counter)
    try:
        stream = src.train_batches(plan, 0)
        try:
            for _ in range(warmup):
                next(stream).release(None)
            start = counter.read()
            for _ in range(batches):
                next(stream).release(None)
            calls = counter.read() - start - 1
        finally:
            stream.close()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return calls / (batches * plan.batch_size)


def measure_pipeline(cfg: DataConfig, *, num_classes: int, seed: int, batches: int, warmup: int,
                     repeats: int, render: RenderOptions = DEFAULT_RENDER, count_calls: bool = True) -> dict[str, Any]:
    """Median images/s over ``repeats`` windows of ``batches`` batches, after ``warmup`` batches.

    ``cpu_ms_per_image`` is the process's CPU time (all threads) per image over the same
    windows: it shows the pipeline's cost even on a machine shared with other work. With
    ``count_calls``, a second stream counts the Python calls per image (:func:`count_python_calls`).
    """
    topology = Topology.from_env()
    cfg = dataclasses.replace(cfg, test_path="")  # the training stream alone: the test DB need not exist here
    src = open_records(cfg, num_classes=num_classes, seed=seed, render=render, rank=topology.rank,
                       cores=topology.cores_per_process)
    plan = SampleOrder(0, 1, cfg.batch_size, seed, cfg.shuffle == "epoch")
    stream = src.train_batches(plan, 0)
    rates, cpu_ms = [], []
    try:
        for _ in range(warmup):
            next(stream).release(None)
        for _ in range(repeats):
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(batches):
                next(stream).release(None)
            images = batches * cfg.batch_size
            rates.append(images / (time.perf_counter() - start))
            cpu_ms.append(1e3 * (time.process_time() - cpu_start) / images)
    finally:
        stream.close()
    calls = count_python_calls(src, plan, batches=batches, warmup=max(1, warmup)) if count_calls else None
    return {
        "images_per_s": round(statistics.median(rates), 1),
        "images_per_s_runs": [round(r, 1) for r in rates],
        "cpu_ms_per_image": round(statistics.median(cpu_ms), 3),
        "python_calls_per_image": None if calls is None else round(calls, 1),
        "native_render": src.native, "cores": topology.cores_per_process,
        "parser_threads": src.readers, "transformer_threads": src.renderers,
        "batch_size": cfg.batch_size, "sample_shape": list(src.sample_shape), "num_train": src.num_train,
        "draft": render.draft, "torch_resize": render.torch_resize,
        "crop_decode": render.crop_decode and jpeg_crop.library() is not None,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``dptrain data-bench``."""
    p.description = ("Measure the input pipeline alone (an LMDB, an image folder or a list file) and print one "
                     "JSON line with images_per_s.")
    p.add_argument("--config", required=True, help="TOML recipe with data.source = \"lmdb\", \"folder\" or \"list\"")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. data.transformer_threads=2; repeatable")
    p.add_argument("--batches", type=int, default=20, help="batches per timed window (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed batches first (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="timed windows; the median is reported (default 3)")
    p.add_argument("--no-draft", action="store_true", help="turn JPEG draft mode off (for comparisons)")
    p.add_argument("--pillow-resize", action="store_true",
                   help="resample with Pillow instead of torch's vectorised kernel (for comparisons)")
    p.add_argument("--no-crop-decode", action="store_true",
                   help="decode whole JPEGs with Pillow instead of only the crop box (for comparisons)")
    p.add_argument("--no-count-calls", action="store_true",
                   help="skip the pass that counts Python calls per image (it runs after the timed windows)")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Entry of ``dptrain data-bench``: measure; return the record (the CLI prints it as one JSON line)."""
    cfg = load_config(args.config, args.set)
    if cfg.data.source not in RECORD_SOURCES:
        raise ConfigError(f"data-bench measures the record pipeline (data.source one of {RECORD_SOURCES}); "
                          f"data.source is {cfg.data.source!r}")
    for name in ("batches", "warmup", "repeats"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise ConfigError(f"--{name} must be positive, got {getattr(args, name)}")
    record = measure_pipeline(cfg.data, num_classes=cfg.model.num_classes, seed=cfg.train.seed,
                              batches=args.batches, warmup=args.warmup, repeats=args.repeats,
                              render=RenderOptions(draft=not args.no_draft, torch_resize=not args.pillow_resize,
                                                  crop_decode=not args.no_crop_decode),
                              count_calls=not args.no_count_calls)
    record.update({
        "cpu": platform.processor() or platform.machine(), "host_cores": os.cpu_count(),
        "python": platform.python_version(), "pillow": PIL.__version__, "git_commit": git_commit(),
        "data": config_to_dict(cfg.data),
    })
    return record
