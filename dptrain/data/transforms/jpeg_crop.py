"""Region-of-interest JPEG decode: only the pixels of a sample's crop box.

A random-resized-crop keeps on average about half of an image, yet a full decode runs the
inverse DCT, upsampling and colour conversion on all of it. ``dptrain/csrc/jpeg_crop.c``
asks libjpeg-turbo for the box alone (``jpeg_crop_scanline`` and ``jpeg_skip_scanlines``,
as DALI's and TensorFlow's crop decoders do). Its pixels equal Pillow's full decode bit for
bit (same library family, ISLOW DCT, fancy upsampling; tests compare them, and
:func:`self_check` compares them again in every process before the decoder is used), so
this is a speed-up only, never a change of what a model sees. The call goes through
ctypes, which releases the GIL for the whole decode, so transformer threads decode in
parallel.

The C file is compiled on first use with the system C compiler (``$CC``, else ``cc``)
against the system libjpeg-turbo (Debian/Ubuntu: ``libjpeg-turbo8-dev`` or
``libjpeg62-turbo-dev``) and cached in ``$DPTRAIN_CACHE`` (default
``$XDG_CACHE_HOME/dptrain``, else ``~/.cache/dptrain``). ``DPTRAIN_JPEG`` picks the decoder:

* ``auto`` (default): the crop decoder when it builds and passes :func:`self_check`, else
  Pillow, with one warning;
* ``pillow``: always Pillow's full decode;
* ``crop``: the crop decoder, and a build or self-check failure is an error (benchmarks use it).

Pillow reads every header first, so a file Pillow refuses is refused whatever the decoder.
Records the crop decoder cannot take (CMYK, a colour image asked for in grey, EXIF-rotated
images, a box off whole pixels) and any stream it refuses go through Pillow: the C code
refuses damaged streams (any libjpeg warning), progressive files with scans missing, and
the rare sampling layouts (4:1:0, 2x4) whose DCT-scaled decode libjpeg-turbo's cropping
gets wrong. So Pillow decides what is undecodable and its messages are the ones users see.
"""
from __future__ import annotations

import ctypes
import io
import logging
import os
from pathlib import Path

import numpy as np
from PIL import Image, features

from dptrain.csrc import build as native_build
from dptrain.errors import ConfigError

log = logging.getLogger(__name__)

JPEG_ENV = "DPTRAIN_JPEG"
"""Environment variable: "auto" (default), "pillow" or "crop"."""
_MODES = ("auto", "pillow", "crop")
SOURCE = Path(native_build.__file__).resolve().parent / "jpeg_crop.c"
CFLAGS = ("-O2", "-fPIC", "-shared")
LIBS = ("-ljpeg",)
_ERR_LEN = 256



def mode() -> str:
    value = os.environ.get(JPEG_ENV, "auto").strip().lower() or "auto"
    if value not in _MODES:
        raise ConfigError(f"{JPEG_ENV}={value!r} is not one of {', '.join(_MODES)}")
    return value


def _compiler() -> list[str] | None:
    """The compiler command: ``$CC`` split as a shell would (``ccache gcc``, ``gcc -std=gnu11``), else cc or gcc."""
    return native_build.compiler("CC", ("cc", "gcc"))


def build(directory: Path | None = None) -> Path:
    """Compile jpeg_crop.c into ``directory`` (default ``native_build.cache_dir()``) unless already
    there; the path (:func:`dptrain.csrc.build.build_library`: keyed by source, compiler and
    flags, written atomically). Raises RuntimeError with the compiler's first error line.
    """
    cc = _compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler {os.environ.get('CC', 'cc')!r} (install gcc or set CC)")
    return native_build.build_library(
        name="jpeg_crop", main=SOURCE, sources=(SOURCE,), command=cc, flags=CFLAGS, libs=LIBS, directory=directory,
        hint="libjpeg-turbo's headers: apt install libjpeg-turbo8-dev or libjpeg62-turbo-dev")


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    fn = lib.dptrain_jpeg_crop
    fn.argtypes = [ctypes.c_char_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_int,  # data, size, scale, gray
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # x0, y0, w, h, flip
                   ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]  # out, err, err_len
    fn.restype = ctypes.c_int
    self_check(lib)
    return lib


