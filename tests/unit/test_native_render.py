"""The native per-sample path (csrc/record_render.c through data/transforms/native.py) against the Python path.

Geometry (boxes, flips, crop windows) must be equal bit for bit; pixels equal for plain crops and
for boxes off whole pixels, within one grey level where the Python path resamples with torch; a
record the native path does not take must come out exactly as the Python path makes it, bad
records included.
"""
from __future__ import annotations

import ctypes
import io
import logging
import struct

import numpy as np
import pytest
from PIL import Image

from dptrain.data.caffe.datum import encode_datum, hwc_to_raw
from dptrain.data.sampling import SampleOrder
from dptrain.data.sources.caffe_lmdb import LmdbSource
from dptrain.data.transforms import jpeg_crop
from dptrain.data.transforms import native as native_render
from dptrain.data.transforms.geometry import (
    CenterResizedCrop,
    Crop,
    Mirror,
    RandomResizedCrop,
    Resize,
    Sample,
    SampleRng,
    build_stages,
)
from dptrain.errors import ConfigError, DataError, SetupError
from lmdb_helpers import NUM_CLASSES, collect, input_threads, make_cfg, png_value, write_db


@pytest.fixture
def lib():
    native_render.reset()
    lib = native_render.library()
    if lib is None:
        pytest.skip("the native input path does not build here (no C compiler or libjpeg-turbo headers)")
    yield lib
    native_render.reset()


def _render_mode(monkeypatch, mode: str) -> None:
    monkeypatch.setenv(native_render.RENDER_ENV, mode)
    native_render.reset()


def _photo(i: int, w: int = 96, h: int = 72) -> np.ndarray:
    rng = np.random.default_rng(i)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([127 + 100 * np.sin(x / (9 + 3 * c) + i) * np.cos(y / (11 + 2 * c) - c) for c in range(3)], -1)
    return np.clip(base + rng.normal(0, 10, base.shape), 0, 255).astype(np.uint8)


def _jpeg(image: np.ndarray, **save) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, "JPEG", quality=90, **save)
    return buf.getvalue()


def _jpeg_record(i: int, **save) -> bytes:
    return encode_datum(label=i % NUM_CLASSES, data=_jpeg(_photo(i, 90 + 7 * i, 70 + 5 * i), **save), encoded=True)


def _raw_record(i: int) -> bytes:
    raw, c, h, w = hwc_to_raw(_photo(i, 60, 50))
    return encode_datum(label=i % NUM_CLASSES, data=raw, channels=c, height=h, width=w)


