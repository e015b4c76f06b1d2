"""Rules through tiny real graphs (part 1): pointwise ops, norms, permutes, fused projections,
attention heads. See tests/test_rules.py for the levels and what the tests assert."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _rule_graphs import (
    Fn,
    S,
    UpDown,
    analyze,
    assert_megatron_pair,
    assert_up_replicated,
)
from torch import nn

from fxtp.core.placement import REPLICATE, Partial, Shard
from passes.registry import LocalSize

aten = torch.ops.aten


def test_pointwise_relu_keeps_shard():
    placements, plan, report, layers = analyze(UpDown(Fn(torch.relu)), torch.randn(2, 4, 16))
    assert placements["linear"] == S(2, 32)
    assert placements["relu"] == S(2, 32)
    assert placements["linear_1"] == Partial()
    assert plan.params["p_up_weight"] == S(0, 32)
    assert plan.params["p_up_bias"] == S(0, 32)
    assert plan.params["p_down_weight"] == S(1, 32)
    assert "p_down_bias" not in plan.params  # added once after the all_reduce
    assert plan.reduces == {"linear_1": "p_down_bias"}
    assert_megatron_pair(layers)
    assert report.count("forward", "all_reduce") == 1


class AddInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x, y):
        return self.down(self.up(x) + y)


def test_pointwise_full_size_replicated_operand_is_sliced():
    placements, plan, _, layers = analyze(AddInput(), torch.randn(4, 16), torch.randn(4, 32))
    assert placements["add"] == S(1, 32)
    assert placements["y"] == REPLICATE
    edge = plan.edges[("add", "y")]
    assert edge.kind == "slice" and edge.placement == S(1, 32)
    assert_megatron_pair(layers)


def test_pointwise_broadcast_operand_is_used_whole():
    # y is (4, 1): broadcast along the sharded dim, so it is not sliced.
    placements, plan, _, layers = analyze(AddInput(), torch.randn(4, 16), torch.randn(4, 1))
    assert placements["add"] == S(1, 32)
    assert ("add", "y") not in plan.edges or plan.edges[("add", "y")].kind != "slice"
    assert_megatron_pair(layers)


class AddBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32, bias=False)
        self.register_buffer("shift", torch.randn(32))
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x) + self.shift))


def test_pointwise_broadcast_replicated_buffer_is_sliced():
    placements, plan, _, layers = analyze(AddBuffer(), torch.randn(2, 4, 16))
    assert placements["add"] == S(2, 32)
    assert placements["b_shift"] == REPLICATE  # buffers are not stored sharded: sliced at use
    edge = plan.edges[("add", "b_shift")]
    assert edge.kind == "slice" and edge.placement == S(0, 32)
    assert "b_shift" not in plan.params
    assert_megatron_pair(layers, up_shape=(16, 16))


class AddBiasParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32, bias=False)
        self.b = nn.Parameter(torch.randn(32))
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x) + self.b))


def test_pointwise_broadcast_parameter_becomes_sharded():
    placements, plan, _, layers = analyze(AddBiasParam(), torch.randn(2, 4, 16))
    assert plan.params["p_b"] == S(0, 32)
    assert placements["p_b"] == S(0, 32)
    assert placements["add"] == S(2, 32)
    assert_megatron_pair(layers)


def test_softmax_over_other_dim_keeps_shard():
    model = UpDown(Fn(lambda h: torch.softmax(h, dim=1)))
    placements, _, _, layers = analyze(model, torch.randn(2, 4, 16))
    assert placements["softmax"] == S(2, 32)
    assert_megatron_pair(layers)


def test_softmax_over_sharded_dim_replicates_producer():
    model = UpDown(Fn(lambda h: torch.softmax(h, dim=-1)))
    placements, plan, report, layers = analyze(model, torch.randn(2, 4, 16))
    assert_up_replicated(layers, "reduces-sharded-dim", placements)
    assert "softmax" in layers["up"].culprit
    assert plan.params == {}
    assert report.count("forward", "all_reduce") == 0


def test_layer_norm_over_features_into_a_layer_replicates_producer():
    """NOTE: [norm into a layer]: the normalized features go straight into down."""
    placements, plan, _, layers = analyze(UpDown(nn.LayerNorm(32)), torch.randn(2, 4, 16))
    assert_up_replicated(layers, "reduces-sharded-dim", placements)
    assert "layer_norm" in layers["up"].culprit
    assert plan.params == {}


class _HeadsAfter(nn.Module):
    """``norm`` over all 32 features, then a view to 4 heads of 8 and back (qk-norm style)."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, h):
        return self.norm(h).view(2, 4, 4, 8).transpose(1, 2).transpose(1, 2).reshape(2, 4, 32)


