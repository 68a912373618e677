"""Threaded LMDB pipeline: order, shards, augmentation determinism, bad input, shutdown.

Each DB is tiny and its pixels are computed from the record index: the green channel of
record i is the constant i, so every sample identifies its record under any crop or flip,
and the other channels pin down the crop window exactly.
"""
from __future__ import annotations

import dataclasses
import io
import itertools
import logging
import re

import numpy as np
import pytest
import torch
from PIL import Image

from dptrain.config import DataConfig
from dptrain.data.caffe.datum import encode_blob, encode_datum
from dptrain.data.sampling import SampleOrder, batches_per_epoch, epoch_permutation, rank_batch_indices
from dptrain.data.sources.caffe_lmdb import LmdbSource
from dptrain.data.sources.records import default_threads
from dptrain.data.transforms.render import RenderOptions
from dptrain.errors import ConfigError, DataError
from dptrain.topology import Topology
from lmdb_helpers import (
    NUM_CLASSES,
    H,
    W,
    collect,
    ids,
    input_threads,
    is_window,
    make_cfg,
    pixels,
    png_value,
    raw_value,
    write_db,
)


@pytest.fixture
def python_render(monkeypatch):
    """The Python rendering path (DPTRAIN_RENDER=python), for tests of its parts."""
    from dptrain.data.transforms import native as native_render

    monkeypatch.setenv(native_render.RENDER_ENV, "python")
    native_render.reset()
    yield
    native_render.reset()


@pytest.fixture(scope="module")
def db29(tmp_path_factory) -> str:
    return write_db(tmp_path_factory.mktemp("db") / "train", [raw_value(i) for i in range(29)])


def test_order_and_augmentation_independent_of_thread_counts(db29):
    steps, world = 12, 2  # 29 // (3*2) = 4 batches per epoch: 3 epochs
    results = {}
    for p, t in itertools.product((1, 2, 3), repeat=2):
        cfg = make_cfg(db29, batch_size=3, parser_threads=p, transformer_threads=t, crop_size=4, mirror=True)
        src = LmdbSource(cfg, num_classes=NUM_CLASSES, seed=11)
        results[p, t] = [collect(src.train_batches(SampleOrder(r, world, 3, seed=11), 0), steps) for r in range(world)]
    ref = results[1, 1]
    for key, res in results.items():
        for r in range(world):
            for (a, la, _), (b, lb, _) in zip(ref[r], res[r], strict=True):
                assert np.array_equal(a, b) and np.array_equal(la, lb), f"P,T={key} rank {r} differs"
    flips = 0
    for r in range(world):
        for step, (images, labels, info) in enumerate(ref[r]):
            expect = rank_batch_indices(step, 29, SampleOrder(r, world, 3, seed=11))
            assert ids(images) == expect.tolist() and labels.tolist() == (expect % NUM_CLASSES).tolist()
            assert all(is_window(im, i) for im, i in zip(images, expect, strict=True)) and info == {"bad_records": 0}
            flips += sum(not np.array_equal(im, pixels(i)[:4, :4]) for im, i in zip(images, expect, strict=True))
    assert flips > 0
    assert input_threads() == []


def test_shards_disjoint_covering_and_reshuffled_per_epoch(db29):
    world, b = 3, 2
    per_epoch = batches_per_epoch(29, world * b)  # 4
    src = LmdbSource(make_cfg(db29, batch_size=b, parser_threads=2, transformer_threads=2),
                      num_classes=NUM_CLASSES, seed=5)
    epochs = [[ids(x) for x, _, _ in collect(src.train_batches(SampleOrder(r, world, b, seed=5), 0), 2 * per_epoch)]
              for r in range(world)]
    for e in range(2):
        shards = [sum(epochs[r][e * per_epoch:(e + 1) * per_epoch], []) for r in range(world)]
        union = sum(shards, [])
        assert len(set(union)) == len(union) == per_epoch * world * b  # disjoint
        assert set(union) == set(epoch_permutation(5, e, 29, True)[:len(union)].tolist())  # cover, remainder stated
    assert epochs[0][:per_epoch] != epochs[0][per_epoch:]  # a new permutation each epoch
    again = [ids(x) for x, _, _ in collect(src.train_batches(SampleOrder(0, world, b, seed=5), 0), 2 * per_epoch)]
    assert again == epochs[0]  # reproducible from the seed


def test_start_step_resumes_the_same_sequence(db29):
    src = LmdbSource(make_cfg(db29, crop_size=4, mirror=True), num_classes=NUM_CLASSES, seed=3)
    plan = SampleOrder(0, 1, 4, seed=3)
    full = collect(src.train_batches(plan, 0), 10)
    resumed = collect(src.train_batches(plan, 6), 4)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(full[6:], resumed, strict=True))


def test_no_shuffle_reads_record_order_as_a_ring(db29):
    src = LmdbSource(make_cfg(db29, shuffle="none"), num_classes=NUM_CLASSES, seed=3)
    out = collect(src.train_batches(SampleOrder(0, 1, 4, seed=3, shuffle=False), 0), 15)
    seen = sum((ids(x) for x, _, _ in out), [])
    # 7 batches of 4 per epoch leave one record over; the next epoch starts with it, as Caffe's reader would
    assert seen == [i % 29 for i in range(60)]


