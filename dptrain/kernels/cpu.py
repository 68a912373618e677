"""The torch-op CPU backends of the update rules: in-place passes, and one pass compiled by inductor.

The default CPU backend is neither: :mod:`.native` runs ``update.cu``'s rules built for the
host. The in-place passes are its fallback where that library cannot be built or fails its
self-check (``DPTRAIN_KERNELS=inplace`` picks them); the compiled pass is
``solver.cpu_fused_update``.

On the CPU, reading ``found_inf`` is a plain memory load (there is no device to wait for),
so a skipped step returns early instead of computing both outcomes and selecting with
``torch.where`` as the reference does.

* **In place** (:func:`update_inplace`): each rule's body rewrites the spec's
  math as in-place passes over the state and master, with one or two fp32 temporaries
  besides the gradient (SGD's step; Adam's direction and denominator), several times fewer
  bytes moved than the reference. Results equal the reference's up to a few fp32 ulps: an
  ``add_(alpha=)`` rounds once where the reference rounds a product and a sum, and
  ``lr * lr_scale * u`` is two products where the reference forms ``lr * lr_scale`` first.
  The passes run over ``INPLACE_CHUNK`` elements at a time, so that after the first pass a
  chunk's buffers are still in the core's cache for the others: the update follows backward
  and the allreduce, which leave masters and state cold, and over the whole buffer each pass
  went back to memory (:data:`INPLACE_CHUNK` gives the measurements).
* **Compiled** (:func:`update_compiled`, ``solver.cpu_fused_update``): the spec's math
  itself, compiled by ``torch.compile`` into one loop that reads and writes each buffer
  once; the scalars travel as one tensor, so a new learning rate does not recompile.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch

from dptrain.inductor import prepare as prepare_inductor
from dptrain.kernels.spec import (
    DECAY_DECOUPLED,
    DECAY_L2,
    RULES,
    AdamScalars,
    PerElement,
    RmspropScalars,
    SgdScalars,
    UpdateArgs,
    rule_of,
)


def _skipped(a: UpdateArgs) -> bool:
    """Zero the gradient and say so when the step is skipped (a CPU load, no sync)."""
    if bool(a.found_inf.reshape(())):
        a.grads.zero_()
        return True
    return False


def _finish(a: UpdateArgs) -> None:
    if a.params is not a.master:
        a.params.copy_(a.master)
    a.grads.zero_()


def _add_l2_(a: UpdateArgs, g: torch.Tensor, weight_decay: float) -> None:
    """g += wd_e * w (spec.decay_coefs' L2 coefficient), in place."""
    if a.decay_scale is None:
        g.add_(a.master, alpha=weight_decay)
    else:
        g.addcmul_(a.master, a.decay_scale, value=weight_decay)


def _plus_decoupled(a: UpdateArgs, step: torch.Tensor, weight_decay: float, wd_lr: float, lr: float) -> torch.Tensor:
    """step + wd_lr_e * w (spec.decay_coefs' decoupled coefficient), as a new tensor: ``step``
    may be a state buffer (SGD's fp32 history)."""
    decay = a.master * (wd_lr if a.lr_scale is None else weight_decay * lr)
    for table in (a.lr_scale, a.decay_scale):
        if table is not None:
            decay.mul_(table)
    return step + decay


def _times_lr_(a: UpdateArgs, t: torch.Tensor, lr: float) -> torch.Tensor:
    """t *= lr * lr_scale, in place (two roundings where the spec rounds lr*lr_scale first)."""
    t.mul_(lr)
    if a.lr_scale is not None:
        t.mul_(a.lr_scale)
    return t


def _momentum_inplace(a: UpdateArgs, g: torch.Tensor, s: SgdScalars, *, nesterov: bool) -> None:
    """:func:`dptrain.kernels.spec.sgd_math` / ``nesterov_math`` as in-place passes over
    ``a.master`` and the momentum."""
    (h,) = a.state
    if s.decay_mode == DECAY_L2:
        _add_l2_(a, g, s.weight_decay)
    if h.dtype == torch.float32:
        h0 = h.clone() if nesterov else None
        h.mul_(s.momentum)
        if a.lr_scale is None:
            h.add_(g, alpha=s.lr)
        else:
            h.addcmul_(g, a.lr_scale, value=s.lr)
        step = h0.mul_(-s.momentum).add_(h, alpha=1.0 + s.momentum) if h0 is not None else h
    else:  # lr-factored fp16 history: G = half(m*G + g); step = lr_e * G (Nesterov: lr_e*((1+m)*G - m*G0))
        h0 = h.float()
        h.copy_(h0 * s.momentum + g)
        step = h.float()
        if nesterov:
            step = step.mul_(1.0 + s.momentum).sub_(h0, alpha=s.momentum)
        _times_lr_(a, step, s.lr)
    if s.decay_mode == DECAY_DECOUPLED:
        step = _plus_decoupled(a, step, s.weight_decay, s.wd_lr, s.lr)
    a.master.sub_(step)


def _adam_direction_(a: UpdateArgs, g: torch.Tensor, s: AdamScalars) -> torch.Tensor:
    """Updates the moments in place and returns u = m_hat / (sqrt(v_hat) + eps) (spec._adam_direction)."""
    if s.decay_mode == DECAY_L2:
        _add_l2_(a, g, s.weight_decay)
    m, v = a.state
    m.mul_(s.beta1).add_(g, alpha=s.one_minus_beta1)
    v.mul_(s.beta2).addcmul_(g, g, value=s.one_minus_beta2)
    denom = v.sqrt()
    bc = a.bias_correction
    if bc is None:
        u = m.clone()
    else:
        u = m / bc[0:1]
        denom.div_(bc[1:2])
    return u.div_(denom.add_(s.eps))


def _adam_inplace(a: UpdateArgs, g: torch.Tensor, s: AdamScalars) -> None:
    """:func:`dptrain.kernels.spec.adam_math` with in-place passes."""
    step = _times_lr_(a, _adam_direction_(a, g, s), s.lr)
    if s.decay_mode == DECAY_DECOUPLED:
        step = _plus_decoupled(a, step, s.weight_decay, s.wd_lr, s.lr)
    a.master.sub_(step)


def _lamb_inplace(a: UpdateArgs, g: torch.Tensor, s: AdamScalars) -> None:
    """:func:`dptrain.kernels.spec.lamb_math` with in-place passes (lr_scale holds the trust ratio)."""
    u = _adam_direction_(a, g, s)
    if s.decay_mode == DECAY_DECOUPLED:
        _add_l2_(a, u, s.weight_decay)
    a.master.sub_(_times_lr_(a, u, s.lr))


def _rmsprop_inplace(a: UpdateArgs, g: torch.Tensor, s: RmspropScalars) -> None:
    """:func:`dptrain.kernels.spec.rmsprop_math` with in-place passes."""
    if s.decay_mode == DECAY_L2:
        _add_l2_(a, g, s.weight_decay)
    v, b = a.state
    v.mul_(s.rms_decay).addcmul_(g, g, value=s.one_minus_rms_decay)
    b.mul_(s.momentum).add_(g.div_(v.sqrt().add_(s.eps)))
    step = _times_lr_(a, b.clone(), s.lr)
    if s.decay_mode == DECAY_DECOUPLED:
        step = _plus_decoupled(a, step, s.weight_decay, s.wd_lr, s.lr)
    a.master.sub_(step)


INPLACE: dict[str, Callable[[UpdateArgs, torch.Tensor, tuple], None]] = {
    "sgd": functools.partial(_momentum_inplace, nesterov=False),
    "nesterov": functools.partial(_momentum_inplace, nesterov=True),
    "adam": _adam_inplace,
    "lamb": _lamb_inplace,
    "rmsprop": _rmsprop_inplace,
}
"""Each rule's in-place body: (args, fp32 unscaled gradient it may overwrite, scalars)."""


INPLACE_CHUNK = 65536
"""Elements per thread in a chunk of :func:`update_inplace` (a chunk is this times torch's thread
count, so every thread still gets a full grain of ATen's element-wise split). A multiple of every
SIMD width: on one thread each element takes the same vector or scalar path, and gets the same
bits, as over the whole buffer. 64 Ki elements of SGD with bf16 storage and fp32 momentum are ~1 MiB
of buffers and temporaries, within a core's L2, so each pass reads what the one before it left in
cache: faster than passes over the whole buffer, in and outside training steps, and 64 Ki is among
the fastest chunk sizes tried (measurements: docs/measurements.md#in-place-chunks)."""


def _chunk(a: UpdateArgs, start: int, stop: int) -> UpdateArgs:
    """``a`` restricted to elements [start, stop): every per-element tensor sliced, the scalars shared."""
    master = a.master[start:stop]
    params = master if a.params is a.master else a.params[start:stop]  # fp32 storage: one buffer
    return replace(a, grads=a.grads[start:stop], master=master, params=params,
                   state=tuple(t[start:stop] for t in a.state),
                   lr_scale=None if a.lr_scale is None else a.lr_scale[start:stop],
                   decay_scale=None if a.decay_scale is None else a.decay_scale[start:stop])


def update_inplace(a: UpdateArgs) -> None:
    """The rule's in-place CPU body between the common unscale and write-back, chunk by chunk
    (:data:`INPLACE_CHUNK`: element-wise passes, so on one thread the same bits as in one piece)."""
    rule = rule_of(a)
    if _skipped(a):
        return
    scalars = rule.scalars(a.hyper)
    coef = float(a.grad_coef.reshape(()))  # a CPU load; the same fp32 value as a Python float, so the same products
    chunk = INPLACE_CHUNK * max(1, torch.get_num_threads())
    # One fp32 scratch for every chunk's unscaled gradient (fp32 storage: the gradient itself,
    # overwritten, zeroed after).
    scratch = torch.empty(min(chunk, a.numel), dtype=torch.float32) if a.grads.dtype != torch.float32 else None
    for start in range(0, a.numel, chunk):
        c = _chunk(a, start, min(a.numel, start + chunk))
        g = c.grads if scratch is None else scratch[: c.numel].copy_(c.grads)
        g.mul_(coef)
        INPLACE[rule.name](c, g, scalars)
        _finish(c)


FUSED_VARIANTS_MAX = 64
"""Compiled variants of the fused CPU update allowed per process (rules x flags x dtypes x shapes)."""


def _fused_body(grads: torch.Tensor, master: torch.Tensor, params: torch.Tensor, state: tuple[torch.Tensor, ...],
                grad_coef: torch.Tensor, values: torch.Tensor, x: PerElement, *, rule: str,
                layout: tuple[tuple[bool, int], ...], write_params: bool) -> None:
    """The spec's math for a step that is not skipped, for inductor to fuse into one loop.

    ``layout`` gives the rule's scalars in order as (is_flag, value): a flag carries its
    value and is part of the compiled variant's key; a float is ``values[value]`` ([k]
    fp32), so a new learning rate reuses the compiled code.
    """
    r = RULES[rule]
    scalars = r.scalars_type(*(v if is_flag else values[v] for is_flag, v in layout))
    new_w, new_state = r.math(grads.float() * grad_coef, master, state, x, scalars)
    for old, new in zip(state, new_state, strict=True):
        old.copy_(new)
    master.copy_(new_w)
    if write_params:
        params.copy_(new_w)
    grads.zero_()


@functools.cache
def _compiled(rule: str, layout: tuple[tuple[bool, int], ...], write_params: bool) -> Callable[..., None]:
    """The compiled update for one rule and flag combination (compiled on first call, then
    cached by inductor on disk, so later processes load it in seconds)."""
    body = functools.partial(_fused_body, rule=rule, layout=layout, write_params=write_params)
    # Without emulate_precision_casts inductor drops the fp16/bf16 round trip of a low-precision
    # state (h.to(fp16).float()), so the master would take the unrounded history while the
    # stored one is rounded: off the spec by up to ~1e-4 per step.
    prepare_inductor()
    return torch.compile(body, options={"emulate_precision_casts": True})


def update_compiled(a: UpdateArgs) -> None:
    """The spec's math as one pass compiled by torch.compile (inductor's C++ backend).

    Reads gradient, master and state once and writes state, master, weights and the zeroed
    gradient once, so it is faster than :func:`update_inplace` in a training step
    (measurements: docs/measurements.md#compiled-update). The first call per
    variant compiles (about ten seconds, a few from inductor's on-disk cache; needs a C++ compiler).
    """
    rule = rule_of(a)
    if _skipped(a):
        return
    scalars = rule.scalars(a.hyper)
    floats = [v for v in scalars if not isinstance(v, int)]
    layout, k = [], 0
    for v in scalars:
        layout.append((True, v) if isinstance(v, int) else (False, k))
        k += not isinstance(v, int)
    values = torch.tensor(floats, dtype=torch.float32)  # [k] fp32
    fn = _compiled(rule.name, tuple(layout), a.params is not a.master)
    # One compiled variant per flag/dtype/shape combination (a run has at most a few): lift
    # dynamo's default limit of 8 so none of them silently falls back to the eager passes.
    with torch._dynamo.config.patch(recompile_limit=FUSED_VARIANTS_MAX):
        fn(a.grads, a.master, a.params, a.state, a.grad_coef, values, a.per_element())
