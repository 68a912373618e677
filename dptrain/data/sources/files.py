"""Image files named by a folder or a list, trained from without converting them first.

* ``data.source = "folder"``: torchvision's ImageFolder layout, ``data.path/<class>/<image>``, labels by
  the sorted class folder names (:func:`list_image_folder`); the test folder's classes are mapped by
  name onto the training folder's, so a class missing from it shifts nothing.
* ``data.source = "list"``: Caffe ``ImageData`` / DALI ``file_list`` lines of ``path label`` in the file
  ``data.path`` (and ``data.test_path``); a relative path is taken from ``data.root`` (else from the
  list file's folder).

Both go through the same reader and renderer threads, native render path, queue sets, sample order,
per-epoch shuffle and bad-record budget as an LMDB (:class:`~dptrain.data.sources.records.RecordSource`):
a reader thread reads each file's bytes and hands them on as an encoded Caffe Datum with its label
(:func:`datum_of`: a few header bytes before the file's own), which the renderers decode as they
decode an LMDB's encoded records. A file that cannot be read or decoded is a bad record named by its
path. ``dptrain make-lmdb`` stays the way to an LMDB.
"""
from __future__ import annotations

import os
from pathlib import Path

from dptrain.config import DataConfig
from dptrain.data.sources.records import RecordHandle, RecordSource, spread
from dptrain.data.transforms.render import DEFAULT_RENDER, RenderOptions
from dptrain.errors import ConfigError, DataError, InputError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
"""File names an image folder's class subfolders are searched for (case-insensitive)."""


def list_image_folder(root: str | Path, key: str = "data.path") -> tuple[list[tuple[str, int]], list[str]]:
    """([(relative path, label)], class names) for ``root/<class>/.../<image>``, all sorted by name.

    As torchvision's ImageFolder: a class folder's images are found at any depth below it (symbolic
    links followed, each folder once), under the class folder's label. Hidden entries
    (``.ipynb_checkpoints``, ``._x.jpg``) are skipped. A class folder without images, or a class entry
    that cannot be opened (a dangling link), is an error, since it would still take a label or drop
    one and shift every class after it. ``key``: the config key that gave ``root``, for the errors.
    """
    root = Path(root)
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise InputError(f"{key} {str(root)!r} {what}; give a folder of class subfolders "
                         f"({key}/<class>/<image>), as torchvision's ImageFolder reads")
    entries = sorted(d for d in root.iterdir() if not d.name.startswith("."))
    broken = [d.name for d in entries if d.is_symlink() and not d.exists()]
    if broken:
        raise InputError(f"{key} {str(root)!r}: class entry {broken[0]!r} is a link to nothing "
                         f"({os.readlink(root / broken[0])!r}); fix or remove it (labels follow the sorted class "
                         f"folders)")
    classes = [d.name for d in entries if d.is_dir()]
    items = []
    for label, c in enumerate(classes):
        files = _images_below(root / c)
        if not files:
            raise InputError(f"class folder {str(root / c)!r} has no images ({', '.join(IMAGE_SUFFIXES)}) at any "
                             f"depth; remove it or add its images (labels follow the sorted class folders)")
        items += [(f"{c}/{f}", label) for f in files]
    if not items:
        raise InputError(f"{key} {str(root)!r} has no images in class subfolders ({', '.join(IMAGE_SUFFIXES)})")
    return items, classes


def _images_below(folder: Path) -> list[str]:
    """The image files at any depth below ``folder``, as sorted '/'-joined paths relative to it; hidden
    entries skipped, links followed, a folder reached twice (a link cycle) read once."""
    out: list[str] = []
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = Path(dirpath).relative_to(folder)
        out += [(rel / f).as_posix() for f in filenames
                if not f.startswith(".") and Path(f).suffix.lower() in IMAGE_SUFFIXES]
    return sorted(out)


def read_list_file(path: str | Path) -> list[tuple[str, int]]:
    """[(path, label)] from ``path label`` lines; blank lines are skipped."""
    return [(p, label) for p, label, _ in read_list_lines(path)]


def read_list_lines(path: str | Path) -> list[tuple[str, int, int]]:
    """[(path, label, line number)] from ``path label`` lines; blank lines are skipped."""
    p = Path(path)
    if not p.is_file():
        what = "is not a regular file" if p.exists() else "does not exist"
        raise InputError(f"list file {str(p)!r} {what}; give an image folder or a file of 'path label' lines")
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is no part of the first path
    except UnicodeDecodeError as e:
        raise InputError(f"list file {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start}); give an image "
                         f"folder or a list of 'path label' lines") from e
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.rsplit(maxsplit=1)
        if len(parts) != 2 or not (parts[1].isascii() and parts[1].isdigit()):
            raise InputError(f"{p}:{n}: expected 'path label' with an integer label >= 0, got {line!r}")
        items.append((parts[0], int(parts[1]), n))
    if not items:
        raise InputError(f"list file {str(p)!r} lists no images")
    return items


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def label_tail(label: int) -> bytes:
    """A Datum's ``label`` (field 5) and ``encoded = true`` (field 7), as protobuf writes them."""
    return b"\x28" + _varint(label) + b"\x38\x01"


def datum_of(data: bytes, tail: bytes) -> bytes:
    """An encoded Caffe Datum of an image file's bytes: ``data`` (field 4) then :func:`label_tail`'s bytes."""
    return b"".join((b"\x22", _varint(len(data)), data, tail))


