"""One solver's queue set: P readers x T renderers bounded FIFO queues (NVCaffe's layout).

Renderer t owns queues ``t*P ... t*P + P - 1``, one per reader, so a reader never
shares a queue with another reader and a renderer never competes for a queue with
another renderer. With 2 solvers x 3 readers x 2 renderers that is 12 queues and 6
DB cursors, as on NVCaffe's slide.

Routing is a pure function of the sample's position ``pos`` in the solver's stream:

* reader ``pos % P`` reads it (reader p reads positions p, p+P, p+2P, ...);
* renderer ``(pos // P) % T`` decodes it, taking it from queue (t, pos % P).

So reader p hands its k-th record to renderer ``k % T``, and renderer t takes
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

    def __init__(self, readers: int, renderers: int, capacity: int) -> None:
        assert readers > 0 and renderers > 0 and capacity > 0, (
            f"bad queue set {readers}x{renderers} capacity {capacity}")
        self.readers, self.renderers = readers, renderers
        self._queues: list[queue.Queue[T_co]] = [
            queue.Queue(maxsize=capacity) for _ in range(readers * renderers)]

    def __len__(self) -> int:
        return len(self._queues)

    def renderer_of(self, pos: int) -> int:
        return (pos // self.readers) % self.renderers

    def reader_positions(self, p: int, length: int | None) -> Iterator[int]:
        """Positions reader p reads, in order; forever when ``length`` is None."""
        positions = itertools.count(p, self.readers)
        return positions if length is None else iter(range(p, length, self.readers))

    def renderer_positions(self, t: int, length: int | None) -> Iterator[int]:
        """Positions renderer t decodes, in order: blocks t, t+T, t+2T, ... of P positions."""
        for block in itertools.count(t, self.renderers):
            for pos in range(block * self.readers, (block + 1) * self.readers):
                if length is not None and pos >= length:
                    return
                yield pos

    def put(self, pos: int, item: T_co, stop: threading.Event) -> bool:
        """Reader side: queue ``item`` for the renderer of ``pos``; False if stopped first."""
        q = self._queues[self.renderer_of(pos) * self.readers + pos % self.readers]
        while not stop.is_set():
            try:
                q.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self, pos: int, stop: threading.Event) -> T_co | None:
        """Renderer side: the item for ``pos`` from its reader's queue; None if stopped first."""
        q = self._queues[self.renderer_of(pos) * self.readers + pos % self.readers]
        while not stop.is_set():
            try:
                return q.get(timeout=POLL_S)
            except queue.Empty:
                continue
        return None
