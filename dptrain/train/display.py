"""The display window: the running loss and the timing between two display lines.

The loss is summed on the device at every iteration (no host sync) and averaged over the
ranks and the iterations since the last display when one is due; across a resume it goes
on from the snapshot's running sum, so a display right after a resume reports the same mean
as the uninterrupted run would. Images/s count only the iterations this process timed.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from dptrain.distributed.comm import Communicator


class DisplayWindow:
    """Loss and time since the last display (module docstring)."""

    def __init__(self, device: torch.device, iteration: int) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.loss_from = iteration
        """Iteration since which :attr:`loss_sum` accumulates (the last display); saved in snapshots."""
        self.restart_clock(iteration)

    def restart_clock(self, iteration: int) -> None:
        self.t_last, self.it_last = time.perf_counter(), iteration
        """When and at which iteration the current timing window began."""

    def add(self, iteration_loss: torch.Tensor) -> None:
        self.loss_sum += iteration_loss

    def state(self, comm: Communicator) -> dict[str, Any]:
        """The snapshot's display state; collective (every rank's running sum is gathered)."""
        return {"loss_from": self.loss_from, "loss_sum": comm.allgather_object(float(self.loss_sum))}

    def load(self, state: dict[str, Any], rank: int, iteration: int) -> None:
        """Go on from a snapshot's display state (a rank the snapshot did not have starts afresh)."""
        if rank < len(state["loss_sum"]):
            self.loss_from = int(state["loss_from"])
            self.loss_sum.fill_(state["loss_sum"][rank])
        else:
            self.loss_from = iteration
        self.restart_clock(iteration)

    def close(self, iteration: int, comm: Communicator, global_batch: int) -> tuple[dict[str, Any], float]:
        """Mean loss and images/s since the last display, with the loss window restarted at
        ``iteration``; also the host milliseconds per iteration. Collective (the loss sum). The
        caller restarts the clock (:meth:`restart_clock`) once the display's own work is done."""
        loss = self.loss_sum.clone()
        comm.allreduce_sum_(loss)
        loss_iters = max(iteration - self.loss_from, 1)
        iters = max(iteration - self.it_last, 1)
        elapsed = max(time.perf_counter() - self.t_last, 1e-9)
        rec = {"loss": float(loss) / (loss_iters * comm.world_size),
               "images_per_s": round(global_batch * iters / elapsed, 2)}
        self.loss_sum.zero_()
        self.loss_from = iteration
        return rec, 1000.0 * elapsed / iters
