"""Per-sample transforms with Caffe ``TransformationParameter`` semantics, and their thread.

A sample's geometry is planned before any pixel is decoded. Each stage only moves a
*box* (the region of the stored image that will become the output) and the output
size; ``render_*`` then decodes and resamples once, straight into the sample's row of
the pinned batch buffer. A box on whole pixels (a random-resized-crop of the stored
image, a resize of the whole image) is resampled by torch's vectorised antialiased
bilinear kernel at a third of Pillow's cost; a fractional box by Pillow, which takes it
as floats. Planning first is what makes the crop decode possible (a JPEG's whole-pixel
box is decoded alone, :mod:`dptrain.data.jpeg_crop`, with Pillow's pixels) and JPEG draft
mode: when the box shrinks by 2x or more, libjpeg decodes at 1/2, 1/4 or 1/8 scale.
That downscale happens in the DCT domain, so it is several times faster and its pixels
differ slightly (a few grey levels) from a full decode followed by a bilinear resize;
both are antialiased. Draft mode never fires for crops that are scaled by less than 2x.

Stages (each has ``spec(in_spec) -> out_spec`` and ``__call__(sample) -> sample``):
``Resize`` (data.resize), ``Crop`` (data.crop_size: random in training, centre in test,
Caffe offsets), ``RandomResizedCrop`` (torchvision's algorithm, 10 tries then a centre
crop), ``CenterResizedCrop`` (its test counterpart: shorter side to crop/0.875, centre
crop), ``Mirror`` (data.mirror, training only) and ``ExpectSize`` (no geometry set: every
record must have the first record's size).

Randomness is a pure function of (seed, epoch, record index, attempt): :class:`SampleRng`
is a counter-based splitmix64 stream, so thread timing and thread counts never change a
sample's crop or flip.
"""
from __future__ import annotations

import io
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from dptrain.config import DataConfig
from dptrain.data import jpeg_crop
from dptrain.data.base import DROPPED_LABEL
from dptrain.data.datum import DatumLike, raw_to_hwc
from dptrain.data.parser import ParsedRecord, RecordHandle, parse_record
from dptrain.errors import ConfigError, DataError

if TYPE_CHECKING:
    from dptrain.data.pipeline import StreamParts

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
EVAL_RESIZE_FRACTION = 0.875
"""Test-time crop fraction for random-resized-crop recipes (224 of 256, the ImageNet convention)."""
RRC_TRIES = 10
"""Box draws before random-resized-crop falls back to a centre crop (torchvision's value)."""


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class SampleRng:
    """Counter-based RNG (splitmix64) keyed by integers, e.g. (seed, epoch, index, attempt)."""

    __slots__ = ("_state",)

    def __init__(self, *key: int) -> None:
        state = 0
        for k in key:
            state = _mix64(((state ^ (k & _MASK64)) + _GOLDEN64) & _MASK64)
        self._state = state

    def _next(self) -> int:
        self._state = (self._state + _GOLDEN64) & _MASK64
        return _mix64(self._state)

    def random(self) -> float:
        """Uniform in [0, 1) with 53 random bits."""
        return (self._next() >> 11) * (1.0 / (1 << 53))

    def uniform(self, lo: float, hi: float) -> float:
        return lo + (hi - lo) * self.random()

    def randint(self, n: int) -> int:
        """Uniform in [0, n); the modulo bias is below 2^-40 for any image size."""
        return self._next() % n


@dataclass(frozen=True)
class SampleSpec:
    """Shape of one sample between stages; None = varies per record. dtype is always uint8."""

    height: int | None
    width: int | None
    channels: int


