"""The per-sample path in native code: one GIL-free call renders a chunk of records into the ring.

Why native threads, and not worker processes: one solver process's Python pipeline stopped
gaining from more threads on a many-core host, because each image cost hundreds of Python and
Python-to-C calls under the GIL, and with many threads the GIL hand-offs cost more than the work
(measurements: docs/measurements.md#native-renderer).
Worker processes would each have a GIL, but need shared-memory ring slots registered as pinned
memory, an LMDB environment per worker, and process lifetimes to manage. Moving the per-sample
work out of Python keeps the threads, the pinned ring and the queue set, and leaves a few Python
calls per image: the parser's LMDB reads and a share of each chunk's bookkeeping
(``tools/calls_per_image.py`` counts them).

``dptrain/csrc/record_render.c`` does, for each record of a chunk, what the renderer thread and
:mod:`.render` do in Python: parse the Datum, plan the geometry with the same RNG and stages
(boxes and flips equal bit for bit), decode only the needed region of a JPEG (the
:mod:`.jpeg_crop` decoder, draft-scaled as Pillow's ``draft`` would) or take a raw record's
pixels, resample with Pillow's bilinear arithmetic, mirror, and write the ring row, label and
crop window. Pixels: plain crops and boxes off whole pixels equal the Python path's bit for bit;
a resized box on whole pixels (most random-resized crops) uses Pillow's arithmetic where the
Python path uses torch's antialiased kernel, which agree to within one grey level
(``tests/unit/test_native_render.py`` bounds the difference over whole batches).

A record the native path does not take (another image format, CMYK, an EXIF rotation, a stream
libjpeg warns about, a wire-type error, a label out of range, ...) comes back with a non-zero
status and goes through the Python path, which renders it or reports it under the bad-record
policy with its usual messages.

The library is built at first use with the system C compiler (``$CC``, else ``cc``) against
libjpeg-turbo, cached (:mod:`dptrain.csrc.build`), and checked against the Python path in every
process before use (:func:`self_check`). ``DPTRAIN_RENDER`` picks the path:

* ``auto`` (default): native when it builds and passes the check, else Python, with one warning;
* ``python``: always the Python path (``dptrain data-bench --python-render`` compares them);
* ``native``: a build or check failure is an error.
"""
from __future__ import annotations

import ctypes
import io
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from dptrain.csrc import build as native_build
from dptrain.data.caffe.datum import encode_datum, hwc_to_raw, parse_datum
from dptrain.data.transforms import jpeg_crop
from dptrain.data.transforms.geometry import (
    CenterResizedCrop,
    Crop,
    ExpectSize,
    Mirror,
    RandomResizedCrop,
    Resize,
    SampleRng,
    Stage,
)
from dptrain.errors import ConfigError

log = logging.getLogger(__name__)

RENDER_ENV = "DPTRAIN_RENDER"
"""Environment variable: "auto" (default), "python" or "native"."""
_MODES = ("auto", "python", "native")
CSRC = Path(native_build.__file__).resolve().parent
SOURCE = CSRC / "record_render.c"
SOURCES = (SOURCE, CSRC / "jpeg_crop.c")
CFLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared")
"""-ffp-contract=off: the geometry's double arithmetic must round as Python's does (no fused multiply-add)."""
TUNE_FLAGS = native_build.TUNE_FLAGS
LIBS = ("-ljpeg", "-lm")

STAGE_WORDS = 8
"""Doubles per stage in the table the C code reads: an op code, then its parameters."""
_OPS = {Resize: 1, Crop: 2, RandomResizedCrop: 3, CenterResizedCrop: 4, Mirror: 5, ExpectSize: 6}

REASONS = {1: "not a Datum the native parser takes", 2: "no label, or out of range", 3: "not a plain JPEG",
           4: "geometry refused", 5: "libjpeg refused the stream", 6: "raw record needs the Python path",
           7: "out of memory"}
"""Status codes of ``dptrain_render_chunk`` (record_render.c's DPT_* values), for logs and tests."""

_U8P = ctypes.POINTER(ctypes.c_uint8)


class Chunk(ctypes.Structure):
    """``dpt_chunk`` of record_render.c: one call's arguments."""

    _fields_ = [
        ("n", ctypes.c_int32), ("channels", ctypes.c_int32), ("out_h", ctypes.c_int32), ("out_w", ctypes.c_int32),
        ("n_stages", ctypes.c_int32), ("num_classes", ctypes.c_int32), ("draft", ctypes.c_int32),
        ("with_windows", ctypes.c_int32), ("max_pixels", ctypes.c_int64), ("seed", ctypes.c_uint64),
        ("stages", ctypes.c_void_p), ("values", ctypes.c_void_p), ("lengths", ctypes.c_void_p),
        ("epochs", ctypes.c_void_p), ("indices", ctypes.c_void_p), ("images", ctypes.c_void_p),
        ("labels", ctypes.c_void_p), ("windows", ctypes.c_void_p), ("status", ctypes.c_void_p),
    ]


