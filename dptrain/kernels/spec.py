"""The update rules' one specification: argument type, scalar rounding and per-element math.

Every backend (:mod:`.cpu` in place, :mod:`.cpu` compiled, :mod:`.cuda` through CuPy)
takes one :class:`UpdateArgs` and must produce what :func:`reference` produces from it.
A rule is defined here by three things:

* its **state** tensors (e.g. SGD's momentum, Adam's two moments), flat like the gradient;
* its **scalars**: the hyper-parameters rounded to fp32 exactly once, on the host
  (:meth:`Rule.scalars`), in the order the CUDA kernel takes them;
* its **math**: a pure function of the unscaled fp32 gradient, the fp32 master, the state,
  the per-element inputs (:class:`PerElement`: lr and decay multipliers, the step's
  bias corrections) and the scalars, returning the new master and state, every multiply,
  divide, square root and add rounded separately (torch ops; the kernel is compiled with
  ``--fmad=false``).

:func:`reference` wraps the math with what is common to every rule: unscale
(``g = float(grads) * grad_coef``), skip on overflow (``found_inf`` set: master, weights and
state stay bit-identical, decided on the device with ``torch.where``), the storage-dtype
weight write-back and the zeroing of the gradient.

Weight decay is common to every rule too (:func:`decay_coefs`): ``decay_mode`` l2 adds
``wd_e * w`` to the gradient, decoupled adds ``wd_lr_e * w`` to the step (LAMB: to the
update direction, before the trust ratio), with ``wd_e = weight_decay * decay_scale`` per
element when a decay table is given (Caffe's ``decay_mult``).
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
    """An update's hyper-parameters as the optimizer computes them for one step; each rule
    reads the fields it needs (:attr:`Rule.scalars`)."""

    lr: float
    momentum: float = 0.0
    """sgd, nesterov and rmsprop: momentum coefficient."""
    weight_decay: float = 0.0
    decoupled: bool = False
    """Decoupled weight decay (``w -= wd * lr * w`` beside the step) instead of L2 in the gradient."""
    beta1: float = 0.9
    """adam and lamb: first-moment decay."""
    beta2: float = 0.999
    """adam and lamb: second-moment decay."""
    eps: float = 1e-8
    """adam, lamb and rmsprop: added to the root of the second moment."""
    rms_decay: float = 0.99
    """rmsprop: decay of the mean square (Caffe's rms_decay, torch's alpha)."""

    @property
    def decay_mode(self) -> int:
        if not self.weight_decay:
            return DECAY_NONE
        return DECAY_DECOUPLED if self.decoupled else DECAY_L2


@dataclass(frozen=True, kw_only=True)
class UpdateArgs:
    """One fused update over one flat group; all tensors 1-D, contiguous, same length and layout.

    ``params`` is ``master`` itself for fp32 storage. ``grad_coef``, ``found_inf`` and
    ``bias_correction`` are device scalars, read on the device: no backend reads them on
    the host except the CPU ones, where a read is a plain load.
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
    """[n] fp32 per-element multiplier of ``lr`` (lr_mult, LARC, LAMB's trust ratio), or None for 1."""
    decay_scale: torch.Tensor | None = None
    """[n] fp32 per-element multiplier of ``weight_decay`` (decay_mult), or None for 1."""
    bias_correction: torch.Tensor | None = None
    """[2] fp32 on the device: ``(1 - beta1^t, sqrt(1 - beta2^t))`` for this step's ``t``
    (:func:`bias_corrections`), or None for (1, 1). Read by adam and lamb only."""

    @property
    def numel(self) -> int:
        return self.grads.numel()

    def per_element(self) -> PerElement:
        return PerElement(self.lr_scale, self.decay_scale, self.bias_correction)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the update reads or writes (for the dispatch's device checks)."""
        extra = [t for t in self.per_element() if t is not None]
        return [self.grads, self.master, self.params, *self.state, self.grad_coef, self.found_inf, *extra]


class PerElement(NamedTuple):
    """The optional inputs of a rule's math besides gradient, master and state (see UpdateArgs)."""

    lr_scale: torch.Tensor | None
    decay_scale: torch.Tensor | None
    bias_correction: torch.Tensor | None


def _f32(x: float) -> float:
    return float(np.float32(x))


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root, as the kernels' ``sqrtf`` (``--prec-sqrt=true``).

    torch's CUDA sqrt is; its vectorised CPU sqrt is not (on AVX2 some roots come out 1 ulp
    off: docs/measurements.md#square-root-on-the-cpu), so on the CPU the root is taken in
    float64 and rounded once, which is exact (53 >= 2*24 + 2 bits).
    """
    return v.sqrt() if v.is_cuda else v.double().sqrt().float()


def decay_coefs(x: PerElement, weight_decay: float, wd_lr: float,
                lr_e: float | torch.Tensor) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """(L2 coefficient, decoupled coefficient) per element, rounded as the kernels round them:

      l2        = weight_decay * decay_scale
      decoupled = (wd_lr, or weight_decay * lr_e with an lr table) * decay_scale

    ``wd_lr`` is fp32(weight_decay * lr) taken in double; a missing table multiplies by
    nothing (not by 1.0), so the rules without tables keep their roundings.
    """
    l2 = weight_decay
    decoupled = wd_lr if x.lr_scale is None else weight_decay * lr_e
    if x.decay_scale is not None:
        l2 = weight_decay * x.decay_scale
        decoupled = decoupled * x.decay_scale
    return l2, decoupled


def _lr_e(lr: float, x: PerElement) -> float | torch.Tensor:
    return lr if x.lr_scale is None else lr * x.lr_scale


# --------------------------------------------------------------------------------------- SGD, Nesterov


class SgdScalars(NamedTuple):
    """SGD's (and Nesterov's) kernel scalars, fp32-rounded on the host (``SgdScalars`` in update.cu)."""

    lr: float
    momentum: float
    weight_decay: float
    wd_lr: float
    """fp32(weight_decay * lr), the product taken in double: the decoupled decay coefficient
    without a per-element lr multiplier."""
    decay_mode: int


def sgd_scalars(h: Hyper) -> SgdScalars:
    """A Python float meeting an fp32 tensor is rounded to fp32; the decoupled decay's
    coefficient is the double product ``weight_decay * lr`` rounded once."""
    return SgdScalars(_f32(h.lr), _f32(h.momentum), _f32(h.weight_decay), _f32(h.weight_decay * h.lr), h.decay_mode)


def _momentum_math(g: torch.Tensor, w: torch.Tensor, state: tuple[torch.Tensor, ...], x: PerElement,
                   s: SgdScalars, *, nesterov: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Momentum SGD with FP32 masters (NVCaffe's ``SGDRegUpdateAllAndClear``), in fp32 math:

      lr_e = lr * lr_scale
      g += wd_e * w                              (decay_mode l2)
      fp32 momentum, Caffe form:  h = m*h + lr_e*g;  step = h
      fp16 momentum, lr-factored (NVIDIA's mixed-precision slides):
                                  G = half(m*float(G) + g);  step = lr_e*float(G)
      nesterov (Caffe's NesterovSolver), from the history before (h0) and after (h):
                                  step = (1+m)*h - m*h0          (fp32)
                                  step = lr_e*((1+m)*G - m*G0)   (fp16)
      step += wd_lr_e * w                        (decay_mode decoupled)
      w -= step
    """
    (h,) = state
    lr_e = _lr_e(s.lr, x)
    l2, decoupled = decay_coefs(x, s.weight_decay, s.wd_lr, lr_e)
    if s.decay_mode == DECAY_L2:
        g = g + l2 * w
    h0 = h
    if h.dtype == torch.float32:
        h = s.momentum * h + lr_e * g
        step = (1.0 + s.momentum) * h - s.momentum * h0 if nesterov else h
    else:
        h = (s.momentum * h.float() + g).to(h.dtype)
        hist = (1.0 + s.momentum) * h.float() - s.momentum * h0.float() if nesterov else h.float()
        step = lr_e * hist
    if s.decay_mode == DECAY_DECOUPLED:
        step = step + decoupled * w
    return w - step, (h,)


