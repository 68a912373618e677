"""Transformer threads: take parsed records from their queues, render them into the batch ring.

Transformer t decodes the positions :class:`~dptrain.data.queues.QueueSet` routes to it,
plans each sample's geometry (:mod:`dptrain.data.geometry`) and renders it
(:mod:`dptrain.data.render`) straight into its row of the ring slot. A bad record is
handled here (:func:`_fill_row`): counted against ``data.max_bad_records`` and replaced
by a substitute in training, dropped in a test stream.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from dptrain.data.base import DROPPED_LABEL
from dptrain.data.geometry import SampleRng
from dptrain.data.parser import parse_record
from dptrain.data.render import transform_datum
from dptrain.data.stream import ParsedRecord, RecordHandle, StreamParts
from dptrain.errors import DataError


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
    for attempt in range(parts.sequence.span):
        if attempt:
            rec = subs.read(rec.pos, attempt)
        if rec.error is None and rec.datum is not None:
            try:
                transform_datum(rec.datum, parts.stages, SampleRng(parts.seed, rec.epoch, rec.index, attempt),
                                parts.channels, dst, parts.render, window)
                return rec.datum.label, bad
            except DataError as e:
                rec.error = e.located(path=parts.reader.path, key=rec.key, rank=parts.rank)
                if parts.drop_bad:
                    return _drop_row(rec, dst, window, parts)
        assert rec.error is not None, "a record without a datum must carry its error"
        bad += 1
        parts.budget.spend(rec.index, rec.error, rec.pos, attempt)
    raise DataError(f"all {parts.sequence.span} records of this solver's shard are bad",
                    path=parts.reader.path, rank=parts.rank)


def _drop_row(rec: ParsedRecord, dst: np.ndarray, window: np.ndarray | None, parts: StreamParts) -> tuple[int, int]:
    """A bad test record under data.max_bad_records: an empty row that no score counts."""
    assert rec.error is not None, "a record without a datum must carry its error"
    parts.budget.spend(rec.index, rec.error, rec.pos)
    dst[...] = 0
    if window is not None:
        window[:] = 0
    return DROPPED_LABEL, 1


class _SubstituteReader:
    """A transformer's own read transaction, opened only when a substitute is needed."""

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

    Each transformer thread already has a core's worth of work. Left at the default, every
    resize would also start an OpenMP team as wide as the machine, whose spinning workers
    take the cores from the other transformers (measured on 2 cores with two transformers:
    2.7 CPU ms per image instead of 2.0). ``torch.set_num_threads`` sets the calling
    thread's team size but also the default that threads started later inherit; a
    short-lived helper thread puts that default back, so the trainer's threads keep theirs.
    """
    with _PIN_LOCK:
        default = torch.get_num_threads()  # also initialises this thread's size from the default
        torch.set_num_threads(1)
        helper = threading.Thread(target=torch.set_num_threads, args=(default,), name="dptrain-torch-threads")
        helper.start()
        helper.join()


def run_transformer(t: int, parts: StreamParts, stop: threading.Event) -> None:
    """Transformer thread t: take its positions from its P queues, decode into the ring."""
    single_threaded_torch_in_this_thread()
    subs = _SubstituteReader(parts)
    batch = parts.batch_size
    try:
        for pos in parts.queues.transformer_positions(t, parts.sequence.length):
            rec = parts.queues.get(pos, stop)
            if rec is None:
                return
            assert rec.pos == pos, f"queue order broken: expected position {pos}, got {rec.pos}"
            b, row = divmod(pos, batch)
            slot = parts.ring.acquire(b, stop)
            if slot is None:
                return
            images, labels, windows = slot
            try:
                labels[row], bad = _fill_row(rec, images[row], windows[row] if parts.windows else None, parts, subs)
            except DataError:
                raise
            except Exception as e:  # a broken invariant, not a bad record: stop the stream
                raise RuntimeError(f"rank {parts.rank}: transformer {t} failed on key "
                                   f"{rec.key.decode('utf-8', 'replace')!r} of {parts.reader.path!r}: {e!r}") from e
            parts.ring.complete(b, parts.batch_rows(b), bad)
    finally:
        subs.close()
