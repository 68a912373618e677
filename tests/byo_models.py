"""Users' own models for the bring-your-own tests: plain nn.Modules on the digits' [B, 3, 32, 32],
each with one of the things a data-parallel wrapper gets wrong (named as ``"byo_models:Name"``)."""
from __future__ import annotations

import collections

import torch
import torch.nn.functional as F
from torch import nn


def _trunk(width: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, width, 5, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten())


class Frozen(nn.Module):
    """A trunk frozen by the model itself (requires_grad=False); the config may freeze more."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.trunk = _trunk()
        self.trunk[0].bias.requires_grad_(False)
        self.head = nn.Linear(8 * 16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


class Unused(nn.Module):
    """A head no loss ever reaches (``dead``), and a branch taken only for batches whose mean pixel is
    above the median (``bright``): on some ranks and iterations, not on others."""

    def __init__(self, num_classes: int, threshold: float = 0.0) -> None:
        super().__init__()
        self.trunk = _trunk()
        self.bright = nn.Linear(8 * 16, 8 * 16)
        self.dead = nn.Linear(8 * 16, num_classes)
        self.head = nn.Linear(8 * 16, num_classes)
        self.threshold = threshold
        self.taken: list[int] = []
        """1 for each forward that took the ``bright`` branch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        if float(x.float().mean()) > self.threshold:  # data-dependent: differs between ranks and steps
            self.taken.append(1)
            h = h + self.bright(h)
        else:
            self.taken.append(0)
        return self.head(h)


class Shared(nn.Module):
    """A block applied twice, and a weight tied between two modules: each is one parameter, reduced once."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.trunk = _trunk()
        self.block = nn.Linear(8 * 16, 8 * 16)
        self.proj = nn.Linear(8 * 16, 8 * 16, bias=False)
        self.back = nn.Linear(8 * 16, 8 * 16, bias=False)
        self.back.weight = self.proj.weight  # tied
        self.head = nn.Linear(8 * 16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        h = torch.relu(self.block(torch.relu(self.block(h))))
        return self.head(self.back(torch.tanh(self.proj(h))))


class EmaNorm(nn.Module):
    """A normalisation of its own that *reassigns* its running mean each training step (not in place)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(features))
        self.register_buffer("running_var", torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.running_mean = 0.9 * self.running_mean + 0.1 * x.mean(0).float()
                self.running_var = 0.9 * self.running_var + 0.1 * x.var(0).float()
        return (x - self.running_mean.to(x.dtype)) * torch.rsqrt(self.running_var.to(x.dtype) + 1e-5)


class Buffers(nn.Module):
    """Buffers beside BatchNorm's: a reassigned running statistic (averaged over ranks), an integer step
    counter and a float buffer that are each rank's own after the start, and one set at random at
    construction (rank 0's reaches every rank)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.trunk = _trunk()
        self.norm = EmaNorm(8 * 16)
        self.head = nn.Linear(8 * 16, num_classes)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("last_max", torch.zeros(()))
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.register_buffer("noise", torch.randn(8 * 16) + rank)  # rank 0's must reach every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.trunk(x))
        if self.training:
            self.steps += 1
            self.last_max = h.detach().abs().max().float()
        return self.head(h + 0 * self.noise.to(h.dtype))


GoogLeNetOutputs = collections.namedtuple("GoogLeNetOutputs", ["logits", "aux_logits2", "aux_logits1"])


class AuxHeads(nn.Module):
    """torchvision's GoogLeNet pattern: a namedtuple (logits, aux2, aux1) in training, logits in eval;
    ``as_dict`` returns {"logits", "aux", "features"} instead."""

    def __init__(self, num_classes: int, as_dict: bool = False) -> None:
        super().__init__()
        self.trunk = _trunk()
        self.head = nn.Linear(8 * 16, num_classes)
        self.aux1 = nn.Linear(8 * 16, num_classes)
        self.aux2 = nn.Linear(8 * 16, num_classes)
        self.as_dict = as_dict

    def forward(self, x: torch.Tensor):
        h = self.trunk(x)
        if not self.training:
            return self.head(h)
        if self.as_dict:
            return {"logits": self.head(h), "aux": self.aux1(h), "features": h}
        return GoogLeNetOutputs(self.head(h), self.aux2(h), self.aux1(h))


class Normed(nn.Module):
    """LayerNorm and GroupNorm, which stay fp32 by default as BatchNorm does."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 5, stride=2)
        self.gn = nn.GroupNorm(2, 8)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.ln = nn.LayerNorm(8 * 16)
        self.head = nn.Linear(8 * 16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(F.relu(self.pool(self.gn(self.conv(x)))).flatten(1)))


def not_a_module(num_classes: int) -> str:
    """A callable that returns something else than a module."""
    return f"{num_classes} classes"


def wide_output(num_classes: int) -> nn.Module:
    """A factory whose model ignores the class count it was given."""
    return nn.Sequential(_trunk(), nn.Linear(8 * 16, 1000))


class FixedSize(nn.Module):
    """A model that takes 32x32 inputs only (a flatten into a Linear of fixed width)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 5, stride=2)
        self.head = nn.Linear(4 * 14 * 14, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).flatten(1))


class MetaHostile(FixedSize):
    """FixedSize whose ``__init__`` reads a tensor's value (as timm's drop-path schedules do), so it cannot
    be built on the meta device."""

    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes)
        self.rate = float(torch.linspace(0, 0.1, 3)[1])


def raises_value(num_classes: int) -> nn.Module:
    """A factory that refuses its own configuration (timm's "Unknown model" is a RuntimeError)."""
    raise ValueError("depth must be even")


def buggy_factory(num_classes: int) -> nn.Module:
    """A factory with a bug of its own that raises TypeError (not a refused keyword)."""
    depth = None
    return nn.Linear(depth + 1, num_classes)


class EvalWide(nn.Module):
    """Right logits in training, an ImageNet head's 1000 in evaluation mode."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.body, self.head, self.wide = _trunk(), nn.Linear(8 * 16, num_classes), nn.Linear(8 * 16, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) if self.training else self.wide(h)


class NoParams(nn.Module):
    """No parameters at all."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3))[:, :1].expand(-1, self.num_classes)


class ComplexParam(Frozen):
    """A model with a complex parameter."""

    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes)
        self.z = nn.Parameter(torch.zeros(3, dtype=torch.complex64))


class Fp64Head(nn.Module):
    """A head created in fp64 (the model casts its features to the head's dtype)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.body, self.head = _trunk(), nn.Linear(8 * 16, num_classes).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).to(self.head.weight.dtype)).float()


class TvEncoderBlock(nn.Module):
    """torchvision's ViT block: pre-norm attention (nn.MultiheadAttention) and an MLP that is a Sequential."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.self_attention = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.self_attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TvEncoder(nn.Module):
    """torchvision's ViT Encoder: its own forward (position embedding, dropout) around a Sequential of blocks."""

    def __init__(self, dim: int, depth: int, tokens: int) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.zeros(1, tokens, dim))
        self.layers = nn.Sequential(collections.OrderedDict(
            (f"encoder_layer_{i}", TvEncoderBlock(dim)) for i in range(depth)))
        self.ln = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(x + self.pos_embedding))


class TvViT(nn.Module):
    """The module tree of torchvision's VisionTransformer, small: conv_proj, class_token, encoder, heads."""

    def __init__(self, num_classes: int, dim: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.conv_proj = nn.Conv2d(3, dim, 8, stride=8)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.encoder = TvEncoder(dim, depth, 17)
        self.heads = nn.Sequential(collections.OrderedDict(head=nn.Linear(dim, num_classes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(len(x), -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])
