"""Caffe LMDB data source: record access by index (the per-solver streams are :mod:`.records`').

Opening: one ``lmdb.Environment`` per LMDB per process (never shared across a fork),
``readonly=True, lock=False`` (the DB is frozen while training; no lock file is needed, as
in DALI's reader) and ``readahead=False`` (random access; OS readahead would pull in
pages of other solvers' records).

Record index -> key. Records are numbered 0..N-1 in key order. Two ways to find record i:

* **prefix seek** (no key table): if the DB's first key starts with ``00000000_`` and
  its last key with ``%08d_ % (N - 1)`` — the layout of ``dptrain make-lmdb`` and Caffe's
  ``convert_imageset`` — record i is found with one B-tree seek to ``b"%08d_" % i``, and
  the found key is checked to carry that prefix.
* **key table** otherwise: the keys are scanned once at open with a values-free cursor
  walk (cheap: large values sit on overflow pages the walk never touches) and kept as
  one bytes blob plus int64 offsets (about 60 MB for ImageNet-1k's 1.28 M keys).

Samples are HWC **RGB** uint8 (raw Caffe records are BGR and are flipped on read), so
``data.mean_value`` is given in RGB order; a Caffe ``mean_file`` (BGR) is converted.
"""
from __future__ import annotations

import logging
import os
import re
import threading

import lmdb
import numpy as np

from dptrain.config import DataConfig
from dptrain.data.sources.records import RecordHandle, RecordSource
from dptrain.data.transforms.render import DEFAULT_RENDER, RenderOptions
from dptrain.errors import DataError

__all__ = ["DataError", "LmdbReader", "LmdbSource"]

log = logging.getLogger(__name__)

DAMAGED_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadTxnError, lmdb.InvalidError, lmdb.PanicError)
"""py-lmdb's errors for pages that are not what they should be (the DB file is corrupt)."""

def damaged(e: lmdb.Error, *, path: str = "", rank: int = 0) -> DataError:
    """The error for a DB whose pages are not what they should be, at open or at a read."""
    return DataError(f"LMDB is damaged ({e}); re-create it with dptrain make-lmdb or copy it again",
                     path=path, rank=rank)


MAX_READERS = 1024
"""Reader slots per Environment; each stream takes P + T read transactions."""
_PREFIX = re.compile(rb"^(\d{8})_")

_envs: dict[str, tuple[int, lmdb.Environment]] = {}
_envs_lock = threading.Lock()


def _open_env(path: str, rank: int) -> lmdb.Environment:
    """The process's Environment for ``path`` (opened once per process)."""
    real = os.path.realpath(path)
    with _envs_lock:
        cached = _envs.get(real)
        if cached is not None and cached[0] == os.getpid():
            return cached[1]
        if not os.path.exists(path):
            raise DataError("LMDB path does not exist; fix data.path / data.test_path", path=path, rank=rank)
        subdir = os.path.isdir(path)
        data_file = os.path.join(path, "data.mdb") if subdir else path
        if not subdir and not os.path.isfile(path):  # a FIFO or device would block lmdb.open forever
            raise DataError("not an LMDB (neither a directory nor a file); point data.path at a Caffe LMDB "
                            "directory", path=path, rank=rank)
        try:
            env = lmdb.open(path, readonly=True, lock=False, readahead=False, max_readers=MAX_READERS,
                            subdir=subdir, meminit=False)
            need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        except lmdb.Error as e:
            raise DataError(f"not an LMDB ({e}); point data.path at a Caffe LMDB directory",
                            path=path, rank=rank) from e
        have = os.path.getsize(data_file)
        if have < need:  # reading past the end of the mapped file would kill the process with SIGBUS
            env.close()
            raise DataError(f"LMDB is truncated: {os.path.basename(data_file)} holds {have} bytes but its pages "
                            f"need {need}; copy the DB again", path=path, rank=rank)
        _envs[real] = (os.getpid(), env)
        return env