def test_test_batches_split_contiguously_with_centre_crop(tmp_path):
    path = write_db(tmp_path / "test", [raw_value(i) for i in range(11)])
    src = LmdbSource(make_cfg(write_db(tmp_path / "train", [raw_value(i) for i in range(8)]),
                               test_path=path, crop_size=4, mirror=True), num_classes=NUM_CLASSES, seed=1)
    assert (src.num_train, src.num_test, src.sample_shape) == (8, 11, (4, 4, 3))
    seen = []
    for rank in range(2):
        batches = collect(src.test_batches(rank, 2, 4), 10)  # stops early with StopIteration
        seen.append([len(labels) for _, labels, _ in batches])
        for images, _labels, _ in batches:
            for im, i in zip(images, ids(images), strict=True):
                assert np.array_equal(im, pixels(i)[1:5, 2:6])  # centre: ((6-4)//2, (8-4)//2), never mirrored
    assert seen == [[4, 2], [4, 1]]


def test_key_table_for_keys_without_index_prefix(tmp_path):
    names = [b"zeta", b"alpha", b"mid", b"beta", b"omega"]
    path = write_db(tmp_path / "db", [raw_value(i) for i in range(5)], keys=names)
    src = LmdbSource(make_cfg(path, batch_size=5, shuffle="none"), num_classes=NUM_CLASSES, seed=1)
    (images, _, _), = collect(src.train_batches(SampleOrder(0, 1, 5, seed=1, shuffle=False), 0), 1)
    assert ids(images) == [names.index(k) for k in sorted(names)]  # records are numbered in key order


def test_source_attributes_and_means(tmp_path):
    path = write_db(tmp_path / "db", [raw_value(i) for i in range(8)])
    (tmp_path / "mean.binaryproto").write_bytes(encode_blob(np.stack([np.full((6, 8), v) for v in (1.0, 2.0, 3.0)])))
    src = LmdbSource(make_cfg(path, mean_file=str(tmp_path / "mean.binaryproto"), scale=0.5),
                      num_classes=NUM_CLASSES, seed=1)
    assert src.mean == (3.0, 2.0, 1.0) and src.scale == 0.5 and src.sample_shape == (H, W, 3)
    gray = write_db(tmp_path / "gray", [raw_value(i, image=pixels(i)[:, :, 1]) for i in range(4)])
    assert LmdbSource(make_cfg(gray), num_classes=NUM_CLASSES, seed=1).sample_shape == (H, W, 1)
    with pytest.raises(ConfigError, match="mean has 3 channels/values but the images have 1 channel"):
        LmdbSource(make_cfg(gray, mean_value=[1.0, 2.0, 3.0]), num_classes=NUM_CLASSES, seed=1)


def _caffe_transform(x_chw: np.ndarray, mean_chw: np.ndarray, h_off: int, w_off: int, size: int, mirror: bool,
                     scale: float) -> np.ndarray:
    """Caffe's DataTransformer::Transform, element by element: (x - mean) * scale at the source
    pixel, written to the mirrored column when mirroring."""
    c_n = x_chw.shape[0]
    out = np.empty((c_n, size, size), np.float32)
    for c in range(c_n):
        for h in range(size):
            for w in range(size):
                top_w = size - 1 - w if mirror else w
                src = (c, h_off + h, w_off + w)
                out[c, h, top_w] = (float(x_chw[src]) - mean_chw[src]) * scale
    return out


