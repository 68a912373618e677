"""Image folders and list files as data sources (``dptrain.data.sources.files``): the same pixels as an
LMDB of the same JPEGs, labels by sorted class folder, lists under a root, and bad input in one line."""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dptrain.cli import main
from dptrain.config import DataConfig
from dptrain.data import open_records
from dptrain.data.caffe.datum import parse_datum
from dptrain.data.caffe.writer import make_lmdb
from dptrain.data.sampling import SampleOrder
from dptrain.data.sources.caffe_lmdb import LmdbSource
from dptrain.data.sources.files import FolderSource, datum_of, label_tail
from dptrain.errors import ConfigError, DataError, InputError
from lmdb_helpers import collect, input_threads

CLASSES = ("cat", "dog", "emu")


def _jpeg(seed: int, size: tuple[int, int] = (40, 36)) -> bytes:
    rng = np.random.default_rng(seed)
    img = (rng.integers(0, 256, (size[1] // 4, size[0] // 4, 3)).repeat(4, 0).repeat(4, 1)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """train/<class>/NN.jpg (7 per class) and val/<class> with one class missing."""
    root = tmp_path_factory.mktemp("images")
    for split, classes in (("train", CLASSES), ("val", ("cat", "emu"))):
        for k, c in enumerate(classes):
            (root / split / c).mkdir(parents=True)
            for i in range(7 if split == "train" else 2):
                (root / split / c / f"{i:02d}.jpg").write_bytes(_jpeg(100 * k + i + (50 if split == "val" else 0)))
    return root


def _cfg(**kw) -> DataConfig:
    return DataConfig(batch_size=4, crop_size=24, random_resized_crop=True, mirror=True, **kw)


def test_a_folder_gives_the_pixels_of_an_lmdb_of_the_same_jpegs(folder, tmp_path):
    make_lmdb(tmp_path / "db", [(f"{c}/{i:02d}.jpg", k) for k, c in enumerate(CLASSES) for i in range(7)],
              root=folder / "train", encoded=True)
    order = SampleOrder(0, 1, 4, seed=3, shuffle=True)
    from_db = collect(LmdbSource(_cfg(source="lmdb", path=str(tmp_path / "db")), num_classes=3, seed=3)
                      .train_batches(order, 0), 8)
    src = open_records(_cfg(source="folder", path=str(folder / "train")), num_classes=3, seed=3)
    assert isinstance(src, FolderSource) and src.classes == list(CLASSES) and src.num_train == 21
    from_folder = collect(src.train_batches(order, 0), 8)  # two epochs: the per-epoch shuffle too
    for (a, la, _), (b, lb, _) in zip(from_db, from_folder, strict=True):
        assert np.array_equal(a, b) and np.array_equal(la, lb)
    assert input_threads() == []


def test_a_list_under_a_root_and_a_test_folder_mapped_by_class_name(folder, tmp_path):
    lines = [f"{c}/{i:02d}.jpg {k}" for k, c in enumerate(CLASSES) for i in range(7)]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n\n")
    order = SampleOrder(0, 1, 4, seed=1, shuffle=False)
    listed = collect(open_records(_cfg(source="list", path=str(tmp_path / "train.txt"), root=str(folder / "train")),
                                  num_classes=3, seed=1).train_batches(order, 0), 3)
    folded = collect(open_records(_cfg(source="folder", path=str(folder / "train")), num_classes=3, seed=1)
                     .train_batches(order, 0), 3)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(listed, folded, strict=True))
    src = open_records(_cfg(source="folder", path=str(folder / "train"), test_path=str(folder / "val")),
                       num_classes=3, seed=1)
    labels = np.concatenate([lb for _, lb, _ in collect(src.test_batches(0, 1, 4), 2)])
    assert labels.tolist() == [0, 0, 2, 2]  # val has no "dog": emu keeps the training folder's label 2


def test_the_record_a_reader_makes_is_the_encoded_datum_of_the_file():
    data = _jpeg(1)
    d = parse_datum(datum_of(data, label_tail(300)))
    assert d.data == data and d.label == 300 and d.encoded


def test_a_bad_file_is_named_by_its_path(folder, tmp_path):
    root = tmp_path / "broken"
    for c in CLASSES:
        (root / c).mkdir(parents=True)
        for i in range(3):
            (root / c / f"{i}.jpg").write_bytes(_jpeg(i))
    (root / "dog" / "1.jpg").write_bytes(b"not a jpeg")
    cfg = DataConfig(source="folder", path=str(root), batch_size=9, crop_size=16, shuffle="none")
    with pytest.raises(DataError, match=r"rank 0: image folder '.*broken' file 'dog/1.jpg': undecodable image"):
        open_records(cfg, num_classes=3, seed=1)  # the records probed at open include it
    src = open_records(dataclasses.replace(cfg, max_bad_records=1), num_classes=3, seed=1)
    (_, _, info), = collect(src.train_batches(SampleOrder(0, 1, 9, seed=1, shuffle=False), 0), 1)
    assert info == {"bad_records": 1}


def test_bad_folders_and_lists_are_named(folder, tmp_path):
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(_jpeg(0))
    with pytest.raises(InputError, match="has no images in class subfolders"):
        open_records(DataConfig(source="folder", path=str(tmp_path / "flat")), num_classes=3, seed=1)
    with pytest.raises(ConfigError, match=r"has 3 class folders \('cat' ... 'emu'\) but model.num_classes = 2"):
        open_records(DataConfig(source="folder", path=str(folder / "train")), num_classes=2, seed=1)
    (tmp_path / "l.txt").write_text("cat/00.jpg 0\ndog/00.jpg\n")
    with pytest.raises(InputError, match=r"l.txt:2: expected 'path label' with an integer label"):
        open_records(DataConfig(source="list", path=str(tmp_path / "l.txt")), num_classes=3, seed=1)
    (tmp_path / "l.txt").write_text("cat/00.jpg 0\ndog/00.jpg 7\n")
    with pytest.raises(ConfigError, match=r"l.txt:2: label 7 of 'dog/00.jpg' is outside \[0, 3\)"):
        open_records(DataConfig(source="list", path=str(tmp_path / "l.txt"), root=str(folder / "train")),
                     num_classes=3, seed=1)
    with pytest.raises(ConfigError, match="data.path must name a training image folder"):
        DataConfig(source="folder")
    with pytest.raises(ConfigError, match="data.root applies to data.source = \"list\""):
        DataConfig(source="folder", path="x", root="y")


@pytest.mark.parametrize("case", ["no classes", "no label", "label too big"])
def test_bad_data_is_one_line_and_exit_2_with_nothing_written(folder, tmp_path, capsys, case):
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(_jpeg(0))
    (tmp_path / "nolabel.txt").write_text("cat/00.jpg\n")
    (tmp_path / "big.txt").write_text("cat/00.jpg 10\n")
    data = {"no classes": ["data.source=folder", f"data.path={json.dumps(str(tmp_path / 'flat'))}"],
            "no label": ["data.source=list", f"data.path={json.dumps(str(tmp_path / 'nolabel.txt'))}"],
            "label too big": ["data.source=list", f"data.path={json.dumps(str(tmp_path / 'big.txt'))}",
                              f"data.root={json.dumps(str(folder / 'train'))}"]}[case]
    (tmp_path / "r.toml").write_text("")
    args = ["train", "--config", str(tmp_path / "r.toml"), "--set", f"train.run_dir={json.dumps(str(tmp_path / 'run'))}"]
    for s in [*data, "data.crop_size=16", "solver.max_iter=1"]:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dptrain: error: "), err
    assert not (tmp_path / "run").exists()


def test_images_below_a_class_folder_are_found_at_any_depth_under_its_label(tmp_path):
    from dptrain.data.sources.files import list_image_folder

    for rel in ("cat/a.jpg", "cat/sub/b.jpg", "cat/sub/deeper/c.png", "cat/.hidden/d.jpg", "dog/only/e.jpg"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(_jpeg(0))
    (tmp_path / "cat" / "sub" / "loop").symlink_to(tmp_path / "cat")  # a link cycle: each folder read once
    items, classes = list_image_folder(tmp_path)
    assert classes == ["cat", "dog"]
    assert items == [("cat/a.jpg", 0), ("cat/sub/b.jpg", 0), ("cat/sub/deeper/c.png", 0), ("dog/only/e.jpg", 1)]


def test_a_dangling_class_link_a_file_for_a_folder_and_an_unreadable_file_are_named(tmp_path, folder):
    from dptrain.data.sources.files import list_image_folder

    root = tmp_path / "linked"
    root.mkdir()
    for c in ("ant", "cat"):
        (root / c).mkdir()
        (root / c / "1.jpg").write_bytes(_jpeg(0))
    (root / "bee").symlink_to(tmp_path / "nowhere")  # would drop a label and shift cat's
    with pytest.raises(InputError, match=r"data.path '.*linked': class entry 'bee' is a link to nothing"):
        list_image_folder(root)
    jpeg = folder / "train" / "cat" / "00.jpg"
    with pytest.raises(InputError, match=r"data.test_path '.*00.jpg' is a file, not a folder; give a folder"):
        open_records(DataConfig(source="folder", path=str(folder / "train"), test_path=str(jpeg)), num_classes=3,
                     seed=1)
    (root / "bee").unlink()
    (root / "ant" / "0.jpg").symlink_to(tmp_path / "gone.jpg")  # listed, then unreadable at the probe: named
    cfg = DataConfig(source="folder", path=str(root), batch_size=3, crop_size=16, shuffle="none")
    with pytest.raises(DataError, match=r"file 'ant/0.jpg': cannot read the image file"):
        open_records(cfg, num_classes=2, seed=1)


def test_a_shard_with_no_good_record_says_why(tmp_path):
    for c in ("cat", "dog"):
        (tmp_path / c).mkdir()
        for i in range(2):
            (tmp_path / c / f"{i}.jpg").write_bytes(_jpeg(i, size=(8, 8)))
    src = open_records(DataConfig(source="folder", path=str(tmp_path), batch_size=2, crop_size=16, shuffle="none",
                                  max_bad_records=10), num_classes=2, seed=1)
    with pytest.raises(DataError, match=r"all 4 records of this solver's shard are bad; the first, 'cat/0.jpg': "
                                        r"image is 8x8 \(HxW\), smaller than data.crop_size 16"):
        collect(src.train_batches(SampleOrder(0, 1, 2, seed=1, shuffle=False), 0), 1)


def test_a_list_names_an_image_labelled_twice_a_missing_file_where_it_looked_and_takes_a_bom(folder, tmp_path,
                                                                                             caplog):
    (tmp_path / "l.txt").write_text("cat/00.jpg 0\ndog/00.jpg 1\ncat/00.jpg 0\ncat/00.jpg 2\n")
    with pytest.raises(ConfigError, match=r"l.txt:4: 'cat/00.jpg' is labelled 2 here and 0 at line 1"):
        open_records(DataConfig(source="list", path=str(tmp_path / "l.txt"), root=str(folder / "train")),
                     num_classes=3, seed=1)
    (tmp_path / "bom.txt").write_bytes("\ufeffcat/00.jpg 0\ndog/00.jpg 1\n".encode())
    from dptrain.data.sources.files import read_list_file

    assert read_list_file(tmp_path / "bom.txt")[0] == ("cat/00.jpg", 0)
    (tmp_path / "gone.txt").write_text("nope/00.jpg 0\ncat/00.jpg 0\n")  # a wrong data.root is found at open
    with pytest.raises(ConfigError, match=r"gone.txt: 2 of 2 files checked at open do not exist under data.root "
                                          r"'.*images0' \(the first, line 1: '.*images0/nope/00.jpg'\); set data.root"):
        open_records(DataConfig(source="list", path=str(tmp_path / "gone.txt"), root=str(folder)), num_classes=3,
                     seed=1)
    cfg = DataConfig(source="list", path=str(tmp_path / "gone.txt"), root=str(folder / "train"), crop_size=16,
                     max_bad_records=1)  # one missing file allowed at open, then named by its path when read
    with caplog.at_level(logging.WARNING):
        open_records(cfg, num_classes=3, seed=1)
    assert re.search(r"file 'nope/00.jpg': cannot read the image file '.*train/nope/00.jpg' \(No such file", caplog.text)
