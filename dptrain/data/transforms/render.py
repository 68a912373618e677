"""Rendering a planned sample: decode once, resample once, into its row of the pinned batch buffer.

The stages of :mod:`dptrain.data.transforms.geometry` have planned the sample's box; ``render_*``
turns it into pixels. A box on whole pixels (a random-resized-crop of the stored
image, a resize of the whole image) is resampled by torch's vectorised antialiased
bilinear kernel at a third of Pillow's cost; a fractional box by Pillow, which takes it
as floats. A JPEG's whole-pixel box is decoded alone (:mod:`dptrain.data.transforms.jpeg_crop`,
with Pillow's pixels), and JPEG draft mode applies: when the box shrinks by 2x or more,
libjpeg decodes at 1/2, 1/4 or 1/8 scale. That downscale happens in the DCT domain, so
it is several times faster and its pixels differ slightly (a few grey levels) from a
full decode followed by a bilinear resize; both are antialiased. Draft mode never fires
for crops that are scaled by less than 2x.

An encoded image is opened and converted by :mod:`dptrain.data.caffe.images`, the same functions
``dptrain make-lmdb`` reads its input files with, so a file it accepts decodes the same way in training.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from dptrain.data.caffe.datum import DatumLike, raw_to_hwc
from dptrain.data.caffe.images import GRAY_MODES, convert_image, open_image
from dptrain.data.transforms import jpeg_crop
from dptrain.data.transforms.geometry import Sample, SampleRng, Stage
from dptrain.errors import DataError


@dataclass(frozen=True)
class RenderOptions:
    """How a planned sample becomes pixels. Every switch is on by default; turning one off
    (``dptrain data-bench --no-draft / --pillow-resize / --no-crop-decode``) measures what it buys."""

    draft: bool = True
    """JPEG draft mode: a DCT-domain 1/2, 1/4 or 1/8 decode when the box shrinks 2x or more."""
    torch_resize: bool = True
    """Resample whole-pixel boxes with torch's antialiased bilinear kernel instead of Pillow's."""
    crop_decode: bool = True
    """Decode only a JPEG's whole-pixel box (:mod:`dptrain.data.transforms.jpeg_crop`; same pixels, less work)."""


DEFAULT_RENDER = RenderOptions()
"""Every switch on: what training renders with (a shared default argument; the options are frozen)."""


def _integral_box(s: Sample) -> tuple[int, int, int, int] | None:
    """The box as ints when its corners are whole pixels (any output size), else None."""
    x0, y0, x1, y1 = s.box
    ib = (round(x0), round(y0), round(x1), round(y1))
    return ib if all(abs(a - b) < 1e-6 for a, b in zip(ib, s.box, strict=True)) else None


def _is_plain_crop(box: tuple[int, int, int, int] | None, s: Sample) -> bool:
    """Whether whole-pixel ``box`` already has the output size (a copy, no resampling)."""
    return box is not None and box[2] - box[0] == s.out_w and box[3] - box[1] == s.out_h


def _resample_torch(crop: Image.Image, out_w: int, out_h: int, dst: np.ndarray) -> None:
    """Antialiased bilinear resize of a whole-pixel crop (an RGB or L image) into ``dst`` [H, W, C].

    torch's uint8 antialiased bilinear kernel is vectorised for channels-last input and
    takes a fraction of Pillow's time on a random-resized crop
    (measurements: docs/measurements.md#resize-in-torch); the op releases the GIL.
    Its output equals Pillow's crop-then-BILINEAR resize (torchvision's resized_crop) to within
    one grey level. Pillow's box resize differs a little more at the border rows, because its
    filter also reads pixels just outside the box.
    """
    w, h = crop.size
    c = len(crop.getbands())
    pixels = torch.frombuffer(bytearray(crop.tobytes()), dtype=torch.uint8)  # bytearray: torch wants it writable
    _resample_hwc(pixels.view(h, w, c), out_w, out_h, dst)


def _resample_hwc(hwc: torch.Tensor, out_w: int, out_h: int, dst: np.ndarray) -> None:
    """:func:`_resample_torch` on uint8 [h, w, C] pixels, viewed as [1, C, h, w] channels-last,
    so the output is channels-last too and the HWC copy into the ring slot is a plain memcpy."""
    x = hwc.unsqueeze(0).permute(0, 3, 1, 2)  # strides (h*w*C, 1, w*C, C): torch sees channels-last
    y = F.interpolate(x, size=(out_h, out_w), mode="bilinear", antialias=True, align_corners=False)
    torch.from_numpy(dst).copy_(y[0].permute(1, 2, 0))


def _store(arr: np.ndarray, s: Sample, dst: np.ndarray) -> None:
    if arr.ndim == 2:
        arr = arr[:, :, None]
    dst[...] = arr[:, ::-1] if s.flip else arr