def sgd_math(g: torch.Tensor, w: torch.Tensor, state: tuple[torch.Tensor, ...], x: PerElement,
             s: SgdScalars) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Momentum SGD: :func:`_momentum_math` without the Nesterov step."""
    return _momentum_math(g, w, state, x, s, nesterov=False)


def nesterov_math(g: torch.Tensor, w: torch.Tensor, state: tuple[torch.Tensor, ...], x: PerElement,
                  s: SgdScalars) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Nesterov momentum: :func:`_momentum_math` with the look-ahead step. At a constant lr it
    equals torch's ``SGD(nesterov=True)`` (``buf = m*buf + g; w -= lr*(g + m*buf)``) up to
    rounding; when lr changes, Caffe's form (lr inside the fp32 history) differs slightly."""
    return _momentum_math(g, w, state, x, s, nesterov=True)


# --------------------------------------------------------------------------------------- Adam, LAMB


class AdamScalars(NamedTuple):
    """Adam's (and LAMB's) kernel scalars, fp32-rounded on the host (``AdamScalars`` in update.cu)."""

    lr: float
    beta1: float
    one_minus_beta1: float
    """fp32(1 - beta1), the difference taken in double."""
    beta2: float
    one_minus_beta2: float
    eps: float
    weight_decay: float
    wd_lr: float
    decay_mode: int


