"""Which layer overflowed: the parameters whose reduced gradient was not finite, and the
first layer of a forward whose output is not finite.

:class:`OverflowLocator` runs inside the optimizer's norm pass, after the overflow flag is
set and before the update zeroes the gradients. It attributes a skipped step to the
parameters whose reduced gradient holds an inf or a NaN, group by group (a flat group's norm
is already known), then parameter by parameter within a non-finite group:

* on the CPU it looks only on a step that is skipped (the flag is a plain load there, read
  by the update anyway), and only into the groups whose norm is not finite;
* on CUDA deciding that would need a host sync, so every step with loss scaling adds a
  per-parameter norm of the gradients (one multi-tensor pass, device ops only, counts kept
  on the device). Its cost is one more read of the gradients: ResNet-50's 51 MB of fp16
  gradients, tens of microseconds on an H100 against a step of about 100 ms.

Every rank holds the same reduced gradient, so every rank counts the same parameters. The
host reads the counts at a display (which syncs anyway): :meth:`collect` returns the
parameters that overflowed since the last display, and :meth:`most_often` those that did
over the whole run, for the line that ends a run whose loss scale collapsed.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dptrain.flat import FlatParams

log = logging.getLogger(__name__)

MAX_NAMED = 5
"""Parameters named in a log line or a metrics record (the ones that overflowed most often)."""
class OverflowLocator:
    """Counts, per parameter, the steps whose reduced gradient was not finite (see the module docstring)."""

    def __init__(self, flat: FlatParams, device: torch.device, *, enabled: bool) -> None:
        self.flat, self.enabled = flat, enabled
        self._cuda = device.type == "cuda"
        self._counts: list[torch.Tensor] = []
        """Per flat group: [segments] int32 on the device, steps each parameter was not finite."""
        self._names: list[list[str]] = []
        """The parameter of each count: the layout the counters were made for."""
        self._version = -1
        self._run: Counter[str] = Counter()
        """Over the whole run, by parameter name (collected at displays)."""
        self.sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
        """With sharded masters each solver counts its own slices of the gradients: the counts are summed
        over the solvers when read (a collective; every solver reads them at the same point)."""

    def _fresh_counts(self) -> None:
        """(Re)build the device counters for the current layout, keeping what they held."""
        if self._counts:
            self._flush()
        self._counts = [torch.zeros(len(g.segments), dtype=torch.int32, device=g.grads.device)
                        for g in self.flat.groups]
        self._names = [[s.name for s in g.segments] for g in self.flat.groups]
        self._version = self.flat.layout_version

    def observe(self, group_norms: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Attribute this step's overflow, if any. ``group_norms``: [groups] fp32, the norm pass's
        per-group gradient norms; ``found_inf``: [1] the scaler's flag. Runs before the update."""
        if not self.enabled:
            return
        if self._version != self.flat.layout_version:
            self._fresh_counts()
        if self._cuda:
            for i in range(len(self.flat.groups)):
                self._count_group(i)
            return
        if not found_inf.item():  # CPU: a plain load
            return
        for i, norm in enumerate(group_norms.tolist()):
            if not math.isfinite(norm):
                self._count_group(i)

    def _count_group(self, i: int) -> None:
        g = self.flat.groups[i]
        views = [g.grads[s.offset : s.offset + s.numel] for s in g.segments]
        norms = torch._foreach_norm(views, 2, dtype=torch.float32)  # one multi-tensor pass, fp32 sums
        self._counts[i] += (~torch.isfinite(torch.stack(norms))).int()

    def _flush(self) -> Counter[str]:
        """Move the device counts to the host, by name (a host sync), and zero them."""
        got: Counter[str] = Counter()
        if self.sum_over_ranks is not None:
            summed = self.sum_over_ranks(torch.cat(self._counts)).split([len(c) for c in self._counts])
            for counts, total in zip(self._counts, summed, strict=True):
                counts.copy_(total)
        for names, counts in zip(self._names, self._counts, strict=True):
            for name, n in zip(names, counts.tolist(), strict=True):
                if n:
                    got[name] += n
            counts.zero_()
        self._run.update(got)
        return got

    def collect(self) -> list[str]:
        """Names of the parameters that overflowed since the last call, most often first (at
        most :data:`MAX_NAMED`). A host sync: call at a display."""
        if not self.enabled or not self._counts:
            return []
        return [name for name, _ in self._flush().most_common(MAX_NAMED)]

    def most_often(self) -> str:
        """The parameters that overflowed most often over the run, as ``name (n steps)``."""
        if self.enabled and self._counts:
            self._flush()
        return ", ".join(f"{name} ({n} step{'s' if n > 1 else ''})" for name, n in self._run.most_common(MAX_NAMED))


def first_nonfinite_layer(model: nn.Module, x: torch.Tensor,
                          logits_of: Callable[[Any], torch.Tensor] = lambda out: out) -> str:
    """Run one forward of ``x`` and name the first leaf module, in execution order, whose output
    is not finite, and whether its own weights are. For the line of a run stopped for a
    non-finite loss; costs one forward, on that path only. ``logits_of``: the logits in the model's
    output (a tensor, or a tuple/dict for some models)."""
    found: list[str] = []

    def hook(name: str):
        def check(module: nn.Module, args: tuple, out: object) -> None:
            if found or not torch.is_tensor(out) or not out.is_floating_point():
                return
            if not bool(torch.isfinite(out).all()):
                params_ok = all(bool(torch.isfinite(p).all()) for p in module.parameters(recurse=False))
                inputs_ok = all(bool(torch.isfinite(a).all()) for a in args if torch.is_tensor(a)
                                and a.is_floating_point())
                why = "its input is not finite" if not inputs_ok else \
                    "its weights are not finite" if not params_ok else "from finite inputs and weights"
                found.append(f"{name} ({type(module).__name__}) gives non-finite output, {why}")
        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n and not any(m.children())]
    try:
        with torch.no_grad():
            out = logits_of(model(x))
    finally:
        for h in handles:
            h.remove()
    if found:
        return found[0]
    return "every layer's output is finite on the next batch" if bool(torch.isfinite(out).all()) else \
        "the model's output is not finite"
