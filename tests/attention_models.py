"""A user's own transformer that calls torch.nn.functional.scaled_dot_product_attention (the det.attention tests;
imported by subprocesses through PYTHONPATH)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SDPABlock(nn.Module):
    """Pre-norm attention + MLP, attention through F.scaled_dot_product_attention (looked up at each call)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.dropout = heads, kv_heads, dim // heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(B, T, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(B, T, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp(self.norm2(x))


class SDPALM(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, dim: int = 64, heads: int = 4, kv_heads: int = 2,
                 layers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.layers = nn.ModuleList(SDPABlock(dim, heads, kv_heads, dropout) for _ in range(layers))
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
