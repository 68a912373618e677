"""Snapshot files: written atomically, read without running code, listed, marked, and chosen for a resume.

* **Writing** (:func:`save_snapshot`, :func:`save_atomically`): a temporary file in the run
  directory, flushed, fsynced and renamed over ``snapshot_iter_<N>.pt``: a crash mid-write
  leaves at most a ``.tmp`` file that is never picked up (and is removed by the next run), so a
  good snapshot is never replaced by a torn one.
* **Reading** (:func:`load_snapshot`, :func:`load_tensors`): ``weights_only=True``, so a snapshot
  never runs code; a file of another format or a foreign one is refused with one line.
* **Markers**: ``snapshot_iter_<N>.pt.diverging`` beside a snapshot written while the run was
  diverging (``dptrain.train.health``); such a snapshot is never offered as good.
* **Retention** (:func:`prune_snapshots`): ``solver.snapshot_keep`` deletes older snapshots once a
  new one is durable, never the last good one.
* **Resume policy** (:func:`resolve_resume`): ``--resume auto`` takes the newest readable
  snapshot, ``--resume PATH`` that file (a folder: its newest readable one), checked before anything
  is built. A folder given for a file elsewhere (``export``, ``--weights``) is refused naming its
  newest snapshot (:func:`folder_given`).
"""
from __future__ import annotations

import errno
import logging
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch

from dptrain.errors import RunDirError, SnapshotError, first_line

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 2
"""Version of the snapshot layout; a snapshot of another version is refused with one line."""
LOCK_NAME = ".dptrain.lock"
LOCK_HOLDER_READS, LOCK_HOLDER_WAIT_S = 20, 0.05
"""How long a refused run waits for the holder to name itself in the lock file (1 s at most)."""
_NAME = re.compile(r"^snapshot_iter_(\d+)\.pt$")
_REQUIRED = ("format", "iteration", "model", "optimizer", "rng", "config")


def is_snapshot_file(p: Path) -> bool:
    """Whether ``p`` is named as a snapshot or holds one (a dict with every entry a snapshot has)."""
    if _NAME.match(p.name):
        return True
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - anything torch cannot load this way is no snapshot
        return False
    return isinstance(obj, dict) and all(k in obj for k in _REQUIRED)


def snapshot_path(run_dir: str | Path, iteration: int) -> Path:
    return Path(run_dir) / f"snapshot_iter_{iteration}.pt"


def save_snapshot(state: dict[str, Any], path: Path) -> Path:
    """Write ``state`` to ``path`` atomically (see :func:`save_atomically`)."""
    try:
        return save_atomically(state, path)
    except OSError as e:
        if isinstance(e, PermissionError) or e.errno == errno.EROFS:  # not a space problem: say what it is
            raise RunDirError(f"cannot write snapshot {str(path)!r}: no permission to write in {str(path.parent)!r} "
                              f"({first_line(e)}); give this user write access to it or choose another "
                              f"train.run_dir, then --resume auto") from e
        raise RunDirError(f"cannot write snapshot {str(path)!r} ({type(e).__name__}: {first_line(e)}; "
                          f"{free_space(path.parent)}); free space or choose another train.run_dir, then "
                          f"--resume auto") from e
    except RuntimeError as e:  # torch.save reports a full disk as a RuntimeError from its zip writer
        raise RunDirError(f"cannot write snapshot {str(path)!r} ({type(e).__name__}: {first_line(e)}; "
                          f"{free_space(path.parent)}); free space or choose another train.run_dir, then "
                          f"--resume auto") from e


