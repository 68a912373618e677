"""The optimizer: learning-rate policies and the fused unscale/skip/update step on FP32 masters.

"Solver" in dptrain names the process (one per GPU) and, after Caffe, the config section
``[solver]``; the update rule that section configures is the optimizer, here.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dptrain import kernels
from dptrain.config import SolverConfig
from dptrain.distributed.unused import UnusedParams
from dptrain.errors import SnapshotError
from dptrain.flat import FlatParams, UpdateUnit
from dptrain.kernels import Hyper, UpdateArgs
from dptrain.kernels.spec import RULES, PerElement, Rule, bias_corrections
from dptrain.overflow import OverflowLocator
from dptrain.param_groups import Multipliers
from dptrain.precision import LossScaler

CLIP_EPS = 1e-6
"""Added to the gradient norm before dividing, as torch.nn.utils.clip_grad_norm_ does."""

RULE_OF_TYPE = {"sgd": "sgd", "nesterov": "nesterov", "adam": "adam", "adamw": "adam", "rmsprop": "rmsprop",
                "lamb": "lamb"}
"""solver.type -> kernel rule: adam and adamw are one rule whose decay_mode tells them apart."""


def rule_for(cfg: SolverConfig) -> Rule:
    """The update rule (its state names and dtypes, its kernel) that ``cfg.type`` selects."""
    return RULES[RULE_OF_TYPE[cfg.type]]


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


@dataclass(frozen=True)
class _Tables:
    """What one flat group's layout fixes, built once per layout (each is a host-to-device copy)."""

    lengths: torch.Tensor
    """[segments] int64: padded length of each segment."""
    lr_mult: torch.Tensor | None
    """[segments] fp32 lr_mult per segment, None when all are 1."""
    lr_scale: torch.Tensor | None
    """[n] fp32: lr_mult per element, None when all are 1."""
    decay_scale: torch.Tensor | None
    """[n] fp32: decay_mult per element, None when all are 1."""


