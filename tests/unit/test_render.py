"""Rendering a planned sample: torch's resample against Pillow's, and the transformer threads' torch settings."""
from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from dptrain.data.loader.renderers import single_threaded_torch_in_this_thread
from dptrain.data.transforms import render
from dptrain.data.transforms.geometry import Sample, SampleRng
from dptrain.data.transforms.render import RenderOptions, render_image


def _photo(height: int, width: int, mode: str) -> Image.Image:
    """Smooth colour ramps plus noise: edges and texture for the filters to disagree on."""
    rng = np.random.default_rng(5)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([128 + 100 * np.sin(xx / 9 + c) * np.cos(yy / 13 - c) for c in range(3)], axis=-1)
    img = Image.fromarray(np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8))
    return img.convert(mode)


def _render(img: Image.Image, box, out_w: int, out_h: int, flip: bool, opts: RenderOptions) -> np.ndarray:
    channels = 3 if img.mode == "RGB" else 1
    dst = np.full((out_h, out_w, channels), 7, np.uint8)
    render_image(img, Sample(tuple(float(v) for v in box), out_w, out_h, SampleRng(0), flip), img.mode, dst, opts)
    return dst


def _pillow(img: Image.Image, box, out_w: int, out_h: int, flip: bool, *, crop_first: bool = False) -> np.ndarray:
    """Pillow's bilinear resize of ``box``; ``crop_first`` crops before resizing (torchvision's resized_crop),
    so the filter sees no pixels outside the box."""
    if crop_first:
        ref = np.asarray(img.crop(box).resize((out_w, out_h), Image.Resampling.BILINEAR))
    else:
        ref = np.asarray(img.resize((out_w, out_h), Image.Resampling.BILINEAR, box=box))
    ref = ref[:, :, None] if ref.ndim == 2 else ref
    return ref[:, ::-1] if flip else ref


@pytest.mark.parametrize("mode", ["RGB", "L"])
@pytest.mark.parametrize("box, out_w, out_h, flip", [
    ((13, 7, 164, 104), 64, 48, False),   # random-resized-crop style downscale, aspect changes
    ((0, 0, 200, 150), 64, 48, True),     # the whole image, mirrored
    ((5, 9, 35, 49), 64, 80, False),      # upscale
])
def test_torch_resample_matches_pillow_crop_then_bilinear_on_whole_pixel_boxes(monkeypatch, mode, box, out_w, out_h, flip):
    img = _photo(150, 200, mode)
    calls = []
    real = render._resample_torch
    monkeypatch.setattr(render, "_resample_torch", lambda *a: calls.append(1) or real(*a))
    fast = _render(img, box, out_w, out_h, flip, RenderOptions())
    assert calls, "a whole-pixel box must take the torch path"
    diff = np.abs(fast.astype(int) - _pillow(img, box, out_w, out_h, flip, crop_first=True).astype(int))
    assert diff.max() <= 1 and diff.mean() < 0.01, (diff.max(), diff.mean())
    calls.clear()
    slow = _render(img, box, out_w, out_h, flip, RenderOptions(torch_resize=False))
    assert np.array_equal(slow, _pillow(img, box, out_w, out_h, flip))
    assert not calls


@pytest.mark.parametrize("mode", ["RGB", "L"])
@pytest.mark.parametrize("box, out_w, out_h", [((13, 7, 164, 104), 64, 48), ((3, 2, 40, 31), 57, 45), ((0, 0, 200, 150), 97, 61)])
def test_mirroring_before_the_torch_resample_equals_mirroring_after(mode, box, out_w, out_h):
    """The transformer flips the crop, then resamples; that must be the mirror image of the unflipped sample."""
    img = _photo(150, 200, mode)
    plain = _render(img, box, out_w, out_h, False, RenderOptions())
    assert np.array_equal(_render(img, box, out_w, out_h, True, RenderOptions()), plain[:, ::-1])