class FileReader:
    """Image files by record index: ``items[i]`` is (path under ``root``, label)."""

    def __init__(self, items: list[tuple[str, int]], root: Path, *, path: str, kind: str) -> None:
        self.path, self.kind, self.root = path, kind, root
        self._files = [os.path.join(root, p) for p, _ in items]
        self._keys = [os.fsencode(p) for p, _ in items]
        self._tails = [label_tail(label) for _, label in items]
        self.num_records = len(items)

    def __len__(self) -> int:
        return self.num_records

    def handle(self) -> _FileHandle:
        return _FileHandle(self)


class _FileHandle(RecordHandle):
    """One reader thread's access to the files (the OS reads them; Python's file read releases the GIL)."""

    def __init__(self, reader: FileReader) -> None:
        self.path, self.kind, self._r = reader.path, reader.kind, reader

    def get_many(self, indices: list[int]) -> tuple[list[bytes], list[bytes], dict[int, DataError]]:
        """(keys, values, errors) of records ``indices``, as ``LmdbReader``'s handle gives them: the key is
        the file's path as listed, the value its encoded Datum; a file that cannot be read has value b""
        and its DataError under its place in the list."""
        r = self._r
        keys, values, errors = [], [], {}
        for i in indices:
            keys.append(r._keys[i])
            try:
                with open(r._files[i], "rb") as f:
                    values.append(datum_of(f.read(), r._tails[i]))
            except OSError as e:
                where = "" if os.fsencode(r._files[i]) == r._keys[i] else f" {str(r._files[i])!r}"
                errors[len(values)] = DataError(f"cannot read the image file{where} ({e.strerror or e})")
                values.append(b"")
        return keys, values, errors

    def close(self) -> None:
        pass


class FolderSource(RecordSource):
    """``data.source = "folder"``: ImageFolder layouts at ``data.path`` and ``data.test_path``."""

    kind = "image folder"

    def __init__(self, cfg: DataConfig, *, num_classes: int, seed: int, rank: int = 0, cores: int = 1,
                 render: RenderOptions = DEFAULT_RENDER, pin_memory: bool = False) -> None:
        items, classes = list_image_folder(cfg.path, "data.path")
        if len(classes) > num_classes:
            raise ConfigError(f"data.path {cfg.path!r} has {len(classes)} class folders ({classes[0]!r} ... "
                              f"{classes[-1]!r}) but model.num_classes = {num_classes}; set model.num_classes = "
                              f"{len(classes)}")
        self.classes = classes
        """The class names, in label order (the sorted folder names)."""
        test = None
        if cfg.test_path:
            test_items, test_classes = list_image_folder(cfg.test_path, "data.test_path")
            label_of = {c: i for i, c in enumerate(classes)}
            unknown = [c for c in test_classes if c not in label_of]
            if unknown:
                raise ConfigError(f"data.test_path {cfg.test_path!r} has class folders the training folder lacks: "
                                  f"{unknown[:5]}; the test classes must be among data.path's")
            test_items = [(p, label_of[test_classes[label]]) for p, label in test_items]
            test = FileReader(test_items, Path(cfg.test_path), path=cfg.test_path, kind=self.kind)
        super().__init__(cfg, FileReader(items, Path(cfg.path), path=cfg.path, kind=self.kind), test,
                         num_classes=num_classes, seed=seed, rank=rank, cores=cores, render=render,
                         pin_memory=pin_memory)


LIST_CHECKS = 256
"""Files of a list checked to exist when it is opened, spread evenly over it: a wrong ``data.root`` is then
found at start-up instead of at the first batch that reads past the records probed, at a bounded cost
on a parallel file system (one stat each); every file is still checked when it is read."""


class ListSource(RecordSource):
    """``data.source = "list"``: ``path label`` list files at ``data.path`` and ``data.test_path``."""

    kind = "list file"

    def __init__(self, cfg: DataConfig, *, num_classes: int, seed: int, rank: int = 0, cores: int = 1,
                 render: RenderOptions = DEFAULT_RENDER, pin_memory: bool = False) -> None:
        readers = [self._reader(path, cfg.root, num_classes, cfg.max_bad_records) if path else None
                   for path in (cfg.path, cfg.test_path)]
        super().__init__(cfg, readers[0], readers[1], num_classes=num_classes, seed=seed, rank=rank, cores=cores,
                         render=render, pin_memory=pin_memory)

    def _reader(self, path: str, root: str, num_classes: int, max_bad: int) -> FileReader:
        lines = read_list_lines(path)
        bad = next(((p, label, n) for p, label, n in lines if label >= num_classes), None)
        if bad is not None:
            raise ConfigError(f"{path}:{bad[2]}: label {bad[1]} of {bad[0]!r} is outside [0, {num_classes}); fix "
                              f"the list or set model.num_classes")
        first: dict[str, tuple[int, int]] = {}
        for p, label, n in lines:
            seen = first.setdefault(p, (label, n))
            if seen[0] != label:
                raise ConfigError(f"{path}:{n}: {p!r} is labelled {label} here and {seen[0]} at line {seen[1]}; an "
                                  f"image takes one label: fix the list")
        base = Path(root) if root else Path(path).parent
        reader = FileReader([(p, label) for p, label, _ in lines], base, path=path, kind=self.kind)
        picks = spread(len(lines), LIST_CHECKS)
        missing = [i for i in picks if not os.path.exists(reader._files[i])]
        if len(missing) > max_bad:
            i = missing[0]
            under = "data.root" if root else "the list file's folder"
            raise ConfigError(f"{path}: {len(missing)} of {len(picks)} files checked at open do not exist under "
                              f"{under} {str(base)!r} (the first, line {lines[i][2]}: {str(reader._files[i])!r}); "
                              f"set data.root to the folder the list's paths are relative to, or fix the list")
        return reader
