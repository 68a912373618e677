"""Caffe record codec, sample RNG, transform stages and queue routing: pure CPU, no threads."""
from __future__ import annotations

import numpy as np
import pytest

from dptrain.config import DataConfig
from dptrain.data.caffe.datum import (
    BlobProto,
    DataError,
    encode_blob,
    encode_datum,
    hwc_to_raw,
    parse_datum,
    raw_to_hwc,
    read_mean_file,
)
from dptrain.data.loader.queues import QueueSet
from dptrain.data.transforms.geometry import (
    CenterResizedCrop,
    Crop,
    RandomResizedCrop,
    Sample,
    SampleRng,
    SampleSpec,
    build_stages,
    check_chain,
)
from dptrain.errors import ConfigError


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def test_datum_field_numbers_match_caffe_wire_format():
    # Hand-encoded proto2 wire bytes, independent of our descriptor: tag = field << 3 | wire type.
    data = bytes(range(12))
    wire = (b"\x08" + _varint(3) + b"\x10" + _varint(2) + b"\x18" + _varint(2)   # channels, height, width
            + b"\x22" + _varint(len(data)) + data + b"\x28" + _varint(7)        # data, label
            + b"\x38\x01" + b"\x40" + _varint(123456))                           # encoded, record_id
    d = parse_datum(wire)
    assert (d.channels, d.height, d.width, d.data, d.label, d.encoded, d.record_id) == (3, 2, 2, data, 7, True, 123456)
    assert encode_datum(label=7, data=data, channels=3, height=2, width=2, encoded=True, record_id=123456) == wire


