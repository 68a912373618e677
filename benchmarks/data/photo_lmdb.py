"""Write photo-like JPEGs into class folders, as input for `dptrain make-lmdb --encoded`.

A GPU host has no image data set and no network, but the input pipeline's cost depends on
what it decodes: ~500 px photos at JPEG quality 90, ~30-60 KB each, with texture (the
first GPU run's LMDB of such photos averaged 33 KB). Flat or tiny images would decode far
faster and flatter the pipeline. So each image here is drawn like a photo: a smooth colour
gradient, a few overlapping shapes, a slight blur (lens softness) and per-pixel noise
(sensor grain), with a random aspect ratio around ``--size``. Image i depends on (seed, i)
only, so any worker count writes the same files.

    python -m benchmarks.data.photo_lmdb --count 1500 --size 500 --out /tmp/photos
    dptrain make-lmdb --encoded --shuffle /tmp/photos /tmp/photos_lmdb
"""
from __future__ import annotations

import argparse
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

QUALITY = 90
"""JPEG quality of the files (issue 31: photos saved at quality 90)."""
ASPECTS = (0.75, 1.33)
"""Range of width/height; the longer side is about ``--size``."""
NOISE_STD = 6.0
"""Per-pixel Gaussian noise in grey levels: the grain that keeps the JPEGs photo-sized (~47 KB at 500 px)."""


def draw_photo(index: int, size: int, seed: int) -> Image.Image:
    """Image ``index``: RGB, its longer side ``size`` px, drawn from (seed, index) alone."""
    rng = np.random.default_rng([seed, index])
    aspect = rng.uniform(*ASPECTS)
    w, h = (size, max(1, round(size / aspect))) if aspect >= 1 else (max(1, round(size * aspect)), size)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    t = (xx * np.cos(angle) + yy * np.sin(angle)) / max(w, h)  # [h, w] position along the gradient
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    pixels = c0 + (c1 - c0) * t[..., None]  # [h, w, 3] fp32
    img = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(4, 12))):
        x0, y0 = rng.uniform(-0.2, 1.0) * w, rng.uniform(-0.2, 1.0) * h
        x1, y1 = x0 + rng.uniform(0.05, 0.6) * w, y0 + rng.uniform(0.05, 0.6) * h
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        shape = int(rng.integers(0, 3))
        if shape == 0:
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif shape == 1:
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            points = [(float(rng.uniform(x0, x1)), float(rng.uniform(y0, y1))) for _ in range(int(rng.integers(3, 7)))]
            draw.polygon(points, fill=fill)
    img = img.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.5, 1.5))))
    noisy = np.asarray(img, dtype=np.float32) + rng.normal(0.0, NOISE_STD, (h, w, 3)).astype(np.float32)
    return Image.fromarray(noisy.clip(0, 255).astype(np.uint8))


def _write(job: tuple[int, int, int, int, str]) -> int:
    """Write one JPEG; returns its size in bytes."""
    index, size, seed, classes, out = job
    path = Path(out) / f"class_{index % classes:03d}" / f"photo_{index:06d}.jpg"
    draw_photo(index, size, seed).save(path, quality=QUALITY)
    return path.stat().st_size


def write_photos(count: int, size: int, out: Path, *, classes: int, seed: int, workers: int) -> dict[str, float]:
    """Write ``count`` JPEGs under ``out``/class_NNN/ (image i in class i mod ``classes``)."""
    if count < 1 or size < 8 or classes < 1:
        raise ValueError(f"need count >= 1, size >= 8 and classes >= 1, got {count}, {size}, {classes}")
    for c in range(min(classes, count)):
        (out / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    jobs = [(i, size, seed, classes, str(out)) for i in range(count)]
    if workers <= 1:
        sizes = [_write(j) for j in jobs]
    else:
        with ProcessPoolExecutor(workers) as pool:
            sizes = list(pool.map(_write, jobs, chunksize=max(1, count // (4 * workers))))
    return {"images": count, "classes": min(classes, count), "mean_kb": round(sum(sizes) / len(sizes) / 1024, 1)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=1500, help="images to write (default 1500)")
    p.add_argument("--size", type=int, default=500, help="longer side in px (default 500)")
    p.add_argument("--out", type=Path, required=True, help="folder for the class subfolders (created)")
    p.add_argument("--classes", type=int, default=10, help="class subfolders, so labels 0..classes-1 (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="processes (default: all cores)")
    args = p.parse_args(argv)
    stats = write_photos(args.count, args.size, args.out, classes=args.classes, seed=args.seed, workers=args.workers)
    print(f"photo_lmdb: {stats['images']} JPEGs of ~{args.size} px in {stats['classes']} classes under {args.out}, "
          f"{stats['mean_kb']} KB each on average")


if __name__ == "__main__":
    main()