@pytest.mark.parametrize("train", [True, False])
def test_mean_file_image_is_subtracted_pixel_by_pixel_at_each_crop_as_caffe_does(tmp_path, train):
    from dptrain.data.base import DeviceFeeder

    rng = np.random.default_rng(0)
    mean_rgb = rng.uniform(0, 255, (3, H, W))
    (tmp_path / "mean.binaryproto").write_bytes(encode_blob(mean_rgb[::-1]))  # Caffe stores BGR
    path = write_db(tmp_path / "db", [raw_value(i) for i in range(8)])
    cfg = make_cfg(path, test_path=path, mean_file=str(tmp_path / "mean.binaryproto"), crop_size=4, mirror=True,
                   scale=0.5, shuffle="none")
    src = LmdbSource(cfg, num_classes=NUM_CLASSES, seed=2)
    assert src.mean_image is not None and tuple(src.mean_image.shape) == (3, H, W)
    stream = (src.train_batches(SampleOrder(0, 1, 4, seed=2, shuffle=False), 0) if train
              else src.test_batches(0, 1, 4))
    feeder = DeviceFeeder(stream, device=torch.device("cpu"), dtype=torch.float32, mean=src.mean, scale=src.scale,
                          channels_last=False, mean_image=src.mean_image)
    try:
        mirrored = 0
        for _ in range(2):
            x, labels = next(feeder)
            for sample, label in zip(x.numpy(), labels.numpy(), strict=True):
                matches = []
                for i in (j for j in range(8) if j % NUM_CLASSES == label):
                    for h_off in range(H - 4 + 1):
                        for w_off in range(W - 4 + 1):
                            for mirror in (False, True):
                                ref = _caffe_transform(pixels(i).transpose(2, 0, 1), mean_rgb, h_off, w_off, 4,
                                                       mirror, 0.5)
                                if np.allclose(sample, ref, atol=1e-4):
                                    matches.append((h_off, w_off, mirror))
                assert matches, "a sample equals no Caffe crop of its record minus the mean at that crop"
                mirrored += any(m for _, _, m in matches) and not any(not m for _, _, m in matches)
                if not train:
                    assert ((H - 4) // 2, (W - 4) // 2, False) in matches
        assert mirrored > 0 if train else mirrored == 0
    finally:
        feeder.close()


def test_mean_image_needs_the_stored_size_and_falls_back_to_channels_with_resizes(tmp_path, caplog):
    path = write_db(tmp_path / "db", [raw_value(i) for i in range(8)])
    ramp = np.stack([np.tile(np.linspace(0, 200, W), (H, 1))] * 3)
    (tmp_path / "ramp.binaryproto").write_bytes(encode_blob(ramp))
    (tmp_path / "small.binaryproto").write_bytes(encode_blob(ramp[:, :4, :4]))
    with pytest.raises(ConfigError, match=r"data.mean_file .*small.binaryproto' is 4x4 \(HxW\) but the records are 6x8"):
        LmdbSource(make_cfg(path, mean_file=str(tmp_path / "small.binaryproto"), crop_size=4), num_classes=5, seed=1)
    with caplog.at_level(logging.WARNING, logger="dptrain.data.sources.caffe_lmdb"):
        src = LmdbSource(make_cfg(path, mean_file=str(tmp_path / "ramp.binaryproto"), resize=[3, 4]),
                          num_classes=5, seed=1)
    assert src.mean_image is None and np.allclose(src.mean, [100.0] * 3)
    assert "varies by up to 100.0 pixel units" in caplog.text and "data.mean_value" in caplog.text


def test_default_threads_follow_cores_and_local_world_size(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    cores = Topology.from_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}).cores_per_process
    assert default_threads(DataConfig(), cores) == (2, 8)
    assert default_threads(DataConfig(parser_threads=1, transformer_threads=3), cores) == (1, 3)
    cores = Topology.from_env({"RANK": "0", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "16"}).cores_per_process
    assert default_threads(DataConfig(), cores) == (1, 1)
    # batches for a GPU: the solver's own thread (every kernel launch) and the readers keep their cores
    assert default_threads(DataConfig(), 16, training_on_cuda=True) == (3, 12)
    assert default_threads(DataConfig(), 2, training_on_cuda=True) == (1, 1)


# --------------------------------------------------------------------------- bad input


def test_missing_and_non_lmdb_paths(tmp_path):
    with pytest.raises(DataError, match="rank 0: LMDB .*nope.*does not exist"):
        LmdbSource(make_cfg(str(tmp_path / "nope")), num_classes=NUM_CLASSES, seed=1)
    (tmp_path / "notdb").mkdir()
    (tmp_path / "notdb" / "data.mdb").write_bytes(b"this is not an lmdb" * 300)
    with pytest.raises(DataError, match="not an LMDB"):
        LmdbSource(make_cfg(str(tmp_path / "notdb")), num_classes=NUM_CLASSES, seed=1)


