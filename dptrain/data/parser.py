"""Parser threads: read this solver's records by key seek and parse them into Datums.

Each parser owns one read transaction and cursor (py-lmdb releases the GIL inside every
LMDB call) and reads only the positions the queue set routes to it, by index, never by
stepping through other solvers' records. Parsing a Datum is one C call (upb), so a
parser stays light and leaves the GIL to the transformers.

A bad record (missing key, unparsable bytes, label out of range) is not raised here: it
travels to the transformer as a :class:`ParsedRecord` with ``error`` set, and the
transformer applies the bad-record policy (see ``transformer.run_transformer``).
"""
from __future__ import annotations

import threading

from dptrain.data.datum import parse_datum
from dptrain.data.stream import ParsedRecord, RecordHandle, StreamParts
from dptrain.errors import DataError


def parse_record(handle: RecordHandle, *, pos: int, epoch: int, index: int,
                 num_classes: int, rank: int) -> ParsedRecord:
    """Read and parse record ``index``; a bad record comes back with ``error`` set."""
    key = b""
    try:
        key, value = handle.get(index)
        d = parse_datum(value)
        if not 0 <= d.label < num_classes:
            raise DataError(f"label {d.label} is outside [0, {num_classes}); "
                            f"fix the DB or set model.num_classes")
        return ParsedRecord(pos, epoch, index, key, d)
    except DataError as e:
        return ParsedRecord(pos, epoch, index, key or f"#{index}".encode(), None,
                            e.located(path=handle.path, key=key or f"#{index}", rank=rank))


def run_parser(p: int, parts: StreamParts, stop: threading.Event) -> None:
    """Parser thread p: read positions p, p+P, ... and queue them for their transformers."""
    handle = parts.reader.handle()
    try:
        for pos in parts.queues.parser_positions(p, parts.sequence.length):
            epoch, index = parts.sequence.index(pos)
            try:
                rec = parse_record(handle, pos=pos, epoch=epoch, index=index,
                                   num_classes=parts.num_classes, rank=parts.rank)
            except Exception as e:  # a broken invariant, not a bad record: stop the stream
                raise RuntimeError(f"rank {parts.rank}: parser {p} failed on record #{index} "
                                   f"of {parts.reader.path!r}: {e!r}") from e
            if not parts.queues.put(pos, rec, stop):
                return
    finally:
        handle.close()
