"""Per-step control flags agreed over the ranks without a host sync: stop requests, a non-finite loss.

Every iteration, each rank fills a small fp32 vector on its device (:data:`FIELDS`): did
this rank receive a stop signal, is this rank's loss non-finite. The vector rides on the
collective the reducer already runs during backward (with BatchNorm's running
statistics), so every rank holds the same sums and takes the same decision with
no extra collective and no host sync. The test loop, which has no other collective,
sums its vector with one small async allreduce per batch.

Reading the sums: on the CPU the collective has finished when ``reducer.wait()`` returns,
so iteration ``k``'s flags are read at once (``lag`` 0). On CUDA they are copied into
pinned host memory behind the collective (an event marks the copy's end) and read ``lag``
iterations later, when the copy has long landed: the host waits only if it ran more than
``lag`` iterations ahead of the device, which bounds that lead instead of draining the
pipeline each step. A decision read for iteration ``k`` takes effect after iteration
``k + lag`` on every rank alike, so all ranks stop at the same iteration.
"""
from __future__ import annotations

import signal
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dptrain.distributed.comm import Communicator, Work

FIELDS = ("stop", "nonfinite_loss", "loss", "unused")
"""The control vector's entries, each summed over the ranks: the loss so too, so that every rank
sees every iteration's mean loss (for :class:`dptrain.train.health.DivergenceWatch`) without a host
sync; ``unused``: ranks that met a parameter without a gradient in the previous iteration which is not
yet known as one (``dptrain.distributed.unused``)."""
STOP, NONFINITE, LOSS, UNUSED = 0, 1, 2, 3
CUDA_LAG = 2
"""Iterations between a CUDA step and the host reading its flags: the device-to-host copy of
iteration k is long done by the end of iteration k + 2, so the read never stalls the
pipeline; a stop takes effect at most this many iterations later."""


class StopFlag:
    """Set by SIGTERM, SIGUSR1 or SIGINT (Ctrl-C): the solver snapshots at the next agreed
    iteration and exits 0, as Caffe does on SIGINT. A second Ctrl-C stops at once, without a
    snapshot (torchrun turns its own second Ctrl-C into a SIGTERM)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self.signum = 0

    def __call__(self, signum: int, frame: object) -> None:
        if self.signum == signal.SIGINT and signum in (signal.SIGINT, signal.SIGTERM):
            raise KeyboardInterrupt
        if signum == signal.SIGINT:
            import logging

            logging.getLogger(__name__).warning("Ctrl-C: snapshot at the next agreed iteration and stop; press it "
                                                "again to stop at once")
        self.requested = True
        self.signum = self.signum or signum

    @property
    def why(self) -> str:
        return f"signal {signal.Signals(self.signum).name} received" if self.signum else \
            "another rank received a stop signal"

    @contextmanager
    def installed(self) -> Iterator[StopFlag]:
        """The handlers for the duration of the block (main thread only), then the old ones."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        old = {s: signal.signal(s, self) for s in self.SIGNALS}
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)


@dataclass
class _Pending:
    step: int
    values: torch.Tensor
    """[len(FIELDS)] fp32 on the host: the pinned copy (CUDA) or the vector itself (CPU)."""
    event: torch.cuda.Event | None
    work: Work | None


class ControlChannel:
    """Posts one control vector per step and hands back the rank sums in step order (see the module docstring)."""

    def __init__(self, comm: Communicator, device: torch.device) -> None:
        self.comm, self.device = comm, device
        self.lag = CUDA_LAG if device.type == "cuda" else 0
        slots = self.lag + 2
        self._vectors = [torch.zeros(len(FIELDS), dtype=torch.float32, device=device) for _ in range(slots)]
        self._hosts = [torch.zeros(len(FIELDS), dtype=torch.float32, pin_memory=device.type == "cuda")
                       for _ in range(slots)]
        self._slot = 0
        self._pending: deque[_Pending] = deque()

    def vector(self, stop: bool, loss: torch.Tensor | None = None, unused: float = 0.0) -> torch.Tensor:
        """This step's device vector: the local stop request, whether ``loss`` is non-finite, ``loss``
        itself and the ``unused`` flag. Device ops only (``fill_`` takes a host value as a kernel argument)."""
        v = self._vectors[self._slot]
        v[STOP].fill_(1.0 if stop else 0.0)
        if loss is None:
            v[NONFINITE:LOSS + 1].zero_()
        else:
            v[NONFINITE].copy_((~torch.isfinite(loss.detach())).float())
            v[LOSS].copy_(loss.detach())
        v[UNUSED].fill_(unused)
        return v

    def submit(self, step: int, *, reduce: bool) -> None:
        """Queue this step's vector for reading. ``reduce``: sum it over the ranks here (the
        test loop); otherwise the reducer summed it with its own collective."""
        v, host = self._vectors[self._slot], self._hosts[self._slot]
        self._slot = (self._slot + 1) % len(self._vectors)
        work = self.comm.allreduce_async(v) if reduce and self.comm.distributed else None
        if self.device.type == "cuda":
            if work is not None:
                work.wait()  # the current stream waits for the collective; the host does not
            host.copy_(v, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._pending.append(_Pending(step, host, event, None))
        else:
            self._pending.append(_Pending(step, v, None, work))

    def ready(self, step: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(step, sums) of every queued step up to ``step - lag`` (waiting for those if need be),
        then of later ones whose copy has already landed; in step order, each once."""
        while self._pending:
            p = self._pending[0]
            if p.event is not None:
                if p.step > step - self.lag and not p.event.query():
                    return
                p.event.synchronize()  # complete already, or lag steps old: never drains the pipeline
            elif p.work is not None:
                p.work.wait()
            self._pending.popleft()
            yield p.step, p.values.clone()

    def drain(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Every queued step's sums (waiting for them): before a snapshot or at the end."""
        return self.ready(step=2**62)