class MasterOptimizer:
    """The configured update rule on flat FP32 masters; writes the storage-dtype weights back.

    ``step`` runs, per flat group: one norm pass (overflow flag and clipping norm) and one
    fused update (unscale by 1/(S*grad_divisor), clip, decay, the rule's state update,
    master update, weight write-back, gradient zeroing). Nothing is read on the host.

    Per-parameter multipliers (``multipliers``, from ``param_groups.resolve_multipliers``)
    become per-element fp32 tables of the flat layout, built once per layout (4 bytes per
    parameter each, only for a multiplier that is not 1 everywhere): every parameter gets
    its own lr_mult and decay_mult in the same single launch per flat group.

    Adam and LAMB count the steps taken in a [1] int64 device tensor, advanced on the device
    only when ``found_inf`` is clear, so a skipped step does not advance the bias correction
    and the host never reads the flag; the corrections are computed from it on the device
    (:func:`~dptrain.kernels.spec.bias_corrections`) and read by the kernel.

    LAMB runs in two passes: the per-parameter norms of the master and of the update
    direction (:func:`~dptrain.kernels.spec.lamb_direction`, torch ops) give the trust ratio
    ``|w| / |u|`` (1 where either is 0), which enters the fused update as the per-element lr
    multiplier, the way LARC's rate does.
    """

    def __init__(self, flat: FlatParams, cfg: SolverConfig, scaler: LossScaler, grad_divisor: int,
                 multipliers: dict[str, Multipliers] | None = None, locator: OverflowLocator | None = None,
                 unused: UnusedParams | None = None) -> None:
        self.flat, self.cfg, self.scaler, self.grad_divisor = flat, cfg, scaler, grad_divisor
        self.rule = rule_for(cfg)
        self.multipliers = multipliers or {}
        self.locator = locator
        """Names the parameters of a skipped step (see dptrain.overflow); runs in the norm pass."""
        self.sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
        """With sharded masters (``reducer.shard = "optimizer"``): sums a small device tensor over the
        solvers in place, no host sync (``dptrain.distributed.shards.Shards.sum_``)."""
        self.unused = unused
        """The parameters no rank gave a gradient (``dptrain.distributed.unused``): the update leaves them
        and their state as they were, as torch's optimizers leave a parameter whose ``.grad`` is None."""
        self._need_norm = scaler.enabled or cfg.clip_gradients > 0
        self._tables: dict[int, _Tables] = {}
        self._tables_version = -1
        self._steps = torch.zeros(1, dtype=torch.int64, device=flat.groups[0].master.device)  # [1] steps taken

    def hyper(self, lr: float) -> Hyper:
        c = self.cfg
        return Hyper(lr=lr, momentum=c.momentum, weight_decay=c.weight_decay,
                     decoupled=c.resolved_decay_mode() == "decoupled", beta1=c.beta1, beta2=c.beta2, eps=c.eps,
                     rms_decay=c.rms_decay)

    def step(self, it: int) -> float:
        """Apply iteration ``it``'s update; return the learning rate used."""
        lr = learning_rate(self.cfg, it)
        coef = self.scaler.inv_scale(self.grad_divisor)
        if self._need_norm:
            norms = self._group_norms()
            total = norms.square().sum().sqrt()  # norm of the loss-scaled, rank-summed gradient
            self.scaler.record_overflow(total)
            if self.locator is not None:
                self.locator.observe(norms, self.scaler.found_inf)  # before the update zeroes the gradients
            if self.cfg.clip_gradients > 0:
                unscaled = total * coef
                coef = coef * (self.cfg.clip_gradients / (unscaled + CLIP_EPS)).clamp(max=1.0)
        hyper = self.hyper(lr)
        bc = None
        if self.rule.bias_correction:
            self._steps += (self.scaler.found_inf == 0).long()  # device op: a skipped step does not count
            bc = bias_corrections(self._steps, self.cfg.beta1, self.cfg.beta2)
        held = self._hold()
        for i, g in enumerate(self.flat.groups):
            t = self._tables_of(i)
            if self.cfg.larc:
                lr_scale = self._larc_scale(i, lr, coef)
            elif self.rule.direction is not None:
                lr_scale = self._trust_scale(i, hyper, coef, bc)
            else:
                lr_scale = t.lr_scale
            for u in g.units():  # the whole group; when sharded, each slice this solver owns
                kernels.update(UpdateArgs(rule=self.rule.name, grads=u.grads, master=u.master, params=u.params,
                                          state=tuple(u.state[k] for k in self.rule.state_names), grad_coef=coef,
                                          found_inf=self.scaler.found_inf, hyper=hyper,
                                          lr_scale=_part(lr_scale, u), decay_scale=_part(t.decay_scale, u),
                                          bias_correction=bc),
                               cpu_fused=self.cfg.cpu_fused_update)
        self._put_back(held)
        self.scaler.update()
        return lr

    def _group_norms(self) -> torch.Tensor:
        """[groups] fp32: the L2 norm of each group's reduced gradient. Sharded: of this solver's
        slices, squared and summed over the solvers (the step's one small collective)."""
        groups = self.flat.groups
        if all(g.parts is None for g in groups):
            return torch.stack([kernels.grad_norm(g.grads) for g in groups])
        sq = torch.stack([torch.stack([kernels.grad_norm(u.grads) for u in g.units()]).square().sum()
                          for g in groups])
        return self._sum(sq).sqrt()

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the solvers that share the sharded state (no-op unsharded)."""
        return t if self.sum_over_ranks is None else self.sum_over_ranks(t)

    def _segment_norms(self, i: int, values: Callable[[UpdateUnit], torch.Tensor]) -> torch.Tensor:
        """[segments] fp32: the L2 norm of each parameter's elements of ``values(unit)`` (a tensor over a
        unit's elements). Sharded: each solver's parts squared, summed over the solvers."""
        g = self.flat.groups[i]
        if g.parts is None:
            full = values(g.units()[0])
            return torch.stack(torch._foreach_norm([full[s.offset : s.offset + s.numel] for s in g.segments]))
        per_unit = {id(u): values(u) for u in g.units()}
        sq = []
        for seg in g.segments:
            pieces = [per_unit[id(u)][lo:hi] for u, lo, hi in g.overlaps(seg)]
            sq.append(torch.stack(torch._foreach_norm(pieces)).square().sum() if pieces
                      else torch.zeros((), device=g.params.device))
        return self._sum(torch.stack(sq)).sqrt()

    def _hold(self) -> list[tuple[UpdateUnit, int, int, torch.Tensor, torch.Tensor, list[torch.Tensor]]]:
        """Before the update: copies of the master and state of every parameter that may have had no
        gradient on any rank (the candidates: few, and known on the host; sharded: this solver's
        elements of them), with the device mask of those that had none. Device ops only."""
        got = self.unused.hold() if self.unused is not None else None
        if got is None:
            return []
        names, none = got
        where = {s.name: (g, s) for g in self.flat.groups for s in g.segments}
        held = []
        for k, name in enumerate(names):
            g, seg = where[name]
            for u, lo, hi in g.overlaps(seg):
                held.append((u, lo, hi, none[k], u.master[lo:hi].clone(),
                             [u.state[n][lo:hi].clone() for n in self.rule.state_names]))
        return held

    def _put_back(self, held: list[tuple[UpdateUnit, int, int, torch.Tensor, torch.Tensor, list[torch.Tensor]]]
                  ) -> None:
        """After the update: where the mask is set, the master and state as they were, the weights
        derived from the master again (the update zeroed the gradients, as it should)."""
        for u, lo, hi, none, master, state in held:
            u.master[lo:hi].copy_(torch.where(none, master, u.master[lo:hi]))
            for n, old in zip(self.rule.state_names, state, strict=True):
                u.state[n][lo:hi].copy_(torch.where(none, old, u.state[n][lo:hi]))
            if u.master is not u.params:
                u.params[lo:hi].copy_(u.master[lo:hi])

    def _master_norms(self, i: int) -> torch.Tensor:
        """[segments] fp32: the L2 norm of each parameter's master."""
        return self._segment_norms(i, lambda u: u.master)

    def _per_element(self, i: int, per_segment: torch.Tensor) -> torch.Tensor:
        """[n] fp32: each segment's value over its padded elements."""
        return per_segment.repeat_interleave(self._tables_of(i).lengths, output_size=self.flat.groups[i].numel)

    def _larc_scale(self, i: int, lr: float, coef: torch.Tensor) -> torch.Tensor:
        """Per-element lr multiplier from NVCaffe's LARC: rate = (1-m)*eta*|w|/|g|, times lr_mult.

        "scale" multiplies lr by rate; "clip" uses min(lr*lr_mult, rate). A parameter whose
        weight or gradient norm is zero keeps its plain lr.
        """
        g = self.flat.groups[i]
        w_norm = self._master_norms(i)
        if g.parts is None:
            g_views = [g.grads[s.offset : s.offset + s.numel] for s in g.segments]
            g_norm = torch.stack([torch.linalg.vector_norm(v, dtype=torch.float32) for v in g_views]) * coef
        else:
            g_norm = self._segment_norms(i, lambda u: u.grads.float()) * coef
        rate = (1.0 - self.cfg.momentum) * self.cfg.larc_eta * w_norm / g_norm
        valid = (w_norm > 0) & (g_norm > 0) & torch.isfinite(rate)
        lr_mult = self._tables_of(i).lr_mult
        plain = torch.ones_like(rate) if lr_mult is None else lr_mult
        if self.cfg.larc_policy == "scale":
            mult = torch.where(valid, rate if lr_mult is None else rate * lr_mult, plain)
        else:
            mult = torch.where(valid, (rate / lr).clamp(max=1.0 if lr_mult is None else lr_mult), plain)
        return self._per_element(i, mult)

    def _trust_scale(self, i: int, hyper: Hyper, coef: torch.Tensor, bc: torch.Tensor | None) -> torch.Tensor:
        """LAMB's first pass: per-element lr multiplier = trust ratio |w|/|u| of the parameter times
        its lr_mult (1 where either norm is 0). Torch ops on the device, no host sync."""
        t = self._tables_of(i)

        def direction(u: UpdateUnit) -> torch.Tensor:  # [unit elements] fp32 scratch
            state = tuple(u.state[k] for k in self.rule.state_names)
            return self.rule.direction(u.grads.float() * coef, u.master, state,
                                       PerElement(None, _part(t.decay_scale, u), bc), self.rule.scalars(hyper))

        u_norm = self._segment_norms(i, direction)
        w_norm = self._master_norms(i)
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        return self._per_element(i, trust if t.lr_mult is None else trust * t.lr_mult)

    def _tables_of(self, i: int) -> _Tables:
        """Group ``i``'s per-layout tables, rebuilt after a :meth:`FlatParams.reorder`."""
        if self._tables_version != self.flat.layout_version:
            self._tables, self._tables_version = {}, self.flat.layout_version
        if i not in self._tables:
            self._tables[i] = self._build_tables(i)
        return self._tables[i]

    def _build_tables(self, i: int) -> _Tables:
        g = self.flat.groups[i]
        dev = g.master.device
        lengths = torch.tensor([s.padded_numel for s in g.segments], device=dev)  # [segments] int64
        mults = [self.multipliers.get(s.name, Multipliers()) for s in g.segments]

        def table(values: list[float]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            if all(v == 1.0 for v in values):
                return None, None
            per_segment = torch.tensor(values, dtype=torch.float32, device=dev)  # [segments] fp32
            return per_segment, per_segment.repeat_interleave(lengths, output_size=g.numel)  # [n] fp32

        lr_mult, lr_scale = table([m.lr_mult for m in mults])
        _, decay_scale = table([m.decay_mult for m in mults])
        return _Tables(lengths, lr_mult, lr_scale, decay_scale)

    def describe(self) -> str:
        """The start-up line: the rule, the custom multipliers, the memory per parameter."""
        custom = sum(1 for m in self.multipliers.values() if m != (1.0, 1.0))
        return (f"solver {self.cfg.type}; lr_mult/decay_mult other than 1 on {custom} of {len(self.multipliers)} "
                f"parameter tensors; bytes per parameter: {self.bytes_per_param()} ({self.flat.num_params} parameters)")

    def bytes_per_param(self) -> dict[str, float]:
        """Device bytes per parameter held for the update: weights, masters, each state buffer,
        grads, the multiplier tables (when any), and their total."""
        out = self.flat.bytes_per_param()
        tables = [t for i in range(len(self.flat.groups)) for t in (self._tables_of(i).lr_scale,
                                                                     self._tables_of(i).decay_scale) if t is not None]
        if tables:
            out["multipliers"] = round(sum(t.numel() * 4 for t in tables) / self.flat.num_params, 3)
        out["total"] = round(sum(out.values()), 3)
        return out

    def state_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"rule": self.rule.name, "state": self.flat.state_dict(),
                                  "scaler": self.scaler.state_dict()}
        if self.rule.bias_correction:
            out["steps"] = self._steps.clone()
        return out

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.flat.load_state_dict(state["state"])  # type: ignore[arg-type]
        self.scaler.load_state_dict(state["scaler"])  # type: ignore[arg-type]
        if self.rule.bias_correction:
            if "steps" not in state:
                raise SnapshotError(f"snapshot has no step count for solver rule {self.rule.name} (it was written "
                                    f"with rule {state.get('rule')!r}); resume with that solver.type")
            self._steps.copy_(state["steps"])  # type: ignore[arg-type]


def _part(table: torch.Tensor | None, u: UpdateUnit) -> torch.Tensor | None:
    """A per-element table's elements of unit ``u`` (the whole table for an unsharded group's one unit)."""
    if table is None or (u.lo == 0 and u.hi == table.numel()):
        return table
    return table[u.lo : u.hi]
