"""The models of ../shared/cases/README.md (public bug reports), one builder per case.

Each builder returns ``(model, example_inputs)`` from a fixed seed. B, T = 2, 8 unless the case
says otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CASES", "build_case"]

B, T = 2, 8


def _inputs(*shapes, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=gen) for s in shapes)


class HeadLiteralAttention(nn.Module):
    """Case 1 (PiPPy PR 922): head count written as literals in ``view``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(512, 512) for _ in range(4))

    def forward(self, x):
        q = self.q(x).view(2, 8, 8, 64).transpose(1, 2)
        k = self.k(x).view(2, 8, 8, 64).transpose(1, 2)
        v = self.v(x).view(2, 8, 8, 64).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(2, 8, 512))


class Attention(nn.Module):
    """Separate q/k/v/o projections; ``kv_heads < heads`` repeats kv heads (grouped-query)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, repeat: str = "expand") -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.repeat = heads, kv_heads, hidden // heads, repeat
        self.q = nn.Linear(hidden, heads * self.hd)
        self.k = nn.Linear(hidden, kv_heads * self.hd)
        self.v = nn.Linear(hidden, kv_heads * self.hd)
        self.o = nn.Linear(heads * self.hd, hidden)

    def _repeat_kv(self, t):
        n = self.heads // self.kv_heads
        if n == 1:
            return t
        if self.repeat == "interleave":
            return t.repeat_interleave(n, dim=1)
        b, h, s, d = t.shape  # Hugging Face's repeat_kv
        return t[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self._repeat_kv(self.k(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2))
        v = self._repeat_kv(self.v(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class FusedQKVChunk(nn.Module):
    """Case 5A: Linear(64, 192) -> chunk(3) -> heads."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = (t.view(B, T, 4, 16).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(B, T, 64))


class FusedQKVUnbind(nn.Module):
    """Case 5B: Linear(64, 192) -> view(B, T, 4, 3, 16) -> unbind(3) (per-head interleaved)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(B, T, 4, 3, 16).unbind(3))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(B, T, 64))


class TiedLM(nn.Module):
    """Case 7: embedding and head share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(32, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.fc(self.emb(ids))))


class VocabLoss(nn.Module):
    """Case 8: Linear(16, 11) -> cross_entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 11)

    def forward(self, x, target):
        return F.cross_entropy(self.head(x).flatten(0, 1), target.flatten())


class NormAfter(nn.Module):
    """Case 9: A LayerNorm over the sharded features, B per-head RMSNorm, C RMSNorm then heads."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        if variant == "A":
            self.up, self.norm, self.down = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 32)
        elif variant == "B":
            self.up, self.norm, self.down = nn.Linear(32, 64), nn.RMSNorm(16), nn.Linear(64, 32)
        else:
            self.up, self.norm, self.down = nn.Linear(32, 32), nn.RMSNorm(32), nn.Linear(32, 32)

    def forward(self, x):
        h = self.up(x)
        if self.variant == "A":
            return self.down(self.norm(h))
        if self.variant == "B":
            return self.down(self.norm(h.view(B, T, 4, 16)).view(B, T, 64))
        return self.down(self.norm(h).view(B, T, 2, 16).view(B, T, 32))


class DropoutResidual(nn.Module):
    """Case 10: Linear -> Dropout -> Linear -> Dropout -> + x."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(32, 64), nn.Linear(64, 32), nn.Dropout(0.25)

    def forward(self, x):
        return x + self.drop(self.down(self.drop(self.up(x))))


class AttentionDropout(nn.Module):
    """Case 17: q/k/v/o Linear(64, 64), 4 heads, SDPA with dropout_p=0.25 (in either mode, as written)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, 4, 16).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
        return self.o(y.transpose(1, 2).reshape(b, t, 64))


class ShapeBranch(nn.Module):
    """Case 12: a shape-dependent branch symbolic_trace cannot follow."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.up(x)
        if h.shape[1] > 1:
            h = h + torch.tril(torch.ones(h.shape[1], h.shape[2], device=h.device))
        return self.down(torch.relu(h))


class SelfAttentionMHA(nn.Module):
    """Case 14: nn.MultiheadAttention as self-attention (packed in_proj_weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


def _seeded(fn):
    def build():
        torch.manual_seed(0)
        return fn()

    return build


CASES = {
    "1-head-literal": _seeded(lambda: (HeadLiteralAttention(), _inputs((B, T, 512)))),
    "2-uneven": _seeded(lambda: (nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 5)), _inputs((B, T, 5)))),
    "3-heads-96": _seeded(lambda: (Attention(96, 6, 6), _inputs((B, T, 96)))),
    "4-gqa": _seeded(lambda: (Attention(64, 8, 2), _inputs((B, T, 64)))),
    "4-gqa-interleave": _seeded(lambda: (Attention(64, 8, 2, repeat="interleave"), _inputs((B, T, 64)))),
    "5a-fused-chunk": _seeded(lambda: (FusedQKVChunk(), _inputs((B, T, 64)))),
    "5b-fused-unbind": _seeded(lambda: (FusedQKVUnbind(), _inputs((B, T, 64)))),
    "6-rowwise-bias": _seeded(lambda: (_bias_mlp(), _inputs((B, T, 8)))),
    "7-tied": _seeded(lambda: (TiedLM(), (torch.randint(0, 32, (B, T), generator=torch.Generator().manual_seed(1)),))),
    "8-vocab-11": _seeded(
        lambda: (VocabLoss(), (*_inputs((B, T, 16)), torch.randint(0, 11, (B, T), generator=torch.Generator().manual_seed(2))))
    ),
    "9a-layernorm": _seeded(lambda: (NormAfter("A"), _inputs((B, T, 32)))),
    "9b-per-head-rmsnorm": _seeded(lambda: (NormAfter("B"), _inputs((B, T, 32)))),
    "9c-rmsnorm-then-heads": _seeded(lambda: (NormAfter("C"), _inputs((B, T, 32)))),
    "10-dropout-eval": _seeded(lambda: (DropoutResidual().eval(), _inputs((B, T, 32)))),
    "11-replicated-input": _seeded(
        lambda: (nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 11)), _inputs((4, 16, 16)))
    ),
    "12-shape-branch": _seeded(lambda: (ShapeBranch(), _inputs((B, T, 16)))),
    "13-encoder-fast-path": _seeded(
        lambda: (nn.TransformerEncoderLayer(64, nhead=4, dim_feedforward=128, batch_first=True).eval(), _inputs((2, 10, 64)))
    ),
    "14-mha": _seeded(lambda: (SelfAttentionMHA(), _inputs((B, T, 64)))),
    "17-sdpa-dropout": _seeded(lambda: (AttentionDropout(), _inputs((B, T, 64)))),
}


def _bias_mlp() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        model[2].bias.copy_(torch.tensor([100.0, 200.0, 300.0]))
    return model


def build_case(name: str):
    return CASES[name]()