@dataclass(slots=True)
class Sample:
    """A planned sample: ``box`` (x0, y0, x1, y1, stored-image pixels) becomes out_w x out_h."""

    box: tuple[float, float, float, float]
    out_w: int
    out_h: int
    rng: SampleRng
    flip: bool = False

    def sub_box(self, x0: float, y0: float, w: float, h: float) -> None:
        """Narrow the box to a region given in current output coordinates."""
        bx0, by0, bx1, by1 = self.box
        sx, sy = (bx1 - bx0) / self.out_w, (by1 - by0) / self.out_h
        self.box = (bx0 + x0 * sx, by0 + y0 * sy, bx0 + (x0 + w) * sx, by0 + (y0 + h) * sy)


class Stage(Protocol):
    def spec(self, in_spec: SampleSpec) -> SampleSpec: ...
    def __call__(self, s: Sample) -> Sample: ...


class ExpectSize:
    """Every stored image must have one size: the first record's when no resize or crop is set,
    or a per-pixel mean image's (data.mean_file is subtracted at each crop's offset in the
    stored image, so Caffe checks the same)."""

    def __init__(self, height: int, width: int, *, source: str = "the first record",
                 fix: str = "set data.resize or data.crop_size") -> None:
        self.height, self.width, self.source, self.fix = height, width, source, fix

    def spec(self, in_spec: SampleSpec) -> SampleSpec:
        return SampleSpec(self.height, self.width, in_spec.channels)

    def __call__(self, s: Sample) -> Sample:
        if (s.out_h, s.out_w) != (self.height, self.width):
            raise DataError(f"image is {s.out_h}x{s.out_w} (HxW) but {self.source} is "
                            f"{self.height}x{self.width}; {self.fix}")
        return s


class Resize:
    """Resize the whole (current) image to height x width (bilinear)."""

    def __init__(self, height: int, width: int) -> None:
        self.height, self.width = height, width

    def spec(self, in_spec: SampleSpec) -> SampleSpec:
        return SampleSpec(self.height, self.width, in_spec.channels)

    def __call__(self, s: Sample) -> Sample:
        s.out_w, s.out_h = self.width, self.height
        return s


class Crop:
    """Caffe crop: offset Rand(H - size + 1) in training, (H - size) // 2 in test."""

    def __init__(self, size: int, *, random: bool) -> None:
        self.size, self.random = size, random

    def spec(self, in_spec: SampleSpec) -> SampleSpec:
        for side in (in_spec.height, in_spec.width):
            if side is not None and side < self.size:
                raise ConfigError(f"data.crop_size {self.size} exceeds the input size "
                                  f"{in_spec.height}x{in_spec.width}; lower it or set data.resize")
        return SampleSpec(self.size, self.size, in_spec.channels)

    def __call__(self, s: Sample) -> Sample:
        c = self.size
        if s.out_w < c or s.out_h < c:
            raise DataError(f"image is {s.out_h}x{s.out_w} (HxW), smaller than data.crop_size {c}; "
                            f"set data.resize or a smaller crop")
        if self.random:
            y0, x0 = s.rng.randint(s.out_h - c + 1), s.rng.randint(s.out_w - c + 1)
        else:
            y0, x0 = (s.out_h - c) // 2, (s.out_w - c) // 2
        s.sub_box(x0, y0, c, c)
        s.out_w = s.out_h = c
        return s


