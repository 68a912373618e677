"""Sample order: a pure function of (seed, epoch, rank, world_size, batch_size).

Step k of an epoch (one global micro-batch) is ``perm[k*G:(k+1)*G]`` with
``G = batch_size * world_size`` samples (``SampleOrder.samples_per_step``), and rank r takes
``[r*B:(r+1)*B]`` of it. (The global *batch* of an iteration is G x iter_size: ``RunSetup``.) So 2 solvers x B see exactly the samples of
1 solver x 2B, and runs at different world sizes can be compared.

Remainder policy (training): the last ``N mod G`` samples of each epoch's permutation are
not used in that epoch, and no sample is ever repeated within an epoch to pad a batch.
With ``shuffle = "epoch"`` the permutation changes every epoch, so no sample is dropped
for good. With ``shuffle = "none"`` the order is the records' order read as one endless
ring, like Caffe's sequential reader: epoch e starts where epoch e - 1 stopped, so the
records one epoch leaves over open the next.

Test order: the test set in record order, split into ``world_size`` contiguous ranges
whose sizes differ by at most one; every test sample is scored exactly once.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from dptrain.errors import ConfigError


@dataclass(frozen=True)
class SampleOrder:
    """Which samples one solver takes; built once by the Trainer from the run's topology."""

    rank: int
    world_size: int
    batch_size: int
    seed: int
    shuffle: bool = True

    @property
    def samples_per_step(self) -> int:
        """Samples of one global micro-batch, over all ranks: batch_size x world_size."""
        return self.batch_size * self.world_size


@functools.lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, num_samples: int, shuffle: bool, samples_per_step: int = 1) -> np.ndarray:
    """The epoch's order of sample indices: [num_samples] int64, reproducible from (seed, epoch).

    Without ``shuffle`` it is record order, rotated to start after the ``epoch * used``
    samples that earlier epochs read (``used`` = the full steps' share of N).

    Cached (read-only): every batch of an epoch slices the same permutation, and drawing one
    for ImageNet's 1.28M samples takes too long to repeat per step
    (docs/measurements.md#epoch-permutation-cache).
    """
    if not shuffle:
        used = num_samples - num_samples % samples_per_step
        perm = np.roll(np.arange(num_samples, dtype=np.int64), -(epoch * used) % num_samples)
    else:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 0x5EED])))
        perm = rng.permutation(num_samples).astype(np.int64)
    perm.setflags(write=False)
    return perm


def batches_per_epoch(num_samples: int, samples_per_step: int) -> int:
    """Full steps (global micro-batches) in one epoch; raises if the dataset holds less than one."""
    n = num_samples // samples_per_step
    if n == 0:
        raise ConfigError(
            f"dataset has {num_samples} samples, fewer than one step over all solvers "
            f"(batch_size x world_size = {samples_per_step}); lower data.batch_size or use fewer solvers"
        )
    return n


def step_position(step: int, num_samples: int, plan: SampleOrder) -> tuple[int, int]:
    """(epoch, batch index within the epoch) of global micro-batch ``step``."""
    per_epoch = batches_per_epoch(num_samples, plan.samples_per_step)
    return divmod(step, per_epoch)


def rank_batch_indices(step: int, num_samples: int, plan: SampleOrder) -> np.ndarray:
    """Sample indices of this rank's slice of global micro-batch ``step``: [batch_size] int64."""
    epoch, k = step_position(step, num_samples, plan)
    perm = epoch_permutation(plan.seed, epoch, num_samples, plan.shuffle, plan.samples_per_step)
    start = k * plan.samples_per_step + plan.rank * plan.batch_size
    return perm[start : start + plan.batch_size].copy()  # writable: callers may hand it to torch


def rank_epoch_shard(epoch: int, num_samples: int, plan: SampleOrder) -> np.ndarray:
    """All indices this rank reads in ``epoch``, in the order it reads them."""
    per_epoch = batches_per_epoch(num_samples, plan.samples_per_step)
    perm = epoch_permutation(plan.seed, epoch, num_samples, plan.shuffle, plan.samples_per_step)
    g = perm[: per_epoch * plan.samples_per_step].reshape(per_epoch, plan.world_size, plan.batch_size)
    return g[:, plan.rank, :].reshape(-1).copy()  # writable, independent of the cached permutation


def eval_range(num_samples: int, rank: int, world_size: int) -> range:
    """This rank's contiguous slice of the test set; slices cover it exactly once."""
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))
