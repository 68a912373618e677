"""dptrain's threaded LMDB pipeline against torch DataLoader, on the same images, cores and augmentation.

The script synthesises natural-ish photos (smooth colour fields, blobs, sensor noise;
about 450 px, JPEG quality 90), writes them as an encoded Caffe LMDB, and then measures,
alternating the cases for ``--rounds`` rounds and reporting the median:

* the single-core raw decode rate (Pillow, full size, no augmentation): the per-core ceiling
  of any pipeline that decodes whole images;
* ``dptrain data-bench`` (decode + random-resized-crop 224 + mirror, uint8 HWC batches)
  over parser/transformer thread counts, once with JPEG draft mode off, once with
  Pillow's resize instead of torch's (``--pillow-resize``), and once decoding whole
  images with Pillow instead of only the crop box (``--no-crop-decode``);
* torch DataLoader with 0 and 2 worker processes over the same LMDB, with the same
  augmentation written the usual way (Pillow decode, torchvision's random-resized-crop
  algorithm, crop + bilinear resize, flip, uint8 HWC tensors, default collate); with 2
  workers also as the PyTorch ImageNet example ships it (ToTensor + Normalize, float32),
  with the resize done by the same torch kernel dptrain uses, and with dptrain's crop
  decoder as well (the same per-image kernels as dptrain, in worker processes).

The crop decoder is required (``DPTRAIN_JPEG=crop``): a machine where it does not build
fails the run instead of measuring Pillow twice.

Every case runs in a fresh process. Results go to
``benchmarks/results/data_pipeline_<hardware>_<yyyymmdd>.md`` with every raw JSON line.

    python -m benchmarks.data.data_pipeline                      # about 5 minutes on 2 cores
    python -m benchmarks.data.data_pipeline --images 200 --rounds 1   # quick look
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
JPEG_QUALITY = 90
CROP = 224
BATCH = 64
THREAD_CASES = [(1, 1), (1, 2), (1, 3), (2, 2), (2, 3)]
"""(parser_threads, transformer_threads) for dptrain."""


def synth_image(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A natural-ish RGB photo: low-frequency colour waves, a few flat blobs, Gaussian noise."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.empty((height, width, 3), np.float32)
    for c in range(3):
        a, b, phase, tilt = rng.uniform(-1, 1, 4)
        img[..., c] = 128 + 60 * np.sin(a * xx / 40 + b * yy / 50 + phase * 6) + 40 * tilt * (xx / width - 0.5)
    for _ in range(6):
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(10, 80)
        img[((xx - cx) ** 2 + (yy - cy) ** 2) < r * r] += rng.uniform(-60, 60, 3)
    img += rng.normal(0, 8, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def build_dataset(out: Path, n: int, seed: int) -> dict[str, float]:
    """Write ``n`` synthetic JPEGs as an encoded Datum LMDB at ``out``."""
    from dptrain.data.caffe.datum import encode_datum
    from dptrain.data.caffe.writer import write_lmdb

    rng = np.random.default_rng(seed)
    sizes, nbytes = [], []

    def records():
        for i in range(n):
            w, h = int(rng.integers(400, 501)), int(rng.integers(330, 451))
            buf = io.BytesIO()
            Image.fromarray(synth_image(rng, w, h)).save(buf, "JPEG", quality=JPEG_QUALITY)
            sizes.append((w, h))
            nbytes.append(buf.tell())
            yield f"{i:08d}_synth/{i:05d}.jpg".encode(), encode_datum(label=i % 1000, data=buf.getvalue(), encoded=True)

    write_lmdb(out, records(), n)
    return {"images": n, "mean_width": float(np.mean([s[0] for s in sizes])),
            "mean_height": float(np.mean([s[1] for s in sizes])), "mean_kb": float(np.mean(nbytes)) / 1024}


# --------------------------------------------------------------------------- cases (each in its own process)


def case_decode(db: str, passes: int) -> dict:
    """Single thread: full-size decode of every record, best of ``passes``."""
    import lmdb

    from dptrain.data.caffe.datum import parse_datum

    env = lmdb.open(db, readonly=True, lock=False)
    with env.begin() as txn:
        blobs = [parse_datum(v).data for _, v in txn.cursor()]
    best = math.inf
    for _ in range(passes):
        start = time.perf_counter()
        for b in blobs:
            Image.open(io.BytesIO(b)).convert("RGB")
        best = min(best, time.perf_counter() - start)
    return {"images_per_s": round(len(blobs) / best, 1), "cpu_ms_per_image": round(1e3 * best / len(blobs), 3)}


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class LmdbJpegDataset:
    """The usual map-style Dataset: one LMDB Environment per worker process, opened lazily.

    ``to_float`` adds torchvision's ToTensor + Normalize (float32 CHW), as the PyTorch
    ImageNet example does; without it samples stay uint8 HWC, exactly what dptrain ships.
    ``torch_resize`` resamples the crop with torch's antialiased bilinear kernel (the one
    dptrain's transformers use) instead of Pillow's; ``crop_decode`` also decodes only the
    crop box with dptrain's JPEG crop decoder (mirrored there), as dptrain's transformers do.
    """

    def __init__(self, path: str, to_float: bool = False, torch_resize: bool = False,
                 crop_decode: bool = False) -> None:
        self.path, self._env, self._keys, self.to_float = path, None, None, to_float
        self.torch_resize, self.crop_decode = torch_resize or crop_decode, crop_decode
        import lmdb

        env = lmdb.open(path, readonly=True, lock=False)
        with env.begin() as txn:
            self._keys = list(txn.cursor().iternext(keys=True, values=False))
        env.close()

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, i: int):
        import lmdb
        import torch

        from dptrain.data.caffe.datum import parse_datum

        if self._env is None:
            self._env = lmdb.open(self.path, readonly=True, lock=False, readahead=False)
        with self._env.begin() as txn:
            d = parse_datum(txn.get(self._keys[i]))
        img = Image.open(io.BytesIO(d.data))
        if not self.crop_decode:
            img = img.convert("RGB")
        x0, y0, w, h = _rrc_box(img.size[0], img.size[1])
        flip = random.random() < 0.5
        if self.crop_decode:
            from dptrain.data.transforms import jpeg_crop

            a = np.empty((h, w, 3), np.uint8)
            refused = jpeg_crop.decode_crop(jpeg_crop.library(), d.data, (x0, y0, x0 + w, y0 + h),
                                            scale=1, gray=False, flip=flip, out=a)
            assert refused is None, refused
            flip = False  # done by the decoder
        else:
            img = img.crop((x0, y0, x0 + w, y0 + h))
        if self.torch_resize:
            a = a if self.crop_decode else np.array(img)  # [h, w, 3]
            # [1, 3, h, w] with a batch stride torch recognises as channels-last, so the output is too
            t = torch.from_numpy(a).as_strided((1, 3, a.shape[0], a.shape[1]), (a.size, 1, a.shape[1] * 3, 3))
            t = torch.nn.functional.interpolate(t, size=(CROP, CROP), mode="bilinear", antialias=True)[0].permute(1, 2, 0)
            x = (t.flip(1) if flip else t).contiguous()  # [H, W, 3] uint8
        else:
            img = img.resize((CROP, CROP), Image.Resampling.BILINEAR)
            if flip:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            x = torch.from_numpy(np.asarray(img).copy())  # [H, W, 3] uint8
        if self.to_float:
            x = x.permute(2, 0, 1).float().div_(255)
            x = (x - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1)
        return x, d.label


def _rrc_box(width: int, height: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params, with Python's random module."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * random.uniform(*scale)
        aspect = math.exp(random.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return random.randint(0, width - w), random.randint(0, height - h), w, h
    if width / height < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif width / height > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def _tree_cpu_s() -> float:
    """CPU seconds (user + sys) used so far by this process and its live children (the workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    me, total = os.getpid(), time.process_time()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:  # field 4 (ppid); utime, stime are fields 14, 15
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def case_dataloader(db: str, workers: int, batches: int, warmup: int, to_float: bool, torch_resize: bool,
                    crop_decode: bool) -> dict:
    import torch

    torch.set_num_threads(1)
    ds = LmdbJpegDataset(db, to_float, torch_resize, crop_decode)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers, drop_last=True,
                                         persistent_workers=workers > 0)

    def forever():
        while True:
            yield from loader

    it = forever()
    for _ in range(warmup):
        next(it)
    start, cpu_start = time.perf_counter(), _tree_cpu_s()
    for _ in range(batches):
        x, _ = next(it)
        want = (BATCH, 3, CROP, CROP) if to_float else (BATCH, CROP, CROP, 3)
        assert x.shape == want, f"unexpected batch {x.shape} {x.dtype}"
    rate = batches * BATCH / (time.perf_counter() - start)
    cpu_ms = 1e3 * (_tree_cpu_s() - cpu_start) / (batches * BATCH)
    return {"images_per_s": round(rate, 1), "cpu_ms_per_image": round(cpu_ms, 3), "workers": workers,
            "output": "float32 CHW normalized" if to_float else "uint8 HWC",
            "resize": "torch" if torch_resize or crop_decode else "Pillow", "crop_decode": crop_decode}


