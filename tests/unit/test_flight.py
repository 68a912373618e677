"""The flight record names the rank that stopped, not the live ranks that are merely waiting."""
from __future__ import annotations

import json

import pytest

from dptrain.distributed import flight
from dptrain.distributed.flight import FlightRecorder


class FakeStore:
    """A dict store; ranks listed in ``live`` publish again (their heartbeat moves) on every read."""

    def __init__(self, live: dict[int, int] | None = None) -> None:
        self.data: dict[str, bytes] = {}
        self.live = live or {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        rank = int(key.rsplit("/", 1)[1])
        if rank in self.live:
            seq, it, beat, failing = self.data[key].decode().split()
            self.data[key] = f"{seq} {it} {int(beat) + 1} {failing}".encode()
        return self.data[key]


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(flight, "SILENT_AFTER_S", 0.01)


def _recorder(store: FakeStore, seqs: int) -> FlightRecorder:
    rec = FlightRecorder(0, 3)
    rec._store, rec._prefix = store, "p/"  # no publisher thread: the test publishes by hand
    for i in range(seqs):
        rec.iteration = i // 4
        s = rec.enter("allreduce_async", tag=i % 4, nbytes=1024)
        if i < seqs - 1:
            rec.finish(s)
    return rec


def test_a_stopped_rank_is_named_and_a_live_rank_behind_is_only_waiting(tmp_path):
    """The CI case: rank 2 stopped with a stale #67 published (it entered more before it stopped);
    rank 1 is alive but still completing #71 while rank 0 waits in #72."""
    store = FakeStore(live={1: 71})
    store.set("p/progress/1", "71 17 5 0")
    store.set("p/progress/2", "67 16 9 0")
    rec = _recorder(store, 72)
    line = rec.explain(tmp_path, "timed out")
    assert line.startswith("rank 0: waiting in allreduce_async of bucket 3 (#72, iteration 17, 1024 B")
    assert "rank 2 never arrived (rank 2 last entered #67 and is silent; rank 1 is alive and waiting at #71)" in line
    record = json.loads((tmp_path / "flight.rank0.json").read_text())
    assert record["never_arrived"] == [2] and record["silent"] == [2] and record["waiting_in"]["seq"] == 72
    assert [c["seq"] for c in record["collectives"]] == list(range(72 - 63, 73))  # the ring keeps the last 64


def test_without_a_silent_rank_every_rank_behind_is_named(tmp_path):
    """A rank hung inside Python still heartbeats from its thread: then being behind is all there is."""
    store = FakeStore(live={1: 70, 2: 72})
    store.set("p/progress/1", "70 17 1 0")
    store.set("p/progress/2", "72 17 1 0")
    line = _recorder(store, 72).explain(tmp_path, "timed out")
    assert "rank 1 never arrived (rank 1 last entered #70)" in line


def test_a_rank_that_stopped_inside_the_collective_and_one_that_exited_after_its_own_failure(tmp_path):
    """Rank 2 entered #72 and stopped there (silent, not behind); rank 1 saw the failure first, said
    so and exited (its heartbeat stopped too, but it had posted that it was failing)."""
    store = FakeStore()
    store.set("p/progress/1", "71 17 3 1")
    store.set("p/progress/2", "72 17 9 0")
    line = _recorder(store, 72).explain(tmp_path, "timed out")
    assert "rank 2 stopped answering (rank 2 last entered #72 and is silent; rank 1 is alive and waiting at #71)" \
        in line, line
    record = json.loads((tmp_path / "flight.rank0.json").read_text())
    assert record["silent"] == [2] and record["never_arrived"] == [2]
    assert store.data["p/progress/0"].decode().endswith(" 1")  # this rank posted that it is failing


def test_every_rank_arrived_and_a_store_that_does_not_answer(tmp_path):
    store = FakeStore(live={1: 72, 2: 72})
    store.set("p/progress/1", "72 17 1 0")
    store.set("p/progress/2", "73 18 1 0")
    assert "every rank had entered it (the collective itself failed)" in _recorder(store, 72).explain(tmp_path, "x")

    class Gone(FakeStore):
        def check(self, keys):
            raise ConnectionError("store host died")

    line = _recorder(Gone(), 72).explain(tmp_path, "x")
    assert "the progress store did not answer" in line
    assert json.loads((tmp_path / "flight.rank0.json").read_text())["store_answered"] is False
