"""Device memory per GPU that dptrain holds for the parameters: the 16-bit weights and gradients, the fp32
masters and the optimizer state, unsharded or with ``reducer.shard = "optimizer"`` (ZeRO-1), at any
GPU count. Activations and workspace are not counted: they depend on the batch, not on the GPU count.

Per parameter (``dptrain.flat``/``dptrain.optimizer``'s ``bytes_per_param``, ``dptrain bench``'s
``state_bytes_per_rank`` = masters + state): weights 2 B and grads 2 B (whole on every GPU, sharded or
not), fp32 masters 4 B (none with fp32 weights: the weights are the masters), optimizer state 4 B (SGD
momentum) or 8 B (Adam, AdamW, LAMB: two fp32 moments). Sharded, the masters and the state are divided by
the GPU count N; each bucket is padded to a multiple of N x 64 elements first
(``dptrain.distributed.shards``), and the padding is held like parameters.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from benchmarks.scaling.machine import GB

Optimizer = Literal["sgd", "adam"]
STATE_BYTES_PER_PARAM: dict[str, int] = {"sgd": 4, "adam": 8}
"""Optimizer state in fp32: SGD's momentum; Adam/AdamW/LAMB's first and second moments."""
MASTER_BYTES_PER_PARAM = 4
ALIGN_ELEMS = 64
"""``dptrain.flat.ALIGN_ELEMS`` (not imported here: that module loads torch): a sharded bucket is padded
to a multiple of world_size x ALIGN_ELEMS elements, so every solver's slice starts 64-aligned."""


def padded_numel(numel: int, world_size: int) -> int:
    """Elements of a bucket of ``numel`` once padded for ``world_size`` owners (``dptrain.distributed.shards``)."""
    unit = world_size * ALIGN_ELEMS
    return -(-numel // unit) * unit


@dataclass(frozen=True)
class MemoryPerGpu:
    """Bytes one GPU holds for the parameters."""

    weights: float
    grads: float
    masters: float
    state: float
    padding_elems: int = 0
    """Elements of bucket padding held per GPU in the 16-bit buffers (the masters and state hold 1/N of it)."""

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.masters + self.state

    def gb(self) -> dict[str, float]:
        """Each part and the total in GB (1e9 B)."""
        return {"weights": self.weights / GB, "grads": self.grads / GB, "masters": self.masters / GB,
                "state": self.state / GB, "total": self.total / GB}


def memory_per_gpu(bucket_numels: Sequence[int], world_size: int, *, shard: bool, optimizer: Optimizer,
                   weight_bytes: int = 2) -> MemoryPerGpu:
    """Memory per GPU for parameters laid out in buckets of ``bucket_numels`` elements on ``world_size`` GPUs.

    ``weight_bytes``: 2 (fp16/bf16 weights and gradients, fp32 masters) or 4 (fp32: no masters). Sharded,
    each bucket is padded (:func:`padded_numel`) and the masters and state divided by ``world_size``;
    unsharded, no bucket padding (the per-parameter 64-element alignment of the flat buffers, there sharded
    or not, is left out: under 0.1 % of ResNet-50's or ViT-L's parameters)."""
    if optimizer not in STATE_BYTES_PER_PARAM:
        raise ValueError(f"optimizer must be one of {sorted(STATE_BYTES_PER_PARAM)}, got {optimizer!r}")
    if weight_bytes not in (2, 4):
        raise ValueError(f"weight_bytes must be 2 (16-bit weights, fp32 masters) or 4 (fp32), got {weight_bytes}")
    numel = sum(bucket_numels)
    whole = sum(padded_numel(b, world_size) for b in bucket_numels) if shard else numel
    owned = whole / world_size if shard else whole
    masters = MASTER_BYTES_PER_PARAM * owned if weight_bytes == 2 else 0.0
    return MemoryPerGpu(weights=weight_bytes * whole, grads=weight_bytes * whole, masters=masters,
                        state=STATE_BYTES_PER_PARAM[optimizer] * owned, padding_elems=whole - numel)
