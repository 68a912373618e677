"""Per-parameter learning-rate and weight-decay multipliers (Caffe's ``lr_mult`` / ``decay_mult``).

Resolved once, from the model, ``solver.param_groups`` and ``solver.no_decay``, into a
multiplier pair per parameter name; the optimizer turns them into per-element tables of
its flat buffers (``optimizer.MasterOptimizer``), so one fused launch per flat group
still updates every parameter with its own multipliers.
"""
from __future__ import annotations

import fnmatch
from typing import NamedTuple

from torch import nn

from dptrain.config import ParamGroup
from dptrain.errors import ConfigError

NORM_TYPES: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm,
                                          nn.modules.instancenorm._InstanceNorm, nn.RMSNorm)
"""Module types whose parameters ``no_decay = ["norm"]`` exempts (their affine scale and shift)."""


class Multipliers(NamedTuple):
    """One parameter's multipliers: lr = base lr x lr_mult, decay = weight_decay x decay_mult."""

    lr_mult: float = 1.0
    decay_mult: float = 1.0


def _matches(pattern: str, name: str, module: nn.Module) -> bool:
    """A group matches a parameter by its dotted name, or by its owner's type name (or a base class's)."""
    return fnmatch.fnmatchcase(name, pattern) or any(fnmatch.fnmatchcase(c.__name__, pattern)
                                                     for c in type(module).__mro__)


def _exempt(no_decay: list[str], name: str, module: nn.Module) -> bool:
    """Whether ``no_decay`` ("bias", "norm") sets this parameter's decay_mult to 0."""
    return ("bias" in no_decay and name.rsplit(".", 1)[-1] == "bias") or (
        "norm" in no_decay and isinstance(module, NORM_TYPES))


def resolve_multipliers(model: nn.Module, groups: list[ParamGroup], no_decay: list[str]) -> dict[str, Multipliers]:
    """Multipliers of every trainable parameter, by dotted name.

    The first group whose ``match`` fits a parameter gives its multipliers (1 and 1 when
    none does); ``no_decay`` then zeroes the decay of biases and normalisation parameters.
    A group that matches no trainable parameter raises :class:`ConfigError` naming it.
    """
    matched = [False] * len(groups)
    out: dict[str, Multipliers] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        owner = model.get_submodule(name.rpartition(".")[0])
        hits = [i for i, g in enumerate(groups) if _matches(g.match, name, owner)]
        for i in hits:
            matched[i] = True
        mult = Multipliers(groups[hits[0]].lr_mult, groups[hits[0]].decay_mult) if hits else Multipliers()
        if _exempt(no_decay, name, owner):
            mult = mult._replace(decay_mult=0.0)
        out[name] = mult
    for i, ok in enumerate(matched):
        if not ok:
            names = list(out)[:4]
            types = sorted({type(m).__name__ for m in model.modules()})[:8]
            raise ConfigError(f"solver.param_groups[{i}].match = {groups[i].match!r} matches no trainable parameter "
                              f"(names look like {names}; module types {types}); fix the glob or remove the group")
    return out