def test_layer_norm_over_features_before_heads_is_a_distributed_norm():
    """NOTE: [distributed norm]: a LayerNorm over up's features before a head view keeps up
    colwise; its weight and bias are sliced like the features and one all_reduce of the
    (2, 4, 2) statistics runs."""
    placements, plan, report, layers = analyze(UpDown(_HeadsAfter(nn.LayerNorm(32))), torch.randn(2, 4, 16))
    assert_megatron_pair(layers)
    assert placements["layer_norm"] == S(2, 32)
    assert plan.params["p_mid_norm_weight"] == plan.params["p_mid_norm_bias"] == S(0, 32)
    assert plan.local_targets["layer_norm"].__name__ == "distributed_layer_norm"
    assert report.count("forward", "all_reduce") == 2  # the statistics, then down's output


def test_rms_norm_written_out_over_features_is_partial():
    """``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`` before a head view: the mean over the
    sharded dim is a Partial (B, T, 1), all_reduced; the rsqrt enters the sharded product through f."""
    placements, plan, report, layers = analyze(
        UpDown(_HeadsAfter(Fn(lambda h: h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)))), torch.randn(2, 4, 16)
    )
    assert_megatron_pair(layers)
    assert placements["mean"] == Partial() and plan.reduces["mean"] is None
    assert plan.local_targets["mean"].__name__ == "mean_of_shard"
    assert plan.edges[("mul", "rsqrt")].kind == "enter"
    assert report.count("forward", "all_reduce") == 2


class HeadNorm(nn.Module):
    """Per-head norm (qk-norm style): (B, T, 64) -> (B, T, 8 heads, 8) -> norm over the 8."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.up = nn.Linear(64, 64)
        self.down = nn.Linear(64, 64)

    def forward(self, x):
        h = self.up(x).view(2, 4, 8, 8)
        h = F.layer_norm(h, (8,)) if self.kind == "layer_norm" else F.rms_norm(h, (8,))
        return self.down(h.reshape(2, 4, 64))


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_per_head_norm_stays_sharded(kind):
    placements, plan, _, layers = analyze(HeadNorm(kind), torch.randn(2, 4, 64))
    assert placements["view"] == S(2, 8)
    assert placements[kind] == S(2, 8)
    assert placements["reshape"] == S(2, 64)
    assert plan.local_args["view"][1] == [2, 4, 4, 8]
    assert_megatron_pair(layers, up_shape=(32, 64), down_shape=(64, 32))


class Permutes(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        h = self.up(x)  # (2, 4, 32) S(2)
        h = torch.relu(h.transpose(1, 2))  # (2, 32, 4) S(1)
        h = h.permute(2, 0, 1)  # (4, 2, 32) S(2)
        h = h.permute(1, 0, 2)  # (2, 4, 32) S(2)
        return self.down(h)


def test_transpose_and_permute_move_the_shard():
    placements, _, _, layers = analyze(Permutes(), torch.randn(2, 4, 16))
    assert placements["linear"] == S(2, 32)
    assert placements["transpose"] == S(1, 32)
    assert placements["relu"] == S(1, 32)
    assert placements["permute"] == S(2, 32)
    assert placements["permute_1"] == S(2, 32)
    assert_megatron_pair(layers)


def test_select_on_non_sharded_dim():
    model = UpDown(Fn(lambda h: h[:, 0]))  # (2, 4, 32) S(2) -> (2, 32) S(1)
    placements, _, _, layers = analyze(model, torch.randn(2, 4, 16))
    assert placements["select"] == S(1, 32)
    assert_megatron_pair(layers)


class Fused(nn.Module):
    """A fused QKV projection split with chunk(3); q * k + v keeps the pieces aligned."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.out = nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(q * k + v)


def test_chunk_of_fused_linear_gets_segments():
    placements, plan, _, layers = analyze(Fused(), torch.randn(2, 4, 64))
    qkv = layers["qkv"]
    assert qkv.style == "colwise"
    # Never naive colwise: one segment of 192 would hand rank 0 all of q and half of k.
    assert placements["linear"] == S(2, 64, 64, 64)
    assert plan.params["p_qkv_weight"] == S(0, 64, 64, 64)
    assert plan.params["p_qkv_bias"] == S(0, 64, 64, 64)
    assert qkv.local_weight_shape == (96, 64)
    assert placements["chunk"] == (S(2, 64),) * 3
    for name in ("getitem", "getitem_1", "getitem_2", "mul", "add"):
        assert placements[name] == S(2, 64), name
    assert layers["out"].style == "rowwise"
    assert layers["out"].local_weight_shape == (64, 32)


