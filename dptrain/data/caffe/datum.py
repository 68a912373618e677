"""Caffe record codec: the ``Datum`` and ``BlobProto`` messages, without protoc.

The messages are declared here field by field (numbers and types as in Caffe's
``caffe.proto``, plus NVCaffe's ``record_id``) and built into classes with the protobuf
library at import time, so existing Caffe/NVCaffe LMDBs parse unchanged.

Pixel layout: a raw (not encoded) Datum holds ``channels x height x width`` uint8 in
**BGR** channel order, as OpenCV hands it to Caffe. dptrain's samples are HWC **RGB**
(what Pillow decodes), so :func:`raw_to_hwc` flips the channel axis and
:func:`hwc_to_raw` flips it back. One-channel records need no flip.

This module has no thread, device or LMDB logic; it runs anywhere in microseconds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory, unknown_fields

from dptrain.errors import ConfigError, DataError

_F = descriptor_pb2.FieldDescriptorProto


class DatumLike(Protocol):
    """The fields of a parsed ``caffe.Datum`` that dptrain reads."""

    channels: int
    height: int
    width: int
    data: bytes
    label: int
    float_data: list[float]
    encoded: bool


def _field(name: str, number: int, ftype: int, *, repeated: bool = False, packed: bool = False) -> _F:
    f = _F(name=name, number=number, type=ftype,
           label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
    if packed:
        f.options.packed = True
    return f


def _build_classes() -> tuple[type[message.Message], type[message.Message]]:
    fdp = descriptor_pb2.FileDescriptorProto(name="dptrain/caffe_datum.proto", package="caffe", syntax="proto2")
    fdp.message_type.add(name="Datum", field=[
        _field("channels", 1, _F.TYPE_INT32),
        _field("height", 2, _F.TYPE_INT32),
        _field("width", 3, _F.TYPE_INT32),
        _field("data", 4, _F.TYPE_BYTES),
        _field("label", 5, _F.TYPE_INT32),
        _field("float_data", 6, _F.TYPE_FLOAT, repeated=True),
        _field("encoded", 7, _F.TYPE_BOOL),
        _field("record_id", 8, _F.TYPE_UINT32),
    ])
    fdp.message_type.add(name="BlobShape", field=[_field("dim", 1, _F.TYPE_INT64, repeated=True, packed=True)])
    blob = fdp.message_type.add(name="BlobProto", field=[
        _field("num", 1, _F.TYPE_INT32),
        _field("channels", 2, _F.TYPE_INT32),
        _field("height", 3, _F.TYPE_INT32),
        _field("width", 4, _F.TYPE_INT32),
        _field("data", 5, _F.TYPE_FLOAT, repeated=True, packed=True),
        _field("diff", 6, _F.TYPE_FLOAT, repeated=True, packed=True),
        _field("double_data", 8, _F.TYPE_DOUBLE, repeated=True, packed=True),
        _field("double_diff", 9, _F.TYPE_DOUBLE, repeated=True, packed=True),
    ])
    shape = _field("shape", 7, _F.TYPE_MESSAGE)
    shape.type_name = ".caffe.BlobShape"
    blob.field.append(shape)
    pool = descriptor_pool.DescriptorPool()  # private pool: never clashes with a user's caffe_pb2
    pool.Add(fdp)
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName("caffe.Datum")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName("caffe.BlobProto")))


Datum, BlobProto = _build_classes()


def encode_datum(*, label: int, data: bytes, channels: int = 0, height: int = 0, width: int = 0,
                 encoded: bool = False, record_id: int | None = None) -> bytes:
    """Serialise one Datum. For ``encoded`` records ``data`` is the image file's bytes."""
    d = Datum(channels=channels, height=height, width=width, data=data, label=label, encoded=encoded)
    if record_id is not None:
        d.record_id = record_id
    return d.SerializeToString()


_WIRE_TYPES = {0: "varint", 1: "64-bit", 2: "length-delimited (bytes)", 3: "group start", 4: "group end",
               5: "32-bit (float)"}
_DATUM_FIELDS = {f.number: f for f in Datum.DESCRIPTOR.fields}


def _expected_wire(f) -> str:
    if f.type == f.TYPE_FLOAT:  # float_data, repeated: one 32-bit value each, or packed
        return "32-bit (float) or length-delimited (packed)"
    return _WIRE_TYPES[2 if f.type == f.TYPE_BYTES else 0]


