"""One solver's threaded stream: sample sequence, pinned batch ring, threads, errors, shutdown.

Sample ``pos`` of a stream (0, 1, 2, ... from the stream's first batch) lands in batch
``pos // B``, row ``pos % B``; batch b lives in ring slot ``b % R`` with R = prefetch + 2.
Which record sits at ``pos`` comes from :mod:`dptrain.data.sampling` alone, so the bytes of
every batch are a pure function of (seed, epoch, rank, world_size, batch_size) and do not
depend on the parser count P, the transformer count T or thread timing.

Slot reuse: the consumer hands each batch back with ``HostBatch.release(event)``. With a
CUDA event (the batch's host-to-device copy), the first transformer that writes the slot
again calls ``event.synchronize()`` before touching it. With ``None`` (CPU) the consumer
may still read the host tensor until it asks for its next batch, so the slot is freed
then, whatever order the batches were released in. A consumer that keeps all R slots without releasing
gets a RuntimeError instead of a hang.

Errors: a bad record over ``data.max_bad_records`` is raised when the consumer reaches its
batch, every earlier batch having been delivered (see ``BadRecordBudget``). Any other
exception of a thread is stored, every thread is stopped and joined, and ``__next__``
re-raises it. A DataError carries the rank, LMDB path and key.
"""
from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dptrain.data.base import HostBatch
from dptrain.data.parser import ParsedRecord, run_parser
from dptrain.data.queues import POLL_S, QueueSet
from dptrain.data.sampling import ShardPlan, batches_per_epoch, rank_epoch_shard
from dptrain.data.transformer import RenderOptions, Stage, run_transformer
from dptrain.errors import DataError

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0
"""close() waits this long per thread; every blocking wait in a thread polls the stop event every POLL_S."""


class TrainSequence:
    """Position -> (epoch, record index) of one rank's training stream from ``start_step`` on."""

    length: int | None = None

    def __init__(self, num_samples: int, plan: ShardPlan, start_step: int) -> None:
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


class TestSequence:
    """Position -> (0, record index) over this rank's contiguous test range."""

    def __init__(self, indices: range) -> None:
        self._range = indices
        self.length = self.span = len(indices)

    def index(self, pos: int, attempt: int = 0) -> tuple[int, int]:
        return 0, self._range.start + (pos + attempt) % self.span


class BadRecordBudget:
    """Distinct bad records met by one stream, judged in stream order as a sequential reader would.

    Threads meet bad records out of order, so :meth:`spend` never raises: it notes where
    each distinct record was first met, as (position, attempt), and the transformer
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
                                           key=fail_error.key, rank=fail_error.rank)
                self._failure = (fail_pos, fail_error)
        if first and self.limit:
            log.warning("rank %d: skipping bad record (%d met, %d allowed), %s: %s", self.rank, count, self.limit,
                        self._fate, error)

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

    def complete(self, b: int, rows: int, bad: int) -> None:
        """Worker side: one row of batch b is written (``bad`` records were skipped for it)."""
        s = b % self.slots
        with self.cond:
            self.filled[s] += 1
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

    reader: object
    """lmdb_source.LmdbReader: ``path``, ``handle()``."""
    sequence: TrainSequence | TestSequence
    queues: QueueSet[ParsedRecord]
    ring: BatchRing
    budget: BadRecordBudget
    stages: list[Stage]
    channels: int
    batch_size: int
    num_classes: int
    seed: int
    rank: int
    render: RenderOptions = RenderOptions()
    windows: bool = False
    """Record each sample's crop window (y0, x0, mirrored) for a per-pixel mean image."""
    drop_bad: bool = False
    """Test streams: a skipped bad record leaves its row empty with label ``DROPPED_LABEL``
    (scored by nobody) instead of a substitute, so every test sample counts once."""

    def batch_rows(self, b: int) -> int:
        """Rows of batch b: batch_size, or fewer in the last batch of a finite stream."""
        n = self.sequence.length
        return self.batch_size if n is None else min(self.batch_size, n - b * self.batch_size)


