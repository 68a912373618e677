"""The contract of one solver's stream: what its threads and its consumer share.

Sample ``pos`` of a stream (0, 1, 2, ... from the stream's first batch) lands in batch
``pos // B``, row ``pos % B``; batch b lives in ring slot ``b % R`` with R = prefetch + 2.
Which record sits at ``pos`` comes from :mod:`dptrain.data.sampling` alone (the sequences
here), so the bytes of every batch are a pure function of (seed, epoch, rank,
world_size, batch_size) and do not depend on the reader count P, the renderer count T,
the chunk size K or thread timing.

The threads move *chunks*: chunk c is rows ``[(c % m) * K, ...)`` of batch ``c // m``, at most
K rows, with m = ceil(B / K) chunks per batch (:meth:`StreamParts.chunk_span`). A reader reads
a chunk's records, a renderer renders the chunk into its rows of the ring slot in one
native call (:mod:`dptrain.data.transforms.native`), so the Python work per image is a share of
a chunk's bookkeeping plus the LMDB reads.

The reader and renderer threads (:mod:`dptrain.data.loader.readers`,
:mod:`dptrain.data.loader.renderers`) and the consumer (:mod:`dptrain.data.loader.pipeline`) import
this module, and it imports none of them: the threads never import the pipeline that
starts them.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dptrain.data.caffe.datum import DatumLike
from dptrain.data.loader.queues import POLL_S, QueueSet
from dptrain.data.sampling import SampleOrder, batches_per_epoch, rank_epoch_shard
from dptrain.data.transforms.geometry import Stage
from dptrain.data.transforms.render import DEFAULT_RENDER, RenderOptions
from dptrain.errors import DataError

log = logging.getLogger(__name__)


class RecordHandle(Protocol):
    """One thread's read handle: a read transaction on an LMDB (``sources.caffe_lmdb.LmdbReader.handle``),
    or a reader of image files (``sources.files.FileReader.handle``)."""

    path: str
    kind: str
    """What ``path`` is, for error lines: "LMDB", "image folder", "list file"."""

    def get(self, index: int) -> tuple[bytes, bytes, DataError | None]: ...
    def get_many(self, indices: list[int]) -> tuple[list[bytes], list[bytes], dict[int, DataError]]: ...
    def close(self) -> None: ...


@dataclass(slots=True)
class ParsedRecord:
    """One record on its way from a reader to a renderer."""

    pos: int
    """Position in the solver's stream (batch pos // B, row pos % B)."""
    epoch: int
    index: int
    """Record index in the DB (0-based, in key order)."""
    key: bytes
    datum: DatumLike | None
    error: DataError | None = None


@dataclass(slots=True)
class ParsedChunk:
    """One chunk's records on their way from a reader to a renderer (see the module docstring)."""

    c: int
    """Chunk index in the stream."""
    epoch: int
    indices: np.ndarray
    """[rows] int64 record indices (0-based, in key order)."""
    keys: list[bytes]
    values: list[bytes]
    """The records' bytes; b"" where the read failed (then in ``errors``)."""
    errors: dict[int, DataError]
    """Row in the chunk -> why its record could not be read."""


class RecordReader(Protocol):
    """Records opened for reading by index (``sources.caffe_lmdb.LmdbReader``, ``sources.files.FileReader``);
    each thread takes its own handle."""

    path: str
    kind: str

    def handle(self) -> RecordHandle: ...


