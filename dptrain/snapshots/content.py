"""What a snapshot holds, and one solver's part in writing, resuming and starting over.

**Content** (:func:`capture`, :func:`restore`): the model's buffers and fp32 masters, the
optimizer state, the reducer's bucket layout, every rank's RNG, the data position and the
running display state, assembled from the parts that own them (:class:`StateParts`).

**The protocol** (:class:`Snapshots`): a snapshot is written by rank 0 after every rank
contributed its state (RNG streams and running loss are gathered), atomically
(:func:`dptrain.snapshots.files.save_snapshot`). It is refused when the fp32 masters are not
finite, so a diverged run keeps its last good snapshot, and one written while the run diverges
is marked (the health watch's ``suspect``) and not offered to ``--resume auto``. A resume checks
first that every rank starts at the same iteration, and drops the metrics.jsonl lines a crashed
run wrote past the snapshot.
"""
from __future__ import annotations

import glob
import itertools
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from dptrain.distributed.comm import Communicator
from dptrain.errors import DivergenceError, SnapshotError
from dptrain.flat import FlatParams
from dptrain.observe.metrics import MetricsWriter
from dptrain.snapshots.files import (
    SNAPSHOT_FORMAT,
    list_snapshots,
    load_snapshot,
    mark_diverging,
    prune_snapshots,
    save_snapshot,
    snapshot_path,
    unmark_diverging,
)

log = logging.getLogger(__name__)


class Health(Protocol):
    """What the snapshots ask of the run's health watch (``dptrain.train.health.HealthWatch``)."""

    def suspect(self, iteration: int) -> str | None: ...
    def error(self, what: str) -> DivergenceError: ...


class Display(Protocol):
    """The running display state a snapshot carries (``dptrain.train.display.DisplayWindow``)."""

    def state(self, comm: Communicator) -> dict[str, Any]: ...


@dataclass
class StateParts:
    """What a snapshot captures, held by the parts that own it."""

    model: nn.Module
    flat: FlatParams
    optimizer: Any
    """``optimizer.MasterOptimizer`` (state_dict / load_state_dict)."""
    reducer: Any
    """``reducer.Reducer`` (state_dict / load_state_dict; its load may re-lay out ``flat``)."""
    comm: Communicator


def capture(parts: StateParts, *, iteration: int, data: dict[str, Any], display: dict[str, Any],
            config: dict[str, Any]) -> dict[str, Any]:
    """The snapshot content at ``iteration``; collective (every rank's RNG state is gathered).

    ``model`` holds every floating buffer and parameter in fp32, the parameters from their
    masters; ``display`` is the running display state, gathered per rank by the caller.
    """
    masters = parts.flat.master_state()  # first: a sharded run gathers them, so no other copy is held meanwhile
    model_state = {k: masters[k] if k in masters else v.detach().float().clone() if v.is_floating_point()
                   else v.detach().clone() for k, v in parts.model.state_dict().items()}  # in the model's order
    model_state.update(masters)
    rng = {"torch": torch.get_rng_state()}
    if parts.comm.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(parts.comm.device)
    return {
        "format": SNAPSHOT_FORMAT,
        "iteration": iteration,
        "model": model_state,
        "optimizer": parts.optimizer.state_dict(),
        "reducer": parts.reducer.state_dict(),
        "rng": parts.comm.allgather_object(rng),
        "data": data,
        "display": display,
        "config": config,
    }


def check_same_classes(then: list[str] | None, now: list[str] | None, what: str) -> None:
    """Refuse weights trained on an image folder whose class folders were others than the data's now:
    labels follow the sorted class names, so a class added, removed or renamed shifts the labels after
    it, and training or scoring would go on with every such label silently wrong. ``None``: a source
    without class names (an LMDB, a list file) or a snapshot written before they were recorded."""
    if then is None or now is None or list(then) == list(now):
        return
    gone, new = [c for c in then if c not in now], [c for c in now if c not in then]
    diff = "; ".join(x for x in (f"gone: {gone[:5]}" if gone else "", f"new: {new[:5]}" if new else "") if x) or \
        "the same names in another order"
    raise SnapshotError(f"{what} was trained on {len(then)} image-folder classes and data.path has {len(now)} "
                        f"({diff}); labels follow the sorted class folders, so they would not match: restore the "
                        f"class folders, or start a new run from its weights with --weights PATH --weights-skip for "
                        f"the classifier")


