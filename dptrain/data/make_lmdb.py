"""``dptrain make-lmdb``: images -> a Caffe Datum LMDB (like Caffe's ``convert_imageset``).

Inputs:
* an image folder with one subfolder per class; classes sorted by name get labels 0, 1, ...;
* a list file of ``path label`` lines (paths relative to ``--root``; a path may contain
  spaces, the label is the last field);
* ``--digits``: the built-in digits set, written as ``OUT/train`` and ``OUT/test``.

Records: ``--encoded`` keeps each file's bytes (re-encoded in its own format only when
``--resize`` or ``--gray`` changes the pixels: PNG stays lossless, anything else becomes
JPEG at quality ENCODE_QUALITY); otherwise raw CHW uint8 in BGR order, as Caffe stores
it. Keys are ``%08d_<path>`` in write order, so readers can seek record i by prefix.
``--shuffle`` permutes the order once with ``--seed`` before writing.
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import lmdb
import numpy as np
from PIL import Image
from tqdm import tqdm

from dptrain.data.datum import encode_datum, hwc_to_raw
from dptrain.data.render import GRAY_MODES, convert_image, open_image
from dptrain.errors import DataError, InputError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
ENCODE_QUALITY = 95
"""JPEG quality when --encoded records must be re-encoded (after --resize/--gray)."""
TXN_RECORDS = 1000
"""Records per write transaction."""
INITIAL_MAP_BYTES = 1 << 30
"""Starting LMDB map size; doubled whenever a transaction hits MDB_MAP_FULL."""


def list_image_folder(root: str | Path) -> tuple[list[tuple[str, int]], list[str]]:
    """([(relative path, label)], class names) for ``root/<class>/<image>``, all sorted by name.

    Hidden entries (``.ipynb_checkpoints``, ``._x.jpg``) are skipped; a class folder without
    images is an error, since it would still take a label and shift every class after it.
    """
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"image folder {str(root)!r} does not exist")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    items = []
    for label, c in enumerate(classes):
        files = [f for f in sorted((root / c).iterdir())
                 if f.suffix.lower() in IMAGE_SUFFIXES and not f.name.startswith(".")]
        if not files:
            raise InputError(f"class folder {str(root / c)!r} has no images ({', '.join(IMAGE_SUFFIXES)}); "
                             f"remove it or add its images (labels follow the sorted class folders)")
        items += [(f"{c}/{f.name}", label) for f in files]
    if not items:
        raise InputError(f"image folder {str(root)!r} has no images in class subfolders ({', '.join(IMAGE_SUFFIXES)})")
    return items, classes


def read_list_file(path: str | Path) -> list[tuple[str, int]]:
    """[(path, label)] from ``path label`` lines; blank lines are skipped."""
    p = Path(path)
    if not p.is_file():
        what = "is not a regular file" if p.exists() else "does not exist"
        raise InputError(f"list file {str(p)!r} {what}; give an image folder or a file of 'path label' lines")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"list file {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start}); give an image "
                         f"folder or a list of 'path label' lines") from e
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.rsplit(maxsplit=1)
        if len(parts) != 2 or not (parts[1].isascii() and parts[1].isdigit()):
            raise InputError(f"{p}:{n}: expected 'path label' with an integer label >= 0, got {line!r}")
        items.append((parts[0], int(parts[1])))
    if not items:
        raise InputError(f"list file {str(p)!r} lists no images")
    return items


def _record(data: bytes, label: int, index: int, *, resize: tuple[int, int] | None, encoded: bool,
            gray: bool) -> bytes:
    """One Datum from an image file's bytes."""
    im = open_image(data)  # upright (EXIF orientation applied), like OpenCV's imread in convert_imageset
    fmt = Image.open(io.BytesIO(data)).format if im.format is None else im.format
    if encoded and resize is None and not gray:
        im.load()  # decode once, as convert_imageset does: a truncated or corrupt file fails here, not in training
        return encode_datum(label=label, data=data, channels=1 if im.mode in GRAY_MODES else 3,
                            height=im.size[1], width=im.size[0], encoded=True, record_id=index)
    im = convert_image(im, "L" if gray else "RGB")
    if resize is not None:
        im = im.resize((resize[1], resize[0]), Image.Resampling.BILINEAR)
    if encoded:
        buf = io.BytesIO()
        if fmt == "PNG":
            im.save(buf, "PNG")
        else:
            im.save(buf, "JPEG", quality=ENCODE_QUALITY)
        return encode_datum(label=label, data=buf.getvalue(), channels=1 if gray else 3,
                            height=im.size[1], width=im.size[0], encoded=True, record_id=index)
    raw, c, h, w = hwc_to_raw(np.asarray(im))
    return encode_datum(label=label, data=raw, channels=c, height=h, width=w, record_id=index)


