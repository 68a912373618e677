"""benchmarks/data/photo_lmdb.py: photo-like JPEGs that depend on (seed, index) alone, in class folders for make-lmdb."""
from __future__ import annotations

import pytest
from PIL import Image

from benchmarks.data import photo_lmdb


def test_photos_are_the_same_whatever_the_worker_count_and_sized_as_asked(tmp_path):
    one = photo_lmdb.write_photos(5, 96, tmp_path / "one", classes=2, seed=3, workers=1)
    two = photo_lmdb.write_photos(5, 96, tmp_path / "two", classes=2, seed=3, workers=2)
    assert one == two and one["images"] == 5 and one["classes"] == 2
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*.jpg"))
    assert [str(f.parent) for f in files] == ["class_000"] * 3 + ["class_001"] * 2  # image i in class i mod 2
    for f in files:
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes()
        with Image.open(tmp_path / "one" / f) as img:
            assert img.format == "JPEG" and img.mode == "RGB" and max(img.size) == 96, img.size
    other_seed = photo_lmdb.draw_photo(0, 96, seed=4).tobytes()
    assert photo_lmdb.draw_photo(0, 96, seed=3).tobytes() != other_seed


def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="need count >= 1, size >= 8 and classes >= 1, got 0, 96, 2"):
        photo_lmdb.write_photos(0, 96, tmp_path, classes=2, seed=0, workers=1)
