"""The `data` stage of gpu_session.sh: ResNet-50 fp16 from a Caffe LMDB of photo-like JPEGs, against synthetic data.

Issue 31 item 5, on the GPU host, in one process tree:
1. ``--images`` photo-like JPEGs of ~``--size`` px (benchmarks/data/photo_lmdb.py) in class folders;
2. ``dptrain make-lmdb --encoded --shuffle`` writes them into one Caffe LMDB;
3. ``dptrain data-bench`` at its defaults on the resnet50_imagenet recipe pointed at that LMDB;
4. ``dptrain bench`` from that LMDB, ``--train-steps`` timed iterations after ``--train-warmup``;
5. ``dptrain bench --synthetic``, the same recipe and steps, the input pipeline taken out.

Each tool's output goes to this process's stdout (the stage log) line by line as it comes, so a
stage cut off at its limit still logs how far the running tool got. After data-bench and after
the LMDB bench a partial record is printed (``"partial": true``), and the last line is the whole
one: the figures and their goals (issue 31, on the GPU host: data-bench >= 8,000 img/s at the
defaults, train-from-LMDB >= 0.95x synthetic), and which input path data-bench ran (native
renderer, crop decoder; Python calls per image with ``--count-calls``). session_summary.py reads
the last record there is. ``--no-train`` stops after step 3 (a CPU test runs the stage tiny that
way).

The defaults fit the stage's limit in gpu_session.sh: data-bench skips its call-count pass (an
extra window of batches under a profile hook) and each bench times 50 steps; the LMDB bench
carries the cold torch.compile of ResNet-50 (about 50 s on the H200), the synthetic bench then
loads it from the cache.

    python -m benchmarks.data.data_stage --work /tmp/data_stage
    python -m benchmarks.data.data_stage --work /tmp/d --images 64 --size 256 --set data.batch_size=8 \\
        --bench-batches 2 --bench-warmup 1 --bench-repeats 1 --no-train
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.data.photo_lmdb import write_photos

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "launch" / "configs" / "resnet50_imagenet.toml"
GOALS = {"data_bench_images_per_s": 8000.0, "lmdb_over_synthetic": 0.95}
"""Issue 31's goals on the next GPU host: data-bench at the defaults, and train-from-LMDB / bench --synthetic."""


def _dptrain(*args: str) -> dict[str, object]:
    """Run ``python -m dptrain ARGS`` (the checkout, no install needed), echo each line of its output as
    it comes (unbuffered), return its last JSON line."""
    cmd = [sys.executable, "-m", "dptrain", *args]
    print("$ " + " ".join(cmd), flush=True)
    last = None
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        assert proc.stdout is not None, "stdout is a pipe"
        for line in proc.stdout:
            print(line, end="", flush=True)
            if line.startswith("{"):
                last = line
    if proc.returncode != 0 or last is None:
        raise SystemExit(f"data stage: {' '.join(args[:1])} failed with exit code {proc.returncode}")
    return json.loads(last)


def _print_record(record: dict[str, object], *, partial: bool) -> None:
    """One JSON line of the stage record: partial after a step, whole at the end."""
    print(json.dumps({**record, "partial": partial}), flush=True)


def _recipe_sets(lmdb: Path, run_dir: Path, sets: list[str]) -> list[str]:
    """--set options: the recipe's train and test LMDB are ours, its run folder is in the work folder."""
    base = [f"data.path={json.dumps(str(lmdb))}", f"data.test_path={json.dumps(str(lmdb))}",
            f"train.run_dir={json.dumps(str(run_dir))}", *sets]
    return [a for s in base for a in ("--set", s)]


