"""A data source over records read by index: the per-solver threaded streams, shared by the LMDB
source and the image-file sources.

At open it probes a few records for the samples' channels and first size, resolves the mean
(``data.mean_value`` or a Caffe ``mean_file``: a mean image is subtracted per pixel on the device
at each sample's crop window, see ``base.window_means``), checks the geometry chain once, and
picks the thread counts. Each stream is P reader and T renderer threads (``dptrain.data.loader``)
over this rank's sample order. Samples are HWC **RGB** uint8, so ``data.mean_value`` is in RGB order.
"""
from __future__ import annotations

import abc
import logging
import math

import numpy as np
import torch

from dptrain.config import DataConfig
from dptrain.data.caffe.datum import parse_datum, read_mean_file
from dptrain.data.loader.pipeline import EmptyStream, PipelineStream
from dptrain.data.loader.queues import QueueSet
from dptrain.data.loader.stream import (
    BadRecordBudget,
    BatchRing,
    RecordReader,
    StreamParts,
    TestSequence,
    TrainSequence,
)
from dptrain.data.sampling import SampleOrder, eval_range
from dptrain.data.transforms import jpeg_crop
from dptrain.data.transforms import native as native_render
from dptrain.data.transforms.geometry import ExpectSize, SampleSpec, build_stages, check_chain
from dptrain.data.transforms.render import DEFAULT_RENDER, RenderOptions, probe_channels_and_size
from dptrain.errors import ConfigError, DataError

log = logging.getLogger(__name__)

MEAN_IMAGE_TOLERANCE = 1.0
"""Pixel units a mean image may vary by before its per-channel average is worth a warning."""
PROBE_RECORDS = 16
"""Records, spread over the training set, whose colour decides the samples' channels at open."""
MAX_READERS_DEFAULT = 3
"""NVCaffe's default parser count; readers are cheap, so a few per solver suffice."""
CHUNK_ROWS_MAX = 16
"""Most rows a reader reads and a renderer renders at once: the per-chunk Python work is spread
over this many images, and each renderer still gets two chunks or more of a batch."""


