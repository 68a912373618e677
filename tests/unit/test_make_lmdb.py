"""make-lmdb -> pipeline round trips (raw BGR, PNG, JPEG), inputs, options and errors."""
from __future__ import annotations

import argparse
import itertools

import numpy as np
import pytest
from PIL import Image

from dptrain.config import DataConfig
from dptrain.data.caffe.datum import parse_datum
from dptrain.data.caffe.writer import make_lmdb
from dptrain.data.sampling import SampleOrder
from dptrain.data.sources.caffe_lmdb import LmdbReader, LmdbSource
from dptrain.data.sources.files import read_list_file
from dptrain.errors import InputError
from dptrain.tools.make_lmdb import add_arguments
from dptrain.tools.make_lmdb import main as make_lmdb_main

CLASSES = ("cat", "dog")


def image(i: int, h: int = 12, w: int = 16) -> np.ndarray:
    """Smooth RGB test image (JPEG-friendly); channels differ so a swap is visible."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 10 + i, y * 12 + 2 * i, np.full((h, w), 40 + 20 * i)], -1).astype(np.uint8)


@pytest.fixture
def folder(tmp_path):
    """root/cat/00.png, root/cat/01.png, root/dog/02.png ... (3 per class); image i as above."""
    root = tmp_path / "images"
    for i in range(6):
        d = root / CLASSES[i // 3]
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image(i)).save(d / f"{i:02d}.png")
        Image.fromarray(image(i)).save(d / f"{i:02d}.jpg", quality=95)
    return root


def read_all(path: str, n: int, **kw) -> tuple[np.ndarray, np.ndarray]:
    src = LmdbSource(DataConfig(source="lmdb", path=path, batch_size=n, shuffle="none", **kw), num_classes=2, seed=0)
    stream = src.train_batches(SampleOrder(0, 1, n, seed=0, shuffle=False), 0)
    try:
        hb = next(stream)
        return hb.images.numpy().copy(), hb.labels.numpy().copy()
    finally:
        stream.close()


def db_keys_and_values(path) -> list[tuple[bytes, bytes]]:
    reader = LmdbReader(str(path))  # the process's one Environment for this path (py-lmdb allows one)
    handle = reader.handle()
    try:
        return [handle.get(i)[:2] for i in range(len(reader))]
    finally:
        handle.close()


def test_folder_raw_round_trip_is_exact_and_stored_bgr(folder, tmp_path):
    items = [(f"{c}/{i:02d}.png", k) for k, c in enumerate(CLASSES) for i in range(3 * k, 3 * k + 3)]
    assert make_lmdb(tmp_path / "raw", items, root=folder) == 6
    images, labels = read_all(str(tmp_path / "raw"), 6)
    assert np.array_equal(images, np.stack([image(i) for i in range(6)])) and labels.tolist() == [0, 0, 0, 1, 1, 1]
    key, value = db_keys_and_values(tmp_path / "raw")[4]
    assert key == b"00000004_dog/04.png"
    d = parse_datum(value)
    planes = np.frombuffer(d.data, np.uint8).reshape(d.channels, d.height, d.width)
    assert np.array_equal(planes[0], image(4)[:, :, 2]) and np.array_equal(planes[2], image(4)[:, :, 0])  # B first


def test_encoded_png_exact_and_jpeg_within_tolerance(folder, tmp_path):
    for ext in ("png", "jpg"):
        items = [(f"{CLASSES[i // 3]}/{i:02d}.{ext}", i // 3) for i in range(6)]
        make_lmdb(tmp_path / ext, items, root=folder, encoded=True)
        images, labels = read_all(str(tmp_path / ext), 6)
        want = np.stack([image(i) for i in range(6)]).astype(int)
        assert labels.tolist() == [0, 0, 0, 1, 1, 1]
        if ext == "png":
            assert np.array_equal(images, want)
        else:  # quality-95 JPEG of a smooth image: chroma subsampling and quantisation cost a few levels
            err = np.abs(images.astype(int) - want)
            assert err.mean() < 3 and err.max() <= 24
            decoded = np.stack([np.asarray(Image.open(folder / p).convert("RGB")) for p, _ in items])
            assert np.array_equal(images, decoded)  # the pipeline decodes exactly what Pillow decodes


def test_cli_folder_with_shuffle_gray_resize(folder, tmp_path, capsys):
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    out = tmp_path / "gray"
    summary = make_lmdb_main(ap.parse_args([str(folder), str(out), "--gray", "--resize", "6", "8",
                                           "--shuffle", "--seed", "3"]))
    assert summary["records"] == 12 and summary["classes"] == 2  # .png and .jpg of each image
    keys = [k.decode() for k, _ in db_keys_and_values(out)]
    assert [k[:9] for k in keys] == [f"{i:08d}_" for i in range(12)]
    names = [k[9:] for k in keys]
    assert sorted(names) == sorted(f"{CLASSES[i // 3]}/{i:02d}.{e}" for i in range(6) for e in ("png", "jpg"))
    assert names != sorted(names)  # shuffled
    images, labels = read_all(str(out), 12)
    assert images.shape == (12, 6, 8, 1)
    assert labels.tolist() == [int(n.startswith("dog")) for n in names]
    again = tmp_path / "gray2"
    make_lmdb_main(ap.parse_args([str(folder), str(again), "--gray", "--resize", "6", "8", "--shuffle", "--seed", "3"]))
    assert [k for k, _ in db_keys_and_values(again)] == [k.encode() for k in keys]  # seeded


def test_list_file_with_root(folder, tmp_path, capsys):
    listing = tmp_path / "list.txt"
    listing.write_text("dog/05.png 1\n\ncat/00.png 0\ncat/01.png 1\n")
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert make_lmdb_main(ap.parse_args([str(listing), str(tmp_path / "out"), "--root", str(folder)]))["records"] == 3
    images, labels = read_all(str(tmp_path / "out"), 3)
    assert labels.tolist() == [1, 0, 1]
    assert np.array_equal(images, np.stack([image(5), image(0), image(1)]))


def test_digits_written_for_the_demo(tmp_path, capsys):
    from dptrain.data.sources.builtin import load_digits_arrays

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    summary = make_lmdb_main(ap.parse_args(["--digits", str(tmp_path / "digits"), "--encoded"]))
    assert summary["records"] == {"train": 1500, "test": 297}
    xtr, ytr, xte, yte = load_digits_arrays()
    cfg = DataConfig(source="lmdb", path=str(tmp_path / "digits/train"), test_path=str(tmp_path / "digits/test"))
    src = LmdbSource(cfg, num_classes=10, seed=0)
    stream = src.test_batches(0, 1, 100)
    got = [(hb.images.numpy().copy(), hb.labels.numpy().copy()) for hb in itertools.islice(stream, 3)]
    stream.close()
    assert np.array_equal(np.concatenate([g[0] for g in got]), xte)
    assert np.array_equal(np.concatenate([g[1] for g in got]), yte)


def test_make_lmdb_errors(folder, tmp_path):
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    make_lmdb(tmp_path / "db", [("cat/00.png", 0)], root=folder)
    with pytest.raises(InputError, match="already holds an LMDB; remove it"):
        make_lmdb(tmp_path / "db", [("cat/00.png", 0)], root=folder)
    (folder / "cat" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(InputError, match="cannot read image .*broken.png"):
        make_lmdb(tmp_path / "db2", [("cat/broken.png", 0)], root=folder)
    bad = tmp_path / "bad.txt"
    bad.write_text("cat/00.png 0\ncat/01.png x\n")
    with pytest.raises(InputError, match=r"bad.txt:2: expected 'path label'"):
        read_list_file(bad)
    with pytest.raises(InputError, match="list file .*missing.txt' does not exist"):
        make_lmdb_main(ap.parse_args([str(tmp_path / "missing.txt"), str(tmp_path / "o")]))
    (tmp_path / "noclasses").mkdir()
    with pytest.raises(InputError, match="has no images in class subfolders"):
        make_lmdb_main(ap.parse_args([str(tmp_path / "noclasses"), str(tmp_path / "o")]))
    with pytest.raises(InputError, match="--digits takes one output path"):
        make_lmdb_main(ap.parse_args(["--digits", "a", "b"]))
    with pytest.raises(InputError, match="takes SOURCE OUT"):
        make_lmdb_main(ap.parse_args(["only_one"]))


def _unwritable(tmp_path):
    """A folder this user cannot create anything in: a read-only one, or for root (whom permissions do not
    stop) sysfs, where no one may create a folder."""
    import os
    from pathlib import Path

    if os.geteuid() == 0:
        return Path("/sys")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    return locked


def test_a_destination_that_cannot_be_written_is_one_line_and_exit_2(folder, tmp_path, capsys):
    from dptrain.cli import main

    where = _unwritable(tmp_path)
    out = where / "dptrain-test-lmdb"
    assert main(["make-lmdb", str(folder), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dptrain: error: cannot create the LMDB {str(out)!r} ("), err
    assert err[0].endswith(f": {str(where / '.dptrain-test-lmdb.incomplete')!r}); choose an output path this user "
                           f"can write to"), err
    assert main(["make-lmdb", "--digits", str(out)]) == 2  # OUT/train under a folder it cannot create
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot create the LMDB {str(out / 'train')!r} (" in err[0], err
    assert not out.exists()


def test_map_grows_and_bad_options_are_refused(folder, tmp_path, monkeypatch):
    monkeypatch.setattr("dptrain.data.caffe.writer.INITIAL_MAP_BYTES", 64 * 1024)  # forces MDB_MAP_FULL + regrow
    items = [(f"{CLASSES[i // 3]}/{i:02d}.png", i // 3) for i in range(6)]
    assert make_lmdb(tmp_path / "big", items, root=folder, resize=(64, 64)) == 6  # 6 x 12 KiB raw > 64 KiB
    assert read_all(str(tmp_path / "big"), 6)[0].shape == (6, 64, 64, 3)
    with pytest.raises(InputError, match=r"--resize needs positive H W, got \[0, 4\]"):
        make_lmdb(tmp_path / "r", items, root=folder, resize=(0, 4))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(InputError, match="lists no images"):
        read_list_file(empty)


def test_hidden_folders_are_skipped_and_an_empty_class_folder_is_refused(folder, tmp_path):
    from dptrain.data.sources.files import list_image_folder

    before = list_image_folder(folder)
    (folder / ".ipynb_checkpoints").mkdir()
    Image.fromarray(image(0)).save(folder / ".ipynb_checkpoints" / "00.png")
    Image.fromarray(image(0)).save(folder / "cat" / "._00.png")  # macOS resource-fork litter
    assert list_image_folder(folder) == before  # labels unchanged: cat 0, dog 1
    (folder / "bird").mkdir()
    with pytest.raises(InputError, match="class folder .*bird' has no images.*remove it or add its images"):
        list_image_folder(folder)


def test_a_failed_conversion_leaves_no_lmdb_and_can_be_rerun(folder, tmp_path):
    items = [(f"cat/{i:02d}.png", 0) for i in range(3)]
    (folder / "cat" / "broken.png").write_bytes(b"not a png")
    out = tmp_path / "out"
    with pytest.raises(InputError, match="cannot read image .*broken.png"):
        make_lmdb(out, items + [("cat/broken.png", 0)], root=folder)
    assert not out.exists() and list(tmp_path.iterdir()) == [folder.parent / "images"]  # no partial DB, no temp
    assert make_lmdb(out, items, root=folder) == 3
    assert len(db_keys_and_values(out)) == 3
    deep = "cat/" + "/".join(["d" * 120] * 5) + "/00.png"  # a path LMDB cannot take as a key
    (folder / deep).parent.mkdir(parents=True)
    Image.fromarray(image(0)).save(folder / deep)
    with pytest.raises(InputError, match="is 6.. bytes, over LMDB's 511; shorten the image paths"):
        make_lmdb(tmp_path / "long", [("cat/00.png", 0), (deep, 0)], root=folder)
    assert not (tmp_path / "long").exists()


def test_sixteen_bit_grey_and_exif_orientation_are_stored_as_opencv_reads_them(tmp_path):
    from PIL import ExifTags

    root = tmp_path / "in"
    (root / "a").mkdir(parents=True)
    ramp = (np.arange(12 * 16, dtype=np.uint32).reshape(12, 16) * 300).astype(np.uint16)
    Image.fromarray(ramp).save(root / "a" / "deep.png")
    stored = image(1)  # 12 x 16, tagged "rotate 90 clockwise"
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6
    Image.fromarray(stored).save(root / "a" / "turned.png", exif=exif.tobytes())
    make_lmdb(tmp_path / "db", [("a/deep.png", 0), ("a/turned.png", 0)], root=root, gray=False)
    (_, deep), (_, turned) = db_keys_and_values(tmp_path / "db")
    d, t = parse_datum(deep), parse_datum(turned)
    deep_rgb = np.frombuffer(d.data, np.uint8).reshape(3, 12, 16)
    assert np.array_equal(deep_rgb[0], (ramp >> 8).astype(np.uint8))  # high byte, not clipped to 255
    assert (t.height, t.width) == (16, 12)
    bgr = np.frombuffer(t.data, np.uint8).reshape(3, 16, 12)
    assert np.array_equal(bgr[::-1].transpose(1, 2, 0), np.rot90(stored, k=-1))


def test_inputs_that_used_to_crash_or_mislead_get_one_line_errors(folder, tmp_path):
    import os

    (tmp_path / "afile").write_text("x")
    with pytest.raises(InputError, match="afile' is a file; choose another output path"):
        make_lmdb(tmp_path / "afile" / "sub", [("cat/00.png", 0)], root=folder)
    with pytest.raises(InputError, match="--seed must be >= 0, got -1"):
        make_lmdb(tmp_path / "s", [("cat/00.png", 0)], root=folder, shuffle=True, seed=-1)
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(InputError, match="list file .*pipe' is not a regular file; give an image folder"):
        read_list_file(tmp_path / "pipe")
    with pytest.raises(InputError, match="list file .*00.png' is not UTF-8 text"):
        read_list_file(folder / "cat" / "00.png")  # an image given where the list file goes
    (tmp_path / "sup.txt").write_text("cat/00.png \u00b2\n")  # a superscript two: isdigit() but not a label
    with pytest.raises(InputError, match="sup.txt:1: expected 'path label'"):
        read_list_file(tmp_path / "sup.txt")
    odd = os.fsdecode(b"img\xff.png")  # a file name that is not UTF-8
    Image.fromarray(image(0)).save(folder / "cat" / odd, format="PNG")
    assert make_lmdb(tmp_path / "odd", [(f"cat/{odd}", 0)], root=folder) == 1
    assert db_keys_and_values(tmp_path / "odd")[0][0] == b"00000000_cat/img\xff.png"


def test_encoded_records_are_decoded_once_so_a_truncated_jpeg_is_refused(folder, tmp_path):
    data = (folder / "cat" / "00.jpg").read_bytes()
    (folder / "cat" / "cut.jpg").write_bytes(data[: len(data) // 2])  # e.g. an interrupted download
    with pytest.raises(InputError, match="cannot read image .*cut.jpg'.*fix or remove it"):
        make_lmdb(tmp_path / "enc", [("cat/00.jpg", 0), ("cat/cut.jpg", 0)], root=folder, encoded=True)
    assert not (tmp_path / "enc").exists()
