"""The data-source seam: what the trainer asks of any input pipeline.

A source yields :class:`HostBatch` objects, uint8 NHWC images and int64 labels, in
the order fixed by :mod:`dptrain.data.sampling`. Normalisation, the cast to the
storage dtype and the NHWC->NCHW change happen on the device in :class:`DeviceFeeder`,
since doing them in numpy costs more than the JPEG decode itself.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dptrain.data.sampling import SampleOrder

DROPPED_LABEL = -1
"""Label of a test-batch row whose record was bad and skipped (data.max_bad_records): it holds
no sample, and the test phase does not score it."""


@dataclass
class HostBatch:
    """One solver's batch as the pipeline produced it."""

    images: torch.Tensor
    """[B, H, W, C] uint8; pinned CPU memory where the pipeline can, or already on the device."""
    labels: torch.Tensor
    """[B] int64; ``DROPPED_LABEL`` marks a skipped bad record in a test batch."""
    release: Callable[[torch.cuda.Event | None], None] | None = None
    """Called once the batch has been consumed, with the event that marks the end of its
    device copy (None on CPU); a ring-buffer pipeline reuses the slot after that event."""
    info: dict[str, int] = field(default_factory=dict)
    """Per-batch counters the pipeline wants in metrics (e.g. bad_records)."""
    windows: torch.Tensor | None = None
    """[B, 3] int32 (y0, x0, mirrored) of each sample's crop in its stored image, from sources
    whose ``mean_image`` is set (Caffe's per-pixel ``mean_file``); None otherwise."""


class BatchStream(Protocol):
    def __iter__(self) -> Iterator[HostBatch]: ...
    def __next__(self) -> HostBatch: ...
    def close(self) -> None: ...


class DataSource(Protocol):
    """What the trainer needs from an input pipeline."""

    num_train: int
    num_test: int
    sample_shape: tuple[int, int, int]
    """(H, W, C) of the images the streams yield."""
    mean: tuple[float, ...]
    """Per-channel mean in pixel units, subtracted on the device."""
    mean_image: torch.Tensor | None
    """[C or 1, H, W] float32 mean image (RGB, pixel units) of the stored images, or None. When
    set, each sample has its own crop window of it subtracted instead of ``mean`` (Caffe's
    ``mean_file``), and the batches carry ``HostBatch.windows``."""
    scale: float
    """Multiplier after mean subtraction."""

    def train_batches(self, plan: SampleOrder, start_step: int) -> BatchStream:
        """Batches for global micro-batch ``start_step``, ``start_step + 1``, ... forever."""
        ...

    def test_batches(self, rank: int, world_size: int, batch_size: int) -> BatchStream:
        """This rank's slice of the test set (see sampling.eval_range), then StopIteration."""
        ...