# --------------------------------------------------------------------------- driver


def _run(cmd: list[str]) -> dict:
    env = {**os.environ, "DPTRAIN_JPEG": "crop"}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _config(path: Path, db: str) -> None:
    path.write_text(f'[data]\nsource = "lmdb"\npath = "{db}"\nbatch_size = {BATCH}\ncrop_size = {CROP}\n'
                    f'random_resized_crop = true\nmirror = true\n[model]\nnum_classes = 1000\n')


def machine() -> dict:
    import PIL
    import torch
    from PIL import features

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else "?"
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "torch": torch.__version__, "pillow": PIL.__version__,
            "libjpeg_turbo": features.version("libjpeg_turbo"), "kernel": platform.release()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=15, help="timed batches of 64 per case and round")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--tag", default="", help="suffix of the results file name, e.g. the machine")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--db", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.case == "decode":
        print(json.dumps(case_decode(args.db, passes=3)))
        return 0
    if args.case and args.case.startswith("dataloader"):
        flags = args.case[len("dataloader"):]
        workers, to_float, torch_resize, crop = int(flags.rstrip("ftc")), "f" in flags, "t" in flags, "c" in flags
        print(json.dumps(case_dataloader(args.db, workers, args.batches, warmup=4, to_float=to_float,
                                         torch_resize=torch_resize, crop_decode=crop)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "synth_lmdb")
        dataset = build_dataset(Path(db), args.images, seed=0)
        cfg = Path(tmp) / "bench.toml"
        _config(cfg, db)
        me = [sys.executable, "-m", "benchmarks.data.data_pipeline", "--db", db, "--batches", str(args.batches)]
        cases = {"decode_1core": me + ["--case", "decode"]}
        for w in (0, 2):
            cases[f"dataloader_w{w}"] = me + ["--case", f"dataloader{w}"]
        cases["dataloader_w2_float"] = me + ["--case", "dataloader2f"]
        cases["dataloader_w2_torchresize"] = me + ["--case", "dataloader2t"]
        cases["dataloader_w2_cropdecode"] = me + ["--case", "dataloader2c"]
        bench = [sys.executable, "-m", "dptrain", "data-bench", "--config", str(cfg), "--batches", str(args.batches),
                 "--warmup", "4", "--repeats", "1"]
        for p, t in THREAD_CASES:
            cases[f"dptrain_p{p}_t{t}"] = bench + ["--set", f"data.parser_threads={p}",
                                                   "--set", f"data.transformer_threads={t}"]
        cases["dptrain_p1_t2_nodraft"] = bench + ["--no-draft", "--set", "data.parser_threads=1",
                                                  "--set", "data.transformer_threads=2"]
        cases["dptrain_p1_t2_pillowresize"] = bench + ["--pillow-resize", "--set", "data.parser_threads=1",
                                                       "--set", "data.transformer_threads=2"]
        cases["dptrain_p1_t2_fulldecode"] = bench + ["--no-crop-decode", "--set", "data.parser_threads=1",
                                                     "--set", "data.transformer_threads=2"]
        cases["dptrain_default"] = bench
        lines: dict[str, list[dict]] = {name: [] for name in cases}
        for r in range(args.rounds):
            for name, cmd in cases.items():
                rec = _run(cmd)
                rec["case"], rec["round"] = name, r
                lines[name].append(rec)
                print(f"round {r} {name}: {rec['images_per_s']} img/s", file=sys.stderr)
    path = write_report(Path(args.out), lines, dataset, args)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _describe(name: str, rec: dict) -> tuple[str, str]:
    if "parser_threads" in rec:
        resize = "torch" if rec.get("torch_resize", True) else "Pillow"
        decode = "crop decode" if rec.get("crop_decode") else "full decode"
        return f"P={rec['parser_threads']} T={rec['transformer_threads']}", f"uint8 HWC, {decode}, {resize} resize"
    if "workers" in rec:
        decode = ", crop decode" if rec.get("crop_decode") else ", full decode"
        resize = f", {rec['resize']} resize" if "resize" in rec else ""
        return f"{rec['workers']} worker proc", rec["output"] + decode + resize
    return "1 thread", "decode only"


def write_report(out_dir: Path, lines: dict[str, list[dict]], dataset: dict, args: argparse.Namespace) -> Path:
    """The markdown table (medians over rounds) plus every raw JSON line."""
    med = {name: statistics.median(r["images_per_s"] for r in recs) for name, recs in lines.items()}
    cpu = {name: statistics.median(r["cpu_ms_per_image"] for r in recs) for name, recs in lines.items()}
    base, base_f = med["dataloader_w2"], med["dataloader_w2_float"]
    m = machine()
    date = datetime.date.today().strftime("%Y%m%d")
    rows = []
    for name, v in med.items():
        threads, output = _describe(name, lines[name][0])
        rows.append(f"| {name} | {threads} | {output} | {v:.0f} | {v / base:.2f}x | {v / base_f:.2f}x | {cpu[name]:.2f} |")
    text = "\n".join([
        f"# Input pipeline: dptrain threads vs torch DataLoader ({m['cores']} cores, {date})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores (affinity), Linux {m['kernel']}, Python {m['python']}, "
        f"torch {m['torch']}, Pillow {m['pillow']} (libjpeg-turbo {m['libjpeg_turbo']}). "
        f"Load average before/after: {args.load_before} / {' '.join(f'{x:.2f}' for x in os.getloadavg())}.",
        "",
        f"Data: {dataset['images']} synthetic JPEGs (quality {JPEG_QUALITY}, mean {dataset['mean_width']:.0f}x"
        f"{dataset['mean_height']:.0f} px, {dataset['mean_kb']:.0f} KiB) in an encoded Caffe Datum LMDB in the "
        f"page cache. Work per sample in every pipeline case: Datum parse, JPEG decode, random-resized-crop "
        f"(scale 0.08-1, ratio 3/4-4/3) to {CROP}x{CROP} bilinear, random mirror; batches of {BATCH}. "
        f"No model. Median of {args.rounds} rounds, cases alternated, each a fresh process; "
        f"{args.batches} timed batches after 4 warm-up batches. CPU ms/image is user+sys time of the "
        f"process and its workers over the timed batches.",
        "",
        "| case | threads | output | images/s | vs DataLoader w2 uint8 | vs DataLoader w2 float | CPU ms/image |",
        "|---|---|---|---:|---:|---:|---:|",
        *rows,
        "",
        f"Ceiling for whole-image decoding: the single-core full-size decode rate is "
        f"{med['decode_1core']:.0f} images/s, so {m['cores'] * med['decode_1core']:.0f} images/s on "
        f"{m['cores']} cores for decode alone (the crop's bilinear resample comes on top). A crop "
        f"decode does less work per image (only the box gets the inverse DCT, upsampling and colour "
        f"conversion; the rows below it are entropy-decoded only), so it can pass that line.",
        "",
        "Raw JSON lines:",
        "",
        "```",
        *(json.dumps(r) for recs in lines.values() for r in recs),
        "```",
        "",
    ])
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"data_pipeline_cpu{m['cores']}_{date}{'_' + args.tag if args.tag else ''}.md"
    path.write_text(text)
    return path


if __name__ == "__main__":
    sys.exit(main())