CHAINS = {
    "rrc": lambda: [RandomResizedCrop(24, (0.08, 1.0), (3 / 4, 4 / 3)), Mirror()],
    "crop": lambda: [Crop(40, random=True), Mirror()],
    "centre": lambda: [CenterResizedCrop(24)],
    "resize+crop": lambda: [Resize(56, 64), Crop(48, random=True), Mirror()],
    "resize": lambda: [Resize(20, 30)],
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_geometry_equals_the_python_stages_bit_for_bit(lib, name):
    stages = CHAINS[name]()
    r = native_render.Renderer(lib, stages=stages, channels=3, sample_shape=(8, 8, 3), num_classes=1, seed=-5,
                               draft=True, windows=False, max_rows=1)
    rng = np.random.default_rng(0)
    box, flip = (ctypes.c_double * 4)(), ctypes.c_int()
    for _ in range(400):
        w, h = (int(v) for v in rng.integers(64, 3000, 2))
        epoch, index = (int(v) for v in rng.integers(0, 2**40, 2))
        r._keys[:, 0] = epoch, index
        assert lib.dptrain_plan_sample(r._arg, 0, w, h, box, ctypes.byref(flip)) == 0
        s = Sample((0.0, 0.0, float(w), float(h)), w, h, SampleRng(-5, epoch, index, 0))
        for st in stages:
            s = st(s)
        assert (tuple(box), bool(flip.value)) == (s.box, s.flip), (w, h, epoch, index)


def _both_paths(monkeypatch, path: str, n_batches: int, **cfg_kw) -> list[list]:
    outs = []
    for mode in ("native", "python"):
        _render_mode(monkeypatch, mode)
        src = LmdbSource(make_cfg(path, **cfg_kw), num_classes=NUM_CLASSES, seed=9)
        assert src.native == (mode == "native")
        outs.append(collect(src.train_batches(SampleOrder(0, 1, cfg_kw.get("batch_size", 4), seed=9), 0), n_batches))
    native_render.reset()
    return outs


@pytest.mark.parametrize("recipe", [dict(crop_size=24, random_resized_crop=True, mirror=True),
                                    dict(crop_size=40, mirror=True), dict(resize=[30, 40]),
                                    dict(resize=[56, 64], crop_size=48, mirror=True)])
def test_batches_match_the_python_path_within_a_grey_level(lib, tmp_path, monkeypatch, recipe):
    values = [_jpeg_record(i) for i in range(10)] + [_jpeg_record(10, progressive=True),
                                                     _jpeg_record(11, subsampling="4:4:4")]
    values += [_raw_record(i) for i in range(12, 16)]
    native, python = _both_paths(monkeypatch, write_db(tmp_path / "db", values), 8, **recipe)
    images_n = np.concatenate([b[0] for b in native]).astype(np.int16)
    images_p = np.concatenate([b[0] for b in python]).astype(np.int16)
    diff = np.abs(images_n - images_p)
    assert diff.max() <= 1 and diff.mean(axis=(0, 1, 2)).max() <= 0.05, (diff.max(), diff.mean())
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(native, python, strict=True))  # labels


def test_records_the_native_path_leaves_come_out_as_the_python_path_makes_them(lib, tmp_path, monkeypatch):
    grey = _photo(3)[:, :, 0]
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: Pillow turns it upright
    buf = io.BytesIO()
    Image.fromarray(_photo(4)).save(buf, "JPEG", quality=90, exif=exif.tobytes())
    cmyk = io.BytesIO()
    Image.fromarray(_photo(5)).convert("CMYK").save(cmyk, "JPEG", quality=90)
    values = [png_value(_photo(0), label=1),
              encode_datum(label=2, data=_jpeg(grey), encoded=True),
              encode_datum(label=3, data=buf.getvalue(), encoded=True),
              encode_datum(label=4, data=cmyk.getvalue(), encoded=True)] + [_jpeg_record(i) for i in range(6, 10)]
    r = native_render.Renderer(lib, stages=[Crop(40, random=False)], channels=3, sample_shape=(40, 40, 3),
                               num_classes=NUM_CLASSES, seed=0, draft=True, windows=False, max_rows=len(values))
    n = len(values)
    left = r.render(values, 0, np.arange(n), np.zeros((n, 40, 40, 3), np.uint8), np.zeros(n, np.int64), None)
    assert left == 3 and r.status[:n].tolist() == [3, 0, 3, 3, 0, 0, 0, 0]  # PNG, EXIF rotation, CMYK
    native, python = _both_paths(monkeypatch, write_db(tmp_path / "db", values), 2, crop_size=40)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(native, python, strict=True))


def _label_as(wire: int) -> bytes:
    """A Datum whose label field (5) is sent with another wire type: bytes "cat" or a float 3.7."""
    image = encode_datum(label=0, data=_jpeg(_photo(0)), encoded=True)
    return image + (bytes([0x2A, 3]) + b"cat" if wire == 2 else bytes([0x2D]) + struct.pack("<f", 3.7))


