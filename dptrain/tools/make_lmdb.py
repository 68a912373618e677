"""``dptrain make-lmdb``: images -> a Caffe Datum LMDB (like Caffe's ``convert_imageset``).

Inputs:
* an image folder with one subfolder per class; classes sorted by name get labels 0, 1, ...;
* a list file of ``path label`` lines (paths relative to ``--root``; a path may contain
  spaces, the label is the last field);
* ``--digits``: the built-in digits set, written as ``OUT/train`` and ``OUT/test``.

The records and the writing are :mod:`dptrain.data.caffe.writer`'s.
"""
from __future__ import annotations

import argparse
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image

from dptrain.data.caffe.datum import encode_datum, hwc_to_raw
from dptrain.data.caffe.writer import make_lmdb, write_lmdb
from dptrain.data.sources.builtin import load_digits_arrays
from dptrain.data.sources.files import list_image_folder, read_list_file
from dptrain.errors import InputError


def make_digits_lmdb(out: str | Path, *, encoded: bool) -> dict[str, int]:
    """The built-in digits as ``out/train`` and ``out/test`` (PNG when encoded, else raw BGR CHW)."""
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


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def main(args: argparse.Namespace) -> dict:
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
        items, classes = list_image_folder(source, "make-lmdb SOURCE")
        root = source
    else:
        items, classes = read_list_file(source), []
        root = Path(args.root) if args.root else source.parent
    n = make_lmdb(out, items, root=root, resize=tuple(args.resize) if args.resize else None,
                  shuffle=args.shuffle, seed=args.seed, encoded=args.encoded, gray=args.gray)
    return {"out": out, "records": n, "classes": len(classes) or None, "encoded": args.encoded}
