"""One stop protocol for every phase of a run.

A run ends early for one of two kinds of reason: a divergence (``dptrain.train.health``), or

* **an agreed stop**: SIGTERM, SIGUSR1 or Ctrl-C reached a rank. The request travels in the
  control sums (``dptrain.distributed.control``), which every rank reads alike, so every rank
  stops after the same training iteration or test batch. :class:`StopProtocol` is the one
  place that turns the sums into that decision, for the training steps and the test
  batches alike, and it raises :class:`StopAgreed` there. The Trainer catches it once,
  writes a snapshot and returns; the solvers exit 0.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from dptrain.distributed.comm import Communicator
from dptrain.distributed.control import STOP, ControlChannel, StopFlag

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
