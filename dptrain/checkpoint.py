"""Snapshots and the run directory: what a run may write where, and how it starts again.

* **Snapshots** are written to a temporary file in the run directory, flushed, and renamed
  over ``snapshot_iter_<N>.pt``: a crash mid-write leaves at most a ``.tmp`` file that is
  never picked up (and is removed by the next run), so a good snapshot is never replaced
  by a torn one. They are read with ``weights_only=True``: a snapshot never runs code.
* **The run directory** (:class:`RunDir`) belongs to one run at a time: rank 0 holds an
  exclusive ``flock`` on ``.dptrain.lock`` for the run's life (the OS drops it when the
  process dies, so a stale lock never blocks), and a fresh run refuses a folder holding an
  earlier run's metrics or snapshots, which it would mix with its own.
* **Resume policy** (:func:`resolve_resume`): ``--resume auto`` takes the newest readable
  snapshot, ``--resume PATH`` that file, checked before anything is built.
* **Snapshot content** (:func:`capture`, :func:`restore`): the model's buffers and fp32
  masters, the optimizer state, the reducer's bucket layout, every rank's RNG, the data
  position and the running display state, assembled from the parts that own them.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import pickle
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from dptrain.distributed.comm import Communicator
from dptrain.errors import RunDirError, SnapshotError, first_line
from dptrain.flat import FlatParams

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 2
"""Version of the snapshot layout; a snapshot of another version is refused with one line."""
LOCK_NAME = ".dptrain.lock"
LOCK_HOLDER_READS, LOCK_HOLDER_WAIT_S = 20, 0.05
"""How long a refused run waits for the holder to name itself in the lock file (1 s at most)."""
_NAME = re.compile(r"^snapshot_iter_(\d+)\.pt$")
_REQUIRED = ("format", "iteration", "model", "optimizer", "rng", "config")


# --------------------------------------------------------------------------------------- files


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
diverging (:class:`dptrain.overflow.DivergenceWatch`): it is never offered as good."""


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


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """Load a snapshot with ``weights_only=True``; :class:`SnapshotError` names the file if it is unusable."""
    p = Path(path)
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
    advice ``foreign`` (it holds code or other classes) or ``torn`` (it cannot be read).
    """
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
    the folder holds no snapshot at all); anything else is a path that must exist and load. Both
    are checked now, before anything is built."""
    if resume != "auto":
        p = Path(resume)
        if not p.is_file():
            raise SnapshotError(f"--resume {resume!r}: no such snapshot file; pass an existing snapshot_iter_<N>.pt "
                                f"or --resume auto")
        load_snapshot(p)  # a torn or foreign file fails here, not after the model is built
        return p
    found = list_snapshots(run_dir)
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
        raise SnapshotError(f"--resume auto: none of the {len(found)} snapshot(s) in {str(run_dir)!r} can be resumed "
                            f"({', '.join(skipped[:3])}{' ...' if len(skipped) > 3 else ''}); pass one with --resume "
                            f"PATH, or start afresh in another train.run_dir")
    return None


# --------------------------------------------------------------------------------------- run dir


