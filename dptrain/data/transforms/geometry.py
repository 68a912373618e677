"""Sample geometry with Caffe ``TransformationParameter`` semantics, and the per-sample RNG.

A sample's geometry is planned before any pixel is decoded. Each stage only moves a
*box* (the region of the stored image that will become the output) and the output
size; :mod:`dptrain.data.transforms.render` then decodes and resamples once, straight into the
sample's row of the pinned batch buffer. Planning first is what makes the crop decode
and JPEG draft mode possible (see there).

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

import math
from dataclasses import dataclass
from typing import Protocol

from dptrain.config import DataConfig
from dptrain.errors import ConfigError, DataError

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