def stage_table(stages: Sequence[Stage]) -> np.ndarray:
    """[len(stages), STAGE_WORDS] float64: the stage chain as record_render.c's ``dpt_plan`` reads it.

    Raises ValueError for a stage it does not know (the stream then uses the Python path).
    """
    table = np.zeros((len(stages), STAGE_WORDS), dtype=np.float64)
    for row, st in zip(table, stages, strict=True):
        op = _OPS.get(type(st))
        if op is None:
            raise ValueError(f"no native form for stage {type(st).__name__}")
        if isinstance(st, (Resize, ExpectSize)):
            params = (st.height, st.width)
        elif isinstance(st, Crop):
            params = (st.size, float(st.random))
        elif isinstance(st, RandomResizedCrop):
            params = (st.size, *st.scale, *st.log_ratio, *st.ratio)
        elif isinstance(st, CenterResizedCrop):
            params = (st.size, st.short_side)
        else:
            params = ()
        row[:1 + len(params)] = (op, *params)
    return table


def mode() -> str:
    value = os.environ.get(RENDER_ENV, "auto").strip().lower() or "auto"
    if value not in _MODES:
        raise ConfigError(f"{RENDER_ENV}={value!r} is not one of {', '.join(_MODES)}")
    return value


def build(directory: Path | None = None, *, tune: bool = True) -> Path:
    """Compile record_render.c (with jpeg_crop.c) unless cached; the path. RuntimeError on failure."""
    cc = native_build.compiler("CC", ("cc", "gcc"))
    if cc is None:
        raise RuntimeError(f"no C compiler {os.environ.get('CC', 'cc')!r} (install gcc or set CC)")
    flags = (*CFLAGS, *(TUNE_FLAGS if tune else ()))
    return native_build.build_library(
        name="record_render", main=SOURCE, sources=SOURCES, command=cc, flags=flags, libs=LIBS,
        machine=native_build.host_cpu() if tune and TUNE_FLAGS else b"", directory=directory,
        hint="libjpeg-turbo's headers: apt install libjpeg-turbo8-dev or libjpeg62-turbo-dev")


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.dptrain_render_chunk.argtypes = [ctypes.POINTER(Chunk)]
    lib.dptrain_render_chunk.restype = ctypes.c_int
    lib.dptrain_plan_sample.argtypes = [ctypes.POINTER(Chunk), ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                        ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_int)]
    lib.dptrain_plan_sample.restype = ctypes.c_int
    return lib


class Renderer:
    """One thread's caller of ``dptrain_render_chunk`` for one stream: the arguments that do not
    change are set once, the per-chunk ones are written into buffers of ``max_rows`` entries."""

    def __init__(self, lib: ctypes.CDLL, *, stages: Sequence[Stage], channels: int, sample_shape: tuple[int, int, int],
                 num_classes: int, seed: int, draft: bool, windows: bool, max_rows: int) -> None:
        self._fn = lib.dptrain_render_chunk
        self._table = stage_table(stages)
        self._values = (ctypes.c_char_p * max_rows)()
        self._lengths = np.zeros(max_rows, dtype=np.uint64)
        self._keys = np.zeros((2, max_rows), dtype=np.uint64)  # epochs, indices
        self.status = np.zeros(max_rows, dtype=np.int8)
        limit = Image.MAX_IMAGE_PIXELS
        c = self._chunk = Chunk(
            channels=channels, out_h=sample_shape[0], out_w=sample_shape[1], n_stages=len(self._table),
            num_classes=num_classes, draft=int(draft), with_windows=int(windows),
            max_pixels=int(limit) if limit else 0, seed=seed & (2**64 - 1),
            stages=self._table.ctypes.data, values=ctypes.addressof(self._values),
            lengths=self._lengths.ctypes.data, epochs=self._keys[0].ctypes.data, indices=self._keys[1].ctypes.data,
            status=self.status.ctypes.data)
        self._arg = ctypes.byref(c)
        self._sample_bytes = int(np.prod(sample_shape))
        self.max_rows = max_rows

    def render(self, values: list[bytes], epoch: int | np.ndarray, indices: np.ndarray, images: np.ndarray,
               labels: np.ndarray, windows: np.ndarray | None) -> int:
        """Render ``values`` (records ``indices`` of ``epoch``) into ``images`` [n, H, W, C] (C-contiguous
        rows of the ring slot), their labels and crop windows; the count left to Python, whose
        :attr:`status` is non-zero."""
        n = len(values)
        c = self._chunk
        c.n = n
        self._values[:n] = values
        self._lengths[:n] = list(map(len, values))
        self._keys[0, :n] = epoch
        self._keys[1, :n] = indices
        c.images = images.ctypes.data
        c.labels = labels.ctypes.data
        c.windows = windows.ctypes.data if windows is not None else None
        return self._fn(self._arg)