@pytest.mark.parametrize("wire,found", [(2, "length-delimited"), (5, "32-bit")])
def test_a_label_of_the_wrong_wire_type_is_a_bad_record_naming_its_key(lib, tmp_path, wire, found):
    values = [_jpeg_record(i) for i in range(40)]
    values[6] = _label_as(wire)  # not among the records probed at open: the renderer meets it
    src = LmdbSource(make_cfg(write_db(tmp_path / "db", values), crop_size=40, shuffle="none"),
                     num_classes=NUM_CLASSES, seed=0)
    with pytest.raises(DataError, match=f"key '00000006_r6'.*field label \\(number 5\\) holds a {found}"):
        collect(src.train_batches(SampleOrder(0, 1, 4, seed=0, shuffle=False), 0), 2)
    assert input_threads() == []


def test_a_datum_without_a_label_is_left_to_python_which_names_its_key(lib, tmp_path):
    """The native parser must not read a missing label as class 0 either: it leaves the record (status 2),
    and the Python path reports it; with data.max_bad_records it is replaced like any bad record."""
    from dptrain.data.caffe.datum import Datum

    values = [_jpeg_record(i) for i in range(40)]
    values[6] = Datum(data=_jpeg(_photo(6)), encoded=True).SerializeToString()  # not among the records probed at open
    r = native_render.Renderer(lib, stages=[Crop(40, random=False)], channels=3, sample_shape=(40, 40, 3),
                               num_classes=NUM_CLASSES, seed=0, draft=True, windows=False, max_rows=2)
    assert r.render(values[5:7], 0, np.arange(2), np.zeros((2, 40, 40, 3), np.uint8), np.zeros(2, np.int64), None) == 1
    assert r.status[:2].tolist() == [0, 2]
    db = write_db(tmp_path / "db", values)
    src = LmdbSource(make_cfg(db, crop_size=40, shuffle="none"), num_classes=NUM_CLASSES, seed=0)
    with pytest.raises(DataError, match=r"key '00000006_r6': unparsable record: the Datum has no label field"):
        collect(src.train_batches(SampleOrder(0, 1, 4, seed=0, shuffle=False), 0), 3)
    assert input_threads() == []
    src = LmdbSource(make_cfg(db, crop_size=40, shuffle="none", max_bad_records=1), num_classes=NUM_CLASSES, seed=0)
    assert collect(src.train_batches(SampleOrder(0, 1, 4, seed=0, shuffle=False), 0), 3)[-1][2]["bad_records"] == 1


def test_a_damaged_jpeg_inside_a_chunk_is_substituted_as_in_the_python_path(lib, tmp_path, monkeypatch):
    values = [_jpeg_record(i) for i in range(12)]
    values[6] = encode_datum(label=1, data=_jpeg(_photo(6))[:300], encoded=True)  # truncated: Pillow refuses
    native, python = _both_paths(monkeypatch, write_db(tmp_path / "db", values), 6, crop_size=40,
                                 max_bad_records=1)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
               for a, b in zip(native, python, strict=True))
    assert native[-1][2]["bad_records"] >= 1


@pytest.mark.parametrize("chunk_rows", [1, 3, 16])
def test_batches_do_not_depend_on_the_chunk_size_or_thread_counts(lib, tmp_path, monkeypatch, chunk_rows):
    path = write_db(tmp_path / "db", [_jpeg_record(i) for i in range(14)])
    ref = collect(LmdbSource(make_cfg(path, batch_size=5, crop_size=24, random_resized_crop=True, mirror=True),
                             num_classes=NUM_CLASSES, seed=2).train_batches(SampleOrder(0, 1, 5, seed=2), 0), 5)
    monkeypatch.setattr("dptrain.data.sources.records.CHUNK_ROWS_MAX", chunk_rows)
    cfg = make_cfg(path, batch_size=5, crop_size=24, random_resized_crop=True, mirror=True, parser_threads=2,
                   transformer_threads=3)
    out = collect(LmdbSource(cfg, num_classes=NUM_CLASSES, seed=2).train_batches(SampleOrder(0, 1, 5, seed=2), 0), 5)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(ref, out, strict=True))
    assert input_threads() == []