def adam_scalars(h: Hyper) -> AdamScalars:
    return AdamScalars(_f32(h.lr), _f32(h.beta1), _f32(1.0 - h.beta1), _f32(h.beta2), _f32(1.0 - h.beta2),
                       _f32(h.eps), _f32(h.weight_decay), _f32(h.weight_decay * h.lr), h.decay_mode)


def bias_corrections(step: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """``(1 - beta1^t, sqrt(1 - beta2^t))`` as [2] fp32 on ``step``'s device, for ``t = max(step, 1)``.

    Device ops on a [1] int64 step count (the betas enter as Python scalars: no host-to-device
    copy), so the host never needs to know whether a step was skipped; taken in float64, as
    torch.optim.Adam takes them on the host, and rounded to fp32 once. ``t >= 1`` keeps a
    first step that is skipped from dividing by zero.
    """
    t = step.clamp(min=1).double()  # [1] float64
    bc1 = 1.0 - torch.pow(beta1, t)
    bc2 = 1.0 - torch.pow(beta2, t)
    return torch.cat([bc1, bc2.sqrt()]).float()  # [2] fp32


def _adam_direction(g: torch.Tensor, w: torch.Tensor, state: tuple[torch.Tensor, ...], x: PerElement,
                    s: AdamScalars) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The Adam direction and the new moments (with decay_mode l2 in the gradient):

      g += wd_e * w                              (decay_mode l2)
      m = beta1*m + (1-beta1)*g
      v = beta2*v + (1-beta2)*(g*g)
      u = (m / bc1) / (sqrt(v) / sqrt_bc2 + eps)
    """
    m, v = state
    if s.decay_mode == DECAY_L2:
        l2, _ = decay_coefs(x, s.weight_decay, s.wd_lr, _lr_e(s.lr, x))
        g = g + l2 * w
    m = s.beta1 * m + s.one_minus_beta1 * g
    v = s.beta2 * v + s.one_minus_beta2 * (g * g)
    bc = x.bias_correction
    if bc is None:
        u = m / (sqrt_rn(v) + s.eps)
    else:
        u = (m / bc[0:1]) / (sqrt_rn(v) / bc[1:2] + s.eps)
    return u, (m, v)


def adam_math(g: torch.Tensor, w: torch.Tensor, state: tuple[torch.Tensor, ...], x: PerElement,
              s: AdamScalars) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Adam (decay_mode l2) and AdamW (decoupled), fp32 moments:

      u as in _adam_direction;  step = lr_e * u
      step += wd_lr_e * w                        (decay_mode decoupled: AdamW)
      w -= step
    """
    u, new_state = _adam_direction(g, w, state, x, s)
    lr_e = _lr_e(s.lr, x)
    step = lr_e * u
    if s.decay_mode == DECAY_DECOUPLED:
        step = step + decay_coefs(x, s.weight_decay, s.wd_lr, lr_e)[1] * w
    return w - step, new_state


def _lamb(g: torch.Tensor, w: torch.Tensor, state: tuple[torch.Tensor, ...], x: PerElement,
          s: AdamScalars) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """LAMB's direction and the new moments:

      u as in _adam_direction
      u += wd_e * w                              (decay_mode decoupled, as in the LAMB paper)
    """
    u, new_state = _adam_direction(g, w, state, x, s)
    if s.decay_mode == DECAY_DECOUPLED:
        u = u + decay_coefs(x, s.weight_decay, s.wd_lr, _lr_e(s.lr, x))[0] * w
    return u, new_state


def lamb_direction(g: torch.Tensor, w: torch.Tensor, state: tuple[torch.Tensor, ...], x: PerElement,
                   s: AdamScalars) -> torch.Tensor:
    """LAMB's update direction (:func:`_lamb`), whose per-parameter norm sets the trust ratio."""
    return _lamb(g, w, state, x, s)[0]


def lamb_math(g: torch.Tensor, w: torch.Tensor, state: tuple[torch.Tensor, ...], x: PerElement,
              s: AdamScalars) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """LAMB (You et al. 2019; Apex/DeepSpeed FusedLAMB with bias correction), second pass:

      u as in _lamb;  w -= (lr * lr_scale) * u

    where the optimizer's ``lr_scale`` carries the trust ratio ``|w| / |u|`` of each
    parameter (first pass, :func:`lamb_direction`) times its lr_mult.
    """
    u, new_state = _lamb(g, w, state, x, s)
    return w - _lr_e(s.lr, x) * u, new_state


# --------------------------------------------------------------------------------------- RMSProp


class RmspropScalars(NamedTuple):
    """RMSProp's kernel scalars, fp32-rounded on the host (``RmspropScalars`` in update.cu)."""

    lr: float
    momentum: float
    rms_decay: float
    one_minus_rms_decay: float
    """fp32(1 - rms_decay), the difference taken in double."""
    eps: float
    weight_decay: float
    wd_lr: float
    decay_mode: int


def rmsprop_scalars(h: Hyper) -> RmspropScalars:
    return RmspropScalars(_f32(h.lr), _f32(h.momentum), _f32(h.rms_decay), _f32(1.0 - h.rms_decay), _f32(h.eps),
                          _f32(h.weight_decay), _f32(h.weight_decay * h.lr), h.decay_mode)


def rmsprop_math(g: torch.Tensor, w: torch.Tensor, state: tuple[torch.Tensor, ...], x: PerElement,
                 s: RmspropScalars) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """RMSProp as torch.optim.RMSprop (not centered), Caffe's with momentum 0, fp32 state:

      g += wd_e * w                              (decay_mode l2)
      v = rms_decay*v + (1-rms_decay)*(g*g)
      b = momentum*b + g / (sqrt(v) + eps);  step = lr_e * b
      step += wd_lr_e * w                        (decay_mode decoupled)
      w -= step
    """
    v, b = state
    lr_e = _lr_e(s.lr, x)
    l2, decoupled = decay_coefs(x, s.weight_decay, s.wd_lr, lr_e)
    if s.decay_mode == DECAY_L2:
        g = g + l2 * w
    v = s.rms_decay * v + s.one_minus_rms_decay * (g * g)
    b = s.momentum * b + g / (sqrt_rn(v) + s.eps)
    step = lr_e * b
    if s.decay_mode == DECAY_DECOUPLED:
        step = step + decoupled * w
    return w - step, (v, b)


# --------------------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """One update rule: what the spec and every backend need to know about it."""

    name: str
    functor: str
    """Its C++ rule type in csrc/update.cu (the CPU build dispatches to it by its index in RULES)."""
    state_names: tuple[str, ...]
    state_dtypes: tuple[torch.dtype, ...]
    """Dtypes each state tensor may have (the CUDA kernel is instantiated for each)."""
    scalars_type: type
    """The NamedTuple of its scalars: float fields are fp32 values, int fields flags."""
    to_scalars: Callable[[Hyper], tuple]
    math: Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, ...]]]
    bias_correction: bool = False
    """Whether the optimizer must pass :func:`bias_corrections` of a step counter."""
    direction: Callable[..., torch.Tensor] | None = None
    """LAMB: the direction whose per-parameter norm the optimizer turns into the trust
    ratio (first pass) before the update (second pass)."""

    def scalars(self, hyper: Hyper) -> tuple:
        """The hyper-parameters rounded as the spec rounds them, in the kernel's argument order."""
        return self.to_scalars(hyper)