class RandomResizedCrop:
    """Random area fraction in ``scale`` and aspect ratio in ``ratio`` (log-uniform), resized to size x size."""

    def __init__(self, size: int, scale: tuple[float, float], ratio: tuple[float, float]) -> None:
        self.size, self.scale = size, scale
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self.ratio = ratio

    def spec(self, in_spec: SampleSpec) -> SampleSpec:
        return SampleSpec(self.size, self.size, in_spec.channels)

    def __call__(self, s: Sample) -> Sample:
        W, H, rng = s.out_w, s.out_h, s.rng
        area = W * H
        for _ in range(RRC_TRIES):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*self.log_ratio))
            w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < w <= W and 0 < h <= H:
                s.sub_box(rng.randint(W - w + 1), rng.randint(H - h + 1), w, h)
                break
        else:
            aspect = W / H
            if aspect < self.ratio[0]:
                w, h = W, round(W / self.ratio[0])
            elif aspect > self.ratio[1]:
                w, h = round(H * self.ratio[1]), H
            else:
                w, h = W, H
            s.sub_box((W - w) // 2, (H - h) // 2, w, h)
        s.out_w = s.out_h = self.size
        return s


class CenterResizedCrop:
    """Test view of random-resized-crop: scale the shorter side to size/0.875, take the centre size x size."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.short_side = round(size / EVAL_RESIZE_FRACTION)

    def spec(self, in_spec: SampleSpec) -> SampleSpec:
        return SampleSpec(self.size, self.size, in_spec.channels)

    def __call__(self, s: Sample) -> Sample:
        side = self.size * min(s.out_w, s.out_h) / self.short_side  # crop side in current pixels
        s.sub_box((s.out_w - side) / 2, (s.out_h - side) / 2, side, side)
        s.out_w = s.out_h = self.size
        return s


class Mirror:
    """Horizontal flip with probability 1/2 (Caffe ``mirror``; training only)."""

    def spec(self, in_spec: SampleSpec) -> SampleSpec:
        return in_spec

    def __call__(self, s: Sample) -> Sample:
        s.flip = s.rng.random() < 0.5
        return s


def build_stages(cfg: DataConfig, *, train: bool, first_hw: tuple[int, int]) -> list[Stage]:
    """The stage chain for the training or the test stream, from the [data] section."""
    stages: list[Stage] = []
    if cfg.resize:
        stages.append(Resize(cfg.resize[0], cfg.resize[1]))
    if cfg.random_resized_crop and train:
        stages.append(RandomResizedCrop(cfg.crop_size, tuple(cfg.rrc_scale), tuple(cfg.rrc_ratio)))
    elif cfg.random_resized_crop and not cfg.resize:
        stages.append(CenterResizedCrop(cfg.crop_size))
    elif cfg.crop_size:
        stages.append(Crop(cfg.crop_size, random=train))
    if not stages:
        stages.append(ExpectSize(*first_hw))
    if train and cfg.mirror:
        stages.append(Mirror())
    return stages


def check_chain(stages: list[Stage], in_spec: SampleSpec) -> SampleSpec:
    """Fold the stage specs once at build time; the output must have a fixed size."""
    spec = in_spec
    for stage in stages:
        spec = stage.spec(spec)
    assert spec.height is not None and spec.width is not None, f"stage chain leaves the size open: {spec}"
    return spec


# --------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class RenderOptions:
    """How a planned sample becomes pixels. Every switch is on by default; turning one off
    (``dptrain data-bench --no-draft / --pillow-resize / --no-crop-decode``) measures what it buys."""

    draft: bool = True
    """JPEG draft mode: a DCT-domain 1/2, 1/4 or 1/8 decode when the box shrinks 2x or more."""
    torch_resize: bool = True
    """Resample whole-pixel boxes with torch's antialiased bilinear kernel instead of Pillow's."""
    crop_decode: bool = True
    """Decode only a JPEG's whole-pixel box (:mod:`dptrain.data.jpeg_crop`; same pixels, less work)."""


def _integral_box(s: Sample) -> tuple[int, int, int, int] | None:
    """The box as ints when its corners are whole pixels (any output size), else None."""
    x0, y0, x1, y1 = s.box
    ib = (round(x0), round(y0), round(x1), round(y1))
    return ib if all(abs(a - b) < 1e-6 for a, b in zip(ib, s.box)) else None


def _is_plain_crop(box: tuple[int, int, int, int] | None, s: Sample) -> bool:
    """Whether whole-pixel ``box`` already has the output size (a copy, no resampling)."""
    return box is not None and box[2] - box[0] == s.out_w and box[3] - box[1] == s.out_h


def _resample_torch(crop: Image.Image, out_w: int, out_h: int, dst: np.ndarray) -> None:
    """Antialiased bilinear resize of a whole-pixel crop (an RGB or L image) into ``dst`` [H, W, C].

    torch's uint8 antialiased bilinear kernel is vectorised for channels-last input and
    takes about a third of Pillow's time on a 224 random-resized-crop (0.3 vs 0.84 ms for
    a 270 px box on one AVX2 core); the op releases the GIL. Its output equals Pillow's
    crop-then-BILINEAR resize (torchvision's resized_crop) to within one grey level. Pillow's
    box resize differs a little more at the border rows, because its filter also reads
    pixels just outside the box.
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


GRAY_MODES = ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")
"""Pillow modes of one-channel images (LA: grey with alpha, which is dropped)."""
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")


def open_image(data: bytes) -> Image.Image:
    """Open an encoded image lazily (header only), refusing decompression bombs, turned upright.

    An EXIF orientation other than 1 is applied (the image is then decoded here, so JPEG
    draft mode does not apply to it), as OpenCV's ``imread`` does for Caffe's
    ``convert_imageset``: a phone photo tagged "rotate 90" trains upright, not sideways.
    """
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise DataError(f"decompression bomb: {e}") from e
    except UnidentifiedImageError as e:  # its text shows only the BytesIO's repr
        raise DataError("undecodable image (not a format Pillow recognises)") from e
    except (OSError, SyntaxError, ValueError) as e:
        raise DataError(f"undecodable image ({e})") from e
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and im.size[0] * im.size[1] > limit:
        raise DataError(f"decompression bomb: {im.size[0]}x{im.size[1]} pixels exceeds "
                        f"PIL.Image.MAX_IMAGE_PIXELS = {limit}")
    if "exif" in im.info:  # Pillow keeps the raw EXIF block there; most images have none
        try:
            if im.getexif().get(ExifTags.Base.Orientation, 1) != 1:
                im = ImageOps.exif_transpose(im)
        except (OSError, SyntaxError, ValueError) as e:
            raise DataError(f"undecodable image ({e})") from e
    return im


def convert_image(im: Image.Image, mode: str) -> Image.Image:
    """``im`` in ``mode`` ("RGB" or "L"). 16-bit grey keeps its high byte (what OpenCV, and so
    Caffe, does); Pillow's own ``convert`` would clip every value above 255 to white."""
    if im.mode in _SIXTEEN_BIT:
        im = Image.fromarray((np.asarray(im) >> 8).astype(np.uint8), "L")
    return im if im.mode == mode else im.convert(mode)


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
        if s.flip:  # in Pillow: 4x cheaper than numpy's negative-stride copy
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
                    dst: np.ndarray, opts: RenderOptions = RenderOptions(), window: np.ndarray | None = None) -> None:
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