def test_damaged_truncated_and_non_file_paths_fail_with_one_line_not_a_crash(tmp_path):
    import os
    import shutil

    good = write_db(tmp_path / "good", [raw_value(i) for i in range(200)])
    data = (tmp_path / "good" / "data.mdb").read_bytes()
    shutil.copytree(good, tmp_path / "trunc")
    (tmp_path / "trunc" / "data.mdb").write_bytes(data[: len(data) // 3])  # an interrupted copy: SIGBUS if read
    with pytest.raises(DataError, match=r"rank 0: LMDB .*trunc': LMDB is truncated: data.mdb holds \d+ bytes"):
        LmdbSource(make_cfg(str(tmp_path / "trunc")), num_classes=NUM_CLASSES, seed=1)
    damaged = bytearray(data)
    rng = np.random.default_rng(0)
    for off in range(4096 * 2, len(damaged), 4096):  # every page after the two meta pages
        damaged[off:off + 64] = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()
    shutil.copytree(good, tmp_path / "damaged")
    (tmp_path / "damaged" / "data.mdb").write_bytes(bytes(damaged))
    with pytest.raises(DataError, match=r"LMDB .*damaged': LMDB is damaged \(.*\); re-create it"):
        LmdbSource(make_cfg(str(tmp_path / "damaged")), num_classes=NUM_CLASSES, seed=1)
    os.mkfifo(tmp_path / "fifo")  # lmdb.open would block on it forever
    with pytest.raises(DataError, match="neither a directory nor a file"):
        LmdbSource(make_cfg(str(tmp_path / "fifo")), num_classes=NUM_CLASSES, seed=1)


def test_a_page_damaged_past_the_open_checks_is_named_damaged_when_read(tmp_path):
    """Open reads the first and last keys and probes a few records; a corrupt page elsewhere
    is met by a parser, and must say "damaged" with the advice, not a bare MDB error code."""
    import lmdb

    from dptrain.data.sources.caffe_lmdb import _Handle

    src = LmdbSource(make_cfg(write_db(tmp_path / "db", [raw_value(i) for i in range(8)])),
                      num_classes=NUM_CLASSES, seed=1)
    handle = _Handle(src._train)

    class CorruptCursor:  # what py-lmdb raises when a page is not what its parent says
        def set_range(self, key):
            raise lmdb.CorruptedError("mdb_cursor_get: MDB_CORRUPTED: Located page was wrong type")

    handle._cursor = CorruptCursor()
    key, value, error = handle.get(3)
    assert (key, value) == (b"#3", b"") and isinstance(error, DataError)
    assert re.search(r"LMDB is damaged \(mdb_cursor_get: MDB_CORRUPTED.*\); re-create it", str(error)), error


def test_empty_db(tmp_path):
    path = write_db(tmp_path / "empty", [])
    with pytest.raises(DataError, match="empty.*no records"):
        LmdbSource(make_cfg(path), num_classes=NUM_CLASSES, seed=1)


def test_bad_first_record_fails_at_open_with_its_key(tmp_path):
    path = write_db(tmp_path / "db", [b"\xff\xff\xff"] + [raw_value(i) for i in range(1, 6)])
    with pytest.raises(DataError, match="key '00000000_r0': unparsable record"):
        LmdbSource(make_cfg(path), num_classes=NUM_CLASSES, seed=1)


def _bomb_value() -> bytes:
    return png_value(np.zeros((40, 40, 3), dtype=np.uint8))


def _jpeg_bytes(h: int, w: int) -> bytes:
    y, x = np.mgrid[0:h, 0:w]
    buf = io.BytesIO()
    Image.fromarray(np.stack([x * 7, y * 5, (x * y) % 251], -1).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _truncated_jpeg_value() -> bytes:
    """Cut inside the last rows: the crop decoder must still refuse it (it reads the whole stream)."""
    data = _jpeg_bytes(32, 24)
    return encode_datum(label=0, data=data[: len(data) - 60], encoded=True)


BAD_RECORDS = {
    "undecodable": (lambda: encode_datum(label=0, data=b"not an image at all", encoded=True), "undecodable image"),
    "unparsable": (lambda: b"\xff\xff\xff", "unparsable record"),
    "label_high": (lambda: raw_value(5, label=NUM_CLASSES + 7), r"label 12 is outside \[0, 5\)"),
    "label_negative": (lambda: raw_value(5, label=-1), r"label -1 is outside \[0, 5\)"),
    "too_small": (lambda: raw_value(5, image=pixels(5)[:3, :3]), "image is 3x3 .*smaller than data.crop_size 4"),
    "truncated_png": (lambda: encode_datum(label=0, data=png_value(pixels(5))[:60], encoded=True), "undecodable"),
    "bomb": (_bomb_value, "decompression bomb"),
    "truncated_jpeg": (_truncated_jpeg_value, r"undecodable image \(image file is truncated"),
    "bomb_jpeg": (lambda: encode_datum(label=0, data=_jpeg_bytes(40, 40), encoded=True), "decompression bomb: 40x40"),
}


@pytest.mark.parametrize("kind", sorted(BAD_RECORDS))
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_bad_record_raises_with_rank_and_key_and_stops_threads(tmp_path, monkeypatch, kind):
    make_value, match = BAD_RECORDS[kind]
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # the 40x40 PNG is a bomb, 6x8 records are not
    values = [raw_value(i) for i in range(40)]
    values[6] = make_value()  # not among the records probed at open (0, 3, 5, 8, ...): the threads meet it
    src = LmdbSource(make_cfg(write_db(tmp_path / "db", values), shuffle="none", crop_size=4,
                               parser_threads=2, transformer_threads=2), num_classes=NUM_CLASSES, seed=1)
    stream = src.train_batches(SampleOrder(0, 1, 4, seed=1, shuffle=False), 0)
    with pytest.raises(DataError, match=f"rank 0: LMDB .* key '00000006_r6': {match}"):
        collect(stream, 3)
    assert input_threads() == []


def _huge_jpeg_header(width: int, height: int) -> bytes:
    """A small JPEG whose frame header claims ``width`` x ``height``: Pillow and libjpeg size an image from
    the header, so it is a decompression bomb in a few hundred bytes."""
    buf = io.BytesIO()
    Image.new("L", (16, 16), 100).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")  # baseline frame: length (2 bytes), precision (1), height (2), width (2)
    data[sof + 5:sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


def test_a_decompression_bomb_is_one_line_from_dptrain_without_pillows_warning(tmp_path):
    """12000 x 12000 lies between Pillow's MAX_IMAGE_PIXELS and twice that, where Pillow only warns: its
    warning used to reach the terminal raw, before dptrain's own line for the record."""
    import os
    import subprocess
    import sys

    values = [raw_value(i) for i in range(40)]
    keys = [f"{i:08d}_r{i}".encode() for i in range(40)]
    values[6], keys[6] = encode_datum(label=0, data=_huge_jpeg_header(12000, 12000), encoded=True), b"00000006_bomb"
    db = write_db(tmp_path / "db", values, keys)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[model]\nname = "lenet"\n[data]\nsource = "lmdb"\npath = "{db}"\nbatch_size = 4\n'
                   f'shuffle = "none"\nresize = [32, 32]\n[solver]\nmax_iter = 5\n[train]\n'
                   f'run_dir = "{tmp_path / "run"}"\n')
    proc = subprocess.run([sys.executable, "-m", "dptrain", "train", "--config", str(cfg)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    own = [ln for ln in proc.stderr.splitlines() if not ln[:8].replace(":", "").isdigit()]  # not a dptrain log line
    assert own == [f"dptrain: error: rank 0: LMDB {db!r} key '00000006_bomb': decompression bomb: 12000x12000 pixels "
                   f"exceeds PIL.Image.MAX_IMAGE_PIXELS = {Image.MAX_IMAGE_PIXELS}"], proc.stderr[-3000:]


def test_a_bad_record_probed_at_open_names_its_key_and_respects_the_skip_budget(tmp_path):
    values = [raw_value(i) for i in range(12)]
    values[0] = b"\xff\xff"
    path = write_db(tmp_path / "db", values)
    with pytest.raises(DataError, match="rank 0: LMDB .* key '00000000_r0': unparsable record"):
        LmdbSource(make_cfg(path, crop_size=4), num_classes=NUM_CLASSES, seed=1)
    src = LmdbSource(make_cfg(path, crop_size=4, shuffle="none", max_bad_records=1), num_classes=NUM_CLASSES, seed=1)
    (images, _, info), = collect(src.train_batches(SampleOrder(0, 1, 4, seed=1, shuffle=False), 0), 1)
    assert ids(images) == [1, 1, 2, 3] and info["bad_records"] == 1  # record 0 replaced by the next one


def test_one_grey_image_at_key_0_does_not_make_a_colour_db_grey(tmp_path):
    grey = np.repeat(pixels(0)[:, :, :1], 3, axis=2)[:, :, 0]
    values = [png_value(grey)] + [png_value(pixels(i)) for i in range(1, 12)]
    src = LmdbSource(make_cfg(write_db(tmp_path / "db", values), shuffle="none"), num_classes=NUM_CLASSES, seed=1)
    assert src.sample_shape == (H, W, 3)
    (images, _, _), = collect(src.train_batches(SampleOrder(0, 1, 4, seed=1, shuffle=False), 0), 1)
    assert np.array_equal(images[0], np.repeat(grey[:, :, None], 3, axis=2))  # the grey record, as RGB
    assert ids(images[1:]) == [1, 2, 3]
    only_grey = write_db(tmp_path / "grey", [png_value(grey)] * 8)
    assert LmdbSource(make_cfg(only_grey), num_classes=NUM_CLASSES, seed=1).sample_shape == (H, W, 1)


def test_skip_budget_substitutes_the_next_record_deterministically(tmp_path, caplog):
    values = [raw_value(i) for i in range(12)]
    values[2], values[5] = b"\xff", raw_value(5, label=99)
    path = write_db(tmp_path / "db", values)
    plan = SampleOrder(0, 1, 4, seed=1, shuffle=False)
    outs = []
    for p, t in ((1, 1), (3, 2)):
        src = LmdbSource(make_cfg(path, shuffle="none", max_bad_records=2, parser_threads=p, transformer_threads=t),
                          num_classes=NUM_CLASSES, seed=1)
        with caplog.at_level(logging.WARNING, logger="dptrain.data.loader.stream"):
            outs.append(collect(src.train_batches(plan, 0), 3))
    for out in outs:
        assert [ids(x) for x, _, _ in out] == [[0, 1, 3, 3], [4, 6, 6, 7], [8, 9, 10, 11]]
        assert [info["bad_records"] for _, _, info in out] == [1, 2, 2]
        assert out[0][1].tolist() == [0, 1, 3, 3]
    assert any("skipping bad record (1 met, 2 allowed)" in r.getMessage() and "00000002_r2" in r.getMessage()
               for r in caplog.records)
    src = LmdbSource(make_cfg(path, shuffle="none", max_bad_records=1), num_classes=NUM_CLASSES, seed=1)
    with pytest.raises(DataError, match="00000005_r5.*2 bad records exceed data.max_bad_records = 1"):
        collect(src.train_batches(plan, 0), 3)
    assert input_threads() == []


def test_bad_test_records_are_dropped_not_substituted(tmp_path, caplog):
    """In a test stream a skipped record leaves an empty row labelled DROPPED_LABEL: a substitute
    would be scored twice. Every P, T gives the same rows."""
    from dptrain.data.base import DROPPED_LABEL

    values = [raw_value(i) for i in range(10)]
    values[2], values[5] = b"\xff", raw_value(5, label=99)
    path = write_db(tmp_path / "db", values)
    for p, t in ((1, 1), (2, 3)):
        src = LmdbSource(make_cfg(path, test_path=path, max_bad_records=2, parser_threads=p, transformer_threads=t),
                          num_classes=NUM_CLASSES, seed=1)
        out = collect(src.test_batches(0, 1, 4), 3)
        labels = [int(v) for _, y, _ in out for v in y]
        assert labels == [0, 1, DROPPED_LABEL, 3, 4, DROPPED_LABEL, 1, 2, 3, 4]  # label = i % 5
        dropped = out[0][0][2]
        assert not dropped.any()  # an empty row, never stale pixels
        assert out[-1][2]["bad_records"] == 2
    assert "dropped from the test" in caplog.text
    assert input_threads() == []


def test_host_batches_stay_intact_until_the_next_one_is_asked_for_in_any_release_order(tmp_path):
    import time

    path = write_db(tmp_path / "db", [raw_value(i) for i in range(40)])
    src = LmdbSource(make_cfg(path, batch_size=1, prefetch=1, transformer_threads=2, shuffle="none"),
                      num_classes=NUM_CLASSES, seed=1)
    stream = src.train_batches(SampleOrder(0, 1, 1, seed=1, shuffle=False), 0)  # 3 ring slots
    try:
        held = [next(stream) for _ in range(3)]
        for hb in reversed(held):  # out of order, with no event: a host reader
            hb.release(None)
        time.sleep(0.3)  # transformers would refill a freed slot by now
        assert [ids(hb.images.numpy()) for hb in held] == [[0], [1], [2]]
        assert [hb.labels.tolist() for hb in held] == [[0], [1], [2]]
        assert ids(next(stream).images.numpy()) == [3]  # asking for the next one frees them
    finally:
        stream.close()


def test_over_budget_error_arrives_at_its_batch_naming_the_same_key_for_any_threads(tmp_path):
    """Threads meet bad records out of order; the stream still stops where a sequential reader
    would: every earlier batch is delivered, and the error names the (limit + 1)-th bad record."""
    values = [raw_value(i) for i in range(60)]
    values[29], values[30], values[50] = b"\xff", b"\xff", b"\xff"  # batches 7, 7 and 12 of 4
    path = write_db(tmp_path / "db", values)
    for limit, batches, key in ((0, 7, "00000029_r29"), (1, 7, "00000030_r30"), (2, 12, "00000050_r50")):
        for p, t, prefetch in ((1, 1, 1), (2, 2, 1), (1, 3, 4), (3, 2, 4)):
            src = LmdbSource(make_cfg(path, shuffle="none", max_bad_records=limit, parser_threads=p,
                                       transformer_threads=t, prefetch=prefetch), num_classes=NUM_CLASSES, seed=1)
            stream = src.train_batches(SampleOrder(0, 1, 4, seed=1, shuffle=False), 0)
            delivered = 0
            with pytest.raises(DataError) as err:
                for hb in stream:
                    hb.release(None)
                    delivered += 1
            assert delivered == batches and key in str(err.value), (limit, p, t, prefetch, delivered, err.value)
    assert input_threads() == []


def test_close_mid_stream_and_release_misuse_leave_no_thread(db29):
    src = LmdbSource(make_cfg(db29, prefetch=1, parser_threads=2, transformer_threads=3),
                      num_classes=NUM_CLASSES, seed=1)
    stream = src.train_batches(SampleOrder(0, 1, 4, seed=1), 0)
    held = [next(stream) for _ in range(3)]  # prefetch + 2 = 3 slots, none released
    with pytest.raises(RuntimeError, match="all 3 ring slots are held; call HostBatch.release"):
        next(stream)
    assert input_threads() == [] and len(held) == 3
    stream = src.train_batches(SampleOrder(0, 1, 4, seed=1), 0)
    next(stream).release(None)
    stream.close()
    stream.close()
    assert input_threads() == []
    with pytest.raises(StopIteration):
        next(stream)


def _jpeg_value(i: int, w: int = 96, h: int = 72) -> bytes:
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 2 + i, y * 3, np.full((h, w), 10 * i)], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90)
    return encode_datum(label=i % NUM_CLASSES, data=buf.getvalue(), encoded=True)


def test_jpeg_random_resized_crop_is_deterministic_across_threads(tmp_path):
    path = write_db(tmp_path / "jpeg", [_jpeg_value(i) for i in range(10)])
    outs = []
    for p, t in ((1, 1), (2, 3)):
        cfg = make_cfg(path, batch_size=3, parser_threads=p, transformer_threads=t, crop_size=16,
                       random_resized_crop=True, mirror=True)
        outs.append(collect(LmdbSource(cfg, num_classes=NUM_CLASSES, seed=4).train_batches(
            SampleOrder(0, 1, 3, seed=4), 0), 6))
    assert outs[0][0][0].shape == (3, 16, 16, 3)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(*outs, strict=True))


@pytest.mark.parametrize("recipe", [dict(crop_size=24, random_resized_crop=True, mirror=True),
                                    dict(crop_size=40, mirror=True)])
def test_crop_decode_feeds_the_same_batches_as_full_decode(tmp_path, monkeypatch, python_render, recipe):
    from dptrain.data.transforms import jpeg_crop

    if jpeg_crop.library() is None:
        pytest.skip("the JPEG crop decoder does not build here")
    path = write_db(tmp_path / "jpeg", [_jpeg_value(i) for i in range(12)])
    cfg = make_cfg(path, transformer_threads=2, **recipe)
    calls = []
    real = jpeg_crop.decode_crop
    monkeypatch.setattr(jpeg_crop, "decode_crop", lambda *a, **k: calls.append(1) or real(*a, **k))
    outs = []
    for crop_decode in (True, False):
        calls.clear()
        src = LmdbSource(cfg, num_classes=NUM_CLASSES, seed=3, render=RenderOptions(crop_decode=crop_decode))
        outs.append(collect(src.train_batches(SampleOrder(0, 1, 4, seed=3), 0), 6))
        assert bool(calls) == crop_decode
    for (fast, fast_labels, _), (full, full_labels, _) in zip(*outs, strict=True):
        assert np.array_equal(fast, full) and np.array_equal(fast_labels, full_labels)


def test_draft_mode_fires_for_2x_downscale_and_stays_close(tmp_path, monkeypatch):
    from PIL import JpegImagePlugin

    from dptrain.data.transforms import jpeg_crop

    crop_decoder = jpeg_crop.library()  # loaded (and self-checked) before draft is patched to count calls
    path = write_db(tmp_path / "jpeg", [_jpeg_value(i) for i in range(4)])
    calls = []
    real_draft = JpegImagePlugin.JpegImageFile.draft
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft",
                        lambda self, mode, size: calls.append(size) or real_draft(self, mode, size))
    cfg = make_cfg(path, resize=[18, 24], shuffle="none")  # 72x96 -> 18x24: 4x smaller
    plan = SampleOrder(0, 1, 4, seed=0, shuffle=False)

    def batch(**render):
        (images, _, _), = collect(LmdbSource(cfg, num_classes=NUM_CLASSES, seed=0,
                                             render=RenderOptions(**render)).train_batches(plan, 0), 1)
        return images

    fast = batch(draft=True, crop_decode=False)
    assert calls and all(size == (24, 18) for size in calls)
    calls.clear()
    exact = batch(draft=False, crop_decode=False)
    assert not calls
    diff = np.abs(fast.astype(int) - exact.astype(int))
    assert diff.mean() < 2.0 and diff.max() <= 12  # DCT-domain downscale vs full decode + bilinear: a few levels
    if crop_decoder is not None:  # the crop decoder (native path or Python's) decodes the 1/4-scale box Pillow picked
        assert np.array_equal(batch(draft=True), fast)


def test_shard_with_only_bad_records_fails_even_within_budget(tmp_path):
    values = [raw_value(i) for i in range(8)]
    for i in (2, 3, 6, 7):  # rank 1's shard with world 2, batch 2, record order
        values[i] = b"\xff"
    src = LmdbSource(make_cfg(write_db(tmp_path / "db", values), shuffle="none", max_bad_records=10),
                      num_classes=NUM_CLASSES, seed=1)
    with pytest.raises(DataError, match="rank 1: .*all 4 records of this solver's shard are bad"):
        collect(src.train_batches(SampleOrder(1, 2, 2, seed=1, shuffle=False), 0), 1)
    assert input_threads() == []


def test_prefix_seek_reports_a_gap_in_the_key_sequence(tmp_path):
    keys = [b"00000000_a", b"00000001_b", b"00000001_c", b"00000003_d"]  # no 00000002_: first/last look dense
    cfg = make_cfg(write_db(tmp_path / "db", [raw_value(i) for i in range(4)], keys=keys), shuffle="none")
    with pytest.raises(DataError, match="key '#2': no record with key prefix '00000002_'"):
        LmdbSource(cfg, num_classes=NUM_CLASSES, seed=1)  # a small DB is probed whole at open
    src = LmdbSource(dataclasses.replace(cfg, max_bad_records=1), num_classes=NUM_CLASSES, seed=1)
    (_, _, info), = collect(src.train_batches(SampleOrder(0, 1, 4, seed=1, shuffle=False), 0), 1)
    assert info == {"bad_records": 1}


def test_double_release_and_dead_renderers_raise(db29, monkeypatch):
    src = LmdbSource(make_cfg(db29), num_classes=NUM_CLASSES, seed=1)
    stream = src.train_batches(SampleOrder(0, 1, 4, seed=1), 0)
    hb = next(stream)
    hb.release(None)
    with pytest.raises(RuntimeError, match="batch 0 released twice"):
        hb.release(None)
    stream.close()
    monkeypatch.setattr("dptrain.data.loader.pipeline.run_renderer", lambda t, parts, stop: None)
    with pytest.raises(RuntimeError, match=r"renderer threads \(data.transformer_threads\) exited before batch 0 was complete"):
        collect(src.train_batches(SampleOrder(0, 1, 4, seed=1), 0), 1)
    assert input_threads() == []


def test_data_bench_measures_and_rejects_other_sources(db29, tmp_path, capsys):
    import argparse
    import json

    from dptrain.tools.data_bench import add_arguments as add_data_bench_args
    from dptrain.tools.data_bench import main as run_data_bench

    ap = argparse.ArgumentParser()
    add_data_bench_args(ap)
    cfg = tmp_path / "bench.toml"
    cfg.write_text(f'[data]\nsource = "lmdb"\npath = "{db29}"\nbatch_size = 4\ncrop_size = 4\nmirror = true\n'
                   f'[model]\nnum_classes = {NUM_CLASSES}\n')
    record = run_data_bench(ap.parse_args(["--config", str(cfg), "--batches", "3", "--repeats", "2"]))
    json.dumps(record)  # the CLI prints it as one JSON line
    assert record["images_per_s"] > 0 and len(record["images_per_s_runs"]) == 2 and record["sample_shape"] == [4, 4, 3]
    with pytest.raises(ConfigError, match="data.source is 'digits'"):
        run_data_bench(ap.parse_args(["--config", str(cfg), "--set", 'data.source="digits"']))
    with pytest.raises(ValueError, match="--batches must be positive"):
        run_data_bench(ap.parse_args(["--config", str(cfg), "--batches", "0"]))


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normalize_batch_matches_the_formula_and_leaves_the_source(channels_last, dtype):
    from dptrain.data.base import normalize_batch

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 5, 6, 3), dtype=torch.uint8, generator=g)  # [B, H, W, C]
    before = images.clone()
    mean = torch.tensor([10.0, 20.0, 30.0]).view(1, 3, 1, 1)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    exact = (images.permute(0, 3, 1, 2).float() - mean) * 0.017
    out = normalize_batch(images, mean, 0.017, dtype, channels_last)
    assert out.dtype == dtype and out.shape == (4, 3, 5, 6) and torch.equal(out, exact.to(dtype))
    assert out.is_contiguous(memory_format=fmt)
    # the one-kernel form CUDA uses, run here on the CPU: x * s - mean * s, one fp32 rounding apart
    fused = normalize_batch(images, mean, 0.017, dtype, channels_last, fused=True)
    assert fused.dtype == dtype and fused.is_contiguous(memory_format=fmt)
    tol = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8}[dtype]
    torch.testing.assert_close(fused.float(), exact.to(dtype).float(), rtol=tol, atol=tol)
    kept = normalize_batch(images, mean, 0.017, dtype, channels_last, fused=True, bias=mean * -0.017)
    assert torch.equal(kept, fused)  # the feeder's precomputed bias changes nothing
    assert torch.equal(images, before)


