"""One solver's threaded stream: P reader and T renderer threads filling a batch ring, and its consumer.

The threads share one :class:`~dptrain.data.loader.stream.StreamParts` (see
:mod:`dptrain.data.loader.stream` for which record lands in which batch row and ring slot).

Slot reuse: the consumer hands each batch back with ``HostBatch.release(event)``. With a
CUDA event (the batch's host-to-device copy), the first renderer that writes the slot
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
import threading
from collections.abc import Callable

import torch

from dptrain.data.base import HostBatch
from dptrain.data.loader.queues import POLL_S
from dptrain.data.loader.readers import run_reader
from dptrain.data.loader.renderers import run_renderer
from dptrain.data.loader.stream import StreamParts

JOIN_TIMEOUT_S = 30.0
"""close() waits this long per thread; every blocking wait in a thread polls the stop event every POLL_S."""


class PipelineStream:
    """Iterator of HostBatch over one sequence, fed by P reader and T renderer threads."""

    def __init__(self, parts: StreamParts, *, readers: int, renderers: int) -> None:
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
            *((f"dptrain-reader-r{parts.rank}-{p}", run_reader, p) for p in range(readers)),
            *((f"dptrain-renderer-r{parts.rank}-{t}", run_renderer, t) for t in range(renderers)),
        ]
        self._threads = [threading.Thread(target=self._guard, args=(fn, i), name=name, daemon=True)
                         for name, fn, i in workers]
        self._renderers = self._threads[readers:]
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
                if not any(th.is_alive() for th in self._renderers):
                    raise RuntimeError(f"rank {self._parts.rank}: renderer threads (data.transformer_threads) exited before batch {b} "
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
