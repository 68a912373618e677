"""Build a shared library from dptrain/csrc at first use, once per source, compiler and machine.

Two ctypes libraries are built this way: the JPEG crop decoder (``csrc/jpeg_crop.c``, C) and
the CPU update (``csrc/update_cpu.cc``, C++, which includes ``update.cu``). The compiler
comes from ``$CC`` / ``$CXX`` (split as a shell would: ``ccache gcc`` works), else the usual
names on PATH. Libraries are cached in ``$DPTRAIN_CACHE`` (default
``$XDG_CACHE_HOME/dptrain``, else ``~/.cache/dptrain``) under a name that hashes every
source, the compiler command, the flags and, for a build tuned to the host CPU
(``-march=native``), that CPU's identity: an edited source, another compiler or another
node's CPU (a home directory shared across a cluster) builds anew instead of loading a
library that could fault. Solvers that start at once take a lock file in the cache folder: one
builds (into a temporary file, renamed when complete), the others wait and load its library.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from dptrain.errors import SetupError

TUNE_FLAGS = ("-march=native",) if platform.machine() in ("x86_64", "AMD64") else ()
"""Flags that tune a library for the building CPU; with them the CPU's identity joins the cache key."""
BUILD_TIMEOUT_S = 300
"""A compile that takes longer is given up on (the caller falls back to its Python path)."""


class OncePerProcess:
    """A library (or None) made on first use, once per process and thread-safe, by ``make``;
    :meth:`reset` forgets it, so that the next use reads its environment variable again (tests)."""

    def __init__(self, make: Callable[[], object]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._made: list[object] = []  # empty until the first use; then [the library or None]

    def get(self) -> object:
        if not self._made:
            with self._lock:
                if not self._made:
                    self._made.append(self._make())
        return self._made[0]

    def reset(self) -> None:
        with self._lock:
            self._made.clear()


def native_or_none(make: Callable[[], object], *, strict: bool, what: str, strict_setting: str, fallback: str,
                   log: logging.Logger) -> object | None:
    """``make()``: build, load and check a library; on any failure of those, ``SetupError`` naming
    ``strict_setting`` when ``strict``, else one warning (``what`` unavailable, ``fallback``) and None."""
    try:
        return make()
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if strict:
            raise SetupError(f"{strict_setting} but the {what} is unavailable: {why}") from e
        log.warning("%s unavailable, %s: %s", what, fallback, why)
        return None


def tuned_or_not(build: Callable[..., Path], log: logging.Logger) -> Path:
    """``build(tune=True)``, or ``build(tune=False)`` when that fails (a compiler that refuses
    :data:`TUNE_FLAGS`); the library's path."""
    try:
        return build(tune=True)
    except RuntimeError as e:
        if not TUNE_FLAGS:
            raise
        log.debug("tuned build failed (%s); building without %s", str(e).splitlines()[0], " ".join(TUNE_FLAGS))
        return build(tune=False)


def cache_dir() -> Path:
    if os.environ.get("DPTRAIN_CACHE"):
        return Path(os.environ["DPTRAIN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dptrain"


def compiler(env: str, names: Sequence[str]) -> list[str] | None:
    """The compiler command: ``$env`` split as a shell would (``ccache gcc``, ``gcc -std=gnu11``),
    else the first of ``names`` on PATH; None when there is none."""
    if os.environ.get(env):
        try:
            words = shlex.split(os.environ[env])
        except ValueError:  # unbalanced quotes
            return None
        found = shutil.which(words[0]) if words else None
        return [found, *words[1:]] if found else None
    for name in names:
        found = shutil.which(name)
        if found:
            return [found]
    return None


def host_cpu() -> bytes:
    """What identifies this CPU's instruction set: the model name and feature flags of the first
    processor in /proc/cpuinfo, else the platform's names."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip()
        if key in ("model name", "flags", "Features", "CPU part", "CPU implementer"):
            found.setdefault(key, line)
    return "\n".join(found.values()).encode() or f"{platform.machine()} {platform.processor()}".encode()


def build_library(*, name: str, main: Path, sources: Sequence[Path], command: list[str], flags: Sequence[str],
                  libs: Sequence[str] = (), machine: bytes = b"", hint: str = "",
                  directory: Path | None = None) -> Path:
    """Compile ``main`` into ``directory``/``name``-<hash>.so unless already there; the path.

    ``sources`` are every file the build reads (``main`` and what it includes): each is part
    of the hash, with ``command``, ``flags``, ``libs``, the architecture and ``machine`` (the
    CPU identity, when the flags tune for it). Raises RuntimeError with the compiler's first error line, then
    ``hint``.
    """
    # the architecture always (a home directory shared by x86-64 and aarch64 nodes), the CPU when tuned for it
    parts = ([p.read_bytes() for p in sources] + [w.encode() for w in (*command, *flags, *libs)]
             + [platform.machine().encode(), machine])
    tag = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"{name}-{tag}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Solvers of one node start together: the first builds, the others wait on the lock and load
    # its library (the lock is released when its holder exits, whatever happens to it). Where the
    # lock cannot be had (another user's lock file, a file system without locks), each builds.
    with contextlib.ExitStack() as held:
        try:
            lock = held.enter_context(open(directory / f"{name}.lock", "a"))
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            pass
        if not target.exists():
            _compile(target, main=main, command=command, flags=flags, libs=libs, hint=hint)
    return target


def _compile(target: Path, *, main: Path, command: list[str], flags: Sequence[str], libs: Sequence[str],
             hint: str) -> None:
    """Build ``main`` into a temporary file of ``target``'s folder, then rename it to ``target``
    (a process that does not take the lock still never loads a half-written library)."""
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        try:
            proc = subprocess.run([*command, *flags, "-o", tmp, str(main), *libs],
                                  capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{Path(command[0]).name} took over {BUILD_TIMEOUT_S} s to build {main.name}") from e
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.splitlines() or ["?"]
            raise RuntimeError(f"{Path(command[0]).name} could not build {main.name}: {lines[0].strip()}"
                               + (f" ({hint})" if hint else ""))
        os.chmod(tmp, 0o755)  # mkstemp made it 0600: others sharing the cache must load it too
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
