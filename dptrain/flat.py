"""Flat parameter and gradient buffers.

Every parameter of a given dtype is a view into one contiguous buffer, and its
``.grad`` is a view into a second one. Parameters are laid out in *reverse
registration order* (an approximation of the order in which backward produces their
gradients), each padded to ``ALIGN_ELEMS``, so a data-parallel bucket is a contiguous
slice of the gradient buffer and needs no copy. The FP32 masters and the momentum are
flat buffers with the same layout, which lets the update run as one pass.

Parameter identity survives: ``module.weight`` stays the same ``nn.Parameter``; only its
storage moves (``param.data = view``), keeping its strides (channels_last included).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dptrain.errors import SnapshotError

ALIGN_ELEMS = 64
"""Each parameter starts at a multiple of 64 elements, as NVCaffe pads its flat buffers;
keeps vector loads (16 B) aligned in the update kernel."""


@dataclass(frozen=True)
class Segment:
    """One parameter's place in its group's flat buffers."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int

    @property
    def padded_numel(self) -> int:
        return _align(self.numel)


def _align(n: int) -> int:
    return (n + ALIGN_ELEMS - 1) // ALIGN_ELEMS * ALIGN_ELEMS


def _view(flat: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of ``flat`` with ``like``'s size and strides starting at ``offset``."""
    return flat.as_strided(like.size(), like.stride(), offset)


class FlatGroup:
    """The parameters of one dtype: model weights, grads, masters and momentum, all flat."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        *,
        momentum_dtype: torch.dtype,
    ) -> None:
        assert named_params, "a flat group needs at least one parameter"
        self.dtype = named_params[0][1].dtype
        self.device = named_params[0][1].device
        for name, p in named_params:
            assert p.dtype == self.dtype, f"{name} is {p.dtype}, group is {self.dtype}"
            assert _is_dense(p), f"{name} has overlapping or gapped strides {p.stride()}"
        self.segments, self.numel = _layout(named_params)
        self.params = torch.zeros(self.numel, dtype=self.dtype, device=self.device)  # [numel] storage dtype
        self.grads = torch.zeros(self.numel, dtype=self.dtype, device=self.device)  # [numel] storage dtype
        for s in self.segments:
            view = _view(self.params, s.param, s.offset)
            view.copy_(s.param.detach())
            s.param.data = view
            s.param.grad = _view(self.grads, s.param, s.offset)
        # FP32 storage needs no separate master: the model weights are the masters.
        self.master = self.params if self.dtype == torch.float32 else self.params.float()  # [numel] fp32
        self.momentum = torch.zeros(self.numel, dtype=momentum_dtype, device=self.device)  # [numel]

    def relayout(self, names: list[str]) -> None:
        """Re-order the flat buffers so parameters sit in the order ``names`` (every name of
        this group, once); values of weights, grads, masters and momentum move with them."""
        by_name = {s.name: s for s in self.segments}
        if sorted(names) != sorted(by_name):
            raise RuntimeError("relayout needs every parameter of the group exactly once")
        old = by_name
        segments, numel = _layout([(n, by_name[n].param) for n in names])
        bufs = {}
        for attr in ("params", "grads", "momentum") + (() if self.master is self.params else ("master",)):
            src = getattr(self, attr)
            dst = torch.zeros(numel, dtype=src.dtype, device=src.device)
            for s in segments:
                o = old[s.name]
                dst[s.offset : s.offset + s.numel] = src[o.offset : o.offset + o.numel]
            bufs[attr] = dst
        self.segments, self.numel = segments, numel
        self.params, self.grads, self.momentum = bufs["params"], bufs["grads"], bufs["momentum"]
        self.master = bufs.get("master", self.params)
        for s in segments:
            s.param.data = _view(self.params, s.param, s.offset)
            s.param.grad = _view(self.grads, s.param, s.offset)

    def grad_slice(self, start: int, stop: int) -> torch.Tensor:
        return self.grads[start:stop]

    def check_grad_views(self) -> None:
        """Raise if someone replaced a ``.grad`` (e.g. ``zero_grad(set_to_none=True)``)."""
        for s in self.segments:
            g = s.param.grad
            if g is None or g.data_ptr() != self.grads.data_ptr() + s.offset * self.grads.element_size():
                raise RuntimeError(
                    f"gradient of {s.name} is no longer a view into the flat buffer; "
                    "never set .grad to None or replace it (use the solver's zeroing)"
                )

    def master_state(self) -> dict[str, torch.Tensor]:
        """FP32 master values per parameter name, for snapshots (clones, unpadded)."""
        return {
            s.name: _view(self.master, s.param, s.offset).detach().clone().contiguous()
            for s in self.segments
        }

    def load_master_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load FP32 masters by name and re-derive the model weights from them."""
        for s in self.segments:
            _view(self.master, s.param, s.offset).copy_(state[s.name])
        if self.master is not self.params:
            self.params.copy_(self.master)

    def momentum_state(self) -> dict[str, torch.Tensor]:
        return {s.name: _view(self.momentum, s.param, s.offset).clone().contiguous() for s in self.segments}

    def load_momentum_state(self, state: dict[str, torch.Tensor]) -> None:
        for s in self.segments:
            _view(self.momentum, s.param, s.offset).copy_(state[s.name])


def _layout(named_params: list[tuple[str, nn.Parameter]]) -> tuple[list[Segment], int]:
    """Segments at 64-element-aligned offsets in the given order; returns (segments, total)."""
    offset, segments = 0, []
    for name, p in named_params:
        segments.append(Segment(name, p, offset, p.numel()))
        offset += _align(p.numel())
    return segments, offset


def _is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly numel() elements with no overlap (any dim order)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz > 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return True


class FlatParams:
    """All trainable parameters of a model, grouped by dtype into flat buffers."""

    def __init__(self, model: nn.Module, *, momentum_dtype: torch.dtype) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise RuntimeError("the model has no trainable parameters")
        named.reverse()  # backward produces the last layers' gradients first
        self.layout_order: list[str] = [n for n, _ in named]
        """Parameter names in layout order across groups; the reducer's launch order."""
        by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
        for n, p in named:
            by_dtype.setdefault(p.dtype, []).append((n, p))
        # FP32 masters need a momentum at least as wide as requested; fp16 momentum
        # applies only to groups stored in reduced precision.
        self.groups: list[FlatGroup] = [
            FlatGroup(ps, momentum_dtype=momentum_dtype if dt != torch.float32 else torch.float32)
            for dt, ps in by_dtype.items()
        ]

    @property
    def num_params(self) -> int:
        return sum(s.numel for g in self.groups for s in g.segments)

    def bytes_per_param(self) -> dict[str, float]:
        """Bytes of device memory per parameter: weights, masters, momentum, grads."""
        n = self.num_params
        weights = sum(g.params.numel() * g.params.element_size() for g in self.groups)
        masters = sum(g.master.numel() * 4 for g in self.groups if g.master is not g.params)
        momentum = sum(g.momentum.numel() * g.momentum.element_size() for g in self.groups)
        grads = sum(g.grads.numel() * g.grads.element_size() for g in self.groups)
        return {k: round(v / n, 3) for k, v in
                {"weights": weights, "masters": masters, "momentum": momentum, "grads": grads}.items()}

    def check_grad_views(self) -> None:
        for g in self.groups:
            g.check_grad_views()

    def master_state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for g in self.groups:
            out.update(g.master_state())
        return out

    def load_master_state(self, state: dict[str, torch.Tensor]) -> None:
        names = {s.name for g in self.groups for s in g.segments}
        missing = sorted(names - set(state))
        if missing:
            raise SnapshotError(f"snapshot lacks parameters {missing[:5]}; was it written for another model?")
        for g in self.groups:
            g.load_master_state(state)

    def momentum_state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for g in self.groups:
            out.update(g.momentum_state())
        return out

    def load_momentum_state(self, state: dict[str, torch.Tensor]) -> None:
        for g in self.groups:
            g.load_momentum_state(state)
