"""The Caffe Datum LMDB writer behind ``dptrain make-lmdb`` (like Caffe's ``convert_imageset``):
(path, label) items, or any (key, value) records, into a new LMDB, atomically.

Records: ``--encoded`` keeps each file's bytes (re-encoded in its own format only when
``--resize`` or ``--gray`` changes the pixels: PNG stays lossless, anything else becomes
JPEG at quality ENCODE_QUALITY); otherwise raw CHW uint8 in BGR order, as Caffe stores
it. Keys are ``%08d_<path>`` in write order, so readers can seek record i by prefix.
``--shuffle`` permutes the order once with ``--seed`` before writing.
"""
from __future__ import annotations

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

from dptrain.data.caffe.datum import encode_datum, hwc_to_raw
from dptrain.data.caffe.images import GRAY_MODES, convert_image, open_image
from dptrain.errors import DataError, InputError

ENCODE_QUALITY = 95
"""JPEG quality when --encoded records must be re-encoded (after --resize/--gray)."""
TXN_RECORDS = 1000
"""Records per write transaction."""
INITIAL_MAP_BYTES = 1 << 30
"""Starting LMDB map size; doubled whenever a transaction hits MDB_MAP_FULL."""


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
    tmp = out.parent / f".{out.name}.incomplete"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier run that died
        tmp.mkdir()
        env = lmdb.open(str(tmp), map_size=INITIAL_MAP_BYTES, subdir=True, meminit=False)
    except (OSError, lmdb.Error) as e:  # a folder this user may not write to, a read-only filesystem
        why = f"{e.strerror}: {str(e.filename)!r}" if isinstance(e, OSError) and e.strerror else str(e)
        raise InputError(f"cannot create the LMDB {str(out)!r} ({why}); choose an output path this user can "
                         f"write to") from e
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
