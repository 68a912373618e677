"""Snapshots: atomic write, newest-valid lookup, and loading with ``weights_only=True``.

A snapshot is written to a temporary file in the run directory, flushed to disk, and
renamed over ``snapshot_iter_<N>.pt``; a crash mid-write leaves at most a ``.tmp`` file
that is never picked up, so a good snapshot is never replaced by a torn one.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from dptrain.errors import RunDirError, SnapshotError, first_line

log = logging.getLogger(__name__)

_NAME = re.compile(r"^snapshot_iter_(\d+)\.pt$")


def snapshot_path(run_dir: str | Path, iteration: int) -> Path:
    return Path(run_dir) / f"snapshot_iter_{iteration}.pt"


def save_snapshot(state: dict[str, Any], path: Path) -> Path:
    """Write ``state`` to ``path`` atomically (temp file, fsync, rename, fsync dir)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError from its zip writer
        raise RunDirError(f"cannot write snapshot {str(path)!r} ({type(e).__name__}: {first_line(e)}; {_free(path.parent)}); free space "
                         f"or choose another train.run_dir, then --resume auto") from e
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def _free(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free there"
    except OSError:
        return "its folder is gone"


def remove_stale_temporaries(run_dir: str | Path) -> int:
    """Delete the temporary files of snapshot writes that were killed (their process is gone)."""
    d, removed = Path(run_dir), 0
    if not d.is_dir():
        return 0
    for p in d.glob(".snapshot_iter_*.pt.*.tmp"):
        pid = p.name.rsplit(".", 2)[-2]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            p.unlink(missing_ok=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        raise SnapshotError(f"snapshot {str(p)!r} not found; pass an existing snapshot_iter_<N>.pt or --resume auto")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a torn or foreign file
        raise SnapshotError(f"snapshot {str(p)!r} cannot be read ({type(e).__name__}: {first_line(e)}); it is torn or not a "
                         f"dptrain snapshot, use an older one") from e
    for key in ("iteration", "model", "solver", "rng", "config"):
        if key not in state:
            raise SnapshotError(f"snapshot {str(p)!r} lacks {key!r}; it was not written by dptrain")
    return state


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """``--resume auto`` -> the newest readable snapshot in ``run_dir`` (None if none);
    anything else is taken as a path."""
    if resume != "auto":
        return Path(resume)
    for it, p in list_snapshots(run_dir):
        try:
            load_snapshot(p)
        except SnapshotError as e:
            log.warning("skipping unreadable snapshot %s: %s", p, e)
            continue
        return p
    return None
