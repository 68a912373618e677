"""Gradient hand-over (dptrain.flat): backward's own gradient tensors copied into the flat buffer
give the bits that accumulating into the zeroed views gives, with the views restored after."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.flat import FlatParams
from dptrain.topology import Topology
from dptrain.train import Trainer


class _Net(nn.Module):
    """Convolutions (channels_last), a linear head and a layer the forward may skip."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.conv2 = nn.Conv2d(8, 4, 3)
        self.head = nn.Linear(4 * 4 * 4, 5)
        self.extra = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        y = self.head(torch.relu(self.conv2(torch.relu(self.conv1(x)))).flatten(1))
        return self.extra(y) if use_extra else y


def _net(dtype: torch.dtype) -> tuple[_Net, FlatParams]:
    torch.manual_seed(0)
    net = _Net().to(dtype).to(memory_format=torch.channels_last)
    return net, FlatParams(net)


def _backward(net: _Net, seed: int, use_extra: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 8, 8, generator=g).to(next(net.parameters()).dtype).to(memory_format=torch.channels_last)
    net(x, use_extra).float().square().sum().backward()


def _grads(flat: FlatParams) -> list[torch.Tensor]:
    return [g.grads.clone() for g in flat.groups]


def _run(dtype: torch.dtype, handover: bool, micro: list[bool]) -> tuple[list[torch.Tensor], FlatParams]:
    """One training step's backwards (``micro`` says which use ``extra``), from zero gradients."""
    net, flat = _net(dtype)
    ptrs = [g.grads.data_ptr() for g in flat.groups]
    if handover:
        flat.release_grads()
    for i, use_extra in enumerate(micro):
        _backward(net, i, use_extra)
    flat.restore_grads()
    flat.check_grad_views()  # every .grad is a view into the flat buffer again
    assert [g.grads.data_ptr() for g in flat.groups] == ptrs
    return _grads(flat), flat


def test_handover_gives_the_accumulated_bits_for_every_pattern():
    # one backward; an unused layer (restored, still zero); iter_size 2 where the layer is used
    # only in the second micro-batch (handed over then) or only in the first (added to after)
    for dtype in (torch.float32, torch.bfloat16):
        for micro in ([True], [False], [False, True], [True, False], [True, True]):
            ref, _ = _run(dtype, False, micro)
            got, flat = _run(dtype, True, micro)
            assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)), (dtype, micro)
        _, flat = _run(dtype, True, [False])
        extra = [s for g in flat.groups for s in g.segments if s.name.startswith("extra.")]
        assert extra and all(not s.param.grad.any() for s in extra)  # unused: its zero view is back


def test_handover_copies_into_the_layout_after_a_reorder():
    net, flat = _net(torch.float32)
    order = sorted(flat.layout_order)  # a different layout than the registration order
    flat.reorder([[n for n in order if n in {s.name for s in g.segments}] for g in flat.groups], order)
    flat.release_grads()
    _backward(net, 0, True)
    flat.restore_grads()
    flat.check_grad_views()
    by_name = {s.name: s.param.grad.clone() for g in flat.groups for s in g.segments}
    ref_net, ref_flat = _net(torch.float32)
    _backward(ref_net, 0, True)
    for g in ref_flat.groups:
        for s in g.segments:
            assert torch.equal(by_name[s.name], s.param.grad), s.name


def test_gradients_are_views_between_steps():
    net, flat = _net(torch.float32)
    flat.release_grads()
    assert all(s.param.grad is None for g in flat.groups for s in g.segments)
    _backward(net, 0, True)  # every parameter used: the hooks put every view back
    flat.check_grad_views()


def test_a_hook_registered_after_the_flat_buffers_finds_the_gradient_in_them():
    # the reducer's hooks are registered after FlatParams' and reduce the flat buffer: by then the
    # handed-over gradient must be in it, with .grad its view (checked in the hook, not after a collective)
    net, flat = _net(torch.float32)
    incoming, checked = {}, []
    views = {id(s.param): (g, s) for g in flat.groups for s in g.segments}

    def later(p: torch.Tensor) -> None:
        g, s = views[id(p)]
        assert p.grad is not None and p.grad.data_ptr() == g.grads[s.offset:].data_ptr(), s.name  # the view
        assert torch.equal(p.grad, incoming[id(p)]), s.name  # holding the gradient (strides: the parameter's)
        checked.append(s.name)

    for p in net.parameters():
        p.register_hook(lambda grad, p=p: incoming.__setitem__(id(p), grad.detach().clone()))  # before accumulation
        p.register_post_accumulate_grad_hook(later)
    flat.release_grads()
    _backward(net, 0, True)
    assert len(checked) == len(list(net.parameters()))


def _trainer(tmp_path, *extra: str) -> Trainer:
    cfg = load_config(None, ["model.name=lenet", "data.source=digits", "data.batch_size=16", "solver.display=0",
                             f"train.run_dir={json.dumps(str(tmp_path))}", *extra])
    return Trainer(cfg, Communicator.from_env(Topology(), 60, torch.device("cpu")))


def test_train_step_hands_gradients_over_and_leaves_views(tmp_path):
    t = _trainer(tmp_path, "solver.iter_size=2")
    p = next(t.model.parameters())
    seen = []  # .grad when backward's gradient for p arrives: None in the first micro-batch, the view after
    p.register_hook(lambda g: seen.append(p.grad is None) or g)
    t.train_step()
    t.train_step()
    assert seen == [True, False, True, False]
    t.flat.check_grad_views()
    t.close()


def test_a_failed_step_leaves_zero_gradients_and_the_views(tmp_path):
    t = _trainer(tmp_path)
    t.train_step()
    first = next(t.model.parameters())  # the first layer's: backward reaches it last, after the others' copies

    def fail(g: torch.Tensor) -> torch.Tensor:
        assert any(g.grads.any() for g in t.flat.groups)  # later layers' gradients are in the buffer
        raise RuntimeError("injected")

    handle = first.register_hook(fail)
    with pytest.raises(RuntimeError, match="injected"):
        t.train_step()
    handle.remove()
    t.flat.check_grad_views()
    assert all(not g.grads.any() for g in t.flat.groups)  # nothing left for the next step to add to
    t.train_step()
    t.close()
