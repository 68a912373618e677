"""Parser threads: read this solver's records by key seek, a chunk at a time.

Each parser owns one read transaction and cursor (py-lmdb releases the GIL inside every
LMDB call) and reads only the chunks the queue set routes to it, by index, never by
stepping through other solvers' records. The transformer parses the Datums (natively, in
the same call that renders them), so a parser stays light and leaves the GIL to others.

A record that cannot be read (missing key, damaged page) is not raised here: it travels
to the transformer in :attr:`ParsedChunk.errors`, and the transformer applies the
bad-record policy (see ``transformer.run_transformer``). :func:`parse_record` is the
Python path's read-and-parse of one record (substitutes, and records the native path leaves).
"""
from __future__ import annotations

import threading

from dptrain.data.datum import parse_datum
from dptrain.data.stream import ParsedChunk, ParsedRecord, RecordHandle, StreamParts
from dptrain.errors import DataError


def parse_value(key: bytes, value: bytes, *, pos: int, epoch: int, index: int, num_classes: int, path: str,
                rank: int) -> ParsedRecord:
    """Parse a read record; a bad one comes back with ``error`` set (located at its key)."""
    try:
        d = parse_datum(value)
        if not 0 <= d.label < num_classes:
            raise DataError(f"label {d.label} is outside [0, {num_classes}); "
                            f"fix the DB or set model.num_classes")
        return ParsedRecord(pos, epoch, index, key, d)
    except DataError as e:
        return ParsedRecord(pos, epoch, index, key, None, e.located(path=path, key=key, rank=rank))


def parse_record(handle: RecordHandle, *, pos: int, epoch: int, index: int,
                 num_classes: int, rank: int) -> ParsedRecord:
    """Read and parse record ``index``; a bad record comes back with ``error`` set."""
    try:
        key, value = handle.get(index)
    except DataError as e:
        key = f"#{index}".encode()
        return ParsedRecord(pos, epoch, index, key, None, e.located(path=handle.path, key=key, rank=rank))
    return parse_value(key, value, pos=pos, epoch=epoch, index=index, num_classes=num_classes, path=handle.path,
                       rank=rank)


def run_parser(p: int, parts: StreamParts, stop: threading.Event) -> None:
    """Parser thread p: read chunks p, p+P, ... and queue them for their transformers."""
    handle = parts.reader.handle()
    try:
        for c in parts.queues.parser_positions(p, parts.num_chunks):
            try:
                epoch, indices = parts.chunk_records(c)
                keys, values, errors = handle.get_many(indices.tolist())
            except Exception as e:  # a broken invariant, not a bad record: stop the stream
                raise RuntimeError(f"rank {parts.rank}: parser {p} failed on chunk {c} "
                                   f"of {parts.reader.path!r}: {e!r}") from e
            if not parts.queues.put(c, ParsedChunk(c, epoch, indices, keys, values, errors), stop):
                return
    finally:
        handle.close()
