"""Renderer threads (NVCaffe's "transformers", ``data.transformer_threads``): take chunks of records from
their queues, parse them and render them into the batch ring.

Renderer t renders the chunks :class:`~dptrain.data.loader.queues.QueueSet` routes to it
straight into their rows of the ring slot: in one native call per chunk
(:mod:`dptrain.data.transforms.native`: Datum parse, geometry, decode, resample, mirror, label
and crop window, without the GIL), and record by record in Python for what that call leaves
and when it is off (:mod:`dptrain.data.transforms.geometry`, :mod:`dptrain.data.transforms.render`). A bad record
is handled here (:func:`_fill_row`): counted against ``data.max_bad_records`` and replaced
by a substitute in training, dropped in a test stream.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from dptrain.data.base import DROPPED_LABEL
from dptrain.data.caffe.datum import parse_datum
from dptrain.data.loader.stream import ParsedChunk, ParsedRecord, RecordHandle, StreamParts
from dptrain.data.transforms import native as native_render
from dptrain.data.transforms.geometry import SampleRng
from dptrain.data.transforms.render import transform_datum
from dptrain.errors import DataError


def parse_value(key: bytes, value: bytes, *, pos: int, epoch: int, index: int, num_classes: int, path: str,
                rank: int, kind: str = "LMDB") -> ParsedRecord:
    """Parse a record a reader read (the Python path: substitutes, and records the native path
    leaves); a bad one comes back with ``error`` set (located at its key)."""
    try:
        d = parse_datum(value)
        if not 0 <= d.label < num_classes:
            raise DataError(f"label {d.label} is outside [0, {num_classes}); "
                            f"fix the data or set model.num_classes")
        return ParsedRecord(pos, epoch, index, key, d)
    except DataError as e:
        return ParsedRecord(pos, epoch, index, key, None, e.located(path=path, key=key, rank=rank, kind=kind))


def parse_record(handle: RecordHandle, *, pos: int, epoch: int, index: int,
                 num_classes: int, rank: int) -> ParsedRecord:
    """Read and parse record ``index``; a bad record comes back with ``error`` set."""
    key, value, error = handle.get(index)
    if error is not None:
        return ParsedRecord(pos, epoch, index, key, None,
                            error.located(path=handle.path, key=key, rank=rank, kind=handle.kind))
    return parse_value(key, value, pos=pos, epoch=epoch, index=index, num_classes=num_classes, path=handle.path,
                       kind=handle.kind,
                       rank=rank)


def _fill_row(rec: ParsedRecord, dst: np.ndarray, window: np.ndarray | None, parts: StreamParts,
              subs: _SubstituteReader) -> tuple[int, int]:
    """Write record ``rec`` (or its substitutes) into ``dst`` (and its crop into ``window``); returns
    (label, bad records met).

    Bad-record policy: a record that fails (unparsable, undecodable, label out of range,
    too small, bomb) counts against ``data.max_bad_records`` (distinct records, see
    ``BadRecordBudget``, which stops the stream at the batch of the first record over the
    limit, in stream order) and is replaced by the record
    at the next position of this solver's epoch shard (wrapping), then the one after, until
    one works. The choice depends only on the position, so it is the same for every P, T
    and thread timing; the substitute gets its own crop/flip (``attempt`` is in its RNG
    key) and overwrites the whole row, so no stale pixels survive.
    """
    bad = 0
    if parts.drop_bad and (rec.error is not None or rec.datum is None):  # the test's bad records: drop, never substitute
        return _drop_row(rec, dst, window, parts)
    first: DataError | None = None
    for attempt in range(parts.sequence.span):
        if attempt:
            rec = subs.read(rec.pos, attempt)
        if rec.error is None and rec.datum is not None:
            try:
                transform_datum(rec.datum, parts.stages, SampleRng(parts.seed, rec.epoch, rec.index, attempt),
                                parts.channels, dst, parts.render, window)
                return rec.datum.label, bad
            except DataError as e:
                rec.error = e.located(path=parts.reader.path, key=rec.key, rank=parts.rank, kind=parts.reader.kind)
                if parts.drop_bad:
                    return _drop_row(rec, dst, window, parts)
        assert rec.error is not None, "a record without a datum must carry its error"
        first = first or rec.error
        bad += 1
        parts.budget.spend(rec.index, rec.error, rec.pos, attempt)
    why = f"; the first, {first.key!r}: {first.reason}" if first is not None else ""
    raise DataError(f"all {parts.sequence.span} records of this solver's shard are bad{why}",
                    path=parts.reader.path, rank=parts.rank, kind=parts.reader.kind)


def _drop_row(rec: ParsedRecord, dst: np.ndarray, window: np.ndarray | None, parts: StreamParts) -> tuple[int, int]:
    """A bad test record under data.max_bad_records: an empty row that no score counts."""
    assert rec.error is not None, "a record without a datum must carry its error"
    parts.budget.spend(rec.index, rec.error, rec.pos)
    dst[...] = 0
    if window is not None:
        window[:] = 0
    return DROPPED_LABEL, 1


class _SubstituteReader:
    """A renderer's own read handle, opened only when a substitute is needed."""

    def __init__(self, parts: StreamParts) -> None:
        self._parts = parts
        self._handle: RecordHandle | None = None

    def read(self, pos: int, attempt: int) -> ParsedRecord:
        p = self._parts
        if self._handle is None:
            self._handle = p.reader.handle()
        epoch, index = p.sequence.index(pos, attempt)
        return parse_record(self._handle, pos=pos, epoch=epoch, index=index, num_classes=p.num_classes, rank=p.rank)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()


