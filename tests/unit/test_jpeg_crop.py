"""The region-of-interest JPEG decoder: Pillow's pixels, Pillow's refusals, and the fallbacks."""
from __future__ import annotations

import ctypes
import io
import logging
import re
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dptrain.data.transforms import jpeg_crop, render
from dptrain.data.transforms.geometry import Sample, SampleRng
from dptrain.data.transforms.render import RenderOptions, render_image
from dptrain.errors import ConfigError, DataError, SetupError


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A decoder state of its own: its cache in tmp_path, DPTRAIN_JPEG read anew, forgotten afterwards."""
    monkeypatch.setenv("DPTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(jpeg_crop.JPEG_ENV, raising=False)
    jpeg_crop.reset()
    yield
    jpeg_crop.reset()


@pytest.fixture
def lib():
    """The decoder, loaded (and self-checked) before a test patches ``decode_crop`` to count calls."""
    found = jpeg_crop.library()
    if found is None:  # another test may have left the Pillow choice behind
        jpeg_crop.reset()
        found = jpeg_crop.library()
    if found is None:
        pytest.skip("the JPEG crop decoder does not build here (no C compiler or no libjpeg-turbo headers)")
    return found


def _photo(height: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([128 + 100 * np.sin(xx / (7 + c) + c) * np.cos(yy / 11 - c) for c in range(3)], axis=-1)
    return np.clip(base + rng.normal(0, 14, base.shape), 0, 255).astype(np.uint8)


def _jpeg(kind: str, height: int = 75, width: int = 93, seed: int = 0) -> bytes:
    im = Image.fromarray(_photo(height, width, seed))
    buf = io.BytesIO()
    if kind == "gray":
        im.convert("L").save(buf, "JPEG", quality=90)
    elif kind == "progressive":
        im.save(buf, "JPEG", quality=90, progressive=True)
    else:
        im.save(buf, "JPEG", quality=90, subsampling=kind)
    return buf.getvalue()


def _boxes(rng: np.random.Generator, w: int, h: int, n: int) -> list[tuple[int, int, int, int]]:
    """Random boxes plus the corners, edges and the whole image."""
    boxes = [(0, 0, w, h), (0, 0, 1, 1), (w - 1, h - 1, w, h), (0, h - 3, w, h), (w - 5, 0, w, h)]
    for _ in range(n):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        boxes.append((x0, y0, int(rng.integers(x0 + 1, w + 1)), int(rng.integers(y0 + 1, h + 1))))
    return boxes


@pytest.mark.parametrize("kind", ["4:2:0", "4:2:2", "4:4:4", "gray", "progressive"])
@pytest.mark.parametrize("scale", [1, 2, 8])
def test_crop_decode_equals_pillows_full_decode_bit_for_bit(lib, kind, scale):
    data = _jpeg(kind, seed=scale)
    im = Image.open(io.BytesIO(data))
    gray = im.mode == "L"
    if scale > 1:  # Pillow's own DCT-scaled decode is the reference
        width = im.size[0]
        _, (_, _, dw, _) = im.draft(im.mode, (im.size[0] // scale, im.size[1] // scale))
        assert round(width / dw) == scale
    full = np.asarray(im)
    full = full[:, :, None] if full.ndim == 2 else full
    h, w = full.shape[:2]
    rng = np.random.default_rng(len(data))
    for i, box in enumerate(_boxes(rng, w, h, 25)):
        x0, y0, x1, y1 = box
        flip = bool(i % 2)
        out = np.empty((y1 - y0, x1 - x0, 1 if gray else 3), np.uint8)
        assert jpeg_crop.decode_crop(lib, data, box, scale=scale, gray=gray, flip=flip, out=out) is None
        want = full[y0:y1, x0:x1]
        assert np.array_equal(out, want[:, ::-1] if flip else want), (kind, scale, box, flip)


def test_grey_jpeg_asked_for_in_rgb_is_pillows_convert(lib):
    data = _jpeg("gray")
    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))[10:40, 5:60]
    out = np.empty((30, 55, 3), np.uint8)
    assert jpeg_crop.decode_crop(lib, data, (5, 10, 60, 40), scale=1, gray=False, flip=False, out=out) is None
    assert np.array_equal(out, want)


def test_damage_anywhere_is_refused_even_below_the_box(lib):
    data = _jpeg("4:2:0", height=120, width=90)
    out = np.empty((8, 8, 3), np.uint8)
    for cut in (len(data) // 3, len(data) - 40):  # the box is in the top rows; the damage is further down
        msg = jpeg_crop.decode_crop(lib, data[:cut], (0, 0, 8, 8), scale=1, gray=False, flip=False, out=out)
        assert msg is not None and "Premature end" in msg
    msg = jpeg_crop.decode_crop(lib, b"\xff\xd8" + b"garbage" * 20, (0, 0, 8, 8), scale=1, gray=False,
                                flip=False, out=out)
    assert msg is not None
    outside = jpeg_crop.decode_crop(lib, data, (85, 0, 93, 8), scale=1, gray=False, flip=False, out=out)
    assert outside is not None and "outside" in outside


def test_out_must_match_the_box(lib):
    with pytest.raises(RuntimeError, match="C-contiguous uint8"):
        jpeg_crop.decode_crop(lib, _jpeg("4:2:0"), (0, 0, 8, 8), scale=1, gray=False, flip=False,
                              out=np.empty((8, 9, 3), np.uint8))


def _render(data: bytes, box, out_w: int, out_h: int, flip: bool, mode: str, opts: RenderOptions) -> np.ndarray:
    dst = np.full((out_h, out_w, 3 if mode == "RGB" else 1), 7, np.uint8)
    sample = Sample(tuple(float(v) for v in box), out_w, out_h, SampleRng(0), flip)
    render_image(render.open_image(data), sample, mode, dst, opts, data)
    return dst


@pytest.mark.parametrize("kind, mode", [("4:2:0", "RGB"), ("4:4:4", "RGB"), ("gray", "L"), ("gray", "RGB"),
                                        ("progressive", "RGB")])
@pytest.mark.parametrize("box, out_w, out_h, flip", [
    ((13, 7, 80, 61), 32, 32, False),   # random-resized-crop: resampled by torch
    ((13, 7, 80, 61), 32, 32, True),
    ((20, 11, 52, 43), 32, 32, True),   # a plain crop: copied straight into the row
    ((4, 0, 92, 72), 20, 16, False),    # 4.4x smaller: draft mode decodes at 1/4, the box stays whole
])
def test_render_with_crop_decode_equals_the_full_decode_path(lib, monkeypatch, kind, mode, box, out_w, out_h, flip):
    data = _jpeg(kind)
    calls = []
    real = jpeg_crop.decode_crop
    monkeypatch.setattr(jpeg_crop, "decode_crop", lambda *a, **k: calls.append(k["scale"]) or real(*a, **k))
    fast = _render(data, box, out_w, out_h, flip, mode, RenderOptions())
    assert calls == [4 if out_w == 20 else 1], "a whole-pixel box of a JPEG must be crop-decoded"
    full = _render(data, box, out_w, out_h, flip, mode, RenderOptions(crop_decode=False))
    assert np.array_equal(fast, full)


def test_images_the_crop_decoder_does_not_take_go_through_pillow(lib, monkeypatch):
    calls = []
    monkeypatch.setattr(jpeg_crop, "decode_crop", lambda *a, **k: calls.append(1))
    colour, buf = _jpeg("4:2:0"), io.BytesIO()
    Image.fromarray(_photo(75, 93, 1)).convert("CMYK").save(buf, "JPEG", quality=90)
    cmyk = buf.getvalue()
    box = (13, 7, 80, 61)
    grey = _render(colour, box, 32, 32, False, "L", RenderOptions())  # Pillow's luma, not libjpeg's Y
    assert np.array_equal(grey, _render(colour, box, 32, 32, False, "L", RenderOptions(crop_decode=False)))
    _render(cmyk, box, 32, 32, False, "RGB", RenderOptions())
    _render(colour, (13.5, 7, 80, 61), 32, 32, False, "RGB", RenderOptions())  # a fractional box
    assert calls == []


def test_a_stream_the_crop_decoder_refuses_gets_pillows_verdict(lib):
    data = _jpeg("4:2:0", height=120, width=90)
    with pytest.raises(DataError, match="undecodable image.*truncated"):
        _render(data[: len(data) * 2 // 3], (0, 0, 40, 30), 20, 15, False, "RGB", RenderOptions())


def test_no_compiler_falls_back_to_pillow_with_one_warning(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with caplog.at_level(logging.WARNING, logger="dptrain.data.transforms.jpeg_crop"):
        assert jpeg_crop.library() is None
        assert jpeg_crop.library() is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "no-such-compiler-here" in warnings[0] and "Pillow" in warnings[0]
    data = _jpeg("4:2:0")  # rendering still works, through Pillow
    out = _render(data, (13, 7, 80, 61), 32, 32, False, "RGB", RenderOptions())
    assert np.array_equal(out, _render(data, (13, 7, 80, 61), 32, 32, False, "RGB", RenderOptions(crop_decode=False)))


def test_a_failing_build_names_the_compiler_error(fresh, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    monkeypatch.setenv(jpeg_crop.JPEG_ENV, "crop")
    with pytest.raises(SetupError, match="DPTRAIN_JPEG=crop but the JPEG crop decoder is unavailable"):
        jpeg_crop.library()
    assert not list((tmp_path / "cache").glob("*.tmp")), "a failed build leaves no temporary file"


def test_jpeg_env_values(fresh, monkeypatch):
    monkeypatch.setenv(jpeg_crop.JPEG_ENV, "pillow")
    assert jpeg_crop.library() is None
    jpeg_crop.reset()
    monkeypatch.setenv(jpeg_crop.JPEG_ENV, "turbo")
    with pytest.raises(ConfigError, match="DPTRAIN_JPEG='turbo' is not one of auto, pillow, crop"):
        jpeg_crop.library()


def test_build_is_cached_and_keyed_by_the_source(fresh, lib, tmp_path, monkeypatch):
    first = jpeg_crop.build(tmp_path / "c")
    mtime = first.stat().st_mtime_ns
    assert jpeg_crop.build(tmp_path / "c") == first and first.stat().st_mtime_ns == mtime
    edited = tmp_path / "jpeg_crop.c"
    edited.write_text(jpeg_crop.SOURCE.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(jpeg_crop, "SOURCE", edited)
    assert jpeg_crop.build(tmp_path / "c") != first


class _Place:
    """A stage that puts the sample at a fixed box of the stored image."""

    def __init__(self, box, out_w: int, out_h: int) -> None:
        self.box, self.out_w, self.out_h = box, out_w, out_h

    def __call__(self, s: Sample) -> Sample:
        x0, y0, x1, y1 = self.box
        s.sub_box(x0, y0, x1 - x0, y1 - y0)
        s.out_w, s.out_h = self.out_w, self.out_h
        return s


class _Datum:
    encoded = True

    def __init__(self, data: bytes) -> None:
        self.data = data


def _datum_render(data: bytes, box, out_w: int, out_h: int, mode: str, opts: RenderOptions) -> np.ndarray:
    """transform_datum's path (Pillow reads the header, then crop decode or Pillow) for an encoded record at ``box``."""
    dst = np.full((out_h, out_w, 3 if mode == "RGB" else 1), 7, np.uint8)
    render.transform_datum(_Datum(data), [_Place(box, out_w, out_h)], SampleRng(1), 3 if mode == "RGB" else 1,
                                dst, opts)
    return dst


