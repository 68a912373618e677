"""A small vision transformer, as a user would bring one to dptrain: a plain ``nn.Module`` that
knows nothing of dptrain (patch embedding, a class token, pre-norm attention blocks with an MLP,
LayerNorm and no BatchNorm, as ViT-B/16 is built).

Train it with ``dptrain train --config examples/vit_digits.toml``: the recipe names it as
``model.name = "examples.vit:VisionTransformer"`` and sets its keyword arguments in ``[model.args]``;
dptrain passes ``num_classes`` itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Multi-head self-attention through torch's fused scaled-dot-product kernel."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)  # [B, heads, N, d / heads]
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """ViT: [B, C, H, W] images -> [B, num_classes] logits from the class token."""

    def __init__(self, *, num_classes: int, image_size: int = 32, patch_size: int = 4, in_channels: int = 3,
                 dim: int = 64, depth: int = 4, heads: int = 4, mlp_ratio: float = 2.0) -> None:
        super().__init__()
        tokens = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads, mlp_ratio) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # [B, tokens, dim]
        x = torch.cat([self.class_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embedding
        return self.head(self.norm(self.blocks(x))[:, 0])
