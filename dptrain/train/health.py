"""The run's health: the non-finite streak, divergence and the loss-scale floor, the three ways a run
that is going wrong ends (exit 2), each named and each keeping the last good snapshot.

* **A non-finite streak**: without loss scaling, the loss stays non-finite for
  ``solver.max_nonfinite`` iterations in a row (each such step is skipped on the device).
* **A divergence**: a loss far above its recent range (:class:`DivergenceWatch`) dates the
  start of a divergence; snapshots written from then on are marked diverging and are not offered
  to ``--resume auto``; the weights not finite when a snapshot is due end the run.
* **The loss-scale floor** (:func:`check_loss_scale_floor`): the dynamic scale would fall below
  ``precision.loss_scale.min_scale``: gradients overflow at every scale.

:class:`HealthWatch` reads the control sums every rank reads alike, so every rank raises
:class:`dptrain.errors.DivergenceError` at the same iteration, naming the newest snapshot from
before the divergence began.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from dptrain.distributed.control import LOSS, NONFINITE
from dptrain.errors import DivergenceError, LossScaleError
from dptrain.precision import LossScaler
from dptrain.snapshots import good_snapshots, list_snapshots, mark_diverging

log = logging.getLogger(__name__)

EXPLOSION_FACTOR = 10.0
"""A finite loss this many times the median of the recent ones marks the start of a divergence."""
LOSS_WINDOW = 20
"""Iterations whose losses make the recent range; as many in range end a divergence (a spike)."""
LOSS_FLOOR = 0.1
"""The median is taken as at least this: a loss under EXPLOSION_FACTOR x LOSS_FLOOR is never an explosion
(a near-perfect fit's tiny losses would otherwise flag any ordinary one)."""


class DivergenceWatch:
    """Since which iteration's weights the run diverges, from each iteration's mean loss.

    A loss that is not finite, or finite but :data:`EXPLOSION_FACTOR` times above the median
    of the last :data:`LOSS_WINDOW` in-range losses, starts a divergence: the loss of step s
    was computed with the weights of iteration s - 1, so from those weights on every snapshot
    is suspect (:meth:`suspect`). A diverging fp32 run typically shows a loss of 1e17 several
    iterations before the first inf, with finite but useless weights in between. After
    :data:`LOSS_WINDOW` iterations back in range the divergence is over (a spike); snapshots
    taken during it stay marked.
    """

    def __init__(self, factor: float = EXPLOSION_FACTOR, window: int = LOSS_WINDOW) -> None:
        self.factor, self.window = factor, window
        self._recent: deque[float] = deque(maxlen=window)
        self._calm = 0
        self.since: int | None = None
        """First iteration whose weights are suspect, while a divergence lasts."""

    def observe(self, step: int, loss: float) -> str | None:
        """Record the mean loss of step ``step``; the reason when a divergence starts there, else None."""
        median = max(statistics.median(self._recent), LOSS_FLOOR) if self._recent else None
        if math.isfinite(loss) and (median is None or loss <= self.factor * median):
            self._recent.append(loss)
            if self.since is not None:
                self._calm += 1
                if self._calm >= self.window:
                    self.since, self._calm = None, 0
            return None
        self._calm = 0
        if self.since is not None:
            return None
        self.since = step - 1
        if not math.isfinite(loss):
            return f"the loss of iteration {step} is not finite"
        return (f"the loss of iteration {step} ({loss:.4g}) is {loss / median:.3g}x the median of the "
                f"{len(self._recent)} before it ({median:.4g})")

    def suspect(self, iteration: int) -> bool:
        """Whether the weights of ``iteration`` come from a divergence under way."""
        return self.since is not None and iteration >= self.since


class HealthWatch:
    """Non-finite losses and divergence, from the control sums every rank reads alike (module docstring).

    ``first_bad_layer`` names the layer a forward first makes non-finite; it runs only on the
    way to a stop for a non-finite loss. Snapshot markers are written by rank 0 only.
    """

    def __init__(self, run_dir: Path, *, rank: int, world_size: int, max_nonfinite: int, scaled: bool,
                 first_bad_layer: Callable[[], str]) -> None:
        self.run_dir, self.rank, self.world_size = run_dir, rank, world_size
        self.max_nonfinite, self.scaled = max_nonfinite, scaled
        self.first_bad_layer = first_bad_layer
        self.divergence = DivergenceWatch()
        self._nonfinite_since: int | None = None

    def observe(self, step: int, sums: torch.Tensor) -> None:
        """One step's sums: follow the mean loss, and stop a non-finite streak without loss scaling
        (with it, a non-finite loss is an overflow: the scaler skips the step and lowers the scale)."""
        self._watch_loss(step, float(sums[LOSS]) / self.world_size)
        if self.scaled:
            return
        if sums[NONFINITE] == 0:
            self._nonfinite_since = None
            return
        since = self._nonfinite_since = self._nonfinite_since or step
        if step - since + 1 >= self.max_nonfinite:
            raise self.error(f"the loss was not finite on {int(sums[NONFINITE])} rank(s) at iteration {step}, "
                             f"{step - since + 1} iteration(s) in a row since {since} (solver.max_nonfinite = "
                             f"{self.max_nonfinite}; those steps were skipped); first non-finite layer: "
                             f"{self.first_bad_layer()}")

    def _watch_loss(self, step: int, loss: float) -> None:
        """Feed the divergence watch; when a divergence starts, mark the snapshots it taints already."""
        began = self.divergence.observe(step, loss)
        if began is None or self.rank != 0:
            return
        tainted = [p for it, p in list_snapshots(self.run_dir) if self.divergence.suspect(it)]
        for p in tainted:
            mark_diverging(p, began)
        log.warning("iter %d: the run may be diverging: %s; snapshots from iteration %d on are marked and not "
                    "offered for --resume auto%s", step, began, self.divergence.since,
                    f" ({len(tainted)} already written)" if tainted else "")

    def suspect(self, iteration: int) -> str | None:
        """Why a snapshot of ``iteration`` is not a good one (written while diverging), or None."""
        if not self.divergence.suspect(iteration):
            return None
        return f"written while diverging, since the weights of iteration {self.divergence.since}"

    def error(self, what: str) -> DivergenceError:
        """The stop for a divergence, naming the newest snapshot from before it began."""
        since = self.divergence.since
        good = good_snapshots(self.run_dir, before=since)
        began = f" (it began with the weights of iteration {since})" if since is not None else ""
        kept = f"the last good snapshot is {good[0][1]}{began}" if good else f"no good snapshot was written{began}"
        return DivergenceError(f"{what}; lower solver.base_lr or set solver.clip_gradients, then resume; {kept}")


def check_loss_scale_floor(scaler: LossScaler, culprits: Callable[[], str] = lambda: "") -> None:
    """Raise :class:`LossScaleError` if the dynamic scale hit ``min_scale``, naming what ``culprits()``
    returns: the parameters that overflowed most often. A host sync."""
    if scaler.floor_hit():
        names = culprits()
        where = f" (non-finite gradients most often in {names})" if names else ""
        raise LossScaleError(
            f"loss scale fell to precision.loss_scale.min_scale = {scaler.cfg.min_scale}: gradients overflow at "
            f"every scale{where}; lower solver.base_lr, add solver.clip_gradients, or use bf16 storage")
