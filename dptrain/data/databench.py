"""``dptrain data-bench``: the LMDB input pipeline alone (read + decode + augment + batch, no model).

The consumer takes each batch and releases it at once, like a trainer whose step is
free, so the number is the pipeline's ceiling on this machine. It prints one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time
from typing import Any

import PIL

from dptrain.config import DataConfig, config_to_dict, load_config
from dptrain.data import jpeg_crop
from dptrain.data.lmdb_source import LmdbSource
from dptrain.data.render import RenderOptions
from dptrain.data.sampling import ShardPlan
from dptrain.errors import ConfigError
from dptrain.provenance import git_commit
from dptrain.topology import Topology


def measure_pipeline(cfg: DataConfig, *, num_classes: int, seed: int, batches: int, warmup: int,
                     repeats: int, render: RenderOptions = RenderOptions()) -> dict[str, Any]:
    """Median images/s over ``repeats`` windows of ``batches`` batches, after ``warmup`` batches.

    ``cpu_ms_per_image`` is the process's CPU time (all threads) per image over the same
    windows: it shows the pipeline's cost even on a machine shared with other work.
    """
    topology = Topology.from_env()
    cfg = dataclasses.replace(cfg, test_path="")  # the training stream alone: the test DB need not exist here
    src = LmdbSource(cfg, num_classes=num_classes, seed=seed, render=render, rank=topology.rank,
                     cores=topology.cores_per_process)
    stream = src.train_batches(ShardPlan(0, 1, cfg.batch_size, seed, cfg.shuffle == "epoch"), 0)
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
    return {
        "images_per_s": round(statistics.median(rates), 1),
        "images_per_s_runs": [round(r, 1) for r in rates],
        "cpu_ms_per_image": round(statistics.median(cpu_ms), 3),
        "parser_threads": src.parsers, "transformer_threads": src.transformers,
        "batch_size": cfg.batch_size, "sample_shape": list(src.sample_shape), "num_train": src.num_train,
        "draft": render.draft, "torch_resize": render.torch_resize,
        "crop_decode": render.crop_decode and jpeg_crop.library() is not None,
    }


def add_data_bench_args(p: argparse.ArgumentParser) -> None:
    """Arguments of ``dptrain data-bench``."""
    p.description = "Measure the LMDB input pipeline alone and print one JSON line with images_per_s."
    p.add_argument("--config", required=True, help="TOML recipe with data.source = \"lmdb\"")
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


def run_data_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Entry of ``dptrain data-bench``: measure; return the record (the CLI prints it as one JSON line)."""
    cfg = load_config(args.config, args.set)
    if cfg.data.source != "lmdb":
        raise ConfigError(f"data-bench measures the LMDB pipeline; data.source is {cfg.data.source!r}, "
                          f"set data.source = \"lmdb\"")
    for name in ("batches", "warmup", "repeats"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise ConfigError(f"--{name} must be positive, got {getattr(args, name)}")
    record = measure_pipeline(cfg.data, num_classes=cfg.model.num_classes, seed=cfg.train.seed,
                              batches=args.batches, warmup=args.warmup, repeats=args.repeats,
                              render=RenderOptions(draft=not args.no_draft, torch_resize=not args.pillow_resize,
                                                  crop_decode=not args.no_crop_decode))
    record.update({
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "python": platform.python_version(), "pillow": PIL.__version__, "git_commit": git_commit(),
        "data": config_to_dict(cfg.data),
    })
    return record
