"""Communicator: the process group from the torchrun environment, and its collectives.

The only module that calls torch.distributed collectives. Backend: NCCL on CUDA, gloo on
CPU. With WORLD_SIZE unset or 1 there is no process group and every collective is the
identity, so ``dptrain train`` runs the same code path in one process.
"""
from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)


class Work(Protocol):
    def wait(self) -> Any: ...


class _DoneWork:
    """A completed collective (single-process runs)."""

    def wait(self) -> bool:
        return True


class Communicator:
    """Rank, world size and the collectives dptrain needs, over one process group."""

    def __init__(self, *, rank: int, world_size: int, local_rank: int, device: torch.device,
                 backend: str | None, owns_group: bool = False) -> None:
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device, self.backend = device, backend
        self._owns_group = owns_group

    @classmethod
    def from_env(cls, timeout_s: float, device: torch.device) -> Communicator:
        """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

        A collective that does not complete within ``timeout_s`` raises on every rank that
        waits for it, so a dead or stuck rank never hangs the others forever.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if world <= 1:
            return cls(rank=0, world_size=1, local_rank=local_rank, device=device, backend=None)
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
        comm = cls(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                   device=device, backend=backend, owns_group=True)
        log.info("process group: backend %s, world size %d", backend, comm.world_size)
        return comm

    @classmethod
    def from_initialized(cls, device: torch.device) -> Communicator:
        """Wrap a process group that is already initialised (tests, embedding applications)."""
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(),
                   local_rank=int(os.environ.get("LOCAL_RANK", dist.get_rank())), device=device,
                   backend=dist.get_backend())

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def broadcast_module(self, module: nn.Module) -> None:
        """Copy rank 0's parameters and buffers into every rank's module, in place."""
        if not self.distributed:
            return
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=0)

    def allreduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks in place and wait for it."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def allreduce_async(self, tensor: torch.Tensor) -> Work:
        """Start an in-place SUM allreduce; on NCCL it runs on NCCL's own stream and the
        handle's ``wait()`` makes the current stream wait for it (no host sync)."""
        if not self.distributed:
            return _DoneWork()
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)

    def allgather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group (only if this communicator created it)."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