class Attention(nn.Module):
    def __init__(self, dim=64, heads=4, fused=True, manual=False):
        super().__init__()
        self.heads, self.fused, self.manual = heads, fused, manual
        if fused:
            self.qkv = nn.Linear(dim, 3 * dim)
        else:
            self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, E = x.shape
        hd = E // self.heads
        q, k, v = self.qkv(x).chunk(3, dim=-1) if self.fused else (self.q(x), self.k(x), self.v(x))
        q, k, v = (t.view(B, T, self.heads, hd).transpose(1, 2) for t in (q, k, v))
        if self.manual:
            o = torch.softmax(q @ k.transpose(-2, -1) * hd**-0.5, dim=-1) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(B, T, E))


def test_fused_attention_heads_sharded():
    placements, plan, report, layers = analyze(Attention(), torch.randn(2, 5, 64))
    assert placements["linear"] == S(2, 64, 64, 64)
    for v in ("view", "view_1", "view_2"):
        assert placements[v] == S(2, 4)  # 4 heads, 2 per rank
        assert plan.local_args[v][1] == [2, 5, 2, 16]
    assert placements["scaled_dot_product_attention"] == S(1, 4)
    assert placements["linear_1"] == Partial()
    assert layers["qkv"].style == "colwise" and layers["qkv"].local_weight_shape == (96, 64)
    assert layers["out"].style == "rowwise" and layers["out"].local_weight_shape == (64, 32)
    assert report.count("forward", "all_reduce") == 1


def test_matmul_between_head_sharded_activations_stays_sharded():
    placements, plan, report, layers = analyze(Attention(manual=True), torch.randn(2, 5, 64))
    # q (B, H, T, hd) S(1) @ k^T (B, H, hd, T) S(1): batch-like head dim, no communication.
    assert placements["transpose_3"] == S(1, 4)  # k^T
    assert placements["matmul"] == S(1, 4)
    assert placements["softmax"] == S(1, 4)
    assert placements["matmul_1"] == S(1, 4)
    assert not any(isinstance(p, Partial) for n, p in placements.items() if n != "linear_1")
    assert layers["qkv"].style == "colwise" and layers["out"].style == "rowwise"
    assert report.count("forward", "all_reduce") == 1


def test_six_heads_at_world_size_four_are_split_as_whole_heads():
    """NOTE: [uneven shards]: 6 heads of 16 over 4 ranks hold 2/2/1/1 whole heads; the view
    asks q, k and v for a split in units of 16 (a head), o's input follows."""
    placements, plan, report, layers = analyze(Attention(dim=96, heads=6, fused=False), torch.randn(2, 5, 96), ws=4)
    heads = Shard(0, (96,), unit=16)
    for name in ("q", "k", "v"):
        assert layers[name].style == "colwise" and layers[name].code is None, name
        assert layers[name].local_weight_shape == (32, 96)  # rank 0's: the most
        assert plan.params[f"p_{name}_weight"] == heads
    assert placements["view"] == Shard(2, (6,))  # the head dim, in units of 1 head
    assert plan.local_args["view"][1][2] == LocalSize(Shard(2, (6,)))  # filled per rank by the rewrite
    assert placements["linear"] == Shard(2, (96,), unit=16)
    assert layers["out"].style == "rowwise" and plan.params["p_out_weight"] == Shard(1, (96,), unit=16)
    assert report.count("forward", "all_reduce") == 1


def test_six_heads_fused_at_world_size_four_are_split_as_whole_heads():
    """The fused q|k|v: segments (96, 96, 96) (the chunk), each in units of a head."""
    placements, plan, _, layers = analyze(Attention(dim=96, heads=6, fused=True), torch.randn(2, 5, 96), ws=4)
    assert layers["qkv"].style == "colwise" and layers["out"].style == "rowwise"
    assert plan.params["p_qkv_weight"] == Shard(0, (96, 96, 96), unit=16)
    assert layers["qkv"].local_weight_shape == (96, 96)  # rank 0: 2 heads of each of q, k, v


def test_more_ranks_than_heads_stays_replicated():
    """4 heads of 16 at world_size 8: a rank would hold no head; nothing is sharded."""
    placements, plan, _, layers = analyze(Attention(dim=64, heads=4, fused=False), torch.randn(2, 5, 64), ws=8)
    assert {layers[n].style for n in ("q", "k", "v", "out")} == {"replicate"}
    assert plan.params == {}