def self_check(lib: ctypes.CDLL) -> None:
    """Render a few records natively and through the Python path; RuntimeError if they disagree.

    Covers colour (4:2:0, 4:4:4, progressive) and grey JPEGs, a raw record, random-resized crops
    with and without draft scaling, crops, mirrors and the test view. Geometry and crop windows
    must be equal; pixels equal for plain crops and fractional boxes, within one grey level
    where the Python path resamples with torch. Run once per process before the path is used.
    """
    from dptrain.data.transforms.render import RenderOptions, transform_datum

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:83, 0:121]
    photo = np.stack([128 + 90 * np.sin(xx / (5 + c) + c) * np.cos(yy / 7 - c) for c in range(3)], axis=-1)
    photo = np.clip(photo + rng.normal(0, 12, photo.shape), 0, 255).astype(np.uint8)
    records = []
    for kind in ("4:2:0", "4:4:4", "progressive", "grey"):
        buf = io.BytesIO()
        Image.fromarray(photo[:, :, 0] if kind == "grey" else photo).save(
            buf, "JPEG", quality=90, **({"progressive": True} if kind == "progressive" else
                                        {} if kind == "grey" else {"subsampling": kind}))
        records.append(encode_datum(label=1, data=buf.getvalue(), encoded=True))
    raw, c, h, w = hwc_to_raw(photo)
    records.append(encode_datum(label=2, data=raw, channels=c, height=h, width=w))
    chains: list[list[Stage]] = [[RandomResizedCrop(32, (0.08, 1.0), (3 / 4, 4 / 3)), Mirror()],
                                 [Crop(40, random=True), Mirror()], [CenterResizedCrop(24)], [Resize(50, 70)]]
    for stages in chains:
        out_h = out_w = stages[0].size if not isinstance(stages[0], Resize) else None
        shape = (stages[0].height, stages[0].width, 3) if out_h is None else (out_h, out_w, 3)
        r = Renderer(lib, stages=stages, channels=3, sample_shape=shape, num_classes=10, seed=7, draft=True,
                     windows=True, max_rows=len(records) * 4)
        values = [v for v in records for _ in range(4)]
        n = len(values)
        images = np.zeros((n, *shape), np.uint8)
        labels, windows = np.zeros(n, np.int64), np.zeros((n, 3), np.int32)
        left = r.render(values, 0, np.arange(n), images, labels, windows)
        if left:
            raise RuntimeError(f"it left {left} of {n} clean records to Python "
                               f"({sorted({REASONS.get(int(s), s) for s in r.status[:n] if s})})")
        for i, v in enumerate(values):
            ref, win, datum = np.zeros(shape, np.uint8), np.zeros(3, np.int32), parse_datum(v)
            transform_datum(datum, stages, SampleRng(7, 0, i, 0), 3, ref, RenderOptions(), win)
            diff = np.abs(ref.astype(np.int16) - images[i]).max()
            if not np.array_equal(win, windows[i]) or diff > 1 or labels[i] != datum.label:
                raise RuntimeError(f"record {i} under {[type(s).__name__ for s in stages]}: window "
                                   f"{windows[i].tolist()} vs {win.tolist()}, pixels differ by up to {diff}")


def _make() -> ctypes.CDLL | None:
    want = mode()
    if want == "python" or jpeg_crop.mode() == "pillow":  # DPTRAIN_JPEG=pillow: whole decodes, in Python
        return None
    if want == "auto" and jpeg_crop.library() is None:
        # the crop decoder's own warning (no compiler, no libjpeg-turbo headers) has just said why: one
        # warning per process for one cause, not a second one here
        log.info("native input path off: the JPEG crop decoder it builds on is unavailable (warned above); "
                 "rendering samples in Python")
        return None

    def make() -> ctypes.CDLL:
        if jpeg_crop.library() is None:
            raise RuntimeError("the JPEG crop decoder it builds on is unavailable")
        lib = load(native_build.tuned_or_not(build, log))
        self_check(lib)
        return lib

    return native_build.native_or_none(
        make, strict=want == "native", what="native input path", strict_setting=f"{RENDER_ENV}=native",
        fallback=f"rendering samples in Python (slower: the GIL caps one process's pipeline); set {RENDER_ENV}=python "
                 f"to choose that silently", log=log)


_library = native_build.OncePerProcess(_make)


def library() -> ctypes.CDLL | None:
    """The native renderer, built, loaded and checked once per process; None when off or unavailable."""
    return _library.get()  # type: ignore[return-value]


def reset() -> None:
    """Forget the loaded renderer, so the next :func:`library` reads ``DPTRAIN_RENDER`` again (tests)."""
    _library.reset()
