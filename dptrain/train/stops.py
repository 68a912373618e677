"""One stop protocol for every phase of a run, and the health checks that end a diverged run.

A run ends early for one of two kinds of reason:

* **an agreed stop**: SIGTERM, SIGUSR1 or Ctrl-C reached a rank. The request travels in the
  control sums (``dptrain.distributed.control``), which every rank reads alike, so every rank
  stops after the same training iteration or test batch. :class:`StopProtocol` is the one
  place that turns the sums into that decision, for the training steps and the test
  batches alike, and it raises :class:`StopAgreed` there. The Trainer catches it once,
  writes a snapshot and returns; the solvers exit 0.
* **a divergence**: the loss stays non-finite for ``solver.max_nonfinite`` iterations
  without loss scaling, or the weights are not finite when a snapshot is due.
  :class:`HealthWatch` raises :class:`dptrain.errors.DivergenceError` on every rank alike
  (it reads the same sums), naming the newest snapshot from before the divergence began.
  It also follows a divergence that has not stopped the run yet (a loss far above its
  recent range): snapshots written from then on are marked diverging and are not offered
  to ``--resume auto``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from dptrain.checkpoint import good_snapshots, list_snapshots, mark_diverging
from dptrain.distributed.comm import Communicator
from dptrain.distributed.control import LOSS, NONFINITE, STOP, ControlChannel, StopFlag
from dptrain.errors import DivergenceError
from dptrain.overflow import DivergenceWatch

log = logging.getLogger(__name__)

Sums = Callable[[int, torch.Tensor], None]
"""Called with (step, control sums) for every step read back: what else the sums decide."""


class StopAgreed(Exception):
    """Every rank agreed to stop here (raised by :class:`StopProtocol`, caught by ``Trainer.fit``)."""


class StopProtocol:
    """Turns the control sums into one stop decision that every rank takes at the same step.

    A stop request carried by the sums of step ``k`` takes effect after step ``k + lag`` of
    that channel (``ControlChannel.lag``: 0 on the CPU, where the sums are read at once). At
    the end of a phase every pending sum is read, and any stop request among them stops the
    run there. Before a phase that would start new work (a test), :meth:`vote` asks every
    rank directly, so a stop never starts one.
    """

    def __init__(self, flag: StopFlag) -> None:
        self.flag = flag
        self._at: int | None = None
        """The step of the current phase after which every rank stops, once a request was read."""

    @property
    def why(self) -> str:
        return self.flag.why

    def _take(self, sums: Iterator[tuple[int, torch.Tensor]], lag: int, also: Sums | None) -> None:
        for step, s in sums:
            if s[STOP] > 0 and self._at is None:
                self._at = step + lag
            if also is not None:
                also(step, s)

    def read(self, channel: ControlChannel, step: int, also: Sums | None = None) -> None:
        """Act on the sums ``channel`` has for the steps up to ``step`` (``also`` sees each);
        raise :class:`StopAgreed` when a stop read earlier is due after ``step``."""
        self._take(channel.ready(step), channel.lag, also)
        if self._at is not None and step >= self._at:
            raise StopAgreed

    def settle(self, channel: ControlChannel, also: Sums | None = None) -> None:
        """The end of a phase: read every pending step's sums (waiting for them) and raise
        :class:`StopAgreed` if any carried a stop request."""
        self._take(channel.drain(), channel.lag, also)
        if self._at is not None:
            raise StopAgreed

    def vote(self, comm: Communicator, device: torch.device) -> None:
        """Before a new phase: raise :class:`StopAgreed` if any rank has a stop request now
        (one blocking collective; a phase starts rarely)."""
        flag = torch.tensor([1.0 if self.flag.requested else 0.0], device=device)
        comm.allreduce_sum_(flag)
        if flag.item() > 0:
            raise StopAgreed


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