class PipelineStream:
    """Iterator of HostBatch over one sequence, fed by P parser and T transformer threads."""

    def __init__(self, parts: StreamParts, *, parsers: int, transformers: int) -> None:
        self._parts = parts
        self._ring = parts.ring
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._next_batch = 0
        self._bad_total = 0
        self._deferred: list[int] = []
        """Batches released with no event (a host reader): freed when the next batch is asked for."""
        self._released: set[int] = set()
        self._closed = False
        workers: list[tuple[str, Callable[[int, StreamParts, threading.Event], None], int]] = [
            *((f"dptrain-parser-r{parts.rank}-{p}", run_parser, p) for p in range(parsers)),
            *((f"dptrain-transformer-r{parts.rank}-{t}", run_transformer, t) for t in range(transformers)),
        ]
        self._threads = [threading.Thread(target=self._guard, args=(fn, i), name=name, daemon=True)
                         for name, fn, i in workers]
        self._transformers = self._threads[parsers:]
        for th in self._threads:
            th.start()

    def _guard(self, fn: Callable[[int, StreamParts, threading.Event], None], i: int) -> None:
        try:
            fn(i, self._parts, self._stop)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the consumer
            with self._ring.cond:
                if self._error is None:
                    self._error = e
                self._stop.set()
                self._ring.cond.notify_all()

    def __iter__(self) -> PipelineStream:
        return self

    def __next__(self) -> HostBatch:
        if self._closed:
            raise StopIteration
        for done in self._deferred:
            self._released.discard(done)  # from here on ring.free's owner check catches a second release
            self._ring.free(done, None)
        self._deferred = []
        b = self._next_batch
        rows = self._parts.batch_rows(b)
        if rows <= 0:
            self.close()
            raise StopIteration
        try:
            self._wait_ready(b, rows)
            # every position of this batch has been read now, so the budget's verdict on them is final
            error = self._parts.budget.failure_before(b * self._parts.batch_size + rows)
            if error is not None:
                raise error
        except BaseException:
            self.close()
            raise
        s = b % self._ring.slots
        self._bad_total += self._ring.bad[s]
        self._next_batch += 1
        return HostBatch(images=self._ring.images[s, :rows], labels=self._ring.labels[s, :rows],
                         release=functools.partial(self._release, b), info={"bad_records": self._bad_total},
                         windows=self._ring.windows[s, :rows] if self._parts.windows else None)

    def _wait_ready(self, b: int, rows: int) -> None:
        ring, s = self._ring, b % self._ring.slots
        with ring.cond:
            while ring.owner[s] != b or ring.filled[s] < rows:
                if self._error is not None:
                    raise self._error
                if ring.owner[s] != b:
                    raise RuntimeError(f"rank {self._parts.rank}: all {ring.slots} ring slots are held; "
                                       f"call HostBatch.release(event) once each batch is consumed")
                if not any(th.is_alive() for th in self._transformers):
                    raise RuntimeError(f"rank {self._parts.rank}: transformer threads exited before batch {b} "
                                       f"was complete")
                ring.cond.wait(POLL_S)

    def _release(self, b: int, event: torch.cuda.Event | None) -> None:
        if self._closed:
            return
        if b in self._released:
            raise RuntimeError(f"batch {b} released twice; call HostBatch.release once per batch")
        self._released.add(b)
        if event is None:  # host reader: it may read batch b until it asks for its next batch
            self._deferred.append(b)
            return
        self._released.discard(b)  # from here on ring.free's owner check catches a second release
        self._ring.free(b, event)

    def close(self) -> None:
        """Stop and join every thread. Idempotent; batches already handed out stay valid."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with self._ring.cond:
            self._ring.cond.notify_all()
        for th in self._threads:
            th.join(JOIN_TIMEOUT_S)
        alive = [th.name for th in self._threads if th.is_alive()]
        if alive:
            raise RuntimeError(f"input threads {alive} did not stop within {JOIN_TIMEOUT_S} s")


class EmptyStream:
    """The test stream of a source without a test DB (or a rank with no test samples)."""

    def __iter__(self) -> EmptyStream:
        return self

    def __next__(self) -> HostBatch:
        raise StopIteration

    def close(self) -> None:
        pass