class RunDir:
    """``train.run_dir``: checked, locked and prepared for one run (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock_file: IO[str] | None = None

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    def check_usable(self, *, writer: bool) -> None:
        """The folder exists or can be created; the writer (rank 0) must also be able to write there."""
        for p in (self.path, *self.path.parents):
            if p.exists():
                if not p.is_dir():
                    raise RunDirError(f"train.run_dir {str(self.path)!r}: {str(p)!r} is a file; choose another run_dir")
                if writer and not os.access(p, os.W_OK | os.X_OK):
                    raise RunDirError(f"train.run_dir {str(self.path)!r}: {str(p)!r} is not writable (a read-only "
                                      f"filesystem or folder); choose another run_dir")
                return

    def lock(self) -> None:
        """Take the run directory for this process until :meth:`unlock` or exit.

        ``flock`` is released by the OS when the process dies, however it dies, so a lock
        left by a crashed run never blocks the next. The lock file names its holder.
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            f = open(self.path / LOCK_NAME, "a+")
        except OSError as e:
            raise RunDirError(f"train.run_dir {str(self.path)!r}: cannot create {LOCK_NAME} ({e.strerror or e}); "
                              f"choose another run_dir") from e
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(f)
            f.close()
            raise RunDirError(f"train.run_dir {str(self.path)!r} is in use by another run ({holder}); wait for it "
                              f"to end or choose another train.run_dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
        f.flush()
        self._lock_file = f

    @staticmethod
    def _holder(f: IO[str]) -> str:
        """The lock file's "host H pid P" line; the holder writes it just after taking the lock,
        so a run that started at the same moment may have to wait a moment to read it."""
        for _ in range(LOCK_HOLDER_READS):
            f.seek(0)
            if holder := f.read().strip():
                return holder
            time.sleep(LOCK_HOLDER_WAIT_S)
        return "another process"

    def unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing the descriptor drops the flock
            self._lock_file = None

    def earlier_run(self) -> list[str]:
        """Files of an earlier run here: its metrics and snapshots."""
        found = [p.name for _, p in list_snapshots(self.path)]
        if self.metrics.is_file() and self.metrics.stat().st_size:
            found.insert(0, self.metrics.name)
        return found

    def refuse_earlier_run(self) -> None:
        """A fresh run would append to the earlier run's metrics.jsonl and overwrite its snapshots."""
        if found := self.earlier_run():
            more = f" and {len(found) - 3} more" if len(found) > 3 else ""
            raise RunDirError(f"train.run_dir {str(self.path)!r} holds an earlier run ({', '.join(found[:3])}{more}); "
                              f"continue it with --resume auto, or choose another train.run_dir")

    def prepare(self, config_toml: str) -> None:
        """Create the folder, write the resolved config and remove dead writers' temporaries (rank 0)."""
        target = self.path / "config.toml"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            target.write_text(config_toml)
        except OSError as e:
            raise RunDirError(f"cannot write {str(target)!r} ({e.strerror or e}); choose another "
                              f"train.run_dir") from e
        if removed := remove_stale_temporaries(self.path):
            log.info("removed %d temporary file(s) of interrupted snapshot writes", removed)


# --------------------------------------------------------------------------------------- content


@dataclass
class StateParts:
    """What a snapshot captures, held by the parts that own it."""

    model: nn.Module
    flat: FlatParams
    optimizer: Any
    """``optimizer.MasterOptimizer`` (state_dict / load_state_dict)."""
    reducer: Any
    """``reducer.Reducer`` (state_dict / load_state_dict; its load may re-lay out ``flat``)."""
    comm: Communicator


def capture(parts: StateParts, *, iteration: int, data: dict[str, int], display: dict[str, Any],
            config: dict[str, Any]) -> dict[str, Any]:
    """The snapshot content at ``iteration``; collective (every rank's RNG state is gathered).

    ``model`` holds every floating buffer and parameter in fp32, the parameters from their
    masters; ``display`` is the running display state, gathered per rank by the caller.
    """
    model_state = {k: v.detach().float().clone() if v.is_floating_point() else v.detach().clone()
                   for k, v in parts.model.state_dict().items()}
    model_state.update(parts.flat.master_state())
    rng = {"torch": torch.get_rng_state()}
    if parts.comm.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(parts.comm.device)
    return {
        "format": SNAPSHOT_FORMAT,
        "iteration": iteration,
        "model": model_state,
        "optimizer": parts.optimizer.state_dict(),
        "reducer": parts.reducer.state_dict(),
        "rng": parts.comm.allgather_object(rng),
        "data": data,
        "display": display,
        "config": config,
    }


def restore(parts: StateParts, state: dict[str, Any]) -> None:
    """Load a snapshot into the parts: buffers, masters (weights re-derived), optimizer and
    scaler state, the reducer's layout, and this rank's RNG (rank 0's for a rank the
    snapshot did not have). The data position and display state are the caller's."""
    rank = parts.comm.rank
    params = {n for n, _ in parts.model.named_parameters()}
    buffers = {k: v for k, v in state["model"].items() if k not in params}
    missing = parts.model.load_state_dict(buffers, strict=False)
    if missing.unexpected_keys:
        raise SnapshotError(f"snapshot has keys this model lacks: {missing.unexpected_keys[:5]}; "
                            "was it written for another model.name?")
    for name, p in parts.model.named_parameters():
        saved = state["model"].get(name)
        if saved is None or saved.shape != p.shape:
            got = "missing" if saved is None else f"{list(saved.shape)}"
            raise SnapshotError(f"snapshot's {name!r} is {got} but this model's is {list(p.shape)}; was it written "
                                f"with another model.num_classes / model.width / input channels?")
    parts.reducer.load_state_dict(state["reducer"])  # may re-lay out the flat buffers: first
    parts.flat.load_master_state(state["model"])
    parts.optimizer.load_state_dict(state["optimizer"])
    rng = state["rng"][rank] if rank < len(state["rng"]) else state["rng"][0]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and parts.comm.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], parts.comm.device)
    if rank >= len(state["rng"]):
        log.warning("rank %d: the snapshot holds RNG states for %d rank(s); this rank starts from rank 0's",
                    rank, len(state["rng"]))


def check_same_start(comm: Communicator, iteration: int) -> None:
    """Every rank must start at the same iteration (collective; before any other collective of
    a resume): a node that found no snapshot (node-local run dirs) would otherwise train from
    scratch beside resumed ones."""
    starts = comm.allgather_object(iteration)
    if len(set(starts)) > 1:
        listed = ", ".join(f"rank {r}: {it}" for r, it in enumerate(starts))
        raise SnapshotError(f"the ranks resumed at different iterations ({listed}); every rank must read the same "
                            f"snapshot: use a train.run_dir all nodes share, or pass --resume PATH")
