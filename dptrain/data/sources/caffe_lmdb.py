"""Caffe LMDB data source: record access by index, shards, and the per-solver threaded streams.

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
``data.mean_value`` is given in RGB order; a Caffe ``mean_file`` (BGR) is converted. A mean
image is subtracted per pixel on the device at each sample's crop window (see
``_resolve_mean`` and ``base.window_means``).
"""
from __future__ import annotations

import logging
import math
import os
import re
import threading

import lmdb
import numpy as np
import torch

from dptrain.config import DataConfig
from dptrain.data.caffe.datum import parse_datum, read_mean_file
from dptrain.data.loader.pipeline import EmptyStream, PipelineStream
from dptrain.data.loader.queues import QueueSet
from dptrain.data.loader.stream import BadRecordBudget, BatchRing, StreamParts, TestSequence, TrainSequence
from dptrain.data.sampling import SampleOrder, eval_range
from dptrain.data.transforms import jpeg_crop
from dptrain.data.transforms import native as native_render
from dptrain.data.transforms.geometry import ExpectSize, SampleSpec, build_stages, check_chain
from dptrain.data.transforms.render import DEFAULT_RENDER, RenderOptions, probe_channels_and_size
from dptrain.errors import ConfigError, DataError

__all__ = ["DataError", "LmdbReader", "LmdbSource", "default_threads"]

log = logging.getLogger(__name__)

DAMAGED_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadTxnError, lmdb.InvalidError, lmdb.PanicError)
"""py-lmdb's errors for pages that are not what they should be (the DB file is corrupt)."""

def damaged(e: lmdb.Error, *, path: str = "", rank: int = 0) -> DataError:
    """The error for a DB whose pages are not what they should be, at open or at a read."""
    return DataError(f"LMDB is damaged ({e}); re-create it with dptrain make-lmdb or copy it again",
                     path=path, rank=rank)


MAX_READERS = 1024
"""Reader slots per Environment; each stream takes P + T read transactions."""
MEAN_IMAGE_TOLERANCE = 1.0
"""Pixel units a mean image may vary by before its per-channel average is worth a warning."""
PROBE_RECORDS = 16
"""Records, spread over the training DB, whose colour decides the samples' channels at open."""
MAX_PARSERS_DEFAULT = 3
"""NVCaffe's default parser count; parsers are cheap, so a few per solver suffice."""
CHUNK_ROWS_MAX = 16
"""Most rows a reader reads and a renderer renders at once: the per-chunk Python work is spread
over this many images, and each renderer still gets two chunks or more of a batch."""
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


class _Handle:
    """One thread's read transaction and cursor.

    After any lmdb error the transaction is aborted and a new one begun before the next read:
    LMDB marks a transaction that met a damaged page as failed (every later read on it would
    fail with MDB_BAD_TXN), so without the renewal one bad page would poison every good record
    after it. The damaged record itself is a bad record like any other (data.max_bad_records).
    """

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

    def get(self, index: int) -> tuple[bytes, bytes]:
        """(key, value) of record ``index``; DataError if it cannot be read."""
        keys, values, errors = self.get_many([index])
        if errors:
            raise errors[0]
        return keys[0], values[0]

    def get_many(self, indices: list[int]) -> tuple[list[bytes], list[bytes], dict[int, DataError]]:
        """(keys, values, errors) of records ``indices``: a record that cannot be read has key
        ``#index``, value b"" and its DataError under its place in the list. One loop for the
        whole list, with as few Python calls per record as the lookup allows (the reader's share
        of the per-image Python work)."""
        r = self._reader
        keys: list[bytes] = []
        values: list[bytes] = []
        errors: dict[int, DataError] = {}
        for i in indices:
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
                    key = r.key(i)
                    value = self._txn.get(key)
                    if value is not None:
                        keys.append(key)
                        values.append(value)
                        continue
                    error = DataError("record vanished from the DB; was it modified while training? Keep LMDBs frozen")
            except lmdb.Error as e:
                error = self._failed(e)
            errors[len(values)] = error
            keys.append(f"#{i}".encode())
            values.append(b"")
        return keys, values, errors

    def close(self) -> None:
        self._txn.abort()


class LmdbReader:
    """An LMDB opened for random access by record index (see the module docstring)."""

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