@pytest.mark.parametrize("box, out_w, out_h", [((4, 0, 92, 72), 20, 16),   # 4.4x: draft at 1/4, whole box
                                               ((13, 7, 80, 61), 32, 32)])  # no draft: Pillow's luma
def test_colour_jpeg_in_grey_takes_pillows_decision(lib, monkeypatch, box, out_w, out_h):
    data = _jpeg("4:2:0")
    calls = []
    real = jpeg_crop.decode_crop
    monkeypatch.setattr(jpeg_crop, "decode_crop", lambda *a, **k: calls.append(k["gray"]) or real(*a, **k))
    fast = _datum_render(data, box, out_w, out_h, "L", RenderOptions())
    assert calls == ([True] if out_w == 20 else [])  # Pillow's draft decodes grey in libjpeg too
    assert np.array_equal(fast, _datum_render(data, box, out_w, out_h, "L", RenderOptions(crop_decode=False)))


def test_exif_jpegs_open_in_pillow_and_upright_ones_are_still_crop_decoded(lib, monkeypatch):
    stored = _photo(40, 64, 3)
    calls = []
    real = jpeg_crop.decode_crop
    monkeypatch.setattr(jpeg_crop, "decode_crop", lambda *a, **k: calls.append(1) or real(*a, **k))
    for orientation in (1, 6):
        exif = Image.Exif()
        exif[0x0112] = orientation
        buf = io.BytesIO()
        Image.fromarray(stored).save(buf, "JPEG", quality=95, exif=exif.tobytes())
        calls.clear()
        out = _datum_render(buf.getvalue(), (0, 0, 40, 64) if orientation == 6 else (0, 0, 64, 40),
                            *((40, 64) if orientation == 6 else (64, 40)), "RGB", RenderOptions())
        want = np.asarray(render.open_image(buf.getvalue()).convert("RGB"))
        assert out.shape == want.shape and np.array_equal(out, want)
        assert calls == ([1] if orientation == 1 else []), orientation  # a rotated one is decoded by Pillow
    assert out.shape[:2] == (64, 40)  # orientation 6 stands the 64x40 photo upright


