"""One solver's queue set: P parsers x T transformers bounded FIFO queues (NVCaffe's layout).

Transformer t owns queues ``t*P ... t*P + P - 1``, one per parser, so a parser never
shares a queue with another parser and a transformer never competes for a queue with
another transformer. With 2 solvers x 3 parsers x 2 transformers that is 12 queues and 6
DB cursors, as on NVCaffe's slide.

Routing is a pure function of the sample's position ``pos`` in the solver's stream:

* parser ``pos % P`` reads it (parser p reads positions p, p+P, p+2P, ...);
* transformer ``(pos // P) % T`` decodes it, taking it from queue (t, pos % P).

So parser p hands its k-th record to transformer ``k % T``, and transformer t takes
blocks of P consecutive positions in turn from queues (t, 0), ..., (t, P-1). Every queue
carries increasing positions, so FIFO order is all the synchronisation the routing
needs, and the smallest unfinished position can always make progress (no deadlock).
"""
from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

T_co = TypeVar("T_co")

POLL_S = 0.05
"""How often a blocked put/get wakes up to look at the stop event; bounds shutdown latency."""


class QueueSet(Generic[T_co]):
    """P x T bounded queues with the routing above."""

    def __init__(self, parsers: int, transformers: int, capacity: int) -> None:
        assert parsers > 0 and transformers > 0 and capacity > 0, (
            f"bad queue set {parsers}x{transformers} capacity {capacity}")
        self.parsers, self.transformers = parsers, transformers
        self._queues: list[queue.Queue[T_co]] = [
            queue.Queue(maxsize=capacity) for _ in range(parsers * transformers)]

    def __len__(self) -> int:
        return len(self._queues)

    def transformer_of(self, pos: int) -> int:
        return (pos // self.parsers) % self.transformers

    def parser_positions(self, p: int, length: int | None) -> Iterator[int]:
        """Positions parser p reads, in order; forever when ``length`` is None."""
        positions = itertools.count(p, self.parsers)
        return positions if length is None else iter(range(p, length, self.parsers))

    def transformer_positions(self, t: int, length: int | None) -> Iterator[int]:
        """Positions transformer t decodes, in order: blocks t, t+T, t+2T, ... of P positions."""
        for block in itertools.count(t, self.transformers):
            for pos in range(block * self.parsers, (block + 1) * self.parsers):
                if length is not None and pos >= length:
                    return
                yield pos

    def put(self, pos: int, item: T_co, stop: threading.Event) -> bool:
        """Parser side: queue ``item`` for the transformer of ``pos``; False if stopped first."""
        q = self._queues[self.transformer_of(pos) * self.parsers + pos % self.parsers]
        while not stop.is_set():
            try:
                q.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self, pos: int, stop: threading.Event) -> T_co | None:
        """Transformer side: the item for ``pos`` from its parser's queue; None if stopped first."""
        q = self._queues[self.transformer_of(pos) * self.parsers + pos % self.parsers]
        while not stop.is_set():
            try:
                return q.get(timeout=POLL_S)
            except queue.Empty:
                continue
        return None
