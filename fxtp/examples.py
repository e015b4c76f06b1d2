"""Built-in example models with example inputs (tiny, random weights, nothing downloaded)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "TinyGPT", "tiny_gpt", "mlp"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    seq_len: int = 16
    dim: int = 64
    n_heads: int = 4
    n_layers: int = 2
    batch: int = 2


class _Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.dim // cfg.n_heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = _Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style decoder: embeddings, pre-norm blocks (causal attention + GELU MLP), LM head.

    Input: token ids ``(batch, seq_len)`` int64. Output: logits ``(batch, seq_len, vocab)`` fp32.
    """

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tiny_gpt(seed: int = 0, cfg: GPTConfig = GPTConfig()) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A :class:`TinyGPT` and example token ids, both from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TinyGPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=gen)
    return model, (ids,)


def mlp(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``Linear(64, 256) -> GELU -> Linear(256, 64)`` and an (8, 64) input."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    return model, (torch.randn(8, 64),)
