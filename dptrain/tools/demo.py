"""``dptrain demo``: the digits recipe under ``python -m dptrain.torchrun`` with N solvers, then its
wall time and test top-1 in one line (``make demo``).

It trains from Caffe LMDBs of the digits (written once with ``make-lmdb --digits --encoded``), or
from the in-memory digits with ``--builtin``, in ``runs/demo``, which it starts over each time: it
removes the outputs of its own earlier run there and refuses a folder holding a run it did not write.
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from dptrain.config import load_config
from dptrain.errors import ConfigError

log = logging.getLogger(__name__)


def add_arguments(d: argparse.ArgumentParser) -> None:
    d.description = "Train the digits recipe with N solver processes and print the wall time and test top-1."
    d.add_argument("--config", default="launch/configs/digits.toml", help="recipe (default: %(default)s)")
    d.add_argument("--nproc", type=int, default=0, help="solver processes (default: GPUs, or 2 on CPU)")
    d.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    d.add_argument("--lmdb", default="runs/digits_lmdb", metavar="DIR",
                   help="train from Caffe LMDBs of the digits in DIR/train and DIR/test, written by "
                        "`make-lmdb --digits --encoded DIR` if missing (default: %(default)s)")
    d.add_argument("--builtin", action="store_true", help="train from the in-memory digits instead of the LMDB")


DEMO_RUN_DIR = "runs/demo"
DEMO_MARK = ".dptrain-demo"
"""Marks a run_dir the demo wrote: only there does it delete an earlier run's outputs."""


def _start_demo_run(run_dir: Path) -> None:
    """The demo starts over each time: it removes the outputs of its own earlier run, and
    refuses a folder holding a run it did not write."""
    from dptrain.snapshots import RunDir

    d = RunDir(run_dir)
    earlier = d.earlier_run()
    if earlier and not (run_dir / DEMO_MARK).exists():
        d.refuse_earlier_run()
    for name in earlier:
        (run_dir / name).unlink()
    if earlier:
        log.info("removed the previous demo run's %s from %s", ", ".join(earlier), run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / DEMO_MARK).touch()


def main(args: argparse.Namespace) -> int:
    """Run the digits recipe under torchrun with ``nproc`` solvers; log wall time and top-1."""
    import torch

    from dptrain.observe.metrics import read_metrics

    sets = [f'train.run_dir="{DEMO_RUN_DIR}"', *args.set]  # its own folder (a --set may move it)
    if not args.builtin:
        lmdb_dir = Path(args.lmdb)
        if not (lmdb_dir / "train").exists():
            from dptrain.tools.make_lmdb import make_digits_lmdb

            counts = make_digits_lmdb(lmdb_dir, encoded=True)
            log.info("wrote the digits as PNG Datum LMDBs in %s: %s", lmdb_dir, counts)
        sets = ['data.source="lmdb"', f'data.path="{lmdb_dir / "train"}"', f'data.test_path="{lmdb_dir / "test"}"',
                *sets]
    cfg = load_config(args.config, sets)
    if args.nproc < 0:
        raise ConfigError(f"--nproc must be >= 1 (0: one per GPU, or 2 on CPU), got {args.nproc}")
    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    run_dir = Path(cfg.train.run_dir)
    _start_demo_run(run_dir)
    cmd = [sys.executable, "-m", "dptrain.torchrun", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "dptrain", "train", "--config", args.config, *[f"--set={s}" for s in sets]]
    env = dict(os.environ)
    if not torch.cuda.is_available():
        # N solvers share the cores; one intra-op thread each avoids oversubscription.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    log.info("running: %s", " ".join(cmd))
    start = time.perf_counter()
    rc = subprocess.call(cmd, env=env)
    wall_s = time.perf_counter() - start
    if rc != 0:
        log.error("training exited with code %d", rc)
        return rc
    tests = [r for r in read_metrics(run_dir / "metrics.jsonl") if "test_top1" in r]
    top1 = tests[-1]["test_top1"]
    log.info("demo: %d solver(s), data %s, %.1f s wall, final test top-1 %.2f%% on %d held-out digits",
             nproc, cfg.data.source, wall_s, 100 * top1, tests[-1]["test_samples"])
    return 0