def default_threads(cfg: DataConfig, cores: int) -> tuple[int, int]:
    """(readers, renderers) per solver (data.parser_threads, data.transformer_threads); 0 in the config means: derive from ``cores``, the
    cores this solver may use (``Topology.cores_per_process``).

    Rendering dominates and runs without the GIL (natively, or in Pillow's and torch's C code),
    so T = cores. Parsers only seek and copy the records: one per 4 cores, at most NVCaffe's 3.
    """
    parsers = cfg.parser_threads or min(MAX_PARSERS_DEFAULT, max(1, cores // 4))
    return parsers, cfg.transformer_threads or cores


class LmdbSource:
    """DataSource over a training LMDB and an optional test LMDB of Caffe Datums."""

    def __init__(self, cfg: DataConfig, *, num_classes: int, seed: int, rank: int = 0, cores: int = 1,
                 render: RenderOptions = DEFAULT_RENDER, pin_memory: bool = False) -> None:
        self._cfg, self._num_classes, self._seed = cfg, num_classes, seed
        self._render = render
        self._pin = pin_memory  # page-locked batch ring: only when the batches go to a CUDA device
        self._train = LmdbReader(cfg.path, rank)
        self._test = LmdbReader(cfg.test_path, rank) if cfg.test_path else None
        self.num_train = len(self._train)
        self.num_test = len(self._test) if self._test is not None else 0
        self.channels, first_hw = self._probe(cfg, rank)
        self._stages = {train: build_stages(cfg, train=train, first_hw=first_hw) for train in (True, False)}
        self.mean, self.mean_image = self._resolve_mean(cfg, first_hw)
        if self.mean_image is not None:
            for stages in self._stages.values():
                stages.insert(0, ExpectSize(*self.mean_image.shape[1:], source="data.mean_file",
                                            fix="compute the mean over this DB or use data.mean_value"))
        in_spec = SampleSpec(None, None, self.channels)
        out = {train: check_chain(stages, in_spec) for train, stages in self._stages.items()}
        if out[True] != out[False]:
            raise ConfigError(f"training samples are {out[True]} but test samples {out[False]}; "
                              f"set data.crop_size or data.resize")
        self.sample_shape = (out[True].height, out[True].width, self.channels)
        self.scale = cfg.scale
        self.readers, self.renderers = default_threads(cfg, cores)
        crop = "off"
        if render.crop_decode:  # built (or found in the cache) now, not in the first batch's time
            crop = "on" if jpeg_crop.library() is not None else "unavailable"
        # the native path renders what the default options do; other options measure the Python path
        self.native = render == DEFAULT_RENDER and native_render.library() is not None
        log.info("LMDB input: %d reader + %d renderer threads per solver (%d cores), samples %s, prefetch %d, "
                 "JPEG crop decode %s, %s path", self.readers, self.renderers, cores, self.sample_shape,
                 cfg.prefetch, crop, "native" if self.native else "Python")

    def _probe(self, cfg: DataConfig, rank: int) -> tuple[int, tuple[int, int]]:
        """(channels, (height, width) of the first good record) from up to PROBE_RECORDS records.

        The records are spread evenly over the DB. The stream is RGB if any of them is in
        colour, so a grey image at key 0 does not turn a colour DB grey. A bad record here
        counts against ``data.max_bad_records`` like anywhere else (the stream counts it
        again, once, when it reaches it).
        """
        n = self.num_train
        picks = sorted({round(i * (n - 1) / max(1, PROBE_RECORDS - 1)) for i in range(min(n, PROBE_RECORDS))})
        found: list[tuple[int, tuple[int, int]]] = []
        bad = 0
        handle = self._train.handle()
        try:
            for index in picks:
                key = f"#{index}".encode()
                try:
                    key, value = handle.get(index)
                    found.append(probe_channels_and_size(parse_datum(value)))
                except DataError as e:
                    located = e.located(path=cfg.path, key=key, rank=rank)
                    bad += 1
                    if bad > cfg.max_bad_records:
                        raise located from e
                    log.warning("%s (skipped: data.max_bad_records = %d)", located, cfg.max_bad_records)
        finally:
            handle.close()
        if not found:
            raise DataError(f"none of the {len(picks)} records probed is readable", path=cfg.path, rank=rank)
        gray = sum(1 for c, _ in found if c == 1)
        channels = 3 if gray < len(found) else 1
        if 0 < gray < len(found):
            log.info("%s: %d of %d probed records are grey; every sample is read as RGB", cfg.path, gray, len(found))
        return channels, found[0][1]

    def _resolve_mean(self, cfg: DataConfig, first_hw: tuple[int, int]) -> tuple[tuple[float, ...], torch.Tensor | None]:
        """(per-channel mean, mean image or None) from data.mean_value / data.mean_file.

        A mean *image* is subtracted pixel by pixel at each sample's crop window, as Caffe
        does, when the geometry is Caffe's (crop and mirror, no resize or random-resized
        crop). With a resize the windows no longer map onto the stored image, so its
        per-channel average is used, with a warning when the image is not flat.
        """
        if not cfg.mean_file:
            mean = tuple(cfg.mean_value)
            self._check_mean_channels(len(mean))
            return mean, None
        a = read_mean_file(cfg.mean_file)  # [C] or [C, H, W], RGB
        self._check_mean_channels(a.shape[0])
        per_channel = tuple(float(m) for m in a.reshape(a.shape[0], -1).mean(axis=1))
        if a.ndim == 1:
            return per_channel, None
        if not (cfg.resize or cfg.random_resized_crop):
            if a.shape[1:] != first_hw:
                raise ConfigError(f"data.mean_file {cfg.mean_file!r} is {a.shape[1]}x{a.shape[2]} (HxW) but the "
                                  f"records are {first_hw[0]}x{first_hw[1]}; compute the mean over this DB or "
                                  f"use data.mean_value")
            log.info("data.mean_file %s: a %dx%d mean image, subtracted at each crop window", cfg.mean_file,
                     a.shape[1], a.shape[2])
            return per_channel, torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
        spread = float(np.abs(a.reshape(a.shape[0], -1) - np.asarray(per_channel)[:, None]).max())
        if spread > MEAN_IMAGE_TOLERANCE:
            log.warning("data.mean_file %s: the mean image varies by up to %.1f pixel units, but with data.resize "
                        "or data.random_resized_crop crops do not map onto it; subtracting its per-channel average "
                        "%s. Set data.mean_value to silence this", cfg.mean_file, spread, per_channel)
        return per_channel, None

    def _check_mean_channels(self, n: int) -> None:
        if n not in (0, 1, self.channels):
            raise ConfigError(f"data mean has {n} channels/values but the images have {self.channels} "
                              f"channel(s); give 1 or {self.channels}")

    def _stream(self, reader: LmdbReader, sequence: TrainSequence | TestSequence, batch_size: int,
                rank: int, train: bool) -> PipelineStream:
        p, t = self.readers, self.renderers
        parts = StreamParts(
            reader=reader, sequence=sequence,
            queues=QueueSet(p, t, capacity=2),
            ring=BatchRing(self._cfg.prefetch + 2, batch_size, self.sample_shape, pin=self._pin),
            budget=BadRecordBudget(self._cfg.max_bad_records, rank, substitutes=train),
            stages=self._stages[train], channels=self.channels, batch_size=batch_size,
            num_classes=self._num_classes, seed=self._seed, rank=rank, render=self._render,
            windows=self.mean_image is not None, drop_bad=not train,
            chunk_rows=min(CHUNK_ROWS_MAX, max(1, math.ceil(batch_size / (2 * t)))), native=self.native,
        )
        return PipelineStream(parts, readers=p, renderers=t)

    def train_batches(self, plan: SampleOrder, start_step: int) -> PipelineStream:
        """Batches of global micro-batch ``start_step``, ``start_step + 1``, ... forever."""
        return self._stream(self._train, TrainSequence(self.num_train, plan, start_step), plan.batch_size,
                            plan.rank, train=True)

    def test_batches(self, rank: int, world_size: int, batch_size: int) -> PipelineStream | EmptyStream:
        """This rank's contiguous slice of the test DB (centre crop, no mirror), then StopIteration."""
        indices = eval_range(self.num_test, rank, world_size)
        if self._test is None or len(indices) == 0:
            return EmptyStream()
        return self._stream(self._test, TestSequence(indices), batch_size, rank, train=False)