_PIN_LOCK = threading.Lock()


def single_threaded_torch_in_this_thread() -> None:
    """Run torch ops issued by the calling thread on that thread alone; leave every other thread as it was.

    Each renderer thread already has a core's worth of work. Left at the default, every
    resize would also start an OpenMP team as wide as the machine, whose spinning workers
    take the cores from the other renderers, so each image costs more CPU time
    (measurements: docs/measurements.md#renderer-threads).
    ``torch.set_num_threads`` sets the calling thread's team size but also the default that
    threads started later inherit; a short-lived helper thread puts that default back, so the
    trainer's threads keep theirs.
    """
    with _PIN_LOCK:
        default = torch.get_num_threads()  # also initialises this thread's size from the default
        torch.set_num_threads(1)
        helper = threading.Thread(target=torch.set_num_threads, args=(default,), name="dptrain-torch-threads")
        helper.start()
        helper.join()


def _python_rows(chunk: ParsedChunk, rows: list[int], row0: int, slot: tuple[np.ndarray, np.ndarray, np.ndarray],
                 parts: StreamParts, subs: _SubstituteReader) -> int:
    """Render ``rows`` of ``chunk`` (row numbers within it) with the Python path; the bad records met."""
    images, labels, windows = slot
    bad = 0
    for i in rows:
        row = row0 + i
        pos = chunk.c // parts.chunks_per_batch * parts.batch_size + row
        index = int(chunk.indices[i])
        error = chunk.errors.get(i)
        if error is not None:
            rec = ParsedRecord(pos, chunk.epoch, index, chunk.keys[i], None,
                               error.located(path=parts.reader.path, key=chunk.keys[i], rank=parts.rank,
                                             kind=parts.reader.kind))
        else:
            rec = parse_value(chunk.keys[i], chunk.values[i], pos=pos, epoch=chunk.epoch, index=index,
                              num_classes=parts.num_classes, path=parts.reader.path, rank=parts.rank,
                              kind=parts.reader.kind)
        labels[row], n_bad = _fill_row(rec, images[row], windows[row] if parts.windows else None, parts, subs)
        bad += n_bad
    return bad


def run_renderer(t: int, parts: StreamParts, stop: threading.Event) -> None:
    """Renderer thread t: take its chunks from its P queues, render them into the ring."""
    single_threaded_torch_in_this_thread()
    subs = _SubstituteReader(parts)
    lib = native_render.library() if parts.native else None
    renderer = None if lib is None else native_render.Renderer(
        lib, stages=parts.stages, channels=parts.channels, sample_shape=parts.ring.images.shape[2:],
        num_classes=parts.num_classes, seed=parts.seed, draft=parts.render.draft, windows=parts.windows,
        max_rows=parts.chunk_rows)
    try:
        for c in parts.queues.renderer_positions(t, parts.num_chunks):
            chunk = parts.queues.get(c, stop)
            if chunk is None:
                return
            assert chunk.c == c, f"queue order broken: expected chunk {c}, got {chunk.c}"
            b, row0, n = parts.chunk_span(c)
            slot = parts.ring.acquire(b, stop)
            if slot is None:
                return
            images, labels, windows = slot
            try:
                if renderer is None:
                    left = list(range(n))
                else:
                    end = row0 + n
                    renderer.render(chunk.values, chunk.epoch, chunk.indices, images[row0:end], labels[row0:end],
                                    windows[row0:end] if parts.windows else None)
                    left = np.flatnonzero(renderer.status[:n]).tolist()
                bad = _python_rows(chunk, left, row0, slot, parts, subs) if left else 0
            except DataError:
                raise
            except Exception as e:  # a broken invariant, not a bad record: stop the stream
                raise RuntimeError(f"rank {parts.rank}: renderer {t} failed on chunk {c} (records "
                                   f"{chunk.indices.tolist()}) of {parts.reader.path!r}: {e!r}") from e
            parts.ring.complete(b, parts.batch_rows(b), n, bad)
    finally:
        subs.close()
