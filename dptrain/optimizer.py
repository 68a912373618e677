"""The optimizer: learning-rate policies and the fused unscale/skip/update step on FP32 masters.

"Solver" in dptrain names the process (one per GPU) and, after Caffe, the config section
``[solver]``; the update rule that section configures is the optimizer, here.
"""
from __future__ import annotations

import math

import torch

from dptrain import kernels
from dptrain.config import SolverConfig
from dptrain.flat import FlatParams
from dptrain.kernels import Hyper, UpdateArgs
from dptrain.overflow import OverflowLocator
from dptrain.precision import LossScaler

CLIP_EPS = 1e-6
"""Added to the gradient norm before dividing, as torch.nn.utils.clip_grad_norm_ does."""


def learning_rate(cfg: SolverConfig, it: int) -> float:
    """The lr policy at iteration ``it`` (0-based), floored at ``min_lr``, times the linear warmup factor.

    Caffe's policies, plus "cosine": ``min_lr + (base_lr - min_lr) * (1 + cos(pi * it / max_iter)) / 2``.
    The warmup scales whatever the policy gives at ``it`` (the cosine is counted from iteration 0,
    not from the warmup's end), as it does for every policy.
    """
    base, p = cfg.base_lr, cfg.lr_policy
    if p == "fixed":
        lr = base
    elif p == "step":
        lr = base * cfg.gamma ** (it // cfg.stepsize)
    elif p == "multistep":
        lr = base * cfg.gamma ** sum(1 for v in cfg.stepvalue if it >= v)
    elif p == "poly":
        lr = base * max(0.0, 1.0 - it / cfg.max_iter) ** cfg.power
    elif p == "exp":
        lr = base * cfg.gamma**it
    elif p == "inv":
        lr = base * (1.0 + cfg.gamma * it) ** (-cfg.power)
    elif p == "sigmoid":
        lr = base * _sigmoid(cfg.gamma * (it - cfg.stepsize))
    elif p == "cosine":
        lr = cfg.min_lr + (base - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(it, cfg.max_iter) / cfg.max_iter))
    else:  # config validation makes this unreachable
        raise AssertionError(f"unknown lr_policy {p!r}")
    lr = max(lr, cfg.min_lr)
    if it < cfg.warmup_iter:
        frac = it / cfg.warmup_iter
        lr *= cfg.warmup_start + (1.0 - cfg.warmup_start) * frac
    return lr


def _sigmoid(z: float) -> float:
    """1 / (1 + exp(-z)) without overflow: exp is only taken of a non-positive number."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


class MasterOptimizer:
    """Momentum SGD on flat FP32 masters; writes the storage-dtype weights back.

    ``step`` runs, per flat group: one norm pass (overflow flag and clipping norm) and one
    fused update (unscale by 1/(S*grad_divisor), clip, decay, momentum, master update,
    weight write-back, gradient zeroing). Nothing is read on the host.
    """

    RULE = "sgd"
    STATE_NAMES = ("momentum",)

    def __init__(self, flat: FlatParams, cfg: SolverConfig, scaler: LossScaler, grad_divisor: int,
                 locator: OverflowLocator | None = None) -> None:
        self.flat, self.cfg, self.scaler, self.grad_divisor = flat, cfg, scaler, grad_divisor
        self.locator = locator
        """Names the parameters of a skipped step (see dptrain.overflow); runs in the norm pass."""
        self._need_norm = scaler.enabled or cfg.clip_gradients > 0
        self._lengths: dict[int, torch.Tensor] = {}  # group -> padded numels of its segments
        self._lengths_version = -1

    def step(self, it: int) -> float:
        """Apply iteration ``it``'s update; return the learning rate used."""
        lr = learning_rate(self.cfg, it)
        coef = self.scaler.inv_scale(self.grad_divisor)
        if self._need_norm:
            norms = torch.stack([kernels.grad_norm(g.grads) for g in self.flat.groups])
            total = norms.square().sum().sqrt()  # norm of the loss-scaled, rank-summed gradient
            self.scaler.record_overflow(total)
            if self.locator is not None:
                self.locator.observe(norms, self.scaler.found_inf)  # before the update zeroes the gradients
            if self.cfg.clip_gradients > 0:
                unscaled = total * coef
                coef = coef * (self.cfg.clip_gradients / (unscaled + CLIP_EPS)).clamp(max=1.0)
        hyper = Hyper(lr=lr, momentum=self.cfg.momentum, weight_decay=self.cfg.weight_decay,
                      decoupled=self.cfg.decay_mode == "decoupled")
        for i, g in enumerate(self.flat.groups):
            lr_scale = self._larc_scale(i, lr, coef) if self.cfg.larc else None
            kernels.update(UpdateArgs(rule=self.RULE, grads=g.grads, master=g.master, params=g.params,
                                      state=tuple(g.state[k] for k in self.STATE_NAMES), grad_coef=coef,
                                      found_inf=self.scaler.found_inf, hyper=hyper, lr_scale=lr_scale),
                           cpu_fused=self.cfg.cpu_fused_update)
        self.scaler.update()
        return lr

    def _larc_scale(self, i: int, lr: float, coef: torch.Tensor) -> torch.Tensor:
        """Per-element lr multiplier from NVCaffe's LARC: rate = (1-m)*eta*|w|/|g|.

        "scale" multiplies lr by rate; "clip" uses min(lr, rate). A parameter whose weight
        or gradient norm is zero keeps the plain lr.
        """
        g = self.flat.groups[i]
        w_norm = torch.stack(torch._foreach_norm([g.master[s.offset : s.offset + s.numel] for s in g.segments]))
        g_views = [g.grads[s.offset : s.offset + s.numel] for s in g.segments]
        g_norm = torch.stack([torch.linalg.vector_norm(v, dtype=torch.float32) for v in g_views]) * coef
        rate = (1.0 - self.cfg.momentum) * self.cfg.larc_eta * w_norm / g_norm
        valid = (w_norm > 0) & (g_norm > 0) & torch.isfinite(rate)
        if self.cfg.larc_policy == "scale":
            mult = torch.where(valid, rate, torch.ones_like(rate))
        else:
            mult = torch.where(valid, (rate / lr).clamp(max=1.0), torch.ones_like(rate))
        return mult.repeat_interleave(self._padded_numels(i), output_size=g.numel)

    def _padded_numels(self, i: int) -> torch.Tensor:
        """Padded length of each segment of group ``i`` as a device tensor, built once per layout:
        creating it is a host-to-device copy, which would be a host sync in every step."""
        if self._lengths_version != self.flat.layout_version:
            self._lengths, self._lengths_version = {}, self.flat.layout_version
        if i not in self._lengths:
            g = self.flat.groups[i]
            self._lengths[i] = torch.tensor([s.padded_numel for s in g.segments],
                                            device=g.master.device)  # [segments] int64
        return self._lengths[i]

    def state_dict(self) -> dict[str, object]:
        return {"rule": self.RULE, "state": self.flat.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.flat.load_state_dict(state["state"])  # type: ignore[arg-type]
        self.scaler.load_state_dict(state["scaler"])  # type: ignore[arg-type]
