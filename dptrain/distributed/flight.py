"""Flight record: the last collectives each rank entered, and who never arrived when one hangs.

Every collective a rank enters (the reducer's buckets and statistics, the blocking ones of
displays, tests, snapshots and startup) goes into a fixed ring of :data:`RING_SIZE`
records: operation, what it carried (bucket index), iteration, bytes, time entered and time
finished. The ring is preallocated numpy arrays written in place: no allocation per step.

Each rank also publishes its progress, the sequence number of the last collective it
entered and a heartbeat count, to a key-value store every :data:`PUBLISH_S` seconds from a
daemon thread (the training thread never waits on the store). torchrun's agent store is used when the
solvers run under torchrun (it outlives any solver); otherwise rank 0 serves one.

When a collective fails or times out (``RankFailure``), the rank reads every rank's progress
twice, :data:`SILENT_AFTER_S` apart: a rank whose heartbeat did not move is stopped or dead
(its last published collective may be stale), and a rank behind this one never entered the
collective this one waits in. When some rank is silent, the silent ranks are the ones
named ("never arrived" when behind, "stopped answering" when their last post shows they had
entered it); live ranks behind this one are only waiting themselves (async buckets complete
at different times on different ranks) and are reported as such. With no silent rank, every
rank behind this one is named. A rank explaining its own failure posts that it is failing,
so its exit right after is not taken for silence. Heartbeats are counts, not clock times,
so hosts with skewed clocks cannot fool it. It writes
``run_dir/flight.rank<r>.json`` and exits with one line naming the collective and, where the
store could tell, the ranks that never arrived.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

log = logging.getLogger(__name__)

RING_SIZE = 64
"""Collectives kept per rank: a few iterations' worth of buckets."""
PUBLISH_S = 0.5
"""How often a rank's progress goes to the store."""
SILENT_AFTER_S = 2 * PUBLISH_S
"""A rank whose heartbeat did not move for this long at failure time is stopped or dead."""
STORE_TIMEOUT_S = 5.0
"""A store read at failure time gives up after this long (the store's host may be the dead rank)."""
OPS = ("allreduce", "allreduce_async", "allgather", "broadcast", "barrier", "broadcast_module", "reduce_scatter_async",
       "all_gather_async")


