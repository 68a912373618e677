"""Flat parameter and gradient buffers.

Every parameter of a given dtype is a view into one contiguous buffer, and its
``.grad`` is a view into a second one (outside a training step's backward: see below).
Parameters are laid out in *reverse registration order* (an approximation of the order in
which backward produces their gradients), each padded to ``ALIGN_ELEMS``, so a data-parallel
bucket is a contiguous slice of the gradient buffer and needs no copy. The FP32 masters and
the optimizer's state (SGD's momentum, Adam's moments) are flat buffers with the same layout,
which lets the update run as one pass.

Parameter identity survives: ``module.weight`` stays the same ``nn.Parameter``; only its
storage moves (``param.data = view``), keeping its strides (channels_last included).

Gradients are handed over, not accumulated, in a training step: :meth:`FlatParams.release_grads`
sets every ``.grad`` to None while the flat gradients are zero (the update zeroes them), so autograd
gives each parameter the gradient tensor backward made, and a post-accumulate-grad hook, registered
here before any reducer's, copies it into the flat buffer and puts the view back: one read and one
write of the gradient, where adding it to a zeroed view reads two and writes one (DDP's default
copies into its buckets the same way). Accumulation micro-batches (iter_size) find the view in
place and add to it, and :meth:`FlatParams.restore_grads` after backward puts back the views of
parameters that got no gradient, which are still zero. The saving was measured on the CPU, not on
CUDA (measurements: docs/measurements.md#gradient-hand-over). Where autograd cannot hand a
gradient over (one laid out unlike its parameter, or still referenced elsewhere) it clones it
first, and the copy comes on top.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dptrain.errors import ConfigError, SnapshotError

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
    pad: int = 0
    """Elements after the aligned end that belong to no parameter: a sharded bucket's padding, so every
    solver owns an equal, aligned slice of it (``dptrain.distributed.shards``)."""

    @property
    def padded_numel(self) -> int:
        return _align(self.numel) + self.pad


def _align(n: int) -> int:
    return (n + ALIGN_ELEMS - 1) // ALIGN_ELEMS * ALIGN_ELEMS


def _view(flat: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of ``flat`` with ``like``'s size and strides starting at ``offset``."""
    return flat.as_strided(like.size(), like.stride(), offset)


def _detached(flat: torch.Tensor, like: torch.Tensor, offset: int, *, copy: bool) -> torch.Tensor:
    """``like``'s values in ``flat`` at ``offset``, detached: a contiguous copy when ``copy`` (a live
    buffer, which later steps change), else a view in ``like``'s layout (NHWC weights stay strided:
    a contiguous copy would double what a snapshot of a gathered buffer holds)."""
    v = _view(flat, like, offset).detach()
    return v.clone(memory_format=torch.contiguous_format) if copy else v


