"""The input wing. The trainer's seam is here at the top: ``build_source`` turns the [data] section
into a :class:`~dptrain.data.base.DataSource`, whose batches (:class:`~dptrain.data.base.HostBatch`)
the :class:`~dptrain.data.base.DeviceFeeder` moves to the device, in the order of ``sampling``.

Below it, by role: ``sources`` (where samples come from), ``caffe`` (the Datum format and the
LMDB writer), ``loader`` (the reader and renderer threads, their queues and the batch ring)
and ``transforms`` (geometry, decoding and rendering, in Python and natively)."""
from __future__ import annotations

import torch

from dptrain.config import DataConfig
from dptrain.data.base import DataSource
from dptrain.data.sources.builtin import digits_source, synthetic_source


def build_source(cfg: DataConfig, *, num_classes: int, seed: int, device: torch.device, rank: int = 0,
                 cores: int = 1) -> DataSource:
    """The source named by ``data.source`` for solver ``rank``, whose input threads share ``cores`` cores."""
    if cfg.source == "digits":
        if cfg.mean_value:  # explicit normalisation, e.g. to match an LMDB of the same digits
            return digits_source(num_classes, tuple(cfg.mean_value), cfg.scale)
        return digits_source(num_classes)
    if cfg.source == "synthetic":
        return synthetic_source(num_classes, cfg.image_size, cfg.synthetic_samples, seed, device)
    from dptrain.data.sources.caffe_lmdb import LmdbSource

    return LmdbSource(cfg, num_classes=num_classes, seed=seed, rank=rank, cores=cores, pin_memory=device.type == "cuda")
