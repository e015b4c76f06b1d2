"""Helpers of the rule tests: analyze a tiny model in process, and the up/down shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxtp.api import _analyze
from fxtp.arguments import CompileOptions
from fxtp.core.placement import Partial, Shard
from passes.registry import Conflict

__all__ = ["analyze", "S", "conflict_of", "UpDown", "Fn", "assert_megatron_pair", "assert_up_replicated"]



def analyze(model: nn.Module, *inputs: torch.Tensor, ws: int = 2):
    """``(placements by node name, sharding plan, report, {layer name: LayerDecision})``."""
    torch.manual_seed(0)
    captured, plan, report = _analyze(model, tuple(inputs), {}, CompileOptions(ws))
    names = {n.name for n in captured.program.graph.nodes}
    assert set(plan.placements) <= names
    return plan.placements, plan, report, {layer.name: layer for layer in report.layers}


def S(dim: int, *segments: int) -> Shard:
    return Shard(dim, tuple(segments))


def conflict_of(fn, *args) -> Conflict:
    with pytest.raises(Conflict) as info:
        fn(*args)
    return info.value



class UpDown(nn.Module):
    """``down(mid(up(x)))``: colwise then rowwise unless ``mid`` refuses the shard."""

    def __init__(self, mid, d_in=16, d_hidden=32, d_out=16):
        super().__init__()
        self.up = nn.Linear(d_in, d_hidden)
        self.down = nn.Linear(d_hidden, d_out)
        self.mid = mid

    def forward(self, x):
        return self.down(self.mid(self.up(x)))


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def assert_megatron_pair(layers, up_shape=(16, 16), down_shape=(16, 16)):
    assert layers["up"].style == "colwise" and layers["up"].code is None
    assert layers["down"].style == "rowwise" and layers["down"].code is None
    assert layers["up"].local_weight_shape == up_shape
    assert layers["down"].local_weight_shape == down_shape


def assert_up_replicated(layers, code, placements):
    assert layers["up"].style == "replicate"
    assert layers["up"].code == code
    assert layers["up"].local_weight_shape == layers["up"].weight_shape
    assert all(not isinstance(p, (Shard, Partial)) for p in placements.values() if not isinstance(p, tuple))