class FlatGroup:
    """The parameters of one dtype: model weights, grads, masters and optimizer state, all flat."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        *,
        state_names: tuple[str, ...],
        state_dtype: torch.dtype,
    ) -> None:
        assert named_params, "a flat group needs at least one parameter"
        self.dtype = named_params[0][1].dtype
        self.device = named_params[0][1].device
        for name, p in named_params:
            assert p.dtype == self.dtype, f"{name} is {p.dtype}, group is {self.dtype}"
            assert _is_dense(p), f"{name} has overlapping or gapped strides {p.stride()}"
        self.segments, self.numel = _layout(named_params)
        self._grad_views: dict[int, torch.Tensor] = {}
        """Each parameter's gradient view, by ``id(param)``: what the hand-over hook copies into."""
        self.params = torch.zeros(self.numel, dtype=self.dtype, device=self.device)  # [numel] storage dtype
        self.grads = torch.zeros(self.numel, dtype=self.dtype, device=self.device)  # [numel] storage dtype
        for s in self.segments:
            view = _view(self.params, s.param, s.offset)
            view.copy_(s.param.detach())
            s.param.data = view
        self._set_grad_views()
        # FP32 storage needs no separate master: the model weights are the masters.
        self.master = self.params if self.dtype == torch.float32 else self.params.float()  # [numel] fp32
        self.state = {name: torch.zeros(self.numel, dtype=state_dtype, device=self.device)  # [numel] each
                      for name in state_names}
        """The optimizer's per-element state, by name (SGD: "momentum"); this solver's slices only
        when sharded (:meth:`shard`)."""
        self._units: tuple[tuple, list[UpdateUnit]] | None = None
        self.parts: list[Part] | None = None
        """The slices of the flat buffers this solver owns, when the masters and optimizer state are
        sharded over the solvers (:meth:`shard`); None: it holds them all."""

    # ------------------------------------------------------------------ sharded masters and state

    def shard(self, ranges: list[tuple[int, int]]) -> None:
        """Keep the masters and the optimizer state of the element ranges ``ranges`` only (this solver's
        slice of each bucket, ``dptrain.distributed.shards``), in buffers of their total length, in
        that order; the full ones go. fp32 weights stay the masters: their slices are views."""
        assert self.parts is None, "the group is sharded already"
        parts, offset = [], 0
        for start, stop in ranges:
            parts.append(Part(start, stop, offset))
            offset += stop - start
        own = self.master is not self.params
        master = torch.empty(offset, dtype=torch.float32, device=self.device) if own else None  # [shard] fp32
        state = {k: torch.empty(offset, dtype=v.dtype, device=self.device) for k, v in self.state.items()}
        for p in parts:
            if master is not None:
                master[p.offset : p.offset + p.size].copy_(self.master[p.start : p.stop])
            for k, v in self.state.items():
                state[k][p.offset : p.offset + p.size].copy_(v[p.start : p.stop])
        self.parts, self.state = parts, state
        self.master = master if own else self.params
        self._own_master = own

    def unshard(self, master: torch.Tensor | None, state: dict[str, torch.Tensor]) -> None:
        """Back to holding everything: ``master`` and ``state`` are the whole group's values (gathered
        from every solver by the caller; ``master`` None for fp32 weights, which are the masters)."""
        assert self.parts is not None, "the group is not sharded"
        self.parts = None
        self.master = master if self._own_master else self.params
        self.state = state

    def units(self) -> list[UpdateUnit]:
        """What one update launch takes, per slice this solver updates: the whole group, or each owned
        part when sharded. ``lo``/``hi``: its element range in the flat buffers. Made once per layout."""
        key = (id(self.params), id(self.master), tuple(id(v) for v in self.state.values()), id(self.parts))
        if self._units is None or self._units[0] != key:
            self._units = (key, self._make_units())
        return self._units[1]

    def _make_units(self) -> list[UpdateUnit]:
        if self.parts is None:
            return [UpdateUnit(0, self.numel, self.grads, self.master, self.params, self.state)]
        out = []
        for p in self.parts:
            params = self.params[p.start : p.stop]
            master = params if self.master is self.params else self.master[p.offset : p.offset + p.size]
            state = {k: v[p.offset : p.offset + p.size] for k, v in self.state.items()}
            out.append(UpdateUnit(p.start, p.stop, self.grads[p.start : p.stop], master, params, state))
        return out

    def overlaps(self, seg: Segment) -> list[tuple[UpdateUnit, int, int]]:
        """(unit, lo, hi) for each unit holding part of ``seg``'s elements, as positions in the unit's views."""
        out = []
        for u in self.units():
            lo, hi = max(seg.offset, u.lo), min(seg.offset + seg.numel, u.hi)
            if lo < hi:
                out.append((u, lo - u.lo, hi - u.lo))
        return out

    def relayout(self, names: list[str], pads: dict[str, int] | None = None) -> None:
        """Re-order the flat buffers so parameters sit in the order ``names`` (every name of
        this group, once), each followed by ``pads[name]`` spare elements; values of weights,
        grads, masters and state move with them. The group must not be sharded."""
        assert self.parts is None, "relayout a sharded group: unshard it first"
        by_name = {s.name: s for s in self.segments}
        if sorted(names) != sorted(by_name):
            raise RuntimeError("relayout needs every parameter of the group exactly once")
        old = by_name
        segments, numel = _layout([(n, by_name[n].param) for n in names], pads or {})
        sources = {"params": self.params, "grads": self.grads, **{f"state.{k}": v for k, v in self.state.items()}}
        if self.master is not self.params:
            sources["master"] = self.master
        bufs = {}
        for key, src in sources.items():
            dst = torch.zeros(numel, dtype=src.dtype, device=src.device)
            for s in segments:
                o = old[s.name]
                dst[s.offset : s.offset + s.numel] = src[o.offset : o.offset + o.numel]
            bufs[key] = dst
        self.segments, self.numel = segments, numel
        self.params, self.grads = bufs["params"], bufs["grads"]
        self.state = {k: bufs[f"state.{k}"] for k in self.state}
        self.master = bufs.get("master", self.params)
        for s in segments:
            s.param.data = _view(self.params, s.param, s.offset)
        self._set_grad_views()

    def _set_grad_views(self) -> None:
        self._grad_views = {id(s.param): _view(self.grads, s.param, s.offset) for s in self.segments}
        for s in self.segments:
            s.param.grad = self._grad_views[id(s.param)]

    def take_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: a gradient autograd handed over (``.grad`` was None, the view
        zero) is copied into the flat buffer and the view put back; a view is left as it is."""
        view = self._grad_views[id(param)]
        g = param.grad
        if g is not None and g is not view:
            view.copy_(g.to_dense() if g.is_sparse else g)
            param.grad = view

    def release_grads(self) -> None:
        """Every ``.grad`` to None; only while the flat gradients are zero (see the module docstring)."""
        for s in self.segments:
            s.param.grad = None

    def restore_grads(self) -> list[str]:
        """Put back the views of parameters whose ``.grad`` is still None (no gradient in backward);
        their names."""
        missing = []
        for s in self.segments:
            if s.param.grad is None:
                s.param.grad = self._grad_views[id(s.param)]
                missing.append(s.name)
        return missing

    def check_grad_views(self) -> None:
        """Raise if someone replaced a ``.grad`` (e.g. ``zero_grad(set_to_none=True)``); holds
        between training steps, not inside one's backward (the hand-over)."""
        for s in self.segments:
            g = s.param.grad
            if g is None or g.data_ptr() != self._grad_views[id(s.param)].data_ptr():
                raise RuntimeError(
                    f"gradient of {s.name} is no longer a view into the flat buffer; "
                    "never set .grad to None or replace it (use the solver's zeroing)"
                )

    def master_state(self, full: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """FP32 master values per parameter name, for snapshots (unpadded); ``full``: the whole group's
        masters when sharded (gathered by the caller). Values of live buffers are copies; those of a
        gathered ``full`` are its views, so a snapshot holds no second copy of what it gathered."""
        master = self.master if full is None else full
        return {s.name: _detached(master, s.param, s.offset, copy=full is None or full is self.params)
                for s in self.segments}

    def load_master_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load FP32 masters by name and re-derive the model weights from them (sharded: every weight,
        and the masters of this solver's parts)."""
        full = self.master if self.parts is None else torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        for s in self.segments:
            _view(full, s.param, s.offset).copy_(state[s.name])
        if full is not self.params:
            self.params.copy_(full)
        if self.parts is not None and self.master is not self.params:
            for p in self.parts:
                self.master[p.offset : p.offset + p.size].copy_(full[p.start : p.stop])

    def state_dict(self, full: dict[str, torch.Tensor] | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state per state name, then per parameter name (unpadded); ``full``: the whole
        group's state when sharded (gathered by the caller, whose views the values then are)."""
        return {k: {s.name: _detached(buf, s.param, s.offset, copy=full is None) for s in self.segments}
                for k, buf in (self.state if full is None else full).items()}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        for k, buf in self.state.items():
            full = buf if self.parts is None else torch.zeros(self.numel, dtype=buf.dtype, device=self.device)
            for s in self.segments:
                _view(full, s.param, s.offset).copy_(state[k][s.name])
            if self.parts is not None:
                for p in self.parts:
                    buf[p.offset : p.offset + p.size].copy_(full[p.start : p.stop])


def _layout(named_params: list[tuple[str, nn.Parameter]], pads: dict[str, int] | None = None
            ) -> tuple[list[Segment], int]:
    """Segments at 64-element-aligned offsets in the given order, each followed by ``pads[name]``
    spare elements (a multiple of 64); returns (segments, total)."""
    offset, segments = 0, []
    for name, p in named_params:
        seg = Segment(name, p, offset, p.numel(), (pads or {}).get(name, 0))
        segments.append(seg)
        offset += seg.padded_numel
    return segments, offset


@dataclass(frozen=True)
class Part:
    """A slice [start, stop) of a sharded group's flat buffers that this solver owns; its masters and
    state sit at ``offset`` in the group's shard buffers."""

    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class UpdateUnit:
    """Equal-length views of what the fused update reads and writes, over elements [lo, hi)."""

    lo: int
    hi: int
    grads: torch.Tensor
    master: torch.Tensor
    params: torch.Tensor
    state: dict[str, torch.Tensor]


def _is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly numel() elements with no overlap (any dim order)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.size(), strict=True) if sz > 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return True


class FlatParams:
    """All trainable parameters of a model, grouped by dtype into flat buffers.

    ``state_names`` are the optimizer's per-element state buffers (SGD: ("momentum",)),
    held in ``state_dtype`` for groups stored in reduced precision and in fp32 otherwise.
    """

    def __init__(self, model: nn.Module, *, state_names: tuple[str, ...] = ("momentum",),
                 state_dtype: torch.dtype = torch.float32) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named and not any(True for _ in model.parameters()):
            raise ConfigError("the model has no parameters at all (no nn.Parameter is registered on it or its "
                              "submodules); dptrain trains a model's parameters: register the weights as nn.Parameter")
        if not named:
            raise ConfigError("the model has no trainable parameters (every one is frozen: requires_grad=False or "
                              "model.freeze); unfreeze some")
        self._frozen_params = {n: p for n, p in model.named_parameters() if not p.requires_grad}
        self.frozen: dict[str, torch.Tensor] = {n: p.detach().float().cpu() for n, p in self._frozen_params.items()}
        """Frozen parameters' fp32 values by name (host memory): they take no update and are not reduced,
        but the model holds them in its storage dtype, so their exact values are kept here for
        snapshots, ``export`` and ``--weights`` (:meth:`master_state`, :meth:`load_master_state`)."""
        named.reverse()  # backward produces the last layers' gradients first
        self._layout_order: list[str] = [n for n, _ in named]
        self._layout_version = 0
        by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
        for n, p in named:
            by_dtype.setdefault(p.dtype, []).append((n, p))
        # FP32 masters need state at least as wide as requested; a reduced-precision state
        # applies only to groups stored in reduced precision.
        self.groups: list[FlatGroup] = [
            FlatGroup(ps, state_names=state_names, state_dtype=state_dtype if dt != torch.float32 else torch.float32)
            for dt, ps in by_dtype.items()
        ]
        for g in self.groups:  # before any reducer's hooks, which reduce the flat buffer
            for seg in g.segments:
                seg.param.register_post_accumulate_grad_hook(g.take_grad)
        self.gather: Callable[..., tuple[torch.Tensor | None, dict[str, torch.Tensor]]] | None = None
        """When the groups are sharded: a collective ``gather(group, with_master=..., with_state=...)`` that returns a
        group's whole masters (None for fp32 weights, or when not asked for) and state (empty when not asked
        for), from every solver's parts (``dptrain.distributed.shards``)."""

    def release_grads(self) -> None:
        """Before the first backward of a training step, while the flat gradients are zero: every
        ``.grad`` to None, so backward hands its gradients over (module docstring): a read of each
        gradient less per step than accumulating into the zeroed views, which makes the step faster
        (measurements: docs/measurements.md#gradient-hand-over)."""
        for g in self.groups:
            g.release_grads()

    def restore_grads(self) -> list[str]:
        """After the last backward of a training step: the views of parameters that got no gradient
        in any of the step's backwards; their names (``dptrain.distributed.unused``)."""
        return [n for g in self.groups for n in g.restore_grads()]

    def zero_grads(self) -> None:
        """Zero every flat gradient buffer (a training step that failed part-way)."""
        for g in self.groups:
            g.grads.zero_()

    @property
    def layout_order(self) -> list[str]:
        """Parameter names in layout order across groups; the reducer's launch order."""
        return list(self._layout_order)

    @property
    def layout_version(self) -> int:
        """Incremented by every :meth:`reorder`, so users of the segment lists know to rebuild
        what they derived from them."""
        return self._layout_version

    def reorder(self, per_group: list[list[str]], layout_order: list[str]) -> None:
        """Lay group ``i`` out in the order ``per_group[i]`` (values move with their parameters)
        and record ``layout_order`` as the order across groups."""
        if sorted(layout_order) != sorted(self._layout_order):
            raise RuntimeError("reorder needs every parameter of the model exactly once")
        for g, names in zip(self.groups, per_group, strict=True):
            if [s.name for s in g.segments] != names:
                g.relayout(names)
        self._layout_order = list(layout_order)
        self._layout_version += 1

    def state_bytes(self) -> int:
        """Bytes of fp32 masters (the fp32 weights, where they are the masters) and optimizer state this
        solver holds: the whole of them, or its slices when sharded."""
        total = 0
        for g in self.groups:
            owned = g.numel if g.parts is None else sum(p.size for p in g.parts)
            total += owned * 4 + sum(v.numel() * v.element_size() for v in g.state.values())
        return total

    def layout_changed(self) -> None:
        """A group was re-laid out or sharded in place (``dptrain.distributed.shards``): what was derived
        from the segment lists (the optimizer's tables, the overflow counters) is rebuilt."""
        self._layout_version += 1

    @property
    def num_params(self) -> int:
        return sum(s.numel for g in self.groups for s in g.segments)

    def bytes_per_param(self) -> dict[str, float]:
        """Bytes of device memory per parameter: weights, masters, each state buffer, grads."""
        n = self.num_params
        weights = sum(g.params.numel() * g.params.element_size() for g in self.groups)
        masters = sum(g.master.numel() * 4 for g in self.groups if g.master is not g.params)
        grads = sum(g.grads.numel() * g.grads.element_size() for g in self.groups)
        out = {"weights": weights, "masters": masters}
        for name in self.groups[0].state:
            out[name] = sum(g.state[name].numel() * g.state[name].element_size() for g in self.groups)
        out["grads"] = grads
        return {k: round(v / n, 3) for k, v in out.items()}

    def check_grad_views(self) -> None:
        for g in self.groups:
            g.check_grad_views()

    def _full(self, g: FlatGroup, *, master: bool, state: bool) -> tuple[torch.Tensor | None,
                                                                         dict[str, torch.Tensor] | None]:
        """A sharded group's whole masters and/or state, as asked (collective), or (None, None)."""
        if g.parts is None:
            return None, None
        assert self.gather is not None, "a sharded group needs the gather of dptrain.distributed.shards"
        full_master, full_state = self.gather(g, with_master=master, with_state=state)
        return (g.params if master and full_master is None else full_master), full_state

    def master_state(self) -> dict[str, torch.Tensor]:
        """Every parameter's fp32 value by name: the masters of the trainable ones, and the frozen ones'.
        Collective when the masters are sharded (every solver gathers them)."""
        out: dict[str, torch.Tensor] = {n: t.clone() for n, t in self.frozen.items()}
        for g in self.groups:
            out.update(g.master_state(self._full(g, master=True, state=False)[0]))
        return out

    def load_master_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set every parameter from fp32 values by name: the masters (the model's weights re-derived) and
        the frozen parameters (their fp32 values kept, the model's copy cast to its dtype)."""
        names = {s.name for g in self.groups for s in g.segments} | set(self.frozen)
        missing = sorted(names - set(state))
        if missing:
            raise SnapshotError(f"snapshot lacks parameters {missing[:5]}; was it written for another model?")
        for g in self.groups:
            g.load_master_state(state)
        with torch.no_grad():
            for n, p in self._frozen_params.items():
                self.frozen[n] = state[n].detach().float().cpu().clone()
                p.copy_(state[n])

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state: {state name: {parameter name: values}} over every group (collective when
        sharded)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for g in self.groups:
            for k, per_param in g.state_dict(self._full(g, master=False, state=True)[1]).items():
                out.setdefault(k, {}).update(per_param)
        return out

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        names = set(self.groups[0].state)
        if set(state) != names:
            raise SnapshotError(f"snapshot's optimizer state is {sorted(state)}, this optimizer's {sorted(names)}; "
                                f"was it written with another solver.type?")
        for g in self.groups:
            g.load_state_dict(state)