_F32 = (torch.float32,)
_MOMENTUM_DTYPES = (torch.float32, torch.float16)
_MOMENTS = ("exp_avg", "exp_avg_sq")

RULES: dict[str, Rule] = {
    "sgd": Rule("sgd", "dpt::MomentumRule<false>", ("momentum",), _MOMENTUM_DTYPES, SgdScalars, sgd_scalars,
                sgd_math),
    "nesterov": Rule("nesterov", "dpt::MomentumRule<true>", ("momentum",), _MOMENTUM_DTYPES, SgdScalars,
                     sgd_scalars, nesterov_math),
    "adam": Rule("adam", "dpt::AdamRule", _MOMENTS, _F32, AdamScalars, adam_scalars, adam_math,
                 bias_correction=True),
    "rmsprop": Rule("rmsprop", "dpt::RmspropRule", ("square_avg", "momentum"), _F32, RmspropScalars,
                    rmsprop_scalars, rmsprop_math),
    "lamb": Rule("lamb", "dpt::LambRule", _MOMENTS, _F32, AdamScalars, adam_scalars, lamb_math,
                 bias_correction=True, direction=lamb_direction),
}
"""The one table of update rules. Everything else derives from it: the CUDA kernels' names
(``kernels.cuda``), the CPU build's rule codes and dispatch (``kernels.native.RULE_CODES`` and the
``DPT_RULES`` macro it compiles ``update_cpu.cc`` with), and the solver types the config accepts
(``optimizer.RULE_OF_TYPE``, checked against this table by tests/unit/test_rule_table.py). Adding a
rule touches this file, ``csrc/update.cu`` and their tests."""


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
    new_w, new_state = rule.math(g, a.master, a.state, a.per_element(), rule.scalars(a.hyper))
    for old, new in zip(a.state, new_state, strict=True):
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
