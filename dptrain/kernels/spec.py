"""The update rules' one specification: argument type, scalar rounding and per-element math.

Every backend (:mod:`.cpu` in place, :mod:`.cpu` compiled, :mod:`.cuda` through CuPy)
takes one :class:`UpdateArgs` and must produce what :func:`reference` produces from it.
A rule is defined here by three things:

* its **state** tensors (e.g. SGD's momentum), flat like the gradient;
* its **scalars**: the hyper-parameters rounded to fp32 exactly once, on the host
  (:meth:`Rule.scalars`), in the order the CUDA kernel takes them;
* its **math**: a pure function of the unscaled fp32 gradient, the fp32 master, the state,
  the per-element lr multiplier and the scalars, returning the new master and state, every
  multiply and add rounded separately (torch ops; the kernel is compiled with
  ``--fmad=false``).

:func:`reference` wraps the math with what is common to every rule: unscale
(``g = float(grads) * grad_coef``), skip on overflow (``found_inf`` set: master, weights and
state stay bit-identical, decided on the device with ``torch.where``), the storage-dtype
weight write-back and the zeroing of the gradient.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

DECAY_NONE, DECAY_L2, DECAY_DECOUPLED = 0, 1, 2
"""How weight decay enters (the kernels' ``decay_mode``): none; added to the gradient (Caffe's
L2); beside the step, scaled by the learning rate (decoupled, Loshchilov & Hutter)."""


@dataclass(frozen=True, kw_only=True)
class Hyper:
    """An update's hyper-parameters as the optimizer computes them for one step."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    decoupled: bool = False
    """Decoupled weight decay (``w -= wd * lr * w`` beside the step) instead of L2 in the gradient."""

    @property
    def decay_mode(self) -> int:
        if not self.weight_decay:
            return DECAY_NONE
        return DECAY_DECOUPLED if self.decoupled else DECAY_L2