def test_crop_windows_for_a_mean_image_match_the_python_path(lib, tmp_path, monkeypatch):
    mean = tmp_path / "mean.npy"
    np.save(mean, np.random.default_rng(0).uniform(90, 110, (3, 50, 60)))  # the raw records are 60 x 50
    cfg = make_cfg(write_db(tmp_path / "db", [_raw_record(i) for i in range(6)]), crop_size=40, mirror=True,
                   mean_file=str(mean))
    outs = []
    for mode in ("native", "python"):
        _render_mode(monkeypatch, mode)
        src = LmdbSource(cfg, num_classes=NUM_CLASSES, seed=1)
        stream = src.train_batches(SampleOrder(0, 1, 4, seed=1), 0)
        try:
            hb = next(stream)
            outs.append((hb.images.numpy().copy(), hb.windows.numpy().copy()))
            hb.release(None)
        finally:
            stream.close()
    native_render.reset()
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])
    assert outs[0][1][:, :2].max() > 0  # crops at several offsets


def test_render_modes_and_a_failed_build_fall_back_with_one_warning(tmp_path, monkeypatch, caplog):
    _render_mode(monkeypatch, "python")
    assert native_render.library() is None
    monkeypatch.setattr(native_render, "build", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no cc here")))
    _render_mode(monkeypatch, "auto")
    with caplog.at_level(logging.WARNING, logger="dptrain.data.transforms.native"):
        assert native_render.library() is None and native_render.library() is None
    assert [r.message for r in caplog.records if "native input path unavailable" in r.message][0].endswith("no cc here")
    assert len(caplog.records) == 1
    _render_mode(monkeypatch, "native")
    with pytest.raises(SetupError, match="DPTRAIN_RENDER=native but the native input path is unavailable: no cc"):
        native_render.library()
    _render_mode(monkeypatch, "fast")
    with pytest.raises(ConfigError, match="DPTRAIN_RENDER='fast' is not one of auto, python, native"):
        native_render.library()
    native_render.reset()


def test_no_compiler_is_one_warning_for_both_native_libraries(tmp_path, monkeypatch, caplog):
    """Without a C compiler the crop decoder warns, and the native renderer, which builds on it, falls
    back without a second warning (DPTRAIN_RENDER=native still makes it an error)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("DPTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(jpeg_crop.JPEG_ENV, raising=False)
    jpeg_crop.reset()
    _render_mode(monkeypatch, "auto")
    try:
        with caplog.at_level(logging.WARNING):
            assert native_render.library() is None and native_render.library() is None
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert [r.name for r in warnings] == ["dptrain.data.transforms.jpeg_crop"], [r.message for r in warnings]
        assert "JPEG crop decoder unavailable" in warnings[0].message and "no-such-cc" in warnings[0].message
        _render_mode(monkeypatch, "native")
        with pytest.raises(SetupError, match="DPTRAIN_RENDER=native but the native input path is unavailable: the "
                                             "JPEG crop decoder it builds on is unavailable"):
            native_render.library()
    finally:
        jpeg_crop.reset()
        native_render.reset()


def test_a_self_check_mismatch_falls_back_to_python(lib, monkeypatch, caplog):
    monkeypatch.setattr(native_render, "self_check", lambda lib: (_ for _ in ()).throw(
        RuntimeError("record 3 under ['Crop']: pixels differ by up to 9")))
    _render_mode(monkeypatch, "auto")
    with caplog.at_level(logging.WARNING, logger="dptrain.data.transforms.native"):
        assert native_render.library() is None
    assert "pixels differ by up to 9" in caplog.text


def test_stage_table_refuses_unknown_stages():
    class Twist:
        pass

    with pytest.raises(ValueError, match="no native form for stage Twist"):
        native_render.stage_table([Twist()])
    cfg = make_cfg("x", crop_size=24, random_resized_crop=True, mirror=True)
    table = native_render.stage_table(build_stages(cfg, train=True, first_hw=(10, 10)))
    assert table.shape == (2, native_render.STAGE_WORDS) and table[:, 0].tolist() == [3, 5]
