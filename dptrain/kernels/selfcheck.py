"""First-use self-check of the update kernels against the torch reference, on the device itself.

The first time a process asks for the CuPy kernels on a device (``kernels.kernel_backend``),
or for the host build of ``update.cu`` on the CPU (``kernels.native``), it compiles them and
runs every rule over small buffers that cover each storage dtype, each state dtype, the
vector path and the scalar tail (aligned and misaligned starts), per-element lr and decay
multipliers (each alone and both), Adam's bias corrections, both decay modes and none, fp32
subnormals and an overflow (skipped) step, comparing the kernel's bits with the
reference's. It costs a few milliseconds after the compile. A mismatch or a failure makes
the dispatch fall back (CUDA: to the reference; CPU: to the in-place passes) with one
warning (``DPTRAIN_KERNELS=auto``) or stop (``DPTRAIN_KERNELS=cupy`` / ``native``).

:func:`compare` takes the kernel as an argument, so the check itself runs on the CPU in the
tests with a deliberately wrong kernel.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from dptrain.kernels import cuda
from dptrain.kernels.spec import RULES, Hyper, UpdateArgs, grad_norm_reference, reference

CHECK_NUMEL = 203
"""Not a multiple of the vector width (4): the scalar tail runs too."""
NORM_RTOL = 1e-5
"""The norm kernel sums per block, then the block sums: fp32 reordering over 203 squares
stays far below this (each partial rounds at 2^-24 relative)."""
STORAGE = (torch.float16, torch.bfloat16, torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _placed(values: torch.Tensor, dtype: torch.dtype, device: torch.device, offset: int) -> torch.Tensor:
    """``values`` as ``dtype`` on ``device``, starting ``offset`` elements into a larger buffer
    (offset 1 breaks the 4-element alignment, so the kernel takes its scalar path)."""
    full = torch.zeros(values.numel() + offset, dtype=dtype, device=device)
    full[offset:] = values.to(dtype)
    return full[offset:]


VARIANTS = ((0, "l2", False, False, False), (1, "decoupled", True, True, False), (0, "decoupled", True, True, True),
            (0, "no decay", True, False, False), (1, "l2", False, True, False))
"""(start offset, weight decay, lr table, decay table, skipped) of the cases run for every rule and
dtype: both decay modes and none, each table alone and both (each a separately compiled variant of
the host build), aligned and misaligned starts, and an overflow."""


def cases(device: torch.device) -> Iterator[tuple[str, UpdateArgs]]:
    """(label, arguments) of every combination the self-check runs."""
    gen = torch.Generator().manual_seed(20261124)
    n = CHECK_NUMEL
    for rule in RULES.values():
        for storage in STORAGE:
            for state_dtype in rule.state_dtypes:
                for offset, decay, lr_table, decay_table, skip in VARIANTS:
                    mag = torch.exp2(torch.randint(-30, 12, (n,), generator=gen).float())
                    grads = torch.randn(n, generator=gen) * mag
                    grads[::11] = 0.0  # with a tiny history: fp32 subnormal intermediates (m*h < 2^-126)
                    master = torch.randn(n, generator=gen) * 0.1
                    # non-negative, as a second moment must be (its square root is taken)
                    state = torch.randn(len(rule.state_names), n, generator=gen).abs() * 0.01
                    state[:, ::11] = 3e-39  # a subnormal fp32 history
                    m = _placed(master, torch.float32, device, offset)
                    args = UpdateArgs(
                        rule=rule.name,
                        grads=_placed(grads, storage, device, offset),
                        master=m,
                        params=m if storage == torch.float32 else _placed(master, storage, device, offset),
                        state=tuple(_placed(s, state_dtype, device, offset) for s in state),
                        grad_coef=torch.tensor([0.37 / 4096], device=device),
                        found_inf=torch.tensor([1.0 if skip else 0.0], device=device),
                        hyper=Hyper(lr=0.9137, momentum=0.9, weight_decay=0.0 if decay == "no decay" else 0.7,
                                    decoupled=decay == "decoupled"),
                        lr_scale=_placed(torch.rand(n, generator=gen) * 2, torch.float32, device, offset)
                        if lr_table else None,
                        decay_scale=_placed((torch.rand(n, generator=gen) * 2).round(), torch.float32, device, offset)
                        if decay_table else None,  # 0, 1 and 2: no_decay, plain and doubled decay
                        bias_correction=torch.tensor([1 - 0.9**3, (1 - 0.999**3) ** 0.5], device=device)
                        if rule.bias_correction else None,
                    )
                    label = (f"{rule.name} storage {str(storage)[6:]} state {str(state_dtype)[6:]} offset {offset} "
                             f"{decay}{' lr_scale' if lr_table else ''}{' decay_scale' if decay_table else ''}"
                             f"{' skipped' if skip else ''}")
                    yield label, args


def placed_clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` as many elements into a new buffer as ``t`` is into its own, so a misaligned
    start stays misaligned (``t.clone()`` is a fresh, aligned allocation: the kernel would take its
    vector path on the copy of a case meant for its scalar one)."""
    offset = t.storage_offset()
    full = torch.empty(offset + t.numel(), dtype=t.dtype, device=t.device)  # [offset + n], a fresh allocation
    return full[offset:].view(t.shape).copy_(t)


def _clone(a: UpdateArgs) -> UpdateArgs:
    """Copies of the buffers an update writes, each placed as the original is (:func:`placed_clone`)."""
    master = placed_clone(a.master)
    return replace(a, grads=placed_clone(a.grads), master=master,
                   params=master if a.params is a.master else placed_clone(a.params),
                   state=tuple(placed_clone(s) for s in a.state))


def compare(kernel: Callable[[UpdateArgs], None], norm: Callable[[torch.Tensor], torch.Tensor],
            device: torch.device) -> str | None:
    """Run ``kernel`` and the reference on every case; the first difference, or None."""
    for label, args in cases(device):
        want, got = _clone(args), _clone(args)
        reference(want)
        kernel(got)
        for name in ("grads", "master", "params"):
            if not torch.equal(_bits(getattr(got, name)), _bits(getattr(want, name))):
                return f"{label}: {name} differs from the torch reference"
        for i, (g, w) in enumerate(zip(got.state, want.state, strict=True)):
            if not torch.equal(_bits(g), _bits(w)):
                return f"{label}: state {RULES[args.rule].state_names[i]} differs from the torch reference"
        grads = args.grads
        got_norm, want_norm = norm(grads), grad_norm_reference(grads)
        if not torch.allclose(got_norm, want_norm, rtol=NORM_RTOL, atol=0):
            return f"{label}: gradient norm {float(got_norm)} vs the reference's {float(want_norm)}"
    inf = torch.tensor([1.0, float("inf")], device=device)
    if not torch.isinf(norm(inf)):
        return "gradient norm of a buffer holding inf is not inf"
    return None


def run(device_index: int) -> str | None:
    """The self-check on ``cuda:device_index``: None when the kernels match the reference,
    else the first mismatch. Compiles the kernels first (compile errors raise)."""
    device = torch.device("cuda", device_index)
    with torch.cuda.device(device):
        return compare(cuda.update, cuda.grad_norm, device)