@pytest.mark.parametrize("channels_last", [False, True])
def test_window_means_gather_each_samples_mirrored_crop_for_both_normalize_forms(channels_last):
    from dptrain.data.base import normalize_batch, window_means

    g = torch.Generator().manual_seed(1)
    mean_image = torch.rand((3, 9, 11), generator=g) * 255
    windows = torch.tensor([[0, 0, 0], [2, 5, 1], [4, 6, 0], [1, 3, 1]], dtype=torch.int32)
    got = window_means(mean_image, windows, 5, 5)
    for b, (y0, x0, flip) in enumerate(windows.tolist()):
        crop = mean_image[:, y0:y0 + 5, x0:x0 + 5]
        assert torch.equal(got[b], crop.flip(-1) if flip else crop), b
    images = torch.randint(0, 256, (4, 5, 5, 3), dtype=torch.uint8, generator=g)
    exact = (images.permute(0, 3, 1, 2).float() - got) * 0.5
    assert torch.equal(normalize_batch(images, got, 0.5, torch.float32, channels_last), exact)
    torch.testing.assert_close(normalize_batch(images, got, 0.5, torch.float32, channels_last, fused=True), exact)


def test_batch_ring_pins_only_when_asked():
    from dptrain.data.loader.stream import BatchRing

    assert not BatchRing(2, 3, (4, 4, 3)).images.is_pinned()