def test_a_bomb_is_refused_from_the_header(lib, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(DataError, match="decompression bomb"):
        _datum_render(_jpeg("4:2:0"), (0, 0, 93, 75), 32, 32, "RGB", RenderOptions())


# --------------------------------------------------------------------------- what the crop decoder must refuse


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """tests/unit/csrc/jpeg_encode.c built against the system libjpeg: writes any sampling layout."""
    source = Path(__file__).parent / "csrc" / "jpeg_encode.c"
    so = tmp_path_factory.mktemp("enc") / "jpeg_encode.so"
    subprocess.run([*jpeg_crop._compiler(), *jpeg_crop.CFLAGS, "-o", str(so), str(source), *jpeg_crop.LIBS],
                   check=True, capture_output=True)
    fn = ctypes.CDLL(str(so)).dpt_test_encode
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_char_p]
    out = tmp_path_factory.mktemp("jpegs")

    def encode(samp: tuple[int, ...], progressive: bool, height: int = 75, width: int = 93) -> bytes:
        pixels = np.ascontiguousarray(_photo(height, width, sum(samp)))
        hs, vs = (ctypes.c_int * 3)(*samp[0::2]), (ctypes.c_int * 3)(*samp[1::2])
        path = out / f"{'-'.join(map(str, samp))}_{int(progressive)}_{width}x{height}.jpg"
        assert fn(pixels.ctypes.data, width, height, 3, hs, vs, int(progressive), 90, str(path).encode()) == 0
        return path.read_bytes()

    return encode


