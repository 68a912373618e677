"""Precision policy (storage dtype, FP32 islands) and the device-side dynamic loss scaler.

Storage: the model's weights, activations and gradients are held in ``storage``
(fp16/bf16/fp32). Modules matching ``fp32_modules`` (BatchNorm by default) keep their
parameters and statistics in fp32; their inputs are cast to fp32 and outputs cast back,
as NVCaffe's per-layer ``forward_math``. The loss is always computed in fp32.
"""
from __future__ import annotations

import fnmatch
import functools
import logging
import time

import torch
from torch import nn

from dptrain.config import LossScaleConfig, PrecisionConfig

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


SLOW_FACTOR = 4.0
"""A storage dtype whose probe convolution is this many times slower than fp32's runs a reference path."""


@functools.cache
def cpu_slowdown(storage: str) -> float:
    """How many times slower than fp32 one small convolution's forward and backward runs in
    ``storage`` on this CPU (1.0 for fp32): measured once per process, in a few tens of ms.

    Measured rather than asked of oneDNN: torch's probe (``_is_mkldnn_fp16_supported``) answers
    True on VMs whose fp16 convolutions fall back to oneDNN's reference kernels, tens of times
    slower than fp32 (measurements: docs/measurements.md#precision-probe).
    The best of three runs of each, after a warm-up, on the calling thread's torch thread count.
    """
    if storage == "fp32":
        return 1.0

    def best(dtype: torch.dtype) -> float:
        x = torch.randn(4, 16, 16, 16, dtype=dtype, requires_grad=True)  # [N, C, H, W]
        conv = nn.Conv2d(16, 16, 3, padding=1).to(dtype)
        times = []
        for _ in range(4):
            start = time.perf_counter()
            conv(x).sum().backward()
            times.append(time.perf_counter() - start)
        return min(times[1:])

    return best(DTYPES[storage]) / max(best(torch.float32), 1e-9)


def cpu_native_support(storage: str) -> bool:
    """Whether this CPU runs ``storage``-dtype convolutions at native speed (:func:`cpu_slowdown`
    under :data:`SLOW_FACTOR`); fp32 always does."""
    return storage == "fp32" or cpu_slowdown(storage) < SLOW_FACTOR


def warn_if_slow_on_cpu(storage: str, device: torch.device) -> None:
    """One log line when the storage dtype runs a slow reference path on this CPU, naming the faster one."""
    if device.type != "cpu" or cpu_native_support(storage):
        return
    faster = next(d for d in ("bf16", "fp32") if d != storage and cpu_native_support(d))
    log.warning("precision.storage = %r runs %.0fx slower than fp32 on this CPU (%s; a probe convolution, measured "
                "at startup): its kernels fall back to a reference path. Use precision.storage = %r for CPU runs here",
                storage, cpu_slowdown(storage), torch.backends.cpu.get_cpu_capability(), faster)


def _matches(name: str, module: nn.Module, patterns: list[str]) -> bool:
    """A module matches by its class name (or a base class name) or its qualified name."""
    type_names = [c.__name__ for c in type(module).__mro__]
    return any(fnmatch.fnmatchcase(t, p) for p in patterns for t in type_names) or any(
        fnmatch.fnmatchcase(name, p) for p in patterns
    )


