"""Tiny test models, each built from a fixed seed: ``build(name) -> (model, example_inputs)``."""

from __future__ import annotations

import torch
from torch import nn

from fxtp.cli.examples import mlp, tiny_gpt, transformer

__all__ = ["build", "MODELS"]


def linear100():
    torch.manual_seed(0)
    return nn.Linear(100, 10), (torch.randn(8, 100),)


def nn_transformer():
    torch.manual_seed(0)
    model = nn.Transformer(
        d_model=64, nhead=4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=128, dropout=0.0
    )
    gen = torch.Generator().manual_seed(1)
    return model, (torch.randn(10, 2, 64, generator=gen), torch.randn(7, 2, 64, generator=gen))


class CatPlusInput(nn.Module):
    """Two colwise layers concatenated (segments (32, 32)) plus a replicated input sliced to
    match: the input's local slice has two pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.down = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(64, 16)

    def forward(self, x, r):
        return self.down(torch.cat([self.a(x), self.b(x)], -1) + r)


def cat_plus_input():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return CatPlusInput(), (torch.randn(2, 4, 16, generator=gen), torch.randn(2, 4, 64, generator=gen))


class SumOfHidden(nn.Module):
    """A hidden value used twice: by a rowwise layer and summed over its features."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return {"out": self.b(h), "hsum": h.sum(-1), "head": h[..., :8]}


def sum_of_hidden():
    torch.manual_seed(0)
    return SumOfHidden(), (torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)),)


def back_to_back():
    """A rowwise layer feeding a colwise one directly: the colwise input is the all_reduced
    value, which must still enter through f (its gradient is summed over ranks)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    return model, (torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).requires_grad_(),)


class TransposedWeights(nn.Module):
    """Layers that are not nn.Linear: ``x @ W.T``, ``matmul(x, W)`` with an (in, out) weight,
    ``F.linear`` called directly, and GPT-2's ``Conv1D`` form ``addmm(b, x2d, W)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(64, 16) / 4)  # (out, in)
        self.w2 = nn.Parameter(torch.randn(64, 16) / 8)  # (in, out)
        self.w3, self.b3 = nn.Parameter(torch.randn(32, 16) / 4), nn.Parameter(torch.randn(32))
        self.w4, self.b4 = nn.Parameter(torch.randn(32, 16) / 6), nn.Parameter(torch.randn(16))

    def forward(self, x):
        h = torch.relu(x @ self.w1.T)
        h = torch.matmul(h, self.w2)
        h = torch.nn.functional.gelu(torch.nn.functional.linear(h, self.w3, self.b3))
        return torch.addmm(self.b4, h.view(-1, 32), self.w4).view(x.shape[0], x.shape[1], 16)


def transposed_weights():
    torch.manual_seed(0)
    return TransposedWeights(), (torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)),)


MODELS = {
    "transposed_weights": transposed_weights,
    "back_to_back": back_to_back,
    "linear100": linear100,
    "mlp": mlp,
    "reference_transformer": transformer,  # torch's own TP reference model (weight tying on)
    "nn_transformer": nn_transformer,
    "tiny_gpt": tiny_gpt,
    "cat_plus_input": cat_plus_input,
    "sum_of_hidden": sum_of_hidden,
}


def build(name: str):
    return MODELS[name]()