def run(args: argparse.Namespace) -> dict[str, object]:
    """The stage's steps (module docstring); returns the record it prints last."""
    photos, lmdb = args.work / "photos", args.work / "lmdb"
    made = write_photos(args.images, args.size, photos, classes=args.classes, seed=0, workers=args.workers)
    print(f"photo_lmdb: {made}", flush=True)
    _dptrain("make-lmdb", "--encoded", "--shuffle", str(photos), str(lmdb))
    config = ["--config", str(args.config)]
    counts = [f"--{k}={v}" for k, v in (("batches", args.bench_batches), ("warmup", args.bench_warmup),
                                        ("repeats", args.bench_repeats)) if v is not None]
    calls = [] if args.count_calls else ["--no-count-calls"]
    data = _dptrain("data-bench", *config, *_recipe_sets(lmdb, args.work / "run_data", args.set), *counts, *calls)
    record: dict[str, object] = {
        "stage": "data", "images": made["images"], "mean_kb": made["mean_kb"], "size_px": args.size,
        "data_bench_images_per_s": data["images_per_s"], "data_bench_cpu_ms_per_image": data.get("cpu_ms_per_image"),
        "data_bench_threads": [data.get("parser_threads"), data.get("transformer_threads")],
        # which input path was measured: a native path that failed its build or self-check here falls back
        # to Python with one warning in the log, and the figure would read as the native path's
        "native_render": data.get("native_render"), "crop_decode": data.get("crop_decode"),
        "python_calls_per_image": data.get("python_calls_per_image"),
        "lmdb_train_images_per_s": None, "synthetic_images_per_s": None, "lmdb_over_synthetic": None,
        "goals": GOALS}
    if args.train:
        _print_record(record, partial=True)
        steps = [f"--steps={args.train_steps}", f"--warmup={args.train_warmup}"]
        lmdb_run = _dptrain("bench", *config, *_recipe_sets(lmdb, args.work / "run_lmdb", args.set), *steps)
        record.update({"lmdb_train_images_per_s": lmdb_run["images_per_s"],
                       "lmdb_data_wait_ms": lmdb_run.get("data_wait_ms"),
                       "train_steps": args.train_steps, "precision": lmdb_run.get("precision")})
        _print_record(record, partial=True)
        synthetic = _dptrain("bench", *config, "--synthetic",
                             *_recipe_sets(lmdb, args.work / "run_synthetic", args.set), *steps)
        record.update({"synthetic_images_per_s": synthetic["images_per_s"],
                       "lmdb_over_synthetic": round(lmdb_run["images_per_s"] / synthetic["images_per_s"], 3)})
        print(f"train from LMDB / synthetic: {lmdb_run['images_per_s']} / {synthetic['images_per_s']} img/s = "
              f"{record['lmdb_over_synthetic']} (goal >= {GOALS['lmdb_over_synthetic']})", flush=True)
    _print_record(record, partial=False)
    return {**record, "partial": False}


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="scratch folder for the JPEGs, the LMDB and run folders")
    p.add_argument("--images", type=int, default=1500, help="JPEGs to write (default 1500)")
    p.add_argument("--size", type=int, default=500, help="their longer side in px (default 500)")
    p.add_argument("--classes", type=int, default=10, help="class folders, so labels (default 10)")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="JPEG writer processes")
    p.add_argument("--config", type=Path, default=RECIPE, help="recipe (default launch/configs/resnet50_imagenet.toml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra recipe override for every tool, e.g. data.batch_size=8; repeatable")
    p.add_argument("--bench-batches", type=int, help="data-bench --batches (default: data-bench's)")
    p.add_argument("--bench-warmup", type=int, help="data-bench --warmup (default: data-bench's)")
    p.add_argument("--bench-repeats", type=int, help="data-bench --repeats (default: data-bench's)")
    p.add_argument("--count-calls", action="store_true",
                   help="let data-bench count Python calls per image (a slower extra pass; off by default)")
    p.add_argument("--train-steps", type=int, default=50, help="timed bench iterations, each run (default 50)")
    p.add_argument("--train-warmup", type=int, default=10, help="untimed bench iterations first (default 10)")
    p.add_argument("--no-train", dest="train", action="store_false", help="stop after data-bench")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
