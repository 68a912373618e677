"""Image files named by a folder or a list: torchvision's ImageFolder layout (one subfolder per class,
labels by sorted folder name) and Caffe ``ImageData`` / DALI ``file_list`` lines of ``path label``.
"""
from __future__ import annotations

from pathlib import Path

from dptrain.errors import InputError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
"""File names an image folder's class subfolders are searched for (case-insensitive)."""


def list_image_folder(root: str | Path) -> tuple[list[tuple[str, int]], list[str]]:
    """([(relative path, label)], class names) for ``root/<class>/<image>``, all sorted by name.

    Hidden entries (``.ipynb_checkpoints``, ``._x.jpg``) are skipped; a class folder without
    images is an error, since it would still take a label and shift every class after it.
    """
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"image folder {str(root)!r} does not exist")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    items = []
    for label, c in enumerate(classes):
        files = [f for f in sorted((root / c).iterdir())
                 if f.suffix.lower() in IMAGE_SUFFIXES and not f.name.startswith(".")]
        if not files:
            raise InputError(f"class folder {str(root / c)!r} has no images ({', '.join(IMAGE_SUFFIXES)}); "
                             f"remove it or add its images (labels follow the sorted class folders)")
        items += [(f"{c}/{f.name}", label) for f in files]
    if not items:
        raise InputError(f"image folder {str(root)!r} has no images in class subfolders ({', '.join(IMAGE_SUFFIXES)})")
    return items, classes


def read_list_file(path: str | Path) -> list[tuple[str, int]]:
    """[(path, label)] from ``path label`` lines; blank lines are skipped."""
    p = Path(path)
    if not p.is_file():
        what = "is not a regular file" if p.exists() else "does not exist"
        raise InputError(f"list file {str(p)!r} {what}; give an image folder or a file of 'path label' lines")
    try:
        text = p.read_text(encoding="utf-8")
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
        items.append((parts[0], int(parts[1])))
    if not items:
        raise InputError(f"list file {str(p)!r} lists no images")
    return items