@pytest.mark.parametrize("width, height, out", [(99, 97, 6), (99, 97, 12), (130, 75, 30), (96, 72, 12)])
def test_draft_decode_keeps_the_box_on_the_image_when_sides_are_not_multiples_of_the_scale(width, height, out):
    """A 1/s draft decode is ceil(w/s) wide, but the image covers only w/s of it: the box must scale by 1/s."""
    yy, xx = np.mgrid[0:height, 0:width]
    ramp = np.stack([xx * 255 // (width - 1), yy * 255 // (height - 1), (xx + yy) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, "JPEG", quality=95)

    def render(draft: bool) -> np.ndarray:
        im = Image.open(io.BytesIO(buf.getvalue()))
        dst = np.empty((out, out, 3), np.uint8)
        render_image(im, Sample((0.0, 0.0, float(width), float(height)), out, out, SampleRng(0)), "RGB", dst,
                     RenderOptions(draft=draft))
        assert (im.size != (width, height)) == draft, "draft mode must fire only when asked"
        return dst

    diff = np.abs(render(True).astype(int) - render(False).astype(int))
    assert diff[..., :2].max() <= 4, diff[..., :2].max()  # the ramps: a misplaced box shows up as an offset


def test_fractional_boxes_and_plain_crops_stay_with_pillow(monkeypatch):
    img = _photo(150, 200, "RGB")
    monkeypatch.setattr(render, "_resample_torch", lambda *a: pytest.fail("torch path taken"))
    box = (10.5, 3.25, 150.5, 120.75)  # e.g. the centre test crop, or a box after draft scaling
    assert np.array_equal(_render(img, box, 64, 48, True, RenderOptions()), _pillow(img, box, 64, 48, True))
    crop = _render(img, (20, 30, 84, 78), 64, 48, False, RenderOptions())
    assert np.array_equal(crop, np.asarray(img)[30:78, 20:84])


def test_transformer_threads_run_torch_alone_and_leave_other_threads_alone():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: dict[str, int] = {}
    pinned, go = threading.Event(), threading.Event()

    def transformer_thread() -> None:
        single_threaded_torch_in_this_thread()
        pinned.set()
        go.wait(10)
        seen["transformer"] = torch.get_num_threads()

    def later_thread() -> None:
        seen["started later"] = torch.get_num_threads()

    try:
        t = threading.Thread(target=transformer_thread)
        t.start()
        assert pinned.wait(10)
        later = threading.Thread(target=later_thread)
        later.start()
        later.join()
        go.set()
        t.join()
        seen["main"] = torch.get_num_threads()
        assert seen == {"transformer": 1, "started later": 2, "main": 2}
    finally:
        torch.set_num_threads(before)


def test_sixteen_bit_grey_keeps_its_high_byte_instead_of_clipping_to_white():
    ramp = (np.arange(8 * 6, dtype=np.uint32).reshape(6, 8) * 1365).astype(np.uint16)  # 0 .. 64155
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, "PNG")
    assert render.open_image(buf.getvalue()).mode.startswith("I;16")
    for mode, channels in (("L", 1), ("RGB", 3)):
        dst = np.empty((6, 8, channels), np.uint8)
        render_image(render.open_image(buf.getvalue()), Sample((0.0, 0.0, 8.0, 6.0), 8, 6, SampleRng(0)),
                     mode, dst, RenderOptions())
        assert np.array_equal(dst, np.repeat((ramp >> 8).astype(np.uint8)[:, :, None], channels, axis=2)), mode


def test_exif_orientation_is_applied_so_photos_train_upright():
    from PIL import ExifTags

    stored = np.zeros((16, 24, 3), np.uint8)
    stored[:, :12, 0] = 255  # left half red as stored; the tag says "rotate 90 clockwise to display"
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6
    buf = io.BytesIO()
    Image.fromarray(stored).save(buf, "PNG", exif=exif.tobytes())
    im = render.open_image(buf.getvalue())
    assert im.size == (16, 24)  # W x H: upright is taller than wide
    assert np.array_equal(np.asarray(im.convert("RGB")), np.rot90(stored, k=-1))  # red on top