class TrainSequence:
    """Position -> (epoch, record index) of one rank's training stream from ``start_step`` on."""

    length: int | None = None

    def __init__(self, num_samples: int, plan: SampleOrder, start_step: int) -> None:
        self._num, self._plan, self._start = num_samples, plan, start_step
        self._per_epoch = batches_per_epoch(num_samples, plan.samples_per_step)
        self.span = self._per_epoch * plan.batch_size
        """Records this rank reads per epoch (its shard)."""
        self._shards: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def _shard(self, epoch: int) -> np.ndarray:
        with self._lock:
            shard = self._shards.get(epoch)
            if shard is None:
                shard = rank_epoch_shard(epoch, self._num, self._plan)
                self._shards = {e: s for e, s in self._shards.items() if e >= epoch - 1}
                self._shards[epoch] = shard
            return shard

    def index(self, pos: int, attempt: int = 0) -> tuple[int, int]:
        """(epoch, record index) at ``pos``; ``attempt`` > 0 walks on through the epoch shard."""
        b = self._plan.batch_size
        epoch, k = divmod(self._start + pos // b, self._per_epoch)
        offset = k * b + pos % b
        return epoch, int(self._shard(epoch)[(offset + attempt) % self.span])

    def rows(self, pos: int, rows: int) -> tuple[int, np.ndarray]:
        """(epoch, [rows] int64 record indices) of positions ``pos ... pos + rows - 1``, all in one
        batch: :meth:`index` (attempt 0) of those positions at once."""
        batch, row0 = divmod(pos, self._plan.batch_size)
        epoch, k = divmod(self._start + batch, self._per_epoch)
        start = k * self._plan.batch_size + row0
        return epoch, self._shard(epoch)[start:start + rows]


class TestSequence:
    """Position -> (0, record index) over this rank's contiguous test range."""

    def __init__(self, indices: range) -> None:
        self._range = indices
        self.length = self.span = len(indices)

    def index(self, pos: int, attempt: int = 0) -> tuple[int, int]:
        return 0, self._range.start + (pos + attempt) % self.span

    def rows(self, pos: int, rows: int) -> tuple[int, np.ndarray]:
        """(0, [rows] int64 record indices) from position ``pos`` on: :meth:`index` of each."""
        return 0, np.arange(self._range.start + pos, self._range.start + pos + rows, dtype=np.int64)


class BadRecordBudget:
    """Distinct bad records met by one stream, judged in stream order as a sequential reader would.

    Threads meet bad records out of order, so :meth:`spend` never raises: it notes where
    each distinct record was first met, as (position, attempt), and the renderer
    substitutes (or, in a test stream, drops) the record either way. Once more than
    ``data.max_bad_records`` distinct records are known, the (limit + 1)-th of them in
    stream order is the failure; :meth:`failure_before` hands it to the consumer when it
    reaches that batch, whose earlier positions have all been read by then. So the run
    stops at the same batch, naming the same key, for any P, T and thread timing.

    A bad record met again in a later epoch is not counted (or logged) again, so a DB with
    k bad records trains with ``max_bad_records >= k`` for any number of epochs. Each
    substitution still shows up in ``HostBatch.info["bad_records"]``.
    """

    def __init__(self, limit: int, rank: int, *, substitutes: bool = True) -> None:
        self.limit, self.rank = limit, rank
        self._fate = "replaced by the next record of the shard" if substitutes else "dropped from the test"
        self._first: dict[int, tuple[tuple[int, int], DataError]] = {}
        """record index -> ((position, attempt) where first met, its error)."""
        self._failure: tuple[int, DataError] | None = None
        self._lock = threading.Lock()

    def spend(self, index: int, error: DataError, pos: int, attempt: int = 0) -> None:
        """Record ``index`` is bad, met while filling position ``pos`` (``attempt``-th candidate)."""
        at = (pos, attempt)
        with self._lock:
            first = index not in self._first
            if first or at < self._first[index][0]:
                self._first[index] = (at, error)
            count = len(self._first)
            if count > self.limit:
                (fail_pos, _), fail_error = sorted(self._first.values(), key=lambda v: v[0])[self.limit]
                if self.limit:
                    fail_error = DataError(f"{fail_error.reason}; {self.limit + 1} bad records exceed "
                                           f"data.max_bad_records = {self.limit}", path=fail_error.path,
                                           key=fail_error.key, rank=fail_error.rank, kind=fail_error.kind)
                self._failure = (fail_pos, fail_error)
        if first and count <= self.limit:  # past the limit the stream stops, naming its record in stream order
            log.warning("skipping bad record (%d met, %d allowed), %s: %s", count, self.limit, self._fate, error)

    def failure_before(self, end: int) -> DataError | None:
        """The error that stops the stream at a position below ``end``, if any."""
        with self._lock:
            return self._failure[1] if self._failure is not None and self._failure[0] < end else None


class BatchRing:
    """R [B, H, W, C] uint8 batch slots (+ labels), page-locked for CUDA runs; batch b is written into slot b % R."""

    def __init__(self, slots: int, batch_size: int, sample_shape: tuple[int, int, int], *, pin: bool = False) -> None:
        self.slots = slots
        self.images = torch.empty((slots, batch_size, *sample_shape), dtype=torch.uint8,
                                  pin_memory=pin)  # [R, B, H, W, C] uint8, pinned for CUDA runs
        self.labels = torch.empty((slots, batch_size), dtype=torch.int64, pin_memory=pin)  # [R, B]
        self.windows = torch.zeros((slots, batch_size, 3), dtype=torch.int32, pin_memory=pin)  # [R, B, (y0, x0, flip)]
        self._images_np, self._labels_np = self.images.numpy(), self.labels.numpy()
        self._windows_np = self.windows.numpy()
        self.owner = list(range(slots))
        """Batch each slot currently belongs to; batch b may be written once owner[b % R] == b."""
        self.filled = [0] * slots
        self.bad = [0] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self.cond = threading.Condition()

    def acquire(self, b: int, stop: threading.Event) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Worker side: wait until slot b % R belongs to batch b; returns its (images, labels, windows) arrays."""
        s = b % self.slots
        with self.cond:
            while self.owner[s] != b:
                if stop.is_set():
                    return None
                self.cond.wait(POLL_S)
            event = self._events[s]
        if event is not None:
            event.synchronize()  # the consumer's device copy out of this slot must finish before we overwrite it
        return self._images_np[s], self._labels_np[s], self._windows_np[s]

    def complete(self, b: int, rows: int, done: int, bad: int) -> None:
        """Worker side: ``done`` more of batch b's ``rows`` rows are written (``bad`` records were skipped for them)."""
        s = b % self.slots
        with self.cond:
            self.filled[s] += done
            self.bad[s] += bad
            if self.filled[s] == rows:
                self.cond.notify_all()

    def free(self, b: int, event: torch.cuda.Event | None) -> None:
        """Consumer side: batch b is done with; its slot goes to batch b + R."""
        s = b % self.slots
        with self.cond:
            if self.owner[s] != b:
                raise RuntimeError(f"batch {b} released twice or out of turn (slot {s} holds batch {self.owner[s]})")
            self._events[s] = event
            self.owner[s], self.filled[s], self.bad[s] = b + self.slots, 0, 0
            self.cond.notify_all()


@dataclass
class StreamParts:
    """Everything the threads of one stream share (read-only except ring, budget, queues)."""

    reader: RecordReader
    """The records; every reader, and a renderer that needs a substitute, opens its own handle."""
    sequence: TrainSequence | TestSequence
    """Position -> (epoch, record index)."""
    queues: QueueSet[ParsedChunk]
    """Reader -> renderer routing of the chunks (a chunk index plays the position's part)."""
    ring: BatchRing
    """Where the renderers write and the consumer reads."""
    budget: BadRecordBudget
    """The stream's allowance of distinct bad records (data.max_bad_records)."""
    stages: list[Stage]
    """The geometry chain, checked once at build time (``geometry.check_chain``)."""
    channels: int
    """Channels of every sample: 3 (RGB) or 1 (grey)."""
    batch_size: int
    num_classes: int
    """Labels must lie in [0, num_classes); a record outside is bad."""
    seed: int
    """First key of every sample's ``SampleRng``."""
    rank: int
    render: RenderOptions = DEFAULT_RENDER
    windows: bool = False
    """Record each sample's crop window (y0, x0, mirrored) for a per-pixel mean image."""
    drop_bad: bool = False
    """Test streams: a skipped bad record leaves its row empty with label ``DROPPED_LABEL``
    (scored by nobody) instead of a substitute, so every test sample counts once."""
    chunk_rows: int = 1
    """K: rows of a batch that one reader reads and one renderer renders together."""
    native: bool = False
    """Render with :mod:`dptrain.data.transforms.native` (else the Python path, sample by sample)."""

    def batch_rows(self, b: int) -> int:
        """Rows of batch b: batch_size, or fewer in the last batch of a finite stream."""
        n = self.sequence.length
        return self.batch_size if n is None else min(self.batch_size, n - b * self.batch_size)

    @property
    def chunks_per_batch(self) -> int:
        return -(-self.batch_size // self.chunk_rows)

    def chunk_span(self, c: int) -> tuple[int, int, int]:
        """(batch, first row, rows) of chunk c; rows <= 0 past the end of a finite stream."""
        b, j = divmod(c, self.chunks_per_batch)
        row0 = j * self.chunk_rows
        return b, row0, min(self.chunk_rows, self.batch_rows(b) - row0)

    def chunk_records(self, c: int) -> tuple[int, np.ndarray]:
        """(epoch, record indices) of chunk c's rows."""
        b, row0, rows = self.chunk_span(c)
        return self.sequence.rows(b * self.batch_size + row0, rows)

    @property
    def num_chunks(self) -> int | None:
        """Chunks of a finite stream (None: endless). Every chunk below it has rows."""
        n = self.sequence.length
        if n is None:
            return None
        full, last = divmod(n, self.batch_size)
        return full * self.chunks_per_batch + -(-last // self.chunk_rows)