# --------------------------------------------------------------------------- thread


def _fill_row(rec: ParsedRecord, dst: np.ndarray, window: np.ndarray | None, parts: StreamParts,
              subs: _SubstituteReader) -> tuple[int, int]:
    """Write record ``rec`` (or its substitutes) into ``dst`` (and its crop into ``window``); returns
    (label, bad records met).

    Bad-record policy: a record that fails (unparsable, undecodable, label out of range,
    too small, bomb) counts against ``data.max_bad_records`` (distinct records, see
    ``BadRecordBudget``, which stops the stream at the batch of the first record over the
    limit, in stream order) and is replaced by the record
    at the next position of this solver's epoch shard (wrapping), then the one after, until
    one works. The choice depends only on the position, so it is the same for every P, T
    and thread timing; the substitute gets its own crop/flip (``attempt`` is in its RNG
    key) and overwrites the whole row, so no stale pixels survive.
    """
    bad = 0
    if parts.drop_bad and (rec.error is not None or rec.datum is None):  # the test's bad records: drop, never substitute
        return _drop_row(rec, dst, window, parts)
    for attempt in range(parts.sequence.span):
        if attempt:
            rec = subs.read(rec.pos, attempt)
        if rec.error is None and rec.datum is not None:
            try:
                transform_datum(rec.datum, parts.stages, SampleRng(parts.seed, rec.epoch, rec.index, attempt),
                                parts.channels, dst, parts.render, window)
                return rec.datum.label, bad
            except DataError as e:
                rec.error = e.located(path=parts.reader.path, key=rec.key, rank=parts.rank)
                if parts.drop_bad:
                    return _drop_row(rec, dst, window, parts)
        assert rec.error is not None, "a record without a datum must carry its error"
        bad += 1
        parts.budget.spend(rec.index, rec.error, rec.pos, attempt)
    raise DataError(f"all {parts.sequence.span} records of this solver's shard are bad",
                    path=parts.reader.path, rank=parts.rank)


