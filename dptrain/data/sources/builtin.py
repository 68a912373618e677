"""In-memory sources: the built-in digits set and a synthetic set for benchmarks."""
from __future__ import annotations

from collections.abc import Iterator
from importlib import resources

import numpy as np
import torch
import torch.nn.functional as F

from dptrain.data.base import HostBatch
from dptrain.data.sampling import SampleOrder, eval_range, rank_batch_indices
from dptrain.errors import ConfigError

DIGITS_TRAIN = 1500
DIGITS_TEST = 297
DIGITS_SPLIT_SEED = 20180101
"""Fixed seed of the train/test split permutation; changing it changes the benchmark."""
DIGITS_SIZE = 32


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train_images, train_labels, test_images, test_labels); images uint8 [N, 32, 32, 3]."""
    with resources.files("dptrain.data").joinpath("digits.npz").open("rb") as f:
        npz = np.load(f)
        images, labels = npz["images"], npz["labels"].astype(np.int64)
    x = torch.from_numpy(images.astype(np.float32) * (255.0 / 16.0)).unsqueeze(1)  # [N, 1, 8, 8]
    x = F.interpolate(x, size=(DIGITS_SIZE, DIGITS_SIZE), mode="bilinear", align_corners=False)
    x = x.clamp_(0, 255).round_().to(torch.uint8).permute(0, 2, 3, 1).repeat(1, 1, 1, 3)
    order = np.random.Generator(np.random.PCG64(DIGITS_SPLIT_SEED)).permutation(len(labels))
    train, test = order[:DIGITS_TRAIN], order[DIGITS_TRAIN : DIGITS_TRAIN + DIGITS_TEST]
    xs = x.numpy()
    return xs[train], labels[train], xs[test], labels[test]


class _IndexedStream:
    """Iterates batches of an in-memory array for a sequence of index arrays."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, index_iter: Iterator[np.ndarray]):
        self._images, self._labels, self._index_iter = images, labels, index_iter

    def __iter__(self) -> _IndexedStream:
        return self

    def __next__(self) -> HostBatch:
        idx = torch.from_numpy(next(self._index_iter))
        # non_blocking: a pageable host->device copy of the indices must not sync the stream
        # (the no-host-sync test runs synthetic data on the GPU)
        return HostBatch(self._images.index_select(0, idx),
                         self._labels.index_select(0, idx.to(self._labels.device, non_blocking=True)))

    def close(self) -> None:
        pass


def _train_indices(num: int, plan: SampleOrder, start_step: int) -> Iterator[np.ndarray]:
    step = start_step
    while True:
        yield rank_batch_indices(step, num, plan)
        step += 1


def _test_indices(num: int, rank: int, world_size: int, batch_size: int) -> Iterator[np.ndarray]:
    r = eval_range(num, rank, world_size)
    for start in range(r.start, r.stop, batch_size):
        yield np.arange(start, min(start + batch_size, r.stop), dtype=np.int64)


class ArraySource:
    """A dataset held in memory as uint8 NHWC tensors."""

    def __init__(
        self,
        train: tuple[torch.Tensor, torch.Tensor],
        test: tuple[torch.Tensor, torch.Tensor],
        mean: tuple[float, ...],
        scale: float,
    ) -> None:
        self._train, self._test = train, test
        self.num_train, self.num_test = len(train[1]), len(test[1])
        self.sample_shape = tuple(train[0].shape[1:])
        self.mean, self.scale = mean, scale
        self.mean_image = None

    def train_batches(self, plan: SampleOrder, start_step: int) -> _IndexedStream:
        return _IndexedStream(*self._train, _train_indices(self.num_train, plan, start_step))

    def test_batches(self, rank: int, world_size: int, batch_size: int) -> _IndexedStream:
        return _IndexedStream(*self._test, _test_indices(self.num_test, rank, world_size, batch_size))


DIGITS_SCALE = 1.0 / 64.0
"""Built-in normalisation: (x - training-set mean) / 64 puts the 0..255 pixels near [-1.2, 2.8]."""


def digits_source(num_classes: int, mean: tuple[float, ...] = (), scale: float = DIGITS_SCALE) -> ArraySource:
    """The built-in digits: 1500 train / 297 test, 32x32x3 uint8.

    ``mean``/``scale`` are data.mean_value/data.scale, as for an LMDB of the same images; an
    empty mean means the built-in normalisation (training-set pixel mean 77.75, scale 1/64).
    """
    if num_classes < 10:
        raise ConfigError(f"model.num_classes is {num_classes}, but digits has 10 classes; set model.num_classes = 10")
    xtr, ytr, xte, yte = load_digits_arrays()
    mean = mean or tuple(float(m) for m in xtr.reshape(-1, 3).mean(0))
    to_t = torch.from_numpy
    return ArraySource((to_t(xtr), to_t(ytr)), (to_t(xte), to_t(yte)), tuple(mean), scale)


SYNTHETIC_POOL = 16
"""Distinct synthetic images; sample i is image i mod SYNTHETIC_POOL, so it is fixed per index."""


def synthetic_source(
    num_classes: int, image_size: int, num_samples: int, seed: int, device: torch.device
) -> ArraySource:
    """A fixed random set for throughput runs. The pool lives on ``device``, so batches are
    gathered there and the input pipeline drops out of the measurement."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (SYNTHETIC_POOL, image_size, image_size, 3), dtype=torch.uint8, generator=g)
    idx = torch.arange(num_samples, dtype=torch.int64)
    labels = (idx * 2654435761) % num_classes  # Knuth multiplicative hash: fixed per index
    view = _PoolView(pool.to(device))
    test_n = min(num_samples, 10_000)
    return ArraySource((view, labels.to(device)), (view, labels[:test_n].to(device)), (127.5,), 1.0 / 64.0)


class _PoolView:
    """Looks like an [N, H, W, C] tensor for index_select; row i is pool[i mod len(pool)]."""

    def __init__(self, pool: torch.Tensor) -> None:
        self._pool = pool
        self.shape = (None, *pool.shape[1:])

    def index_select(self, dim: int, idx: torch.Tensor) -> torch.Tensor:
        assert dim == 0, "only batch gathers are supported"
        return self._pool.index_select(0, (idx % self._pool.shape[0]).to(self._pool.device, non_blocking=True))