def write_lmdb(out: str | Path, records: Iterator[tuple[bytes, bytes]], total: int) -> int:
    """Write (key, value) pairs into a new LMDB at ``out``; returns the count written.

    The DB is built in ``.<name>.incomplete`` beside ``out`` and renamed into place only
    when every record is in, so a run that fails part-way leaves no LMDB that looks whole.
    """
    out = Path(out)
    if (out / "data.mdb").exists():
        raise InputError(f"{str(out)!r} already holds an LMDB; remove it or choose another output path")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{str(out)!r} exists and is not an empty folder; remove it or choose another output path")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise InputError(f"cannot create {str(out)!r}: {str(blocker)!r} is a file; choose another output path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.incomplete"
    shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier run that died
    tmp.mkdir()
    env = lmdb.open(str(tmp), map_size=INITIAL_MAP_BYTES, subdir=True, meminit=False)
    written, done = 0, False
    try:
        bar = tqdm(total=total, unit="img", desc=f"make-lmdb {out.name}", disable=not sys.stderr.isatty())
        chunk: list[tuple[bytes, bytes]] = []
        for key, value in records:
            if len(key) > env.max_key_size():
                raise InputError(f"key {key[:40].decode('utf-8', 'replace')!r}... is {len(key)} bytes, over "
                                 f"LMDB's {env.max_key_size()}; shorten the image paths")
            chunk.append((key, value))
            if len(chunk) == TXN_RECORDS:
                written += _put_chunk(env, chunk)
                bar.update(len(chunk))
                chunk = []
        written += _put_chunk(env, chunk)
        bar.update(len(chunk))
        bar.close()
        done = True
    except lmdb.Error as e:
        raise InputError(f"writing the LMDB {str(out)!r} failed ({e}); check the disk space and the path") from e
    finally:
        env.close()
        if not done:
            shutil.rmtree(tmp, ignore_errors=True)
    if out.exists():
        out.rmdir()  # empty, checked above
    tmp.rename(out)
    return written


def _put_chunk(env: lmdb.Environment, chunk: list[tuple[bytes, bytes]]) -> int:
    while True:
        try:
            with env.begin(write=True) as txn:
                for key, value in chunk:
                    txn.put(key, value)
            return len(chunk)
        except lmdb.MapFullError:
            env.set_mapsize(env.info()["map_size"] * 2)


def make_lmdb(out: str | Path, items: list[tuple[str, int]], *, root: str | Path = ".",
              resize: tuple[int, int] | None = None, shuffle: bool = False, seed: int = 0,
              encoded: bool = False, gray: bool = False) -> int:
    """Write ``items`` ([(path relative to root, label)]) as Datums to a new LMDB ``out``; returns the count."""
    if resize is not None and min(resize) <= 0:
        raise InputError(f"--resize needs positive H W, got {list(resize)}")
    if seed < 0:
        raise InputError(f"--seed must be >= 0, got {seed}")
    order = np.random.default_rng(seed).permutation(len(items)) if shuffle else np.arange(len(items))
    root = Path(root)

    def records() -> Iterator[tuple[bytes, bytes]]:
        for i, j in enumerate(order):
            rel, label = items[j]
            path = root / rel
            try:
                value = _record(path.read_bytes(), label, i, resize=resize, encoded=encoded, gray=gray)
            except (OSError, Image.DecompressionBombError, DataError) as e:
                why = e.reason if isinstance(e, DataError) else str(e)
                raise InputError(f"cannot read image {str(path)!r} ({why}); fix or remove it from the input") from e
            yield b"%08d_" % i + os.fsencode(rel), value  # fsencode: file names need not be UTF-8

    return write_lmdb(out, records(), len(items))


