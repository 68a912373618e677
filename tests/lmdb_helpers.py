"""Tiny Caffe LMDBs whose pixels are computed from the record index, for the pipeline tests
(CPU and GPU): the green channel of record i is the constant i, so every sample identifies its
record under any crop or flip, and the other channels pin down the crop window exactly."""
from __future__ import annotations

import io
import itertools
import threading

import numpy as np
from PIL import Image

from dptrain.config import DataConfig
from dptrain.data.caffe.datum import encode_datum, hwc_to_raw
from dptrain.data.caffe.writer import write_lmdb

H, W, NUM_CLASSES = 6, 8, 5


def pixels(i: int) -> np.ndarray:
    """[H, W, 3] RGB of record i: R and B vary per pixel, G = i."""
    y, x = np.mgrid[0:H, 0:W]
    return np.stack([x * 16 + y, np.full((H, W), i), (i * 3 + x * 5 + y * 7) % 256], -1).astype(np.uint8)


def raw_value(i: int, label: int | None = None, image: np.ndarray | None = None) -> bytes:
    raw, c, h, w = hwc_to_raw(pixels(i) if image is None else image)
    return encode_datum(label=i % NUM_CLASSES if label is None else label, data=raw, channels=c, height=h, width=w)


def png_value(image: np.ndarray, label: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, "PNG")
    return encode_datum(label=label, data=buf.getvalue(), encoded=True)


def write_db(path, values: list[bytes], keys: list[bytes] | None = None) -> str:
    keys = keys or [f"{i:08d}_r{i}".encode() for i in range(len(values))]
    write_lmdb(path, iter(zip(keys, values, strict=True)), len(values))
    return str(path)


def make_cfg(path: str, **kw) -> DataConfig:
    kw.setdefault("batch_size", 4)
    return DataConfig(source="lmdb", path=path, **kw)


def collect(stream, n: int) -> list[tuple[np.ndarray, np.ndarray, dict]]:
    out = []
    try:
        for hb in itertools.islice(stream, n):
            out.append((hb.images.numpy().copy(), hb.labels.numpy().copy(), dict(hb.info)))
            hb.release(None)
    finally:
        stream.close()
    return out


def input_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dptrain-")]


def ids(images: np.ndarray) -> list[int]:
    return [int(im[0, 0, 1]) for im in images]


def is_window(sample: np.ndarray, i: int) -> bool:
    """sample equals some crop of pixels(i), possibly mirrored."""
    full, ch, cw = pixels(i), sample.shape[0], sample.shape[1]
    return any(np.array_equal(sample, v) for y, x in itertools.product(range(H - ch + 1), range(W - cw + 1))
               for v in (full[y:y + ch, x:x + cw], full[y:y + ch, x:x + cw][:, ::-1]))