def parse_datum(value: bytes) -> DatumLike:
    """Parse one Datum; raises DataError on bytes that are not a Datum.

    A field of the Datum sent with another wire type (a label written as bytes or as a float)
    is a bad record: protobuf would keep it as an unknown field and leave the field at its
    default, so the record would train as class 0 without a word. A Datum without a label field
    is one for the same reason (Caffe's writers always set it, 0 included).
    """
    d = Datum()
    try:
        d.ParseFromString(value)
    except message.DecodeError as e:
        raise DataError(f"unparsable record: not a Caffe Datum ({e})") from e
    for u in unknown_fields.UnknownFieldSet(d):
        f = _DATUM_FIELDS.get(u.field_number)
        if f is not None:
            raise DataError(f"unparsable record: Datum field {f.name} (number {f.number}) holds a "
                            f"{_WIRE_TYPES.get(u.wire_type, str(u.wire_type))} value, expected "
                            f"{_expected_wire(f)}; re-create the DB with dptrain make-lmdb")
    if not d.HasField("label"):
        raise DataError("unparsable record: the Datum has no label field (number 5), which would read as class 0; "
                        "re-create the DB with a label for every record (dptrain make-lmdb)")
    return d


def hwc_to_raw(image: np.ndarray) -> tuple[bytes, int, int, int]:
    """RGB (or gray) HWC uint8 -> (CHW BGR bytes, channels, height, width) as Caffe stores it."""
    if image.ndim == 2:
        image = image[:, :, None]
    h, w, c = image.shape
    chw = image.transpose(2, 0, 1)
    if c == 3:
        chw = chw[::-1]  # RGB -> BGR
    return np.ascontiguousarray(chw, dtype=np.uint8).tobytes(), c, h, w


def raw_to_hwc(d: DatumLike) -> np.ndarray:
    """A raw Datum's pixels as an [H, W, C] uint8 RGB view (no copy; negative channel stride).

    Raises DataError when the record's sizes and byte count disagree, or when it holds
    ``float_data`` (dptrain ships uint8 samples; convert such DBs to uint8 first).
    """
    c, h, w = d.channels, d.height, d.width
    if not d.data:
        if len(d.float_data):
            raise DataError("record holds float_data; dptrain reads uint8 data only, re-create the DB as uint8")
        raise DataError("unparsable record: raw Datum has no data")
    if c not in (1, 3) or h <= 0 or w <= 0 or len(d.data) != c * h * w:
        raise DataError(f"unparsable record: raw Datum is {c}x{h}x{w} (CxHxW) but holds {len(d.data)} bytes")
    chw = np.frombuffer(d.data, dtype=np.uint8).reshape(c, h, w)
    if c == 3:
        chw = chw[::-1]  # BGR -> RGB
    return chw.transpose(1, 2, 0)


def encode_blob(array_chw_bgr: np.ndarray) -> bytes:
    """Serialise a [C, H, W] float array as a Caffe BlobProto (shape [1, C, H, W]), e.g. a mean file."""
    a = np.asarray(array_chw_bgr, dtype=np.float32)
    b = BlobProto(num=1, channels=a.shape[0], height=a.shape[1], width=a.shape[2])
    b.shape.dim.extend([1, *a.shape])
    b.data.extend(a.reshape(-1).tolist())
    return b.SerializeToString()


def read_mean_file(path: str | Path) -> np.ndarray:
    """The mean from a Caffe binaryproto or a .npy file: [C] or [C, H, W] float64, RGB order, pixel units.

    binaryproto: a BlobProto of shape [1, C, H, W] (or num/channels/height/width) in
    Caffe's BGR order, as ``compute_image_mean`` writes it. .npy: shape [C] or [C, H, W] in
    RGB order. Errors are ConfigErrors that name ``data.mean_file``.
    """
    p = Path(path)

    def bad(reason: str) -> ConfigError:
        return ConfigError(f"data.mean_file {str(p)!r}: {reason}")

    if not p.is_file():
        raise bad("file not found; fix the path or use data.mean_value")
    if p.suffix == ".npy":
        try:
            a = np.load(p, allow_pickle=False).astype(np.float64)
        except (OSError, ValueError, TypeError) as e:
            raise bad(f"not a numeric .npy array ({e}); save the mean with numpy.save") from e
        bgr = False
    else:
        b = BlobProto()
        try:
            b.ParseFromString(p.read_bytes())
        except message.DecodeError as e:
            raise bad(f"not a Caffe BlobProto ({e}); give a compute_image_mean binaryproto or a .npy") from e
        values = np.asarray(b.double_data or b.data, dtype=np.float64)
        dims = list(b.shape.dim) or [b.num or 1, b.channels, b.height, b.width]
        if values.size == 0 or int(np.prod(dims)) != values.size:
            raise bad(f"blob has shape {dims} but {values.size} values; re-create it with compute_image_mean")
        if len(dims) == 4 and dims[0] != 1:
            raise bad(f"blob holds {dims[0]} images; a mean file holds one ([1, C, H, W])")
        a = values.reshape(dims[-3:]) if len(dims) >= 3 else values
        bgr = True
    if a.ndim not in (1, 3) or a.shape[0] not in (1, 3):
        raise bad(f"mean has shape {list(a.shape)}; expected [C] or [C, H, W] with C in (1, 3)")
    return a[::-1].copy() if bgr else a