def test_raw_records_are_bgr_chw_and_read_back_as_rgb_hwc():
    rgb = np.zeros((2, 3, 3), dtype=np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 10, 20, 30  # R, G, B
    rgb[1, 2] = (1, 2, 3)
    raw, c, h, w = hwc_to_raw(rgb)
    assert (c, h, w) == (3, 2, 3)
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(3, 2, 3)
    assert planes[0, 0, 0] == 30 and planes[2, 0, 0] == 10  # first plane is blue, as Caffe/OpenCV store it
    assert tuple(planes[:, 1, 2]) == (3, 2, 1)
    d = parse_datum(encode_datum(label=1, data=raw, channels=c, height=h, width=w))
    assert np.array_equal(raw_to_hwc(d), rgb)


def test_gray_raw_round_trip():
    g = np.arange(12, dtype=np.uint8).reshape(3, 4)
    raw, c, h, w = hwc_to_raw(g)
    assert (c, h, w) == (1, 3, 4)
    d = parse_datum(encode_datum(label=0, data=raw, channels=c, height=h, width=w))
    assert np.array_equal(raw_to_hwc(d)[:, :, 0], g)


@pytest.mark.parametrize("value, match", [
    (b"\xff\xff\xff", "unparsable record"),
    (encode_datum(label=0, data=b"\x00" * 5, channels=3, height=2, width=2), "holds 5 bytes"),
    (encode_datum(label=0, data=b"", channels=3, height=2, width=2), "no data"),
])
def test_bad_raw_records_raise_data_error(value, match):
    with pytest.raises(DataError, match=match):
        raw_to_hwc(parse_datum(value))


def test_float_data_records_are_refused_with_advice():
    from dptrain.data.caffe.datum import Datum

    d = Datum(channels=1, height=1, width=2, label=0)
    d.float_data.extend([0.5, 1.5])
    with pytest.raises(DataError, match="float_data.*uint8"):
        raw_to_hwc(parse_datum(d.SerializeToString()))


def test_located_error_names_rank_path_and_key():
    e = DataError("undecodable image (x)").located(path="/db", key=b"00000003_a.jpg", rank=2)
    assert str(e) == "rank 2: LMDB '/db' key '00000003_a.jpg': undecodable image (x)"
    assert isinstance(e, ValueError)


def test_mean_file_binaryproto_is_bgr_and_npy_is_rgb(tmp_path):
    chw_bgr = np.stack([np.full((4, 5), 104.0), np.full((4, 5), 117.0), np.full((4, 5), 123.0)])
    chw_bgr[0, 1, 2] = 7.0
    (tmp_path / "mean.binaryproto").write_bytes(encode_blob(chw_bgr))
    rgb = read_mean_file(tmp_path / "mean.binaryproto")
    assert rgb.shape == (3, 4, 5) and np.array_equal(rgb, chw_bgr[::-1]) and rgb[2, 1, 2] == 7.0
    np.save(tmp_path / "mean.npy", np.array([1.0, 2.0, 3.0]))
    assert np.array_equal(read_mean_file(tmp_path / "mean.npy"), [1.0, 2.0, 3.0])


def test_mean_file_errors_name_the_setting_and_the_file(tmp_path):
    cases = {
        "nope.binaryproto": (None, "file not found; fix the path or use data.mean_value"),
        "bad.binaryproto": (b"\xff\xff", "not a Caffe BlobProto"),
        "two.binaryproto": (BlobProto(num=2, channels=3, height=2, width=2, data=[0.0] * 24).SerializeToString(),
                            "blob holds 2 images"),
        "bad.npy": (np.zeros((2, 5)), r"mean has shape \[2, 5\]; expected \[C\]"),
        "pickled.npy": (np.array([{"a": 1}], dtype=object), "not a numeric .npy array"),
    }
    for name, (content, match) in cases.items():
        if isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        elif content is not None:
            np.save(tmp_path / name, content, allow_pickle=True)
        with pytest.raises(ConfigError, match=f"data.mean_file '.*{name}': {match}"):
            read_mean_file(tmp_path / name)


def test_sample_rng_is_a_pure_function_of_its_key():
    a = [SampleRng(1, 2, 3).random() for _ in range(3)]
    assert a == [SampleRng(1, 2, 3).random() for _ in range(3)]
    r = SampleRng(1, 2, 3)
    seq = [r.random() for _ in range(1000)]
    other = SampleRng(1, 2, 4)
    assert seq[:10] != [other.random() for _ in range(10)]
    assert 0.45 < float(np.mean(seq)) < 0.55 and min(seq) >= 0 and max(seq) < 1
    draws = [SampleRng(7, i).randint(3) for i in range(300)]
    assert set(draws) == {0, 1, 2}


def _plan(stage, w, h, key=(0,)):
    return stage(Sample((0.0, 0.0, float(w), float(h)), w, h, SampleRng(*key)))


def test_caffe_centre_crop_offsets():
    s = _plan(Crop(4, random=False), 9, 7)
    assert s.box == (2.0, 1.0, 6.0, 5.0) and (s.out_w, s.out_h) == (4, 4)  # (9-4)//2, (7-4)//2


def test_random_crop_covers_every_offset_and_stays_inside():
    offsets = {_plan(Crop(4, random=True), 6, 5, (i,)).box[:2] for i in range(200)}
    assert offsets == {(float(x), float(y)) for x in range(3) for y in range(2)}


def test_crop_larger_than_image_is_a_data_error():
    with pytest.raises(DataError, match="smaller than data.crop_size 8"):
        _plan(Crop(8, random=False), 6, 9)


def test_random_resized_crop_boxes_lie_inside_with_requested_area():
    stage = RandomResizedCrop(16, (0.25, 0.5), (0.75, 4 / 3))
    for i in range(100):
        s = _plan(stage, 60, 40, (i,))
        x0, y0, x1, y1 = s.box
        assert 0 <= x0 < x1 <= 60 and 0 <= y0 < y1 <= 40 and (s.out_w, s.out_h) == (16, 16)
        assert 0.2 * 2400 <= (x1 - x0) * (y1 - y0) <= 0.55 * 2400  # rounding of w, h widens the range a bit


def test_center_resized_crop_takes_the_0875_centre():
    s = _plan(CenterResizedCrop(224), 512, 256)
    assert s.box == pytest.approx((144.0, 16.0, 368.0, 240.0))  # 224/256 of the shorter side, centred


def test_stage_specs_check_the_chain_before_threads_start():
    cfg = DataConfig(resize=[6, 6], crop_size=8)
    with pytest.raises(ConfigError, match="crop_size 8 exceeds the input size 6x6"):
        check_chain(build_stages(cfg, train=True, first_hw=(10, 10)), SampleSpec(None, None, 3))
    ok = DataConfig(crop_size=8, mirror=True)
    assert check_chain(build_stages(ok, train=True, first_hw=(10, 10)), SampleSpec(None, None, 3)) == SampleSpec(8, 8, 3)
    bare = build_stages(DataConfig(), train=False, first_hw=(5, 7))
    assert check_chain(bare, SampleSpec(None, None, 1)) == SampleSpec(5, 7, 1)


@pytest.mark.parametrize("readers, renderers", [(1, 1), (3, 2), (2, 3)])
def test_queue_routing_partitions_positions(readers, renderers):
    qs = QueueSet(readers, renderers, capacity=2)
    assert len(qs) == readers * renderers
    n = 41
    by_reader = sorted(p for k in range(readers) for p in qs.reader_positions(k, n))
    by_renderer = [list(qs.renderer_positions(t, n)) for t in range(renderers)]
    assert by_reader == list(range(n))
    assert sorted(sum(by_renderer, [])) == list(range(n))
    for t, positions in enumerate(by_renderer):
        assert positions == sorted(positions) and all(qs.renderer_of(p) == t for p in positions)


@pytest.mark.parametrize("field,number", [("channels", 1), ("height", 2), ("width", 3), ("label", 5),
                                          ("encoded", 7)])
@pytest.mark.parametrize("wire", [1, 2, 5])
def test_a_datum_field_of_the_wrong_wire_type_is_a_bad_record(field, number, wire):
    """protobuf keeps such a field as unknown and leaves the default (a label of 0): dptrain refuses it."""
    import struct

    from dptrain.data.caffe.datum import encode_datum, parse_datum
    from dptrain.errors import DataError

    payload = {1: struct.pack("<d", 3.0), 2: bytes([3]) + b"cat", 5: struct.pack("<f", 3.7)}[wire]
    value = encode_datum(label=1, data=b"abc") + bytes([number << 3 | wire]) + payload
    with pytest.raises(DataError, match=f"Datum field {field} \\(number {number}\\) holds a .*, expected "):
        parse_datum(value)
    assert parse_datum(encode_datum(label=1, data=b"abc")).label == 1


def test_a_datum_without_a_label_is_a_bad_record():
    """protobuf reads a missing label as 0: the record would train as class 0 without a word."""
    from dptrain.data.caffe.datum import Datum, encode_datum, parse_datum
    from dptrain.errors import DataError

    for value in (Datum(data=b"abc", channels=3, height=1, width=1).SerializeToString(), b""):
        with pytest.raises(DataError, match=r"unparsable record: the Datum has no label field \(number 5\), which "
                                            r"would read as class 0; re-create the DB with a label for every record"):
            parse_datum(value)
    assert parse_datum(encode_datum(label=0, data=b"abc")).label == 0  # a label of 0 written out is a label