def restore(parts: StateParts, state: dict[str, Any], what: str = "the snapshot") -> None:
    """Load a snapshot into the parts: buffers, masters (weights re-derived), optimizer and
    scaler state, the reducer's layout, and this rank's RNG (rank 0's for a rank the
    snapshot did not have). The data position and display state are the caller's."""
    rank = parts.comm.rank
    params = {n for n, _ in parts.model.named_parameters()}
    buffers = {k: v for k, v in state["model"].items() if k not in params}
    missing = parts.model.load_state_dict(buffers, strict=False)
    if missing.unexpected_keys:
        raise SnapshotError(f"{what} has keys this model lacks: {missing.unexpected_keys[:5]}; "
                            "was it written for another model.name?")
    for name, p in parts.model.named_parameters():
        saved = state["model"].get(name)
        if saved is None or saved.shape != p.shape:
            got = "missing" if saved is None else f"{list(saved.shape)}"
            raise SnapshotError(f"{what}: {name!r} is {got} there but {list(p.shape)} in this model; --resume "
                                f"continues the same model, so check model.num_classes, model.args (model.width for "
                                f"a zoo model) and the input channels; or start a new run from its weights with "
                                f"--weights PATH --weights-skip {name!r}")
    parts.reducer.load_state_dict(state["reducer"])  # may re-lay out the flat buffers: first
    parts.flat.load_master_state(state["model"])
    parts.optimizer.load_state_dict(state["optimizer"])
    rng = state["rng"][rank] if rank < len(state["rng"]) else state["rng"][0]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and parts.comm.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], parts.comm.device)
    if rank >= len(state["rng"]):
        log.warning("rank %d: the snapshot holds RNG states for %d rank(s); this rank starts from rank 0's",
                    rank, len(state["rng"]))


def check_same_start(comm: Communicator, iteration: int) -> None:
    """Every rank must start at the same iteration (collective; before any other collective of
    a resume): a node that found no snapshot (node-local run dirs) would otherwise train from
    scratch beside resumed ones."""
    starts = comm.allgather_object(iteration)
    if len(set(starts)) > 1:
        listed = ", ".join(f"rank {r}: {it}" for r, it in enumerate(starts))
        raise SnapshotError(f"the ranks resumed at different iterations ({listed}); every rank must read the same "
                            f"snapshot: use a train.run_dir all nodes share, or pass --resume PATH")


