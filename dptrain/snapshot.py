"""Snapshots: atomic write, newest-valid lookup, and loading with ``weights_only=True``.

A snapshot is written to a temporary file in the run directory, flushed to disk, and
renamed over ``snapshot_iter_<N>.pt``; a crash mid-write leaves at most a ``.tmp`` file
that is never picked up, so a good snapshot is never replaced by a torn one.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^snapshot_iter_(\d+)\.pt$")


def snapshot_path(run_dir: str | Path, iteration: int) -> Path:
    return Path(run_dir) / f"snapshot_iter_{iteration}.pt"


def save_snapshot(state: dict[str, Any], path: Path) -> Path:
    """Write ``state`` to ``path`` atomically (temp file, fsync, rename, fsync dir)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def list_snapshots(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(iteration, path) of every snapshot in ``run_dir``, newest first."""
    d = Path(run_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """Load a snapshot with ``weights_only=True``; ValueError names the file if it is unusable."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"snapshot {str(p)!r} not found; pass an existing snapshot_iter_<N>.pt or --resume auto")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a torn or foreign file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""  # torch's texts run to many lines
        raise ValueError(f"snapshot {str(p)!r} cannot be read ({type(e).__name__}: {first}); it is torn or not a "
                         f"dptrain snapshot, use an older one") from e
    for key in ("iteration", "model", "solver", "rng", "config"):
        if key not in state:
            raise ValueError(f"snapshot {str(p)!r} lacks {key!r}; it was not written by dptrain")
    return state


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """``--resume auto`` -> the newest readable snapshot in ``run_dir`` (None if none);
    anything else is taken as a path."""
    if resume != "auto":
        return Path(resume)
    for it, p in list_snapshots(run_dir):
        try:
            load_snapshot(p)
        except ValueError as e:
            log.warning("skipping unreadable snapshot %s: %s", p, e)
            continue
        return p
    return None