def save_atomically(obj: Any, path: Path) -> Path:
    """``torch.save`` to a temporary file beside ``path``, fsync, rename over ``path``, fsync the folder.

    A crash or a full disk leaves ``path`` as it was; the temporary file is removed before
    the error (OSError, or RuntimeError from torch's zip writer) propagates.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError):
        tmp.unlink(missing_ok=True)  # first, so the caller's free-space figure counts what it held
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def free_space(folder: Path) -> str:
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


DIVERGING_SUFFIX = ".diverging"
"""A file ``snapshot_iter_<N>.pt.diverging`` beside a snapshot marks it as written while the run was
diverging (:class:`dptrain.train.health.DivergenceWatch`): it is never offered as good."""


def mark_diverging(path: Path, reason: str) -> None:
    """Mark snapshot ``path`` as taken during a divergence (the marker holds the reason)."""
    try:
        path.with_name(path.name + DIVERGING_SUFFIX).write_text(reason + "\n")
    except OSError as e:
        log.warning("cannot mark %s as diverging (%s)", path, e)


def unmark_diverging(path: Path) -> None:
    path.with_name(path.name + DIVERGING_SUFFIX).unlink(missing_ok=True)


def is_diverging(path: Path) -> bool:
    return path.with_name(path.name + DIVERGING_SUFFIX).exists()


def good_snapshots(run_dir: str | Path, before: int | None = None) -> list[tuple[int, Path]]:
    """:func:`list_snapshots` without the ones marked diverging (and those at or after ``before``)."""
    return [(it, p) for it, p in list_snapshots(run_dir)
            if not is_diverging(p) and (before is None or it < before)]


def list_snapshots(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(iteration, path) of every snapshot in ``run_dir``, newest first."""
    d = Path(run_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def folder_given(folder: Path, what: str) -> SnapshotError:
    """The error for a folder given where a snapshot or weights file is expected (``what``: "snapshot",
    "--weights"): it says so and names the file most likely meant, the folder's newest snapshot not
    marked diverging."""
    found = list_snapshots(folder)
    good = [p for _, p in found if not is_diverging(p)]
    if good:
        hint = f"pass a file: its newest good snapshot is {str(good[0])!r}"
    elif found:
        hint = (f"pass a file: its {len(found)} snapshot(s) are all marked diverging, the newest is "
                f"{str(found[0][1])!r}")
    else:
        hint = "it holds no snapshot_iter_<N>.pt; pass a snapshot file"
    return SnapshotError(f"{what} {str(folder)!r} is a folder, not a file; {hint}")


def prune_snapshots(run_dir: str | Path, newest: int, keep: int) -> list[Path]:
    """Delete the snapshots older than ``newest`` that ``solver.snapshot_keep = keep`` leaves out (0:
    none); the ones deleted. Called only once snapshot ``newest`` is durable (fsynced and renamed into
    place) and marked if it is suspect.

    Kept: the newest ``keep`` (``newest`` and the ``keep - 1`` before it), and the newest snapshot
    before ``newest`` not marked diverging. That one is the last good snapshot a divergence stop names
    while ``newest`` is marked, and it becomes so if the losses just after ``newest`` start a
    divergence that marks ``newest`` too. Snapshots past ``newest`` (left by a run resumed from an
    earlier one) are not touched; a file that cannot be deleted is logged and stays.
    """
    if keep <= 0:
        return []
    older = [p for it, p in list_snapshots(run_dir) if it < newest]
    last_good = next((p for p in older if not is_diverging(p)), None)
    deleted = []
    for p in older[keep - 1:]:
        if p == last_good:
            continue
        try:
            p.unlink(missing_ok=True)
        except OSError as e:
            log.warning("cannot delete %s for solver.snapshot_keep = %d (%s); it stays", p, keep, e)
            continue
        unmark_diverging(p)
        deleted.append(p)
    return deleted


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """Load a snapshot with ``weights_only=True``; :class:`SnapshotError` names the file if it is unusable."""
    p = Path(path)
    if p.is_dir():
        raise folder_given(p, "snapshot")
    if not p.is_file():
        raise SnapshotError(f"snapshot {str(p)!r} not found; pass an existing snapshot_iter_<N>.pt or --resume auto")
    state = load_tensors(p, "snapshot", foreign="use a snapshot written by dptrain",
                         torn="it is torn or not a dptrain snapshot, use an older one")
    if not isinstance(state, dict):
        raise SnapshotError(f"snapshot {str(p)!r} holds a {type(state).__name__}, not a dptrain snapshot")
    return check_snapshot(state, p)


def load_tensors(p: Path, noun: str, *, foreign: str, torn: str) -> Any:
    """``torch.load(p, weights_only=True)`` to the CPU: tensors and plain containers, never code.

    An unusable file is a :class:`SnapshotError` naming it as ``noun``, ending with the
    advice ``foreign`` (it holds code or other classes) or ``torn`` (it cannot be read). torch's zip
    reader does not check the members' CRC-32s, so a flipped bit in the tensor data would load as a
    wrong weight: they are checked first (one read of the file, at checksum speed).
    """
    _check_crcs(p, noun, torn)
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # torch's own text advises weights_only=False: never quoted
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(e))
        if unsafe:
            raise SnapshotError(f"{noun} {str(p)!r} holds a {unsafe.group(1)}, not only tensors and plain "
                                f"containers, and dptrain does not run code from a file; {foreign}") from e
        raise SnapshotError(f"{noun} {str(p)!r} cannot be read (not a {noun}'s content: {_unpickler_detail(e)}); "
                            f"{torn}") from e
    except Exception as e:  # torch raises many types for a torn or foreign file
        raise SnapshotError(f"{noun} {str(p)!r} cannot be read ({type(e).__name__}: {first_line(e)}); {torn}") from e


