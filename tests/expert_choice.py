"""An expert-choice MoE (issue 35, item 11): importing this module registers its 2 cases,
``EXPERT_CHOICE``, in ``cases.CASES`` (``cases.build_case``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cases import B, CASES, T, _inputs, _seeded


class _ExpertMLP(nn.Module):
    def __init__(self, dim: int, inter: int, bias: bool) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, inter, bias=bias), nn.Linear(inter, dim, bias=bias)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class ExpertChoiceMoE(nn.Module):
    """Expert-choice routing (Zhou et al. 2022): each of 4 ``nn.Linear`` experts picks its top
    ``capacity * N / E`` tokens (``topk`` over tokens), reads them by ``index_select``, and adds
    its gated output back by ``index_add``; a shared expert sees every token."""

    def __init__(self, dim: int = 64, experts: int = 4, inter: int = 128, capacity: int = 2, bias: bool = True) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(_ExpertMLP(dim, inter, bias) for _ in range(experts))
        self.shared = _ExpertMLP(dim, inter, bias)
        self.capacity = capacity

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        scores = self.router(flat).softmax(dim=-1)  # (N, E)
        weights, tokens = torch.topk(scores.t(), flat.shape[0] * self.capacity // len(self.experts), dim=-1)  # (E, C)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            out = out.index_add(0, tokens[e], expert(flat.index_select(0, tokens[e])) * weights[e].unsqueeze(-1))
        return (out + self.shared(flat)).view(b, t, d)


class ExpertChoiceStack(nn.Module):
    """2 pre-norm blocks ``x + moe(norm(x))``."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(64) for _ in range(2))
        self.moes = nn.ModuleList(ExpertChoiceMoE(bias=bias) for _ in range(2))

    def forward(self, x):
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return x


EXPERT_CHOICE = ("expert-choice-moe", "expert-choice-moe-no-bias")
CASES.update(
    {
        "expert-choice-moe": _seeded(lambda: (ExpertChoiceStack(), _inputs((B, T, 64)))),
        "expert-choice-moe-no-bias": _seeded(lambda: (ExpertChoiceStack(bias=False), _inputs((B, T, 64)))),
    }
)