class DeviceFeeder:
    """Moves host batches to the device and normalises them there, one batch ahead.

    On CUDA the copy runs on a side stream (non_blocking from pinned memory) and the
    compute stream waits on an event, so no host sync happens. The normalisation
    ``(x - mean) * scale``, the cast to ``dtype`` and the NHWC->NCHW change run on the
    device (:func:`normalize_batch`); with ``channels_last`` the NHWC bytes keep their layout.
    With a ``mean_image``, ``mean`` is each sample's window of it (:func:`window_means`).
    """

    def __init__(
        self,
        stream: BatchStream,
        *,
        device: torch.device,
        dtype: torch.dtype,
        mean: tuple[float, ...],
        scale: float,
        channels_last: bool,
        mean_image: torch.Tensor | None = None,
    ) -> None:
        self._stream = stream
        self._device = device
        self._dtype = dtype
        self._channels_last = channels_last
        self._mean = torch.tensor(mean or (0.0,), dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self._scale = scale
        self._bias = self._mean * -scale  # [1, C, 1, 1] fp32: the fused form's additive term, made once
        self._mean_image = None if mean_image is None else mean_image.to(device, torch.float32)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._next: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.cuda.Event | None] | None = None
        self.last_info: dict[str, int] = {}

    def _stage(self) -> None:
        host = next(self._stream)
        self.last_info = host.info
        windows = None
        if self._mean_image is not None and host.windows is None:
            raise RuntimeError("DeviceFeeder has a mean image but the batch carries no crop windows")
        if self._copy_stream is None:
            # On the CPU .to() returns the ring slot itself. The images are normalised into a new
            # tensor before the next batch is staged, but the labels live on as the loss's saved
            # target through backward, after release() lets a worker refill the slot: copy them.
            images, labels, event = host.images.to(self._device), host.labels.to(self._device, copy=True), None
            if self._mean_image is not None:
                windows = host.windows.to(self._device)  # read in __next__ with the images: no copy needed
        else:
            with torch.cuda.stream(self._copy_stream):
                images = host.images.to(self._device, non_blocking=True)
                labels = host.labels.to(self._device, non_blocking=True)
                if self._mean_image is not None:
                    windows = host.windows.to(self._device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
        if host.release is not None:
            host.release(event)
        self._next = (images, labels, windows, event)

    def __iter__(self) -> DeviceFeeder:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (images [B, C, H, W] in ``dtype``, labels [B] int64) on the device."""
        if self._next is None:
            self._stage()
        assert self._next is not None, "stage produced no batch"
        images, labels, windows, event = self._next
        self._next = None
        if event is not None:
            # The compute stream must not read the batch before its copy lands; the
            # copy stream's buffers are then used on the compute stream, so record it.
            torch.cuda.current_stream(self._device).wait_event(event)
            for t in (images, labels) if windows is None else (images, labels, windows):
                t.record_stream(torch.cuda.current_stream(self._device))
        if windows is not None:
            assert self._mean_image is not None, "windows are only staged with a mean image"
            mean = window_means(self._mean_image, windows, images.shape[1], images.shape[2])
            x = normalize_batch(images, mean, self._scale, self._dtype, self._channels_last)
        else:
            x = normalize_batch(images, self._mean, self._scale, self._dtype, self._channels_last, bias=self._bias)
        return x, labels

    def prefetch(self) -> None:
        """Start the next batch's copy now, so it overlaps this step's compute."""
        if self._next is None:
            try:
                self._stage()
            except StopIteration:
                pass

    def close(self) -> None:
        self._stream.close()


def window_means(mean_image: torch.Tensor, windows: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, C, height, width] fp32: each sample's crop window of ``mean_image`` [C, H, W], mirrored with it.

    Caffe subtracts the mean image at the crop's offset, before mirroring: ``out =
    mirror(crop(x - M)) = mirror(crop(x)) - mirror(crop(M))``, which is this gather.
    """
    y0, x0, flip = windows.to(torch.int64).unbind(1)
    ys = torch.arange(height, device=windows.device)
    xs = torch.arange(width, device=windows.device)
    rows = y0[:, None] + ys  # [B, h]
    cols = x0[:, None] + torch.where(flip[:, None] != 0, width - 1 - xs, xs)  # [B, w]
    return mean_image[:, rows[:, :, None], cols[:, None, :]].permute(1, 0, 2, 3)  # [C, B, h, w] -> [B, C, h, w]


def normalize_batch(
    images: torch.Tensor, mean: torch.Tensor, scale: float, dtype: torch.dtype, channels_last: bool,
    *, fused: bool | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 [B, H, W, C] -> ``dtype`` [B, C, H, W] as ``(x - mean) * scale`` in fp32 math.

    ``fused`` (default: on CUDA) is one elementwise kernel: it reads the uint8 NHWC bytes and
    writes ``x * scale + (-mean * scale)``, computed in fp32, in ``dtype`` and the target layout
    (1 byte read and 2-4 written per element). It differs from the unfused form by fp32 rounding
    (one ulp). Unfused (default on the CPU, where torch's mixed-dtype kernels are not vectorised
    and the fused form ran slower; measurements: docs/measurements.md#normalisation-on-the-cpu):
    an fp32 copy in the target layout, subtract and scale in place, then the cast. ``bias`` is
    ``-mean * scale`` when the caller keeps it (DeviceFeeder does, so a step allocates nothing for it).
    """
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = images.permute(0, 3, 1, 2)  # an NCHW view of the NHWC bytes (channels_last strides)
    if images.is_cuda if fused is None else fused:
        out = torch.empty(x.shape, dtype=dtype, device=images.device, memory_format=fmt)
        return torch.add(mean * -scale if bias is None else bias, x, alpha=scale, out=out)
    # the copy converts and lays out in one pass and is always new: the in-place ops never touch the source
    x = x.to(torch.float32, memory_format=fmt, copy=True)
    return x.sub_(mean).mul_(scale).to(dtype)