class FlightRecorder:
    """This rank's ring of collectives and its progress in the store (see the module docstring)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.iteration = 0
        """The trainer's iteration, recorded with each collective."""
        self.seq = 0
        """Collectives entered so far; the last one's sequence number."""
        self._op = np.zeros(RING_SIZE, dtype=np.int8)
        self._tag = np.full(RING_SIZE, -1, dtype=np.int32)
        self._iter = np.zeros(RING_SIZE, dtype=np.int64)
        self._bytes = np.zeros(RING_SIZE, dtype=np.int64)
        self._seq = np.zeros(RING_SIZE, dtype=np.int64)
        self._entered = np.zeros(RING_SIZE, dtype=np.float64)
        self._finished = np.zeros(RING_SIZE, dtype=np.float64)
        self._lock = threading.Lock()
        self._store: Any = None
        self._prefix = ""
        self._beat = 0
        self._failing = 0
        """1 once this rank is explaining a failure: it may exit soon, and its silence then means nothing."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ recording

    def enter(self, op: str, *, tag: int = -1, nbytes: int = 0) -> int:
        """Record entering collective ``op`` (``tag``: bucket index); returns its sequence number."""
        with self._lock:
            self.seq += 1
            i = self.seq % RING_SIZE
            self._op[i] = OPS.index(op)
            self._tag[i], self._iter[i], self._bytes[i], self._seq[i] = tag, self.iteration, nbytes, self.seq
            self._entered[i], self._finished[i] = time.time(), 0.0
            return self.seq

    def finish(self, seq: int) -> None:
        """Collective ``seq`` has completed on this rank (a no-op once the ring has moved past it)."""
        i = seq % RING_SIZE
        with self._lock:
            if self._seq[i] == seq:
                self._finished[i] = time.time()

    def records(self) -> list[dict[str, Any]]:
        """The ring, oldest first, as JSON-ready dicts."""
        with self._lock:
            order = np.argsort(self._seq)
            return [{"seq": int(self._seq[i]), "op": OPS[self._op[i]], "bucket": int(self._tag[i]),
                     "iteration": int(self._iter[i]), "bytes": int(self._bytes[i]),
                     "entered": float(self._entered[i]), "finished": float(self._finished[i]) or None}
                    for i in order if self._seq[i] > 0]

    def waiting_in(self) -> dict[str, Any] | None:
        """The oldest collective entered and not finished: the one this rank is stuck in."""
        pending = [r for r in self.records() if r["finished"] is None]
        return pending[0] if pending else None

    # ------------------------------------------------------------------ progress store

    def attach_store(self, store: Any, prefix: str) -> None:
        """Publish progress to ``store`` under ``prefix`` from a daemon thread."""
        self._store, self._prefix = store, prefix
        self._thread = threading.Thread(target=self._publish_loop, name=f"dptrain-flight-{self.rank}", daemon=True)
        self._thread.start()

    def _publish_loop(self) -> None:
        while not self._stop.wait(PUBLISH_S):
            self.publish()

    def publish(self) -> None:
        """Post (last collective entered, iteration, heartbeat) for this rank; the heartbeat
        moves on every call, so the others can tell a live rank from a stopped one."""
        if self._store is None:
            return
        self._beat += 1
        try:
            self._store.set(f"{self._prefix}progress/{self.rank}",
                            f"{self.seq} {self.iteration} {self._beat} {self._failing}")
        except Exception as e:  # noqa: BLE001 - a store gone away must not stop training; the failure path says so
            log.debug("rank %d: publishing progress failed: %s", self.rank, e)

    def progress(self) -> dict[int, tuple[int, int, int, int]] | None:
        """Every rank's (last collective entered, iteration, heartbeat, failing) from the store; None
        if it does not answer."""
        if self._store is None:
            return None
        self.publish()
        out = {}
        try:
            for r in range(self.world_size):
                key = f"{self._prefix}progress/{r}"
                if self._store.check([key]):
                    seq, it, beat, failing = self._store.get(key).decode().split()
                    out[r] = (int(seq), int(it), int(beat), int(failing))
        except Exception as e:  # noqa: BLE001 - its host may be the rank that died
            log.debug("rank %d: reading progress failed: %s", self.rank, e)
            return None
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * PUBLISH_S)

    # ------------------------------------------------------------------ failure

    def explain(self, run_dir: Path, reason: str) -> str:
        """Write ``flight.rank<r>.json`` and return the line that names the collective this rank
        waits in and the ranks that never arrived (as far as the store can tell)."""
        waiting = self.waiting_in()
        self._failing = 1
        self.publish()
        first = self.progress()
        time.sleep(SILENT_AFTER_S)  # every live rank's publisher has posted at least once more by then
        progress = self.progress()
        silent: list[int] = []
        if first is not None and progress is not None:
            silent = [r for r in range(self.world_size) if r != self.rank and r in first and r in progress
                      and progress[r][2] == first[r][2] and not progress[r][3]]  # a failing rank may have exited
        behind: list[int] = []
        if progress is not None and waiting is not None:
            behind = [r for r in range(self.world_size)
                      if r != self.rank and progress.get(r, (0, 0, 0, 0))[0] < waiting["seq"]]
        # silent ranks are the culprits when there are any (behind or not: a stopped rank's last post may be
        # stale); otherwise every rank behind this one
        culprits = sorted(set(silent) | {r for r in behind if r not in progress}) if silent else behind
        record = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "reason": reason,
                  "waiting_in": waiting, "progress": {str(r): v for r, v in (progress or {}).items()},
                  "store_answered": progress is not None, "silent": silent, "never_arrived": culprits,
                  "collectives": self.records()}
        path = run_dir / f"flight.rank{self.rank}.json"
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, path)
            where = f"flight record {path}"
        except OSError as e:
            where = f"no flight record ({e.strerror or e})"
        if waiting is None:
            what = "a collective"
        else:
            bucket = f" of bucket {waiting['bucket']}" if waiting["bucket"] >= 0 else ""
            what = (f"{waiting['op']}{bucket} (#{waiting['seq']}, iteration {waiting['iteration']}, "
                    f"{waiting['bytes']} B, {time.time() - waiting['entered']:.0f} s ago)")
        if culprits:
            def state(r: int) -> str:
                if r not in progress:
                    return f"rank {r} never reported"
                return f"rank {r} last entered #{progress[r][0]}" + (" and is silent" if r in silent else "")
            last = "; ".join(state(r) for r in culprits)
            waiting_too = [r for r in behind if r not in culprits]
            if waiting_too:
                last += "; " + "; ".join(f"rank {r} is alive and waiting at #{progress[r][0]}" for r in waiting_too)
            # a silent rank that had entered this collective stopped inside it
            verb = "never arrived" if all(r in behind for r in culprits) else "stopped answering"
            who = f"rank {', '.join(map(str, culprits))} {verb} ({last})"
        elif progress is None:
            who = "the progress store did not answer (its host may be the rank that failed)"
        else:
            who = "every rank had entered it (the collective itself failed)"
        return f"rank {self.rank}: waiting in {what}: {who}; {where}"


def progress_store(rank: int, comm_broadcast: Any) -> tuple[Any, str]:
    """A store every rank can reach, and a key prefix for this run.

    Under torchrun: a client of torchrun's agent store (it outlives every solver). Otherwise:
    rank 0 serves a TCPStore on a free port and tells the others where (``comm_broadcast``,
    a collective at startup).
    """
    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in os.environ:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
        return store, f"dptrain/flight/{run}/"
    server = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timeout) if rank == 0 else None
    host, port = comm_broadcast((socket.gethostname(), server.port) if server is not None else None)
    store = server if server is not None else dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return store, f"dptrain/flight/{run}/"