def render_image(im: Image.Image, s: Sample, mode: str, dst: np.ndarray, opts: RenderOptions,
                 data: bytes | None = None) -> None:
    """Decode (draft-scaled when the box shrinks >= 2x), resample once, write into ``dst`` [H, W, C].

    A plain crop is copied. A box on whole pixels (random-resized-crop in training, a
    resize of the whole image) goes through :func:`_resample_torch`; a fractional box
    (after draft scaling, the centre test crop, resize then crop) through Pillow's
    resize, which takes the box as floats. For a whole-pixel box of a JPEG whose file
    bytes are ``data``, only the box is decoded (:func:`_crop_decode`).
    """
    x0, y0, x1, y1 = s.box
    factor = min((x1 - x0) / s.out_w, (y1 - y0) / s.out_h)
    scale = 1
    try:
        if opts.draft and factor >= 2 and im.format == "JPEG":
            w, h = im.size
            drafted = im.draft(mode, (math.ceil(w / factor), math.ceil(h / factor)))
            if drafted is not None:
                # Pillow's box is the stored image's extent in reduced pixels: exactly w/s x h/s. The
                # reduced image is ceil(w/s) wide; its last column is partly the decoder's edge padding.
                _, (dx0, dy0, dx1, dy1) = drafted
                fx, fy = (dx1 - dx0) / w, (dy1 - dy0) / h
                s.box = (x0 * fx, y0 * fy, x1 * fx, y1 * fy)
                scale = round(1 / fx)
        box = _integral_box(s)
        plain = _is_plain_crop(box, s)
        in_torch = box is not None and not plain and opts.torch_resize
        if (plain or in_torch) and opts.crop_decode and data is not None \
                and _crop_decode(im, data, box, scale, mode, s, dst, plain):
            return
        im = convert_image(im, mode)
        if plain or in_torch:
            out = im.crop(box)
        else:
            out = im.resize((s.out_w, s.out_h), Image.Resampling.BILINEAR, box=s.box)
        if s.flip:  # in Pillow: cheaper than numpy's negative-stride copy (docs/measurements.md#flip-in-pillow)
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if in_torch:  # flipping before the resample equals flipping after: the filter is symmetric
            _resample_torch(out, s.out_w, s.out_h, dst)
            return
        arr = np.asarray(out)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"undecodable image ({e})") from e
    dst[...] = arr[:, :, None] if arr.ndim == 2 else arr


def _crop_decode(im: Image.Image, data: bytes, box: tuple[int, int, int, int], scale: int, mode: str,
                 s: Sample, dst: np.ndarray, plain: bool) -> bool:
    """Decode only ``box`` of JPEG ``data`` (at 1/``scale``), mirrored if ``s.flip``, into ``dst``
    (a plain crop) or through :func:`_resample_hwc`; False when the crop decoder cannot
    take this image or refuses the stream, which then goes to Pillow.

    Taken: a JPEG not yet decoded (an EXIF-rotated one was, by :func:`open_image`) whose
    Pillow mode is ``mode``, or grey asked for in RGB (libjpeg replicates the grey as
    Pillow's ``convert`` does). Not taken: CMYK, and colour asked for in grey without draft
    mode (Pillow's luma weights are not libjpeg's Y; under draft, Pillow has libjpeg decode
    to grey, its mode is then "L", and so is the crop decoder's output).

    Pillow has parsed the header (:func:`open_image`), so a file Pillow refuses never
    reaches the crop decoder, and a stream the crop decoder refuses is decoded by Pillow:
    Pillow's verdict stands either way.
    """
    if im.format != "JPEG" or not im.tile or not (im.mode == mode or (im.mode == "L" and mode == "RGB")):
        return False
    lib = jpeg_crop.library()
    if lib is None:
        return False
    x0, y0, x1, y1 = box
    gray = mode == "L"
    target = dst if plain and dst.flags.c_contiguous else np.empty((y1 - y0, x1 - x0, 1 if gray else 3), np.uint8)
    refused = jpeg_crop.decode_crop(lib, data, box, scale=scale, gray=gray, flip=s.flip, out=target)
    if refused is not None:
        return False
    if plain:
        if target is not dst:
            dst[...] = target
    else:
        _resample_hwc(torch.from_numpy(target), s.out_w, s.out_h, dst)
    return True


def render_raw(hwc: np.ndarray, s: Sample, channels: int, dst: np.ndarray, opts: RenderOptions) -> None:
    """Raw pixels: a plain crop is a slice copy (bit-exact); anything else goes through Pillow."""
    crop = _integral_box(s)
    if hwc.shape[2] == channels and _is_plain_crop(crop, s):
        _store(hwc[crop[1]:crop[3], crop[0]:crop[2]], s, dst)
        return
    im = Image.fromarray(np.ascontiguousarray(hwc[:, :, 0] if hwc.shape[2] == 1 else hwc))
    render_image(im, s, "RGB" if channels == 3 else "L", dst, opts)


def transform_datum(datum: DatumLike, stages: list[Stage], rng: SampleRng, channels: int,
                    dst: np.ndarray, opts: RenderOptions = DEFAULT_RENDER, window: np.ndarray | None = None) -> None:
    """Decode, augment and write one parsed Datum into ``dst`` ([H, W, C] uint8 view of a ring slot).

    ``window`` (int32 [3]), if given, receives the sample's crop in the stored image as
    (y0, x0, mirrored), for a per-pixel mean image (see ``base.window_means``).
    """
    if datum.encoded:
        im = open_image(datum.data)
        w, h = im.size
    else:
        hwc = raw_to_hwc(datum)
        h, w = hwc.shape[:2]
    s = Sample((0.0, 0.0, float(w), float(h)), w, h, rng)
    for stage in stages:
        s = stage(s)
    if window is not None:
        window[:] = (round(s.box[1]), round(s.box[0]), s.flip)
    if datum.encoded:
        render_image(im, s, "RGB" if channels == 3 else "L", dst, opts, datum.data)
    else:
        render_raw(hwc, s, channels, dst, opts)


def probe_channels_and_size(datum: DatumLike) -> tuple[int, tuple[int, int]]:
    """(channels, (height, width)) of a record; LmdbSource probes a few to fix the stream's colour mode."""
    if datum.encoded:
        im = open_image(datum.data)
        return (1 if im.mode in GRAY_MODES else 3), (im.size[1], im.size[0])
    hwc = raw_to_hwc(datum)
    return hwc.shape[2], hwc.shape[:2]
