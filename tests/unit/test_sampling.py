"""Sample order: pure function of (seed, epoch, rank, world_size, batch_size)."""
from __future__ import annotations

import numpy as np
import pytest

from dptrain.data.sampling import (
    SampleOrder,
    batches_per_epoch,
    epoch_permutation,
    eval_range,
    rank_batch_indices,
    rank_epoch_shard,
)
from dptrain.errors import ConfigError


def test_global_batch_independent_of_world_size():
    n = 1000
    one = SampleOrder(rank=0, world_size=1, batch_size=64, seed=3)
    for step in (0, 5, 15, 16, 40):  # 15 per epoch: covers an epoch boundary
        whole = rank_batch_indices(step, n, one)
        halves = [rank_batch_indices(step, n, SampleOrder(r, 2, 32, 3)) for r in range(2)]
        quarters = [rank_batch_indices(step, n, SampleOrder(r, 4, 16, 3)) for r in range(4)]
        assert np.array_equal(whole, np.concatenate(halves))
        assert np.array_equal(whole, np.concatenate(quarters))


def test_shards_disjoint_and_cover_with_stated_remainder():
    n, world = 1003, 3
    plans = [SampleOrder(r, world, 10, seed=7) for r in range(world)]
    shards = [rank_epoch_shard(2, n, p) for p in plans]
    union = np.concatenate(shards)
    assert len(np.unique(union)) == len(union)  # disjoint
    per_epoch = batches_per_epoch(n, 30)
    assert len(union) == per_epoch * 30  # the N mod G remainder is the only thing left out
    left = set(range(n)) - set(union.tolist())
    assert len(left) == n % 30
    assert left == set(epoch_permutation(7, 2, n, True)[per_epoch * 30:].tolist())


def test_permutation_changes_per_epoch_and_is_reproducible():
    a, b = epoch_permutation(1, 0, 500, True), epoch_permutation(1, 1, 500, True)
    assert not np.array_equal(a, b)
    assert np.array_equal(a, epoch_permutation(1, 0, 500, True))
    assert not np.array_equal(a, epoch_permutation(2, 0, 500, True))
    assert np.array_equal(epoch_permutation(1, 4, 10, False), np.arange(10))


def test_unshuffled_epochs_continue_where_the_last_one_stopped():
    """shuffle = "none" reads the records as a ring, at any world size: no record is left out for good."""
    n = 29
    for world, batch in ((1, 4), (2, 2), (3, 3)):
        plans = [SampleOrder(r, world, batch, seed=0, shuffle=False) for r in range(world)]
        steps = 3 * batches_per_epoch(n, world * batch)
        stream = [int(i) for step in range(steps) for p in plans for i in rank_batch_indices(step, n, p)]
        assert stream == [i % n for i in range(len(stream))], (world, batch)


def test_too_small_dataset_raises():
    with pytest.raises(ConfigError, match="fewer than one step over all solvers"):
        batches_per_epoch(10, 64)


def test_test_ranges_cover_once():
    for world in (1, 2, 3, 4):
        ranges = [eval_range(297, r, world) for r in range(world)]
        ids = [i for r in ranges for i in r]
        assert ids == list(range(297))
        assert max(len(r) for r in ranges) - min(len(r) for r in ranges) <= 1
