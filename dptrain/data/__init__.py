"""The input wing. The trainer's seam is here at the top: ``build_source`` turns the [data] section
into a :class:`~dptrain.data.base.DataSource`, whose batches (:class:`~dptrain.data.base.HostBatch`)
the :class:`~dptrain.data.base.DeviceFeeder` moves to the device, in the order of ``sampling``.

Below it, by role: ``sources`` (where samples come from), ``caffe`` (the Datum format and the
LMDB writer), ``loader`` (the reader and renderer threads, their queues and the batch ring)
and ``transforms`` (geometry, decoding and rendering, in Python and natively)."""
from __future__ import annotations

import torch

from dptrain.config import RECORD_SOURCES, DataConfig
from dptrain.data.base import DataSource
from dptrain.data.sources.builtin import digits_source, synthetic_source
from dptrain.data.sources.files import FolderSource, ListSource
from dptrain.data.sources.records import RecordSource
from dptrain.data.transforms.render import DEFAULT_RENDER, RenderOptions
from dptrain.errors import ConfigError


def build_source(cfg: DataConfig, *, num_classes: int, seed: int, device: torch.device, rank: int = 0,
                 cores: int = 1) -> DataSource:
    """The source named by ``data.source`` for solver ``rank``, whose input threads share ``cores`` cores."""
    if cfg.source == "digits":
        if cfg.mean_value:  # explicit normalisation, e.g. to match an LMDB of the same digits
            return digits_source(num_classes, tuple(cfg.mean_value), cfg.scale)
        return digits_source(num_classes)
    if cfg.source == "synthetic":
        return synthetic_source(num_classes, cfg.image_size, cfg.synthetic_samples, seed, device)
    return open_records(cfg, num_classes=num_classes, seed=seed, rank=rank, cores=cores,
                        pin_memory=device.type == "cuda")


def open_records(cfg: DataConfig, *, num_classes: int, seed: int, rank: int = 0, cores: int = 1,
                 render: RenderOptions = DEFAULT_RENDER, pin_memory: bool = False) -> RecordSource:
    """The threaded record source of ``data.source`` (an LMDB, an image folder or a list file)."""
    if cfg.source == "lmdb":
        from dptrain.data.sources.caffe_lmdb import LmdbSource

        kind: type[RecordSource] = LmdbSource
    elif cfg.source == "folder":
        kind = FolderSource
    elif cfg.source == "list":
        kind = ListSource
    else:
        raise ConfigError(f"data.source = \"{cfg.source}\" is not read from records; use one of {RECORD_SOURCES}")
    return kind(cfg, num_classes=num_classes, seed=seed, rank=rank, cores=cores, render=render, pin_memory=pin_memory)