def _cast_inputs_fp32(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _make_cast_back(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple, out):
        return out.to(dtype) if torch.is_tensor(out) and out.is_floating_point() else out

    return hook


def apply_precision(model: nn.Module, cfg: PrecisionConfig) -> list[str]:
    """Cast ``model`` to the storage dtype in place, keeping FP32 islands; return their names.

    An island's inputs are cast to fp32 before it runs and its output is cast back to the
    storage dtype, so the rest of the network sees only storage-dtype activations.
    BatchNorm is the exception: its CPU and cuDNN kernels take a storage-dtype input with
    fp32 parameters and statistics and compute in fp32 natively, so it needs no casts
    (which would cost two extra passes over every activation).
    """
    dtype = DTYPES[cfg.weights]  # fp32 under autocast: the model is not cast, torch.autocast casts per op
    model.to(dtype)
    if dtype == torch.float32:
        return []
    islands: list[str] = []
    for name, module in model.named_modules():
        if name and _matches(name, module, cfg.fp32_modules):
            if any(_matches(n, m, cfg.fp32_modules) for n, m in _ancestors(model, name)):
                continue  # an enclosing island already handles the casts
            module.float()
            if not isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.register_forward_pre_hook(_cast_inputs_fp32)
                module.register_forward_hook(_make_cast_back(dtype))
            islands.append(name)
    return islands


def _ancestors(model: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    parts = name.split(".")
    out = []
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        out.append((prefix, model.get_submodule(prefix)))
    return out


class LossScaler:
    """Loss scaling whose whole state machine runs on the device.

    ``found_inf`` ([1] fp32) is set by :meth:`record_overflow` from the optimizer's norm pass
    and read by the update kernel, which skips the step when it is set. :meth:`update` advances the scale with
    device ops only. The host reads device state only in :meth:`stats` and
    :meth:`floor_hit`, which the trainer calls at display and snapshot boundaries.

    Dynamic rule: an overflowing step is always skipped; after ``hysteresis`` consecutive
    overflows the scale is multiplied by ``backoff_factor`` (and the streak restarts);
    after ``growth_interval`` consecutive clean steps it is multiplied by
    ``growth_factor``, capped at ``max_scale``. A backoff below ``min_scale`` leaves the
    scale at ``min_scale`` and raises the floor flag.
    """

    def __init__(self, cfg: LossScaleConfig, mode: str, device: torch.device) -> None:
        self.cfg, self.mode = cfg, mode
        self.enabled = mode != "none"
        init = cfg.init_scale if self.enabled else 1.0
        self.scale = torch.full((1,), init, dtype=torch.float32, device=device)
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self._growth = torch.zeros(1, dtype=torch.int32, device=device)
        self._streak = torch.zeros(1, dtype=torch.int32, device=device)
        self._skipped = torch.zeros(1, dtype=torch.int64, device=device)
        self._floor_hit = torch.zeros(1, dtype=torch.bool, device=device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` in fp32 (the loss itself when scaling is off)."""
        return loss * self.scale if self.enabled else loss

    def inv_scale(self, grad_divisor: int) -> torch.Tensor:
        """``1 / (S * grad_divisor)`` as a [1] fp32 device tensor: unscale and average in one factor."""
        return (1.0 / grad_divisor) / self.scale

    def record_overflow(self, grad_norm: torch.Tensor) -> None:
        """Set ``found_inf`` from the reduced gradient's norm (non-finite: skip this step).

        Device ops only. Every rank holds the same reduced gradient, so every rank takes the
        same decision without another collective. A no-op without loss scaling.
        """
        if self.enabled:
            self.found_inf.copy_((~torch.isfinite(grad_norm)).float().reshape(1))

    def record_nonfinite_loss(self, ranks_nonfinite: torch.Tensor) -> None:
        """Without loss scaling, skip a step whose loss was not finite on any rank
        (``ranks_nonfinite``: [] fp32, how many ranks saw it, summed by the reducer's
        collective), so the weights stay finite while the trainer counts towards
        ``solver.max_nonfinite``. Device ops only; a no-op with loss scaling, where the
        optimizer's norm pass sets the flag."""
        if not self.enabled:
            skip = (ranks_nonfinite > 0).reshape(1)
            self.found_inf.copy_(skip)
            self._skipped.add_(skip)

    def update(self) -> None:
        """Advance the scale after a step; device ops only, no host sync."""
        if not self.enabled:
            return
        overflow = self.found_inf > 0
        self._skipped.add_(overflow.long())
        if self.mode == "static":
            return
        c = self.cfg
        streak = torch.where(overflow, self._streak + 1, torch.zeros_like(self._streak))
        backoff = streak >= c.hysteresis
        backed = self.scale * c.backoff_factor
        self._floor_hit |= backoff & (backed < c.min_scale)
        scale = torch.where(backoff, backed.clamp(min=c.min_scale), self.scale)
        growth = torch.where(overflow, torch.zeros_like(self._growth), self._growth + 1)
        grow = growth >= c.growth_interval
        scale = torch.where(grow, (scale * c.growth_factor).clamp(max=c.max_scale), scale)
        self.scale.copy_(scale)
        self._growth.copy_(torch.where(grow, torch.zeros_like(growth), growth))
        self._streak.copy_(torch.where(backoff, torch.zeros_like(streak), streak))

    def stats(self) -> dict[str, float]:
        """Host copy of the scale and the skipped-step count. A host sync: call when logging."""
        return {"loss_scale": float(self.scale.item()), "skipped_steps": int(self._skipped.item())}

    def floor_hit(self) -> bool:
        """Whether a backoff would have taken the scale below ``min_scale`` (``dptrain.train.health``
        ends the run then). A host sync: call at display and snapshot boundaries."""
        return bool(self._floor_hit.item())

    def state_dict(self) -> dict[str, torch.Tensor | str]:
        return {
            "mode": self.mode,
            "scale": self.scale.clone(),
            "growth": self._growth.clone(),
            "streak": self._streak.clone(),
            "skipped": self._skipped.clone(),
            "floor_hit": self._floor_hit.clone(),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor | str]) -> None:
        """Restore the scaler. Only a snapshot taken in the same mode restores the scale: one
        resumed with other precision settings starts from this config's scale (1 with no
        scaling), since a stale 65536 with scaling off would divide every gradient by it.
        A static scale always comes from the config. Skipped steps are counted on."""
        self._skipped.copy_(state["skipped"])
        saved = state["mode"]
        if saved != self.mode:
            log.warning("the snapshot's loss scaling is %s, this run's is %s: the scale restarts at %g",
                        saved, self.mode, float(self.scale.item()))
            return
        if self.mode == "dynamic":
            self.scale.copy_(state["scale"])
            self._growth.copy_(state["growth"])
            self._streak.copy_(state["streak"])
            self._floor_hit.copy_(state["floor_hit"])