def _drop_row(rec: ParsedRecord, dst: np.ndarray, window: np.ndarray | None, parts: StreamParts) -> tuple[int, int]:
    """A bad test record under data.max_bad_records: an empty row that no score counts."""
    assert rec.error is not None, "a record without a datum must carry its error"
    parts.budget.spend(rec.index, rec.error, rec.pos)
    dst[...] = 0
    if window is not None:
        window[:] = 0
    return DROPPED_LABEL, 1


class _SubstituteReader:
    """A transformer's own read transaction, opened only when a substitute is needed."""

    def __init__(self, parts: StreamParts) -> None:
        self._parts = parts
        self._handle: RecordHandle | None = None

    def read(self, pos: int, attempt: int) -> ParsedRecord:
        p = self._parts
        if self._handle is None:
            self._handle = p.reader.handle()
        epoch, index = p.sequence.index(pos, attempt)
        return parse_record(self._handle, pos=pos, epoch=epoch, index=index, num_classes=p.num_classes, rank=p.rank)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()


_PIN_LOCK = threading.Lock()


def single_threaded_torch_in_this_thread() -> None:
    """Run torch ops issued by the calling thread on that thread alone; leave every other thread as it was.

    Each transformer thread already has a core's worth of work. Left at the default, every
    resize would also start an OpenMP team as wide as the machine, whose spinning workers
    take the cores from the other transformers (measured on 2 cores with two transformers:
    2.7 CPU ms per image instead of 2.0). ``torch.set_num_threads`` sets the calling
    thread's team size but also the default that threads started later inherit; a
    short-lived helper thread puts that default back, so the trainer's threads keep theirs.
    """
    with _PIN_LOCK:
        default = torch.get_num_threads()  # also initialises this thread's size from the default
        torch.set_num_threads(1)
        helper = threading.Thread(target=torch.set_num_threads, args=(default,), name="dptrain-torch-threads")
        helper.start()
        helper.join()


def run_transformer(t: int, parts: StreamParts, stop: threading.Event) -> None:
    """Transformer thread t: take its positions from its P queues, decode into the ring."""
    single_threaded_torch_in_this_thread()
    subs = _SubstituteReader(parts)
    batch = parts.batch_size
    try:
        for pos in parts.queues.transformer_positions(t, parts.sequence.length):
            rec = parts.queues.get(pos, stop)
            if rec is None:
                return
            assert rec.pos == pos, f"queue order broken: expected position {pos}, got {rec.pos}"
            b, row = divmod(pos, batch)
            slot = parts.ring.acquire(b, stop)
            if slot is None:
                return
            images, labels, windows = slot
            try:
                labels[row], bad = _fill_row(rec, images[row], windows[row] if parts.windows else None, parts, subs)
            except DataError:
                raise
            except Exception as e:  # a broken invariant, not a bad record: stop the stream
                raise RuntimeError(f"rank {parts.rank}: transformer {t} failed on key "
                                   f"{rec.key.decode('utf-8', 'replace')!r} of {parts.reader.path!r}: {e!r}") from e
            parts.ring.complete(b, parts.batch_rows(b), bad)
    finally:
        subs.close()