def make_digits_lmdb(out: str | Path, *, encoded: bool) -> dict[str, int]:
    """The built-in digits as ``out/train`` and ``out/test`` (PNG when encoded, else raw BGR CHW)."""
    from dptrain.data.builtin import load_digits_arrays

    xtr, ytr, xte, yte = load_digits_arrays()
    counts = {}
    for split, images, labels in (("train", xtr, ytr), ("test", xte, yte)):
        def records(images: np.ndarray = images, labels: np.ndarray = labels,
                    split: str = split) -> Iterator[tuple[bytes, bytes]]:
            for i, (img, label) in enumerate(zip(images, labels, strict=True)):
                if encoded:
                    buf = io.BytesIO()
                    Image.fromarray(img).save(buf, "PNG")
                    value = encode_datum(label=int(label), data=buf.getvalue(), channels=3, height=img.shape[0],
                                         width=img.shape[1], encoded=True, record_id=i)
                else:
                    raw, c, h, w = hwc_to_raw(img)
                    value = encode_datum(label=int(label), data=raw, channels=c, height=h, width=w, record_id=i)
                yield f"{i:08d}_{split}/{i:05d}.png".encode(), value

        counts[split] = write_lmdb(Path(out) / split, records(), len(labels))
    return counts


def add_make_lmdb_args(p: argparse.ArgumentParser) -> None:
    """Arguments of ``dptrain make-lmdb``."""
    p.description = ("Convert images into a Caffe Datum LMDB. SOURCE is an image folder (one subfolder per "
                     "class) or a 'path label' list file (paths relative to --root). With --digits, OUT/train "
                     "and OUT/test are written from the built-in digits.")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="SOURCE OUT: input folder or list file, then the new LMDB; with --digits only OUT")
    p.add_argument("--root", default="", help="directory the list file's paths are relative to (default: its folder)")
    p.add_argument("--resize", nargs=2, type=int, metavar=("H", "W"), help="resize every image to H x W")
    p.add_argument("--shuffle", action="store_true", help="write the records in a seeded random order")
    p.add_argument("--seed", type=int, default=0, help="seed of --shuffle (default 0)")
    p.add_argument("--encoded", action="store_true", help="store the encoded file bytes (default: raw BGR CHW)")
    p.add_argument("--gray", action="store_true", help="store one-channel images")
    p.add_argument("--digits", action="store_true", help="write the built-in digits to OUT/train and OUT/test")


def run_make_lmdb(args: argparse.Namespace) -> dict:
    """Entry of ``dptrain make-lmdb``: write the LMDB(s); return what was written (the CLI prints it)."""
    if args.digits:
        if len(args.paths) != 1:
            raise InputError(f"make-lmdb --digits takes one output path, got {args.paths}")
        counts = make_digits_lmdb(args.paths[0], encoded=args.encoded)
        return {"out": args.paths[0], "records": counts, "encoded": args.encoded}
    if len(args.paths) != 2:
        raise InputError(f"make-lmdb takes SOURCE OUT (or --digits OUT), got {args.paths}")
    source, out = Path(args.paths[0]), args.paths[1]
    if source.is_dir():
        items, classes = list_image_folder(source)
        root = source
    else:
        items, classes = read_list_file(source), []
        root = Path(args.root) if args.root else source.parent
    n = make_lmdb(out, items, root=root, resize=tuple(args.resize) if args.resize else None,
                  shuffle=args.shuffle, seed=args.seed, encoded=args.encoded, gray=args.gray)
    return {"out": out, "records": n, "classes": len(classes) or None, "encoded": args.encoded}
