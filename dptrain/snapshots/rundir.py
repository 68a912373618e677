"""``train.run_dir``: checked, locked and prepared for one run.

Rank 0 holds an exclusive ``flock`` on ``.dptrain.lock`` for the run's life (the OS drops it
when the process dies, so a stale lock never blocks), and a fresh run refuses a folder
holding an earlier run's metrics or snapshots, which it would mix with its own.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path
from typing import IO

from dptrain.errors import RunDirError
from dptrain.snapshots.files import free_space, list_snapshots, remove_stale_temporaries

log = logging.getLogger(__name__)

LOCK_NAME = ".dptrain.lock"
LOCK_HOLDER_READS, LOCK_HOLDER_WAIT_S = 20, 0.05
"""How long a refused run waits for the holder to name itself in the lock file (1 s at most)."""


class RunDir:
    """``train.run_dir``: checked, locked and prepared for one run (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock_file: IO[str] | None = None
        self._made: list[Path] = []
        """The folders :meth:`lock` created, deepest first."""
        self._made_lock = False

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
        self._made = []
        for p in (self.path, *self.path.parents):
            if p.exists():
                break
            self._made.append(p)
        self._made_lock = not (self.path / LOCK_NAME).exists()
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
        self._lock_file = f
        try:  # unbuffered: a write that fails leaves nothing for close() to fail on again
            if os.fstat(f.fileno()).st_size:  # an earlier holder's line
                os.ftruncate(f.fileno(), 0)
            os.write(f.fileno(), f"host {socket.gethostname()} pid {os.getpid()}\n".encode())
        except OSError as e:  # a full disk: the first byte this run writes
            error = RunDirError(f"train.run_dir {str(self.path)!r}: cannot write {LOCK_NAME} ({e.strerror or e}; "
                                f"{free_space(self.path)}); free space or choose another train.run_dir")
            self.undo_start()  # gives the lock back and removes what lock() made
            raise error from e

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

    def undo_start(self) -> None:
        """A run that ended before it trained (a bad model path, a model that cannot take the data, a
        folder without classes) leaves nothing behind: the lock file it made, the config.toml it wrote
        and the folders :meth:`lock` made go, when nothing else (metrics, snapshots) is there."""
        held = self._lock_file is not None
        self.unlock()
        if not held:
            return
        try:
            if self._made_lock and {p.name for p in self.path.iterdir()} <= {LOCK_NAME, "config.toml"}:
                (self.path / "config.toml").unlink(missing_ok=True)
                (self.path / LOCK_NAME).unlink()
            for p in self._made:  # deepest first
                p.rmdir()
        except OSError:  # not empty, or gone: keep what is there
            pass

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
