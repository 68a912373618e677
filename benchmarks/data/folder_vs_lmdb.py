"""Image folder against LMDB: the same photo-like JPEGs read as ``data.source = "folder"`` and from an LMDB
that ``dptrain make-lmdb --encoded`` wrote of them, in one sitting.

Each pair runs ``dptrain data-bench`` on both sides back to back, alternating which goes first
(ABBA), so the drift of a shared VM falls on both alike; the report gives each side's median
images/s and the median of the per-pair ratios (folder / LMDB). Before timing, one batch of each
side is rendered with the same seed and compared pixel for pixel.

    python -m benchmarks.data.folder_vs_lmdb --count 1500 --size 500 --pairs 6 --out /tmp/fvl
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.data.photo_lmdb import write_photos
from dptrain.config import DataConfig
from dptrain.data import open_records
from dptrain.data.caffe.writer import make_lmdb
from dptrain.data.sampling import SampleOrder
from dptrain.data.sources.files import list_image_folder

RECIPE = """[model]
num_classes = {classes}
[data]
source = "{source}"
path = "{path}"
batch_size = 64
crop_size = 224
random_resized_crop = true
mirror = true
[train]
seed = 1
"""


def _bench(config: Path, batches: int) -> dict:
    cmd = [sys.executable, "-m", "dptrain", "data-bench", "--config", str(config), "--batches", str(batches),
           "--repeats", "3", "--no-count-calls"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def same_pixels(folder: Path, db: Path, classes: int) -> bool:
    """One batch of each side, same seed and order: equal images and labels."""
    batches = []
    for source, path in (("folder", folder), ("lmdb", db)):
        cfg = DataConfig(source=source, path=str(path), batch_size=16, crop_size=224, random_resized_crop=True,
                         mirror=True)
        stream = open_records(cfg, num_classes=classes, seed=1).train_batches(SampleOrder(0, 1, 16, 1, True), 0)
        hb = next(stream)
        batches.append((hb.images.numpy().copy(), hb.labels.numpy().copy()))
        hb.release(None)
        stream.close()
    return all(np.array_equal(a, b) for a, b in zip(*batches, strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=1500, help="JPEGs to write (default 1500)")
    ap.add_argument("--size", type=int, default=500, help="longer side in pixels (default 500)")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--pairs", type=int, default=6, help="ABBA pairs of data-bench runs (default 6)")
    ap.add_argument("--batches", type=int, default=15, help="batches per timed window (default 15)")
    ap.add_argument("--out", type=Path, required=True, help="folder for the JPEGs, the LMDB and the configs")
    args = ap.parse_args(argv)
    folder, db = args.out / "photos", args.out / "photos_lmdb"
    if not folder.exists():
        write_photos(args.count, args.size, folder, classes=args.classes, seed=0, workers=2)
    if not db.exists():
        items, _ = list_image_folder(folder)
        make_lmdb(db, items, root=folder, encoded=True)
    configs = {}
    for source, path in (("folder", folder), ("lmdb", db)):
        configs[source] = args.out / f"{source}.toml"
        configs[source].write_text(RECIPE.format(classes=args.classes, source=source, path=path))
    pixels = same_pixels(folder, db, args.classes)
    runs: dict[str, list[float]] = {"folder": [], "lmdb": []}
    ratios = []
    for k in range(args.pairs):
        order = ("folder", "lmdb") if k % 2 == 0 else ("lmdb", "folder")
        got = {side: _bench(configs[side], args.batches)["images_per_s"] for side in order}
        for side, ips in got.items():
            runs[side].append(ips)
        ratios.append(got["folder"] / got["lmdb"])
        print(json.dumps({"pair": k, **got, "ratio": round(ratios[-1], 3)}), flush=True)
    print(json.dumps({"same_pixels": pixels, "folder_images_per_s": statistics.median(runs["folder"]),
                      "lmdb_images_per_s": statistics.median(runs["lmdb"]),
                      "median_pair_ratio": round(statistics.median(ratios), 3),
                      "pairs_won_by_folder": sum(r >= 1 for r in ratios), "pairs": args.pairs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