class _Handle(RecordHandle):
    """One thread's read transaction and cursor.

    After any lmdb error the transaction is aborted and a new one begun before the next read:
    LMDB marks a transaction that met a damaged page as failed (every later read on it would
    fail with MDB_BAD_TXN), so without the renewal one bad page would poison every good record
    after it. The damaged record itself is a bad record like any other (data.max_bad_records).
    """

    kind = "LMDB"

    def __init__(self, reader: LmdbReader) -> None:
        self.path, self._reader = reader.path, reader
        self._begin()

    def _begin(self) -> None:
        self._txn = self._reader.env.begin(buffers=False)
        self._cursor = self._txn.cursor()

    def _failed(self, e: lmdb.Error) -> DataError:
        """The DataError for ``e``, after renewing the transaction; a renewal that fails is raised."""
        self._txn.abort()
        try:
            self._begin()
        except lmdb.Error as again:
            raise damaged(again, path=self.path, rank=self._reader.rank) from again
        if isinstance(e, DAMAGED_ERRORS):
            return damaged(e)
        return DataError(f"LMDB read failed ({e})")

    def get_many(self, indices: list[int]) -> tuple[list[bytes], list[bytes], dict[int, DataError]]:
        """(keys, values, errors) of records ``indices``: a record that cannot be read has its key (``#index``
        where the key itself cannot be read), value b"" and its DataError under its place in the list. One loop for the
        whole list, with as few Python calls per record as the lookup allows (the reader's share
        of the per-image Python work)."""
        r = self._reader
        keys: list[bytes] = []
        values: list[bytes] = []
        errors: dict[int, DataError] = {}
        for i in indices:
            failed_key = b"#%d" % i
            try:
                if r.key_blob is None:
                    prefix = b"%08d_" % i
                    if self._cursor.set_range(prefix):
                        key, value = self._cursor.item()
                        if key.startswith(prefix):
                            keys.append(key)
                            values.append(value)
                            continue
                    error = DataError(f"no record with key prefix {prefix.decode()!r}; the DB's keys are not a "
                                      f"dense %08d_ sequence (re-create it with dptrain make-lmdb)")
                else:
                    key = failed_key = r.key(i)
                    value = self._txn.get(key)
                    if value is not None:
                        keys.append(key)
                        values.append(value)
                        continue
                    error = DataError("record vanished from the DB; was it modified while training? Keep LMDBs frozen")
            except lmdb.Error as e:
                error = self._failed(e)
            errors[len(values)] = error
            keys.append(failed_key)
            values.append(b"")
        return keys, values, errors

    def close(self) -> None:
        self._txn.abort()


class LmdbReader:
    """An LMDB opened for random access by record index (see the module docstring)."""

    kind = "LMDB"

    def __init__(self, path: str, rank: int = 0) -> None:
        self.path, self.rank = path, rank
        self.env = _open_env(path, rank)
        self.key_blob: bytes | None = None
        self._key_offsets = np.zeros(1, dtype=np.int64)
        try:
            with self.env.begin() as txn:
                self.num_records = txn.stat()["entries"]
                if self.num_records == 0:
                    raise DataError("LMDB has no records; fill it with dptrain make-lmdb", path=path, rank=rank)
                cur = txn.cursor()
                first = cur.key() if cur.first() else b""
                last = cur.key() if cur.last() else b""
                if not (self._prefix_number(first) == 0 and self._prefix_number(last) == self.num_records - 1):
                    self._build_key_table(cur)
        except lmdb.Error as e:
            raise damaged(e, path=path, rank=rank) from e
        log.info("opened LMDB %s: %d records, %s", path, self.num_records,
                 "prefix seek" if self.key_blob is None else "key table")

    @staticmethod
    def _prefix_number(key: bytes) -> int:
        m = _PREFIX.match(key)
        return int(m.group(1)) if m else -1

    def _build_key_table(self, cur: lmdb.Cursor) -> None:
        keys = list(cur.iternext(keys=True, values=False)) if cur.first() else []
        self.key_blob = b"".join(keys)
        self._key_offsets = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum([len(k) for k in keys], out=self._key_offsets[1:])

    def __len__(self) -> int:
        return self.num_records

    def key(self, index: int) -> bytes:
        assert self.key_blob is not None, "key() needs the key table"
        return self.key_blob[self._key_offsets[index]:self._key_offsets[index + 1]]

    def handle(self) -> _Handle:
        """A new read transaction for one thread (py-lmdb releases the GIL inside its calls)."""
        return _Handle(self)


class LmdbSource(RecordSource):
    """DataSource over a training LMDB and an optional test LMDB of Caffe Datums."""

    kind = "LMDB"

    def __init__(self, cfg: DataConfig, *, num_classes: int, seed: int, rank: int = 0, cores: int = 1,
                 render: RenderOptions = DEFAULT_RENDER, pin_memory: bool = False) -> None:
        super().__init__(cfg, LmdbReader(cfg.path, rank), LmdbReader(cfg.test_path, rank) if cfg.test_path else None,
                         num_classes=num_classes, seed=seed, rank=rank, cores=cores, render=render,
                         pin_memory=pin_memory)
