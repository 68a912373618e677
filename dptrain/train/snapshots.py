"""One solver's view of the run's snapshots: write one (collective), resume from one, or start over.

A snapshot is written by rank 0 after every rank contributed its state (RNG streams and
running loss are gathered), atomically (``dptrain.checkpoint.save_snapshot``). It is
refused when the fp32 masters are not finite, so a diverged run keeps its last good
snapshot, and one written while the run diverges is marked (``HealthWatch.suspect``) and
not offered to ``--resume auto``. A resume checks first that every rank starts at the same
iteration, and drops the metrics.jsonl lines a crashed run wrote past the snapshot.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dptrain.checkpoint import (
    StateParts,
    capture,
    check_same_start,
    load_snapshot,
    mark_diverging,
    restore,
    save_snapshot,
    snapshot_path,
    unmark_diverging,
)
from dptrain.observe.metrics import MetricsWriter
from dptrain.train.display import DisplayWindow
from dptrain.train.stops import HealthWatch

log = logging.getLogger(__name__)


class Snapshots:
    """Snapshots of ``run_dir`` for the solver that owns ``parts`` (module docstring)."""

    def __init__(self, parts: StateParts, run_dir: Path, config: dict[str, Any], *, health: HealthWatch,
                 metrics: MetricsWriter) -> None:
        self.parts, self.run_dir, self.config = parts, run_dir, config
        self.comm = parts.comm
        self.health, self.metrics = health, metrics
        self.saved_at: int | None = None
        """Iteration of the snapshot last written or resumed from: a stop there writes nothing new."""

    def save(self, iteration: int, data: dict[str, int], display: DisplayWindow) -> Path | None:
        """Write snapshot_iter_<iteration>.pt (rank 0, which gets the path); collective.
        ``data`` is the data position and setup (see :meth:`resume`)."""
        path = snapshot_path(self.run_dir, iteration)
        rank0 = self.comm.rank == 0
        if self.saved_at == iteration:
            return path if rank0 else None
        if not all(bool(torch.isfinite(g.master).all()) for g in self.parts.flat.groups):
            raise self.health.error(f"the weights are not finite at iteration {iteration}, so no snapshot was written")
        state = capture(self.parts, iteration=iteration, data=data, display=display.state(self.comm),
                        config=self.config)
        self.saved_at = iteration
        if not rank0:
            return None
        unmark_diverging(path)  # a marker left by the run that wrote this iteration before a resume
        save_snapshot(state, path)
        suspect = self.health.suspect(iteration)
        if suspect:
            mark_diverging(path, suspect)
            log.warning("snapshot %s (marked diverging)", path)
        else:
            log.info("snapshot %s", path)
        return path

    def resume(self, path: Path, data_at: Callable[[int], dict[str, int]]) -> dict[str, Any]:
        """Load snapshot ``path`` into the parts once every rank starts at its iteration; returns
        the snapshot (its ``iteration``, ``data`` and ``display`` are the caller's to apply).
        ``data_at(iteration)`` is this run's data setup there, compared with the snapshot's."""
        state = load_snapshot(path)
        iteration = int(state["iteration"])
        check_same_start(self.comm, iteration)
        restore(self.parts, state)
        self.saved_at = iteration
        self._warn_if_data_setup_changed(state["data"], data_at(iteration))
        dropped = self.metrics.drop_after(iteration)  # lines a crashed run wrote past its last snapshot
        log.info("resumed from %s at iteration %d%s", path, iteration,
                 f"; dropped {dropped} metrics.jsonl line(s) past it" if dropped else "")
        return state

    def start_over(self) -> None:
        """``--resume auto`` found no snapshot: start at 0, dropping what a crashed run logged."""
        check_same_start(self.comm, 0)
        dropped = self.metrics.drop_after(0)  # the crashed run's lines: this run writes them again
        log.info("--resume auto: no snapshot in %s; starting fresh%s", self.run_dir,
                 f" (dropped {dropped} metrics.jsonl line(s) of the earlier run)" if dropped else "")

    def _warn_if_data_setup_changed(self, then: dict[str, int], now: dict[str, int]) -> None:
        """Resuming with another batch size, world size, iter_size or seed is allowed, but the run
        no longer continues the interrupted one sample for sample: say so."""
        changed = [f"{k} {then[k]} -> {v}" for k, v in now.items() if k in then and then[k] != v]
        if changed and self.comm.rank == 0:
            log.warning("resuming with another data setup than the snapshot's (%s): training goes on, but the sample "
                        "order (and, for more ranks, the RNG streams) differ from an uninterrupted run",
                        ", ".join(changed))
