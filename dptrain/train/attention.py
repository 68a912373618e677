"""``model.attention``: which kernel runs the model's ``F.scaled_dot_product_attention``, chosen by measuring.

torch dispatches an SDPA call by a fixed priority (flash, then memory-efficient, then math,
whichever accepts the inputs), not by speed. On the CPU that order loses where the sequences are
short: torch's flash kernel for the CPU tiles the sequence, and its bf16 backward took longer than
the math path's few large matmuls on a small ViT's 65 tokens, while at 1024 tokens flash won by
far (docs/measurements.md#attention-kernels). The right kernel depends on the shapes, so dptrain
measures, as cuDNN's autotuner and NVCaffe do for convolutions:

1. :func:`record_calls`: one forward of two samples in training mode (in eval mode and without
   gradients ``nn.MultiheadAttention`` takes a fused path that calls no SDPA), under no_grad, with
   the SDPA calls recorded (their shapes, dtype, mask and flags; the batch dimension then scaled to
   the solver's batch). Buffers are put back afterwards, and the RNG is forked.
2. :func:`time_kernels`: each kernel torch has for those calls, forward and backward on random
   inputs of the recorded shapes, a few times; a kernel that refuses the inputs is left out.
3. The fastest total wins, unless it beats torch's own dispatch by less than :data:`MIN_GAIN`
   (then torch's). Rank 0 measures and every rank takes its choice, so all solvers run the same
   numerics; a snapshot records it, and ``--resume`` keeps it rather than measuring again.

The choice only selects among torch's own kernels, each exact up to rounding. "auto" measures for
a model given by import path, running eagerly on the CPU; the zoo has no attention, inductor
lowers SDPA itself under ``model.compile``, and on CUDA torch's order is tuned for the GPUs (this
path has not run there). A named kernel ("math", "flash", "efficient", "cudnn") is used wherever
set; "torch" leaves the dispatch to torch.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger(__name__)

KERNELS: dict[str, SDPBackend] = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                                  "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
"""``model.attention``'s kernel names -> torch's SDPA backends."""
TORCH = "torch"
"""torch's own dispatch, the baseline every measured kernel must beat."""
MIN_GAIN = 0.03
"""A kernel replaces torch's dispatch only if it is this much faster over the recorded calls: a
smaller lead is within a start-up timing's noise, and not worth numerics that differ from torch's."""
RECORD_BATCH = 2
"""Samples in the recording forward: two, since a batch norm in training mode refuses one."""
REPEATS = 3
"""Timed forward-and-backward passes per kernel and call (after one untimed)."""


