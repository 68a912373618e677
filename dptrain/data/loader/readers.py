"""Reader threads (NVCaffe's "parsers", ``data.parser_threads``): read this solver's records, a chunk at a time.

Each reader owns one read handle (an LMDB read transaction and cursor: py-lmdb releases the
GIL inside every LMDB call; or a file reader) and reads only the chunks the queue set routes
to it, by index, never by stepping through other solvers' records. It does not parse: the
renderer threads parse the records (natively, in the same call that renders them), so a
reader stays light and leaves the GIL to others.

A record that cannot be read (missing key, damaged page, unreadable file) is not raised
here: it travels to the renderer in :attr:`ParsedChunk.errors`, and the renderer applies
the bad-record policy (see ``renderers.run_renderer``).
"""
from __future__ import annotations

import threading

from dptrain.data.loader.stream import ParsedChunk, StreamParts


def run_reader(p: int, parts: StreamParts, stop: threading.Event) -> None:
    """Reader thread p: read chunks p, p+P, ... and queue them for their renderers."""
    handle = parts.reader.handle()
    try:
        for c in parts.queues.reader_positions(p, parts.num_chunks):
            try:
                epoch, indices = parts.chunk_records(c)
                keys, values, errors = handle.get_many(indices.tolist())
            except Exception as e:  # a broken invariant, not a bad record: stop the stream
                raise RuntimeError(f"rank {parts.rank}: reader {p} failed on chunk {c} "
                                   f"of {parts.reader.path!r}: {e!r}") from e
            if not parts.queues.put(c, ParsedChunk(c, epoch, indices, keys, values, errors), stop):
                return
    finally:
        handle.close()