def default_threads(cfg: DataConfig, cores: int, *, training_on_cuda: bool = False) -> tuple[int, int]:
    """(readers, renderers) per solver (``data.parser_threads``, ``data.transformer_threads``); 0 in the
    config means: derive from ``cores``, the cores this solver may use (``Topology.cores_per_process``).

    Rendering dominates and runs without the GIL (natively, or in Pillow's and torch's C code), so
    T = cores. Readers only seek and copy the records: one per 4 cores, at most NVCaffe's 3. When the
    batches go to a GPU, the solver's own thread (which launches every kernel of the step) and the
    readers keep a core each: T = cores - readers - 1, at least 1.
    """
    readers = cfg.parser_threads or min(MAX_READERS_DEFAULT, max(1, cores // 4))
    renderers = max(1, cores - readers - 1) if training_on_cuda else cores
    return readers, cfg.transformer_threads or renderers


def spread(n: int, k: int) -> list[int]:
    """Up to ``k`` of the indices 0..n-1, spread evenly, the first and the last included."""
    k = min(n, k)
    return sorted({round(i * (n - 1) / max(1, k - 1)) for i in range(k)})


class RecordHandle(abc.ABC):
    """One reader thread's access to a source's records: ``get_many`` is the source's own (one loop over
    a chunk's records), ``get`` the one-record case of it."""

    @abc.abstractmethod
    def get_many(self, indices: list[int]) -> tuple[list[bytes], list[bytes], dict[int, DataError]]:
        """(keys, values, errors) of records ``indices``; a record that cannot be read has value b"" and
        its DataError under its place in the list."""

    def get(self, index: int) -> tuple[bytes, bytes, DataError | None]:
        """(key, value, error) of record ``index``: the key even when it cannot be read (its file's path,
        or ``#index`` where the source cannot name it), the DataError then set and the value b""."""
        keys, values, errors = self.get_many([index])
        return keys[0], values[0], errors.get(0)


class RecordSource:
    """DataSource over readable records: a training set and an optional test set, each a
    :class:`~dptrain.data.loader.stream.RecordReader` (an LMDB of Caffe Datums, image files), read and
    rendered by the per-solver threads of :mod:`dptrain.data.loader`."""

    kind = "records"
    """What the sources read, for the start-up line ("LMDB", "image folder", "list file")."""

    def __init__(self, cfg: DataConfig, train: RecordReader, test: RecordReader | None, *, num_classes: int,
                 seed: int, rank: int = 0, cores: int = 1, render: RenderOptions = DEFAULT_RENDER,
                 pin_memory: bool = False) -> None:
        self._cfg, self._num_classes, self._seed = cfg, num_classes, seed
        self._render = render
        self._pin = pin_memory  # page-locked batch ring: only when the batches go to a CUDA device
        self._train, self._test = train, test
        self.num_train = len(self._train)
        self.num_test = len(self._test) if self._test is not None else 0
        self.channels, first_hw = self._probe(cfg, rank)
        self._stages = {train: build_stages(cfg, train=train, first_hw=first_hw) for train in (True, False)}
        self.mean, self.mean_image = self._resolve_mean(cfg, first_hw)
        if self.mean_image is not None:
            for stages in self._stages.values():
                stages.insert(0, ExpectSize(*self.mean_image.shape[1:], source="data.mean_file",
                                            fix="compute the mean over this DB or use data.mean_value"))
        in_spec = SampleSpec(None, None, self.channels)
        out = {train: check_chain(stages, in_spec) for train, stages in self._stages.items()}
        if out[True] != out[False]:
            raise ConfigError(f"training samples are {out[True]} but test samples {out[False]}; "
                              f"set data.crop_size or data.resize")
        self.sample_shape = (out[True].height, out[True].width, self.channels)
        self.scale = cfg.scale
        self.readers, self.renderers = default_threads(cfg, cores, training_on_cuda=pin_memory)
        crop = "off"
        if render.crop_decode:  # built (or found in the cache) now, not in the first batch's time
            crop = "on" if jpeg_crop.library() is not None else "unavailable"
        # the native path renders what the default options do; other options measure the Python path
        self.native = render == DEFAULT_RENDER and native_render.library() is not None
        log.info("%s input: %d reader + %d renderer threads per solver (%d cores), samples %s, prefetch %d, "
                 "JPEG crop decode %s, %s path", self._train.kind, self.readers, self.renderers, cores, self.sample_shape,
                 cfg.prefetch, crop, "native" if self.native else "Python")

    def _probe(self, cfg: DataConfig, rank: int) -> tuple[int, tuple[int, int]]:
        """(channels, (height, width) of the first good record) from up to PROBE_RECORDS records.

        The records are spread evenly over the DB. The stream is RGB if any of them is in
        colour, so a grey image at key 0 does not turn a colour DB grey. A bad record here
        counts against ``data.max_bad_records`` like anywhere else (the stream counts it
        again, once, when it reaches it).
        """
        picks = spread(self.num_train, PROBE_RECORDS)
        found: list[tuple[int, tuple[int, int]]] = []
        bad = 0
        handle = self._train.handle()
        try:
            for index in picks:
                key, value, error = handle.get(index)
                if error is None:
                    try:
                        found.append(probe_channels_and_size(parse_datum(value)))
                        continue
                    except DataError as e:
                        error = e
                located = error.located(path=self._train.path, key=key, rank=rank, kind=self._train.kind)
                bad += 1
                if bad > cfg.max_bad_records:
                    raise located from error
                log.warning("%s (skipped: data.max_bad_records = %d)", located, cfg.max_bad_records)
        finally:
            handle.close()
        if not found:
            raise DataError(f"none of the {len(picks)} records probed is readable", path=self._train.path, rank=rank,
                            kind=self._train.kind)
        gray = sum(1 for c, _ in found if c == 1)
        channels = 3 if gray < len(found) else 1
        if 0 < gray < len(found):
            log.info("%s: %d of %d probed records are grey; every sample is read as RGB", cfg.path, gray, len(found))
        return channels, found[0][1]

    def _resolve_mean(self, cfg: DataConfig, first_hw: tuple[int, int]) -> tuple[tuple[float, ...], torch.Tensor | None]:
        """(per-channel mean, mean image or None) from data.mean_value / data.mean_file.

        A mean *image* is subtracted pixel by pixel at each sample's crop window, as Caffe
        does, when the geometry is Caffe's (crop and mirror, no resize or random-resized
        crop). With a resize the windows no longer map onto the stored image, so its
        per-channel average is used, with a warning when the image is not flat.
        """
        if not cfg.mean_file:
            mean = tuple(cfg.mean_value)
            self._check_mean_channels(len(mean))
            return mean, None
        a = read_mean_file(cfg.mean_file)  # [C] or [C, H, W], RGB
        self._check_mean_channels(a.shape[0])
        per_channel = tuple(float(m) for m in a.reshape(a.shape[0], -1).mean(axis=1))
        if a.ndim == 1:
            return per_channel, None
        if not (cfg.resize or cfg.random_resized_crop):
            if a.shape[1:] != first_hw:
                raise ConfigError(f"data.mean_file {cfg.mean_file!r} is {a.shape[1]}x{a.shape[2]} (HxW) but the "
                                  f"records are {first_hw[0]}x{first_hw[1]}; compute the mean over this DB or "
                                  f"use data.mean_value")
            log.info("data.mean_file %s: a %dx%d mean image, subtracted at each crop window", cfg.mean_file,
                     a.shape[1], a.shape[2])
            return per_channel, torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
        spread = float(np.abs(a.reshape(a.shape[0], -1) - np.asarray(per_channel)[:, None]).max())
        if spread > MEAN_IMAGE_TOLERANCE:
            log.warning("data.mean_file %s: the mean image varies by up to %.1f pixel units, but with data.resize "
                        "or data.random_resized_crop crops do not map onto it; subtracting its per-channel average "
                        "%s. Set data.mean_value to silence this", cfg.mean_file, spread, per_channel)
        return per_channel, None

    def _check_mean_channels(self, n: int) -> None:
        if n not in (0, 1, self.channels):
            raise ConfigError(f"data mean has {n} channels/values but the images have {self.channels} "
                              f"channel(s); give 1 or {self.channels}")

    def _stream(self, reader: RecordReader, sequence: TrainSequence | TestSequence, batch_size: int,
                rank: int, train: bool) -> PipelineStream:
        p, t = self.readers, self.renderers
        parts = StreamParts(
            reader=reader, sequence=sequence,
            queues=QueueSet(p, t, capacity=2),
            ring=BatchRing(self._cfg.prefetch + 2, batch_size, self.sample_shape, pin=self._pin),
            budget=BadRecordBudget(self._cfg.max_bad_records, rank, substitutes=train),
            stages=self._stages[train], channels=self.channels, batch_size=batch_size,
            num_classes=self._num_classes, seed=self._seed, rank=rank, render=self._render,
            windows=self.mean_image is not None, drop_bad=not train,
            chunk_rows=min(CHUNK_ROWS_MAX, max(1, math.ceil(batch_size / (2 * t)))), native=self.native,
        )
        return PipelineStream(parts, readers=p, renderers=t)

    def train_batches(self, plan: SampleOrder, start_step: int) -> PipelineStream:
        """Batches of global micro-batch ``start_step``, ``start_step + 1``, ... forever."""
        return self._stream(self._train, TrainSequence(self.num_train, plan, start_step), plan.batch_size,
                            plan.rank, train=True)

    def test_batches(self, rank: int, world_size: int, batch_size: int) -> PipelineStream | EmptyStream:
        """This rank's contiguous slice of the test DB (centre crop, no mirror), then StopIteration."""
        indices = eval_range(self.num_test, rank, world_size)
        if self._test is None or len(indices) == 0:
            return EmptyStream()
        return self._stream(self._test, TestSequence(indices), batch_size, rank, train=False)