def self_check(lib: ctypes.CDLL) -> None:
    """Decode boxes of a few small JPEGs with ``lib`` and with Pillow; RuntimeError if any pixel differs.

    The crop decoder links the system libjpeg-turbo, Pillow its own copy. They decode alike
    (same ISLOW IDCT, fancy upsampling and colour conversion), and this check, run once per
    process before the decoder is used, turns a library that does not (another version's
    arithmetic, headers of one version and a library of another) into the Pillow fallback
    instead of samples that depend on the machine. It covers 4:2:0, 4:2:2, 4:4:4,
    progressive and grey files, DCT scales 1 and 2, and a mirrored box.
    """
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:45, 0:61]
    photo = np.stack([128 + 90 * np.sin(xx / (5 + c) + c) * np.cos(yy / 7 - c) for c in range(3)], axis=-1)
    photo = np.clip(photo + rng.normal(0, 12, photo.shape), 0, 255).astype(np.uint8)
    for kind in ("4:2:0", "4:2:2", "4:4:4", "progressive", "grey"):
        buf = io.BytesIO()
        im = Image.fromarray(photo[:, :, 0] if kind == "grey" else photo)
        im.save(buf, "JPEG", quality=90, **({"progressive": True} if kind == "progressive" else
                                             {} if kind == "grey" else {"subsampling": kind}))
        data = buf.getvalue()
        for scale in (1, 2):
            ref = Image.open(io.BytesIO(data))
            if scale > 1:
                ref.draft(ref.mode, (ref.size[0] // scale, ref.size[1] // scale))
            full = np.asarray(ref)
            full = full[:, :, None] if full.ndim == 2 else full
            h, w, c = full.shape
            box = (w // 8, h // 6, w - w // 5, h - h // 7)
            out = np.empty((box[3] - box[1], box[2] - box[0], c), np.uint8)
            refused = decode_crop(lib, data, box, scale=scale, gray=c == 1, flip=True, out=out)
            if refused is not None or not np.array_equal(out, full[box[1]:box[3], box[0]:box[2]][:, ::-1]):
                raise RuntimeError(f"its pixels differ from Pillow's (a {kind} JPEG at 1/{scale} scale: "
                                   f"{refused or 'different values'}; Pillow's libjpeg-turbo is "
                                   f"{features.version('libjpeg_turbo')})")


def _make() -> ctypes.CDLL | None:
    want = mode()
    if want == "pillow":
        return None
    return native_build.native_or_none(_load, strict=want == "crop", what="JPEG crop decoder",
                                       strict_setting=f"{JPEG_ENV}=crop",
                                       fallback="decoding whole images with Pillow", log=log)


_library = native_build.OncePerProcess(_make)


def library() -> ctypes.CDLL | None:
    """The crop decoder, built and loaded once per process; None when off or unavailable (``auto``)."""
    return _library.get()  # type: ignore[return-value]


def reset() -> None:
    """Forget the loaded decoder, so the next :func:`library` call reads ``DPTRAIN_JPEG`` again (tests)."""
    _library.reset()


def decode_crop(lib: ctypes.CDLL, data: bytes, box: tuple[int, int, int, int], *, scale: int, gray: bool,
                flip: bool, out: np.ndarray) -> str | None:
    """Decode ``box`` (x0, y0, x1, y1 in pixels of the 1/``scale`` decode) into ``out``.

    ``out``: C-contiguous uint8 [y1 - y0, x1 - x0, 1 if gray else 3]; mirrored left-right if
    ``flip``. Returns None, or libjpeg's message when the stream was refused (``out`` is then
    partly written).
    """
    x0, y0, x1, y1 = box
    channels = 1 if gray else 3
    if out.shape != (y1 - y0, x1 - x0, channels) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise RuntimeError(f"out is {out.dtype} {out.shape}, not a C-contiguous uint8 "
                         f"{(y1 - y0, x1 - x0, channels)} array")
    err = ctypes.create_string_buffer(_ERR_LEN)
    rc = lib.dptrain_jpeg_crop(data, len(data), scale, int(gray), x0, y0, x1 - x0, y1 - y0, int(flip),
                               out.ctypes.data, err, _ERR_LEN)
    return None if rc == 0 else err.value.decode("utf-8", "replace")