@dataclass(frozen=True, kw_only=True)
class UpdateArgs:
    """One fused update over one flat group; all tensors 1-D, contiguous, same length and layout.

    ``params`` is ``master`` itself for fp32 storage. ``grad_coef`` and ``found_inf`` are
    [1] fp32 device scalars, read on the device: no backend reads them on the host except
    the CPU ones, where a read is a plain load.
    """

    rule: str
    """Key of :data:`RULES`."""
    grads: torch.Tensor
    """[n] storage dtype: the summed, loss-scaled gradient. Zeroed on return."""
    master: torch.Tensor
    """[n] fp32 master weights."""
    params: torch.Tensor
    """[n] storage dtype: receives the master rounded to the storage dtype."""
    state: tuple[torch.Tensor, ...]
    """The rule's per-element state, in :attr:`Rule.state_names` order."""
    grad_coef: torch.Tensor
    """[1] fp32: ``1 / (S * grad_divisor)`` times the clipping factor."""
    found_inf: torch.Tensor
    """[1] fp32: non-zero (or NaN) skips the step."""
    hyper: Hyper
    lr_scale: torch.Tensor | None = None
    """[n] fp32 per-element multiplier of ``lr`` (LARC), or None for 1."""

    @property
    def numel(self) -> int:
        return self.grads.numel()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the update reads or writes (for the dispatch's device checks)."""
        extra = [self.lr_scale] if self.lr_scale is not None else []
        return [self.grads, self.master, self.params, *self.state, self.grad_coef, self.found_inf, *extra]


# --------------------------------------------------------------------------------------- SGD


class SgdScalars(NamedTuple):
    """SGD's kernel scalars, fp32-rounded on the host (``SgdScalars`` in update.cu)."""

    lr: float
    momentum: float
    weight_decay: float
    wd_lr: float
    """fp32(weight_decay * lr), the product taken in double: the decoupled decay coefficient
    without a per-element lr multiplier."""
    decay_mode: int


def _f32(x: float) -> float:
    return float(np.float32(x))


def sgd_scalars(h: Hyper) -> SgdScalars:
    """A Python float meeting an fp32 tensor is rounded to fp32; the decoupled decay's
    coefficient is the double product ``weight_decay * lr`` rounded once."""
    return SgdScalars(_f32(h.lr), _f32(h.momentum), _f32(h.weight_decay), _f32(h.weight_decay * h.lr), h.decay_mode)


def sgd_math(g: torch.Tensor, w: torch.Tensor, state: tuple[torch.Tensor, ...], lr_scale: torch.Tensor | None,
             s: SgdScalars) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Momentum SGD with FP32 masters (NVCaffe's ``SGDRegUpdateAllAndClear``), in fp32 math:

      lr_e = lr * lr_scale
      g += weight_decay * w                      (decay_mode l2)
      fp32 momentum, Caffe form:  h = m*h + lr_e*g;  step = h
      fp16 momentum, lr-factored (NVIDIA's mixed-precision slides):
                                  G = half(m*float(G) + g);  step = lr_e*float(G)
      step += weight_decay * lr_e * w            (decay_mode decoupled)
      w -= step
    """
    (h,) = state
    lr_e = s.lr if lr_scale is None else s.lr * lr_scale
    if s.decay_mode == DECAY_L2:
        g = g + s.weight_decay * w
    if h.dtype == torch.float32:
        h = s.momentum * h + lr_e * g
        step = h
    else:
        h = (s.momentum * h.float() + g).to(h.dtype)
        step = lr_e * h.float()
    if s.decay_mode == DECAY_DECOUPLED:
        step = step + (s.wd_lr if lr_scale is None else s.weight_decay * lr_e) * w
    return w - step, (h,)


# --------------------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """One update rule: what the spec and every backend need to know about it."""

    name: str
    state_names: tuple[str, ...]
    state_dtypes: tuple[torch.dtype, ...]
    """Dtypes each state tensor may have (the CUDA kernel is instantiated for each)."""
    scalars_type: type
    """The NamedTuple of its scalars: float fields are fp32 values, int fields flags."""
    to_scalars: Callable[[Hyper], tuple]
    math: Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, ...]]]

    def scalars(self, hyper: Hyper) -> tuple:
        """The hyper-parameters rounded as the spec rounds them, in the kernel's argument order."""
        return self.to_scalars(hyper)


RULES: dict[str, Rule] = {
    "sgd": Rule("sgd", ("momentum",), (torch.float32, torch.float16), SgdScalars, sgd_scalars, sgd_math),
}


def rule_of(args: UpdateArgs) -> Rule:
    rule = RULES.get(args.rule)
    if rule is None:
        raise RuntimeError(f"unknown update rule {args.rule!r}; known: {sorted(RULES)}")
    if len(args.state) != len(rule.state_names):
        raise RuntimeError(f"rule {rule.name} takes state {rule.state_names}, got {len(args.state)} tensor(s)")
    return rule


# --------------------------------------------------------------------------------------- reference


def reference(a: UpdateArgs) -> None:
    """The update every backend must reproduce, in place; see the module docstring.

    Reads ``found_inf`` on the device (``torch.where``), so the host never waits; a skipped
    step keeps master and state bit-identical (``w - 0*h`` would turn -0.0 into +0.0).
    """
    rule = rule_of(a)
    skip = a.found_inf.reshape(()) != 0
    g = a.grads.float() * a.grad_coef
    new_w, new_state = rule.math(g, a.master, a.state, a.lr_scale, rule.scalars(a.hyper))
    for old, new in zip(a.state, new_state):
        old.copy_(torch.where(skip, old, new))
    a.master.copy_(torch.where(skip, a.master, new_w))
    if a.params is not a.master:
        a.params.copy_(a.master)
    a.grads.zero_()


def grad_norm_reference(grads: torch.Tensor) -> torch.Tensor:
    """L2 norm of one flat gradient buffer, accumulated in fp32: [] fp32 on the device.

    Non-finite gradients make the norm non-finite, so one pass yields both the overflow
    flag and the clipping norm. (Squares of finite bf16 values above ~1.8e19 overflow
    fp32 too; such a step is then treated as an overflow, which is the safe side.)
    """
    return torch.linalg.vector_norm(grads, dtype=torch.float32)