def _decode_in_time(lib, data: bytes, box, scale: int, seconds: float = 20.0):
    """decode_crop on a daemon thread: (refusal or None, pixels); fails the test if it does not return."""
    out = np.empty((box[3] - box[1], box[2] - box[0], 3), np.uint8)
    result = []
    t = threading.Thread(target=lambda: result.append(
        jpeg_crop.decode_crop(lib, data, box, scale=scale, gray=False, flip=False, out=out)), daemon=True)
    t.start()
    t.join(seconds)
    assert result, f"the crop decoder did not return within {seconds} s (box {box}, 1/{scale})"
    return result[0], out


# (h, v) sampling factors of Y, Cb, Cr
_LAYOUTS = {"4:2:0": (2, 2, 1, 1, 1, 1), "4:2:2": (2, 1, 1, 1, 1, 1), "4:4:0": (1, 2, 1, 1, 1, 1),
            "4:4:4": (1, 1, 1, 1, 1, 1), "4:1:1": (4, 1, 1, 1, 1, 1), "4:1:0": (4, 2, 1, 1, 1, 1),
            "2x4": (2, 4, 1, 1, 1, 1), "1x4": (1, 4, 1, 1, 1, 1)}


@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_any_sampling_layout_is_decoded_as_pillow_does_or_refused(lib, encoder, layout, progressive):
    """Under DCT scaling, libjpeg-turbo's jpeg_crop_scanline mis-sized 4:1:0 and 2x4 chroma (wrong
    pixels), and skipping rows of a progressive 2x4 file looped forever: those are refused now."""
    data = encoder(_LAYOUTS[layout], progressive)
    refused_at = []
    for scale in (1, 2, 4, 8):
        ref = Image.open(io.BytesIO(data))
        if scale > 1:
            ref.draft("RGB", (ref.size[0] // scale, ref.size[1] // scale))
        full = np.asarray(ref)
        h, w = full.shape[:2]
        for box in [(0, 0, w, h), (w // 3, h // 4, w - 2, h - h // 5), (w // 2, h // 3, w // 2 + 2, h // 2)]:
            refused, out = _decode_in_time(lib, data, box, scale)
            if refused is None:
                assert np.array_equal(out, full[box[1]:box[3], box[0]:box[2]]), (layout, scale, box)
            else:
                assert "sampling layout" in refused, refused
                refused_at.append(scale)
    if layout in ("4:1:0", "2x4"):
        assert {2, 4} <= set(refused_at), refused_at
    else:  # the layouts cameras and encoders write are crop-decoded at every scale
        assert not refused_at


def test_a_progressive_image_with_scans_missing_goes_to_pillow(lib):
    data = _jpeg("progressive")
    scans = [m.start() for m in re.finditer(b"\xff\xda", data)]
    assert len(scans) > 3
    box = (13, 7, 80, 61)
    for cut in scans[1:3]:  # the first scans only, then a clean end of image
        partial = data[:cut] + b"\xff\xd9"
        out = np.empty((54, 67, 3), np.uint8)
        assert jpeg_crop.decode_crop(lib, partial, box, scale=1, gray=False, flip=False,
                                     out=out) == "progressive image with scans missing"
        # libjpeg versions fill in the missing coefficients differently: Pillow's copy decides
        fast = _render(partial, box, 32, 32, False, "RGB", RenderOptions())
        assert np.array_equal(fast, _render(partial, box, 32, 32, False, "RGB", RenderOptions(crop_decode=False)))


def test_a_stream_libjpeg_warns_about_goes_to_pillow(lib):
    data = _jpeg("4:2:0")
    sos = data.index(b"\xff\xda")
    junk = data[:sos] + b"\x00\x01" + data[sos:]  # 2 extraneous bytes before a marker: a libjpeg warning
    out = np.empty((54, 67, 3), np.uint8)
    msg = jpeg_crop.decode_crop(lib, junk, (13, 7, 80, 61), scale=1, gray=False, flip=False, out=out)
    assert msg is not None and "extraneous bytes" in msg
    fast = _render(junk, (13, 7, 80, 61), 32, 32, False, "RGB", RenderOptions())
    assert np.array_equal(fast, _render(junk, (13, 7, 80, 61), 32, 32, False, "RGB", RenderOptions(crop_decode=False)))


@pytest.mark.parametrize("damage", ["junk after SOI", "short JFIF segment"])
def test_a_header_pillow_refuses_is_refused_with_the_crop_decoder_too(lib, damage):
    """libjpeg takes these headers, Pillow does not; Pillow reads every header, so its verdict stands."""
    data = _jpeg("4:2:0")
    if damage == "junk after SOI":
        bad = data[:2] + b"\x00" + data[2:]
    else:
        app0_end = 4 + int.from_bytes(data[4:6], "big")
        bad = data[:2] + b"\xff\xe0\x00\x07JFIF\x00" + data[app0_end:]
    verdicts = []
    for opts in (RenderOptions(), RenderOptions(crop_decode=False)):
        with pytest.raises(DataError, match="undecodable image") as e:
            _datum_render(bad, (13, 7, 80, 61), 32, 32, "RGB", opts)
        verdicts.append(str(e.value))
    assert verdicts[0] == verdicts[1]


def test_a_decoder_whose_pixels_differ_from_pillows_is_not_used(lib, fresh, monkeypatch, caplog):
    jpeg_crop.self_check(lib)  # the real one passes
    real = jpeg_crop.decode_crop

    def off_by_one(*args, **kwargs):
        msg = real(*args, **kwargs)
        kwargs["out"][0, 0, 0] ^= 1
        return msg

    monkeypatch.setattr(jpeg_crop, "decode_crop", off_by_one)
    with pytest.raises(RuntimeError, match="pixels differ from Pillow's .*4:2:0 JPEG at 1/1 scale"):
        jpeg_crop.self_check(lib)
    with caplog.at_level(logging.WARNING, logger="dptrain.data.transforms.jpeg_crop"):
        assert jpeg_crop.library() is None  # auto: Pillow, with one warning
    assert [r.getMessage() for r in caplog.records if "pixels differ" in r.getMessage()]
    jpeg_crop.reset()
    monkeypatch.setenv(jpeg_crop.JPEG_ENV, "crop")
    with pytest.raises(SetupError, match="unavailable: its pixels differ"):
        jpeg_crop.library()


def test_cc_may_carry_arguments_and_the_library_is_readable_by_others(fresh, lib, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", f"{jpeg_crop._compiler()[0]} -std=gnu11")
    built = jpeg_crop.build(tmp_path / "c")
    assert built.stat().st_mode & 0o755 == 0o755
    monkeypatch.setenv("CC", "'unbalanced")
    with pytest.raises(RuntimeError, match="no C compiler"):
        jpeg_crop.build(tmp_path / "d")


def test_the_source_compiles_against_the_jpeg8_api(lib, tmp_path):
    """Ubuntu's libjpeg-turbo8 (JPEG_LIB_VERSION 80) names the IDCT sizes DCT_h/v_scaled_size."""
    (tmp_path / "jconfig.h").write_text("#include_next <jconfig.h>\n#undef JPEG_LIB_VERSION\n"
                                        "#define JPEG_LIB_VERSION 80\n")
    probe = subprocess.run([*jpeg_crop._compiler(), "-fsyntax-only", "-Werror", f"-I{tmp_path}", "-x", "c", "-"],
                           input="#include <stdio.h>\n#include <jpeglib.h>\n"
                                 "#if JPEG_LIB_VERSION != 80\n#error shim not used\n#endif\n",
                           capture_output=True, text=True, check=False)
    assert probe.returncode == 0, probe.stderr
    out = subprocess.run([*jpeg_crop._compiler(), "-fsyntax-only", "-Wall", "-Werror", f"-I{tmp_path}",
                          str(jpeg_crop.SOURCE)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