@dataclass(frozen=True)
class Call:
    """One SDPA call's inputs, as far as the kernel choice depends on them."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtype: torch.dtype
    mask: tuple[tuple[int, ...], torch.dtype] | None
    dropout: float
    causal: bool
    scale: float | None

    def scaled(self, batch: int) -> Call:
        """The same call at ``batch`` samples: the leading dimension scaled from the recorded
        :data:`RECORD_BATCH` samples (it holds the batch, or batch x heads)."""
        def grow(shape: tuple[int, ...]) -> tuple[int, ...]:
            return (shape[0] * batch // RECORD_BATCH, *shape[1:]) if shape else shape

        mask = None if self.mask is None else (grow(self.mask[0]) if self.mask[0][:1] == self.q[:1] else self.mask[0],
                                               self.mask[1])
        return Call(grow(self.q), grow(self.k), grow(self.v), self.dtype, mask, self.dropout, self.causal, self.scale)


SDPA_KERNEL_OPS = frozenset({
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable"})
"""The aten kernels ``F.scaled_dot_product_attention`` dispatches to, other than the math path's
decomposition: what the recording sees, whoever made the call (the model's code, or torch's own, as
``nn.MultiheadAttention`` does)."""


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func._schema.name.split("::")[-1] in SDPA_KERNEL_OPS:
            a = {**dict(zip((x.name for x in func._schema.arguments), args, strict=False)), **kwargs}
            mask = a.get("attn_mask", a.get("attn_bias"))
            self.calls.append(Call(tuple(a["query"].shape), tuple(a["key"].shape), tuple(a["value"].shape),
                                   a["query"].dtype, None if mask is None else (tuple(mask.shape), mask.dtype),
                                   float(a.get("dropout_p", 0.0)), bool(a.get("is_causal", False)), a.get("scale")))
        return func(*args, **kwargs)


def record_calls(model: nn.Module, sample: torch.Tensor, precision: Callable[[], contextlib.AbstractContextManager]
                 ) -> list[Call]:
    """The SDPA calls of one forward of ``sample`` (:data:`RECORD_BATCH` samples, in training mode,
    under no_grad and ``precision``, the run's autocast context); the model's buffers (batch-norm
    statistics) and the RNG are left as they were. Empty when the forward fails: the training forward
    will say why."""
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    was_training = model.training
    rec = _Recorder()
    try:
        with torch.random.fork_rng(devices=[sample.device] if sample.device.type == "cuda" else []), \
                torch.no_grad(), precision(), rec:
            model.train()(sample)
    except Exception as e:  # noqa: BLE001 - any failure of the user's forward is the training forward's to report
        log.debug("model.attention: the recording forward failed (%s); torch's dispatch stays", e)
        return []
    finally:
        model.train(was_training)
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers and b.shape == buffers[n].shape:
                    b.copy_(buffers[n])
    return rec.calls


def _inputs(call: Call, device: torch.device, gen: torch.Generator) -> tuple[list[torch.Tensor], dict[str, Any]]:
    def rand(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device="cpu").to(device=device, dtype=call.dtype).requires_grad_()

    qkv = [rand(call.q), rand(call.k), rand(call.v)]
    kwargs: dict[str, Any] = {"is_causal": call.causal, "scale": call.scale, "dropout_p": call.dropout}
    if call.mask is not None:
        shape, dtype = call.mask
        kwargs["attn_mask"] = (torch.ones(shape, dtype=torch.bool, device=device) if dtype == torch.bool
                               else torch.zeros(shape, dtype=dtype, device=device))
    return qkv, kwargs


def _time_once(call: Call, kernel: str, device: torch.device, gen: torch.Generator) -> float:
    (q, k, v), kwargs = _inputs(call, device, gen)
    ctx = contextlib.nullcontext() if kernel == TORCH else sdpa_kernel([KERNELS[kernel]])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with ctx:
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    out.backward(torch.ones_like(out))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def time_kernels(calls: list[Call], device: torch.device, kernels: list[str] | None = None) -> dict[str, float]:
    """Seconds per step of every kernel that runs all of ``calls`` (forward and backward, the median of
    :data:`REPEATS` passes per distinct call, times its count), torch's dispatch included."""
    gen = torch.Generator().manual_seed(0)
    counts = Counter(calls)
    out: dict[str, float] = {}
    for kernel in [TORCH, *(kernels or list(KERNELS))]:
        total = 0.0
        try:
            for call, n in counts.items():
                _time_once(call, kernel, device, gen)  # untimed: first-use costs
                total += n * statistics.median(_time_once(call, kernel, device, gen) for _ in range(REPEATS))
        except RuntimeError as e:  # "No available kernel": this backend does not take these inputs
            log.debug("model.attention: %s does not run %s (%s)", kernel, call, str(e).splitlines()[0] if str(e) else e)
            continue
        out[kernel] = total
    return out


def fastest(times: dict[str, float]) -> str:
    """The kernel to use: the fastest, or torch's dispatch unless that lead is at least :data:`MIN_GAIN`."""
    best = min(times, key=times.__getitem__)
    base = times.get(TORCH)
    if base is None or best == TORCH or times[best] > base * (1 - MIN_GAIN):
        return TORCH
    return best


def choose(model: nn.Module, sample: torch.Tensor, batch_size: int,
           precision: Callable[[], contextlib.AbstractContextManager]) -> tuple[str, dict[str, float]]:
    """``model.attention = "auto"``'s measurement on this process: (kernel, seconds per step of each)."""
    calls = [c.scaled(batch_size) for c in record_calls(model, sample, precision)]
    if not calls:
        return TORCH, {}
    with torch.random.fork_rng(devices=[]):
        times = time_kernels(calls, sample.device)
    return fastest(times), times


def context(kernel: str) -> contextlib.AbstractContextManager:
    """The forward's SDPA context for ``kernel`` (torch's dispatch: none)."""
    return contextlib.nullcontext() if kernel == TORCH else sdpa_kernel([KERNELS[kernel]])