def _check_same_model(then: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    """A snapshot resumes only the model it was written for (``model.name`` and ``model.args``), in the
    precision mode it was written in (storage and autocast keep different weights and state dtypes)."""
    for section, key, default in (("model", "name", None), ("model", "args", {}), ("precision", "mode", "storage")):
        was, is_ = then.get(section, {}).get(key, default), now.get(section, {}).get(key, default)
        if was != is_:
            raise SnapshotError(f"snapshot {str(path)!r} was written with {section}.{key} = {was!r}, this run has "
                                f"{is_!r}; resume with that setting, or start a new run from its weights with "
                                f"--weights PATH")


class Snapshots:
    """Snapshots of ``run_dir`` for the solver that owns ``parts`` (module docstring)."""

    def __init__(self, parts: StateParts, run_dir: Path, config: dict[str, Any], *, health: Health,
                 metrics: MetricsWriter) -> None:
        self.parts, self.run_dir, self.config = parts, run_dir, config
        self.comm = parts.comm
        self.health, self.metrics = health, metrics
        self.saved_at: int | None = None
        """Iteration of the snapshot last written or resumed from: a stop there writes nothing new."""
        self.keep = int(config.get("solver", {}).get("snapshot_keep", 0))
        """``solver.snapshot_keep``, read from the run's config (the dict that goes into each snapshot)."""

    def save(self, iteration: int, data: dict[str, Any], display: Display) -> Path | None:
        """Write snapshot_iter_<iteration>.pt (rank 0, which gets the path); collective.
        ``data`` is the data position and setup (see :meth:`resume`)."""
        path = snapshot_path(self.run_dir, iteration)
        rank0 = self.comm.rank == 0
        if self.saved_at == iteration:
            return path if rank0 else None
        finite = all(bool(torch.isfinite(g.master).all()) for g in self.parts.flat.groups)
        if any(g.parts is not None for g in self.parts.flat.groups):  # each solver holds its slices only
            finite = all(self.comm.allgather_object(finite))
        if not finite:
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
        self._prune(iteration)
        return path

    def _prune(self, iteration: int) -> None:
        """Delete what ``solver.snapshot_keep`` leaves out (rank 0), now that snapshot ``iteration`` is
        durable and marked (:func:`dptrain.snapshots.files.prune_snapshots`)."""
        if deleted := prune_snapshots(self.run_dir, iteration, self.keep):
            log.info("deleted %s (solver.snapshot_keep = %d)", ", ".join(p.name for p in deleted), self.keep)

    def resume(self, path: Path, data_at: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
        """Load snapshot ``path`` into the parts once every rank starts at its iteration; returns
        the snapshot (its ``iteration``, ``data`` and ``display`` are the caller's to apply).
        ``data_at(iteration)`` is this run's data setup there, compared with the snapshot's."""
        state = load_snapshot(path)
        _check_same_model(state["config"], self.config, path)
        iteration = int(state["iteration"])
        check_same_start(self.comm, iteration)
        now = data_at(iteration)
        check_same_classes(state["data"].get("classes"), now.get("classes"), f"snapshot {str(path)!r}")
        restore(self.parts, state, f"snapshot {str(path)!r}")
        self.saved_at = iteration
        self._warn_if_data_setup_changed(state["data"], now)
        self._warn_if_data_changed(state["config"].get("data", {}), self.config.get("data", {}))
        if self.comm.rank == 0:
            self._set_aside_other_branches(path, iteration)
        dropped = self.metrics.drop_after(iteration)  # lines a crashed run wrote past its last snapshot
        log.info("resumed from %s at iteration %d%s", path, iteration,
                 f"; dropped {dropped} metrics.jsonl line(s) past it" if dropped else "")
        return state

    def _set_aside_other_branches(self, path: Path, iteration: int) -> None:
        """Move the run_dir's snapshots that the resumed run does not continue into a ``superseded_<time>``
        folder beside them, with a copy of metrics.jsonl: those past ``iteration`` when ``path`` is one of
        this run_dir's own (a resume from an earlier snapshot starts another branch), and every one when
        ``path`` lies elsewhere (another run's). Left in place, the new branch would overwrite them as it
        passes their iterations, and ``--resume auto`` would later pick the newest of the old branch."""
        own = path.parent.resolve() == self.run_dir.resolve()
        others = [p for i, p in list_snapshots(self.run_dir)
                  if (i > iteration if own else p.resolve() != path.resolve())]
        if not others:
            return
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = next(a for n in itertools.count(1)
                     if not (a := self.run_dir / f"superseded_{stamp}{f'_{n}' if n > 1 else ''}").exists())
        try:
            aside.mkdir()
            for p in others:
                for f in self.run_dir.glob(glob.escape(p.name) + "*"):  # the snapshot and its markers
                    f.rename(aside / f.name)
            metrics = self.run_dir / "metrics.jsonl"
            if metrics.is_file():
                shutil.copy2(metrics, aside / metrics.name)
        except OSError as e:
            raise SnapshotError(f"cannot move the snapshots the resumed run does not continue into {str(aside)!r} "
                                f"({e.strerror or e}); move {others[0].name} and the like out of train.run_dir "
                                f"{str(self.run_dir)!r} by hand, or choose another train.run_dir") from e
        log.warning("resuming from %s: moved %d snapshot(s) of another branch (%s) and a copy of metrics.jsonl "
                    "into %s, so the new branch neither overwrites them nor is passed over by --resume auto", path,
                    len(others), ", ".join(p.name for p in others[:3]) + (" ..." if len(others) > 3 else ""), aside)

    def start_over(self) -> None:
        """``--resume auto`` found no snapshot: start at 0, dropping what a crashed run logged."""
        check_same_start(self.comm, 0)
        dropped = self.metrics.drop_after(0)  # the crashed run's lines: this run writes them again
        log.info("--resume auto: no snapshot in %s; starting fresh%s", self.run_dir,
                 f" (dropped {dropped} metrics.jsonl line(s) of the earlier run)" if dropped else "")

    def _warn_if_data_changed(self, then: dict[str, Any], now: dict[str, Any]) -> None:
        """Resuming on other data (``data.source``, ``data.path``, ``data.test_path``) is allowed with a
        warning, as another batch size is, not refused: the same samples move (a copy on node-local
        disk, another mount) or change format (the built-in digits written by ``make-lmdb --digits``
        train bit for bit alike), and dptrain cannot tell such a copy from another data set without
        reading both. A refusal would leave such a run only ``--weights``, which drops its iteration
        and solver state; the warning puts both values in the log, as config.toml now holds the new."""
        changed = [f"data.{k} {then.get(k, '')!r} -> {now.get(k, '')!r}" for k in ("source", "path", "test_path")
                   if then.get(k, "") != now.get(k, "")]
        if changed and self.comm.rank == 0:
            log.warning("resuming on other data than the snapshot's (%s): training goes on from the snapshot's "
                        "iteration on this data, which continues the interrupted run only if it holds the same "
                        "samples; to start a new run from the snapshot's weights instead, use --weights PATH",
                        ", ".join(changed))

    def _warn_if_data_setup_changed(self, then: dict[str, Any], now: dict[str, Any]) -> None:
        """Resuming with another batch size, world size, iter_size or seed is allowed, but the run
        no longer continues the interrupted one sample for sample: say so."""
        changed = [f"{k} {then[k]} -> {v}" for k, v in now.items() if k in then and then[k] != v and k != "classes"]
        if changed and self.comm.rank == 0:
            log.warning("resuming with another data setup than the snapshot's (%s): training goes on, but the sample "
                        "order (and, for more ranks, the RNG streams) differ from an uninterrupted run",
                        ", ".join(changed))
