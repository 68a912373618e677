"""The errors a user can cause and fix, told apart from bugs.

Only subclasses of :class:`UserError` become one line on stderr and an exit code in
``dptrain.cli``: 2 for a mistake in the input (config, data, snapshot, run directory,
environment), 1 for :class:`RankFailure` (another rank failed or hung first; its own line names
the cause). Everything else, internal invariants included, raises ``RuntimeError`` (or
``AssertionError``) and keeps its traceback, so a bug never reads as a config mistake.

This module imports nothing from dptrain: every other module may raise these.
"""
from __future__ import annotations

EXIT_USER_ERROR = 2
"""Exit code of a user error: the run cannot go on until the input is fixed."""
EXIT_RANK_FAILURE = 1
"""Exit code of a rank that stopped because another rank failed first."""


class UserError(Exception):
    """A problem the user can fix; the message names the thing at fault and what to do."""

    exit_code = EXIT_USER_ERROR


class ConfigError(UserError, ValueError):
    """A bad config value, command-line argument or recipe; the message names the dotted key."""


class DataError(UserError, ValueError):
    """A bad input record or data path; the message names the rank, the LMDB (or image folder or
    list file) and the key (or file).

    Codec and transform code raises it with the ``reason`` only; the thread that knows
    the record adds the place with :meth:`located`.
    """

    def __init__(self, reason: str, *, path: str = "", key: bytes | str = b"", rank: int = 0,
                 kind: str = "LMDB") -> None:
        self.reason, self.path, self.rank, self.kind = reason, path, rank, kind
        self.key = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
        where = f"{kind} {path!r}" if path else "data"
        at = f" {'key' if kind == 'LMDB' else 'file'} {self.key!r}" if self.key else ""
        super().__init__(f"rank {rank}: {where}{at}: {reason}")

    def located(self, *, path: str, key: bytes | str, rank: int, kind: str = "LMDB") -> DataError:
        """The same reason, with the source (``kind``: "LMDB", "image folder", "list file"), its path,
        the record's key (an LMDB key, or the image file's path) and the rank filled in."""
        e = DataError(self.reason, path=path, key=key, rank=rank, kind=kind)
        e.__cause__ = self.__cause__
        return e


class InputError(UserError, ValueError):
    """An input file or folder that cannot be used as given: a ``make-lmdb`` source or
    list file, a metrics file to read."""


class SnapshotError(UserError):
    """A snapshot or weights file that cannot be read, written or applied to this model."""


class RunDirError(UserError):
    """``train.run_dir`` cannot be used: not writable, full, locked by another run, or
    holding an earlier run that a fresh one would overwrite."""


class SetupError(UserError):
    """The environment cannot run what the config asks for (no GPU, no CuPy, no launcher
    variables); the message says what to install or which setting to change."""


class LossScaleError(UserError):
    """The dynamic loss scale hit its floor: gradients overflow at every scale."""


class DivergenceError(UserError):
    """The loss or the gradient norm stayed non-finite without loss scaling to skip it."""


class PeerStartupError(UserError):
    """Another rank refused to start (its own line says why, e.g. rank 0's run directory lock):
    this rank exits 2 with it, before any rank waits in the process group."""


class StartupStopped(UserError):
    """A stop signal arrived before training began: nothing to snapshot, exit 0."""

    exit_code = 0


class RankFailure(UserError):
    """A collective failed or timed out: another rank probably died or hung. The message
    names this rank; the failed rank has its own error."""

    exit_code = EXIT_RANK_FAILURE


def first_line(e: BaseException) -> str:
    """An exception's text cut to its first line (torch's run to many), or its type's name if it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