def _damage_a_middle_leaf_page(path: str) -> None:
    """Mark the middle leaf page of ``path``/data.mdb as something else: a real damaged page,
    which LMDB meets as MDB_CORRUPTED and after which it fails the whole read transaction."""
    import struct

    data = bytearray(open(f"{path}/data.mdb", "rb").read())
    page = 4096
    flags_at = 10  # MDB_page: pgno (8 bytes), pad (2), flags (2)
    leaves = [p for p in range(2, len(data) // page)
              if struct.unpack_from("<H", data, p * page + flags_at)[0] == 0x02]  # P_LEAF
    assert len(leaves) >= 5, f"want a DB of several leaf pages, found {len(leaves)}"
    struct.pack_into("<H", data, leaves[len(leaves) // 2] * page + flags_at, 0x10)  # P_DIRTY: not a leaf
    open(f"{path}/data.mdb", "wb").write(bytes(data))


def test_a_damaged_leaf_page_costs_only_its_own_records_under_a_skip_budget(tmp_path, caplog):
    """After an lmdb error the thread's read transaction is renewed, so the good records after a
    damaged page read normally; only the records on that page count against the budget."""
    from dptrain.data.sources.caffe_lmdb import LmdbReader

    n = 240
    path = write_db(tmp_path / "db", [raw_value(i) for i in range(n)])
    _damage_a_middle_leaf_page(path)
    handle = LmdbReader(path).handle()
    keys, _, errors = handle.get_many(list(range(n)))
    handle.close()
    bad = {keys[i].decode() for i in errors}
    assert 0 < len(bad) < n // 3 and all("LMDB is damaged" in str(e) for e in errors.values()), (len(bad), errors)
    src = LmdbSource(make_cfg(path, shuffle="none", max_bad_records=len(bad)), num_classes=NUM_CLASSES, seed=1)
    with caplog.at_level(logging.WARNING, logger="dptrain.data.loader.stream"):
        batches = collect(src.train_batches(SampleOrder(0, 1, 4, seed=1, shuffle=False), 0), n // 4)
    named = {m.split("key '")[1].split("'")[0] for m in caplog.messages if "skipping bad record" in m}
    assert named == bad  # warned once each, and no other record
    seen = set(ids(np.concatenate([b[0] for b in batches])))
    assert seen == set(range(n)) - {int(k[1:]) for k in bad}  # every good record was read (bad ones substituted)