def _check_crcs(p: Path, noun: str, torn: str) -> None:
    """SnapshotError naming the first member of zip file ``p`` whose bytes do not match their CRC-32
    (nothing for a file that is no zip: torch.load then says what it is)."""
    try:
        with zipfile.ZipFile(p) as z:
            bad = z.testzip()
    except Exception:  # noqa: BLE001 - not a readable zip: torch.load names what it is
        return
    if bad is not None:
        raise SnapshotError(f"{noun} {str(p)!r} is damaged: its member {bad!r} does not match its CRC-32 (a flipped "
                            f"bit on disk or in a copy); {torn}")


def check_snapshot(state: dict[str, Any], p: Path) -> dict[str, Any]:
    """``state`` if it is a snapshot of this dptrain's format with every part; else SnapshotError."""
    if state.get("format") != SNAPSHOT_FORMAT and "iteration" in state:
        raise SnapshotError(f"snapshot {str(p)!r} has format {state.get('format', 1)}, this dptrain reads format "
                            f"{SNAPSHOT_FORMAT}; resume it with the dptrain version that wrote it")
    for key in _REQUIRED:
        if key not in state:
            raise SnapshotError(f"snapshot {str(p)!r} lacks {key!r}; it was not written by dptrain")
    return state


def _unpickler_detail(e: Exception) -> str:
    """What torch's weights-only unpickler stumbled on (``Unsupported operand 0``), without its advice."""
    m = re.search(r"WeightsUnpickler error: \s*([^\n]+)", str(e))
    return m.group(1).strip() if m else type(e).__name__


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """``--resume auto`` -> the newest readable snapshot in ``run_dir`` not marked diverging (None if
    the folder holds no snapshot at all); ``--resume DIR`` -> the same choice in folder DIR (an error
    if it holds none: the user named it for its snapshots); anything else is a path that must exist
    and load. All are checked now, before anything is built."""
    if resume != "auto":
        p = Path(resume)
        if p.is_dir():
            chosen = _newest_resumable(p, f"--resume {resume!r}")
            if chosen is None:
                raise SnapshotError(f"--resume {resume!r} is a folder without a snapshot_iter_<N>.pt; pass a snapshot "
                                    f"file, or --resume auto for train.run_dir")
            log.info("--resume %s is a folder: resuming from its newest good snapshot, %s", resume, chosen.name)
            return chosen
        if not p.is_file():
            raise SnapshotError(f"--resume {resume!r}: no such snapshot file; pass an existing snapshot_iter_<N>.pt "
                                f"or --resume auto")
        load_snapshot(p)  # a torn or foreign file fails here, not after the model is built
        return p
    return _newest_resumable(Path(run_dir), "--resume auto")


def _newest_resumable(folder: Path, how: str) -> Path | None:
    """The newest readable snapshot in ``folder`` not marked diverging; None if it holds no snapshot
    at all. ``how`` (the argument given) opens the error when it holds only unusable ones."""
    found = list_snapshots(folder)
    skipped = []
    for _, p in found:
        if is_diverging(p):
            log.warning("skipping %s: written while the run was diverging (%s)", p,
                        p.with_name(p.name + DIVERGING_SUFFIX).read_text().strip())
            skipped.append(f"{p.name} (diverging)")
            continue
        try:
            load_snapshot(p)
        except SnapshotError as e:
            log.warning("skipping unreadable snapshot %s: %s", p, e)
            skipped.append(f"{p.name} (unreadable)")
            continue
        return p
    if found:
        raise SnapshotError(f"{how}: none of the {len(found)} snapshot(s) in {str(folder)!r} can be resumed "
                            f"({', '.join(skipped[:3])}{' ...' if len(skipped) > 3 else ''}); pass one with --resume "
                            f"PATH, or start afresh in another train.run_dir")
    return None
