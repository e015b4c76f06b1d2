"""Rules through tiny real graphs (part 2): concatenation, embeddings, losses, GQA and
the rest. See tests/test_rules.py for the levels and what the tests assert."""

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

from fxtp.core import local_ops
from fxtp.core.placement import Replicate

aten = torch.ops.aten


class ChunkThenNorm(nn.Module):
    """A fused projection's first chunk through ``fn`` (a layer_norm over its 64 features)."""

    def __init__(self, fn=lambda a: F.layer_norm(a, (64,))):
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.fn = fn

    def forward(self, x):
        a, b, c = self.qkv(x).chunk(3, dim=-1)
        return self.fn(a) + b + c


def test_conflict_after_chunk_replicates_the_fused_producer():
    placements, plan, _, layers = analyze(ChunkThenNorm(lambda a: torch.softmax(a, -1)), torch.randn(2, 64))
    assert layers["qkv"].style == "replicate"
    assert layers["qkv"].code == "reduces-sharded-dim"
    assert plan.params == {}


def test_norm_after_chunk_is_distributed_on_the_fused_segments():
    """A layer_norm of one chunk of a fused projection: a distributed norm (NOTE: [distributed
    norm]) on that segment's shard; qkv stays colwise in [64, 64, 64] segments."""
    placements, plan, _, layers = analyze(ChunkThenNorm(), torch.randn(2, 64))
    assert layers["qkv"].style == "colwise" and plan.params["p_qkv_weight"].segments == (64, 64, 64)
    assert plan.local_targets["layer_norm"].__name__ == "distributed_layer_norm"


class CatTwo(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(16, 32)
        self.down = nn.Linear(64 if dim == -1 else 32, 16)

    def forward(self, x):
        return self.down(torch.cat([self.a(x), self.b(x)], dim=self.dim))


def test_cat_along_sharded_dim_concatenates_segments():
    placements, plan, report, layers = analyze(CatTwo(-1), torch.randn(2, 4, 16))
    assert placements["linear"] == S(2, 32)
    assert placements["linear_1"] == S(2, 32)
    assert placements["cat"] == S(2, 32, 32)
    assert plan.params["p_down_weight"] == S(1, 32, 32)
    assert layers["a"].style == layers["b"].style == "colwise"
    assert layers["down"].style == "rowwise"
    assert layers["down"].local_weight_shape == (16, 32)
    assert report.count("forward", "all_reduce") == 1


def test_cat_along_other_dim_keeps_shard():
    placements, plan, _, layers = analyze(CatTwo(1), torch.randn(2, 4, 16))
    assert placements["cat"] == S(2, 32)
    assert plan.params["p_down_weight"] == S(1, 32)
    assert layers["down"].style == "rowwise"


class CatParam(nn.Module):
    """A learned (B, 1, 32) prefix concatenated along the sequence with a colwise output."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.prefix = nn.Parameter(torch.randn(2, 1, 32))
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.cat([self.prefix, self.up(x)], dim=1))


def test_cat_with_parameter_along_other_dim_shards_the_parameter():
    placements, plan, _, layers = analyze(CatParam(), torch.randn(2, 4, 16))
    assert plan.params["p_prefix"] == S(2, 32)
    assert placements["cat"] == S(2, 32)
    assert_megatron_pair(layers)


def test_op_without_own_rule_asks_dtensor():
    model = UpDown(Fn(lambda h: torch.cumsum(h, dim=1)))  # over the sequence, not the features
    placements, plan, _, layers = analyze(model, torch.randn(2, 4, 16))
    assert placements["cumsum"] == S(2, 32)
    assert_megatron_pair(layers)


def test_op_dtensor_would_redistribute_is_unsupported_op():
    model = UpDown(Fn(lambda h: torch.cumsum(h, dim=-1)))  # a scan over the sharded features
    placements, plan, _, layers = analyze(model, torch.randn(2, 4, 16))
    assert_up_replicated(layers, "unsupported-op", placements)
    assert "cumsum" in layers["up"].reason
    assert "cumsum" in layers["up"].culprit
    assert plan.params == {}


class InPlace(nn.Module):
    def __init__(self, into_input: bool = False):
        super().__init__()
        self.into_input = into_input
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x, c):
        h = self.up(x)
        if self.into_input:  # writes a shard into a replicated input: refused
            c.add_(h)
            return self.down(c)
        h.add_(c)  # (symbolic_trace turns `h += c` into a functional add)
        return self.down(torch.relu_(h))


def test_in_place_ops_follow_their_functional_rule():
    placements, plan, _, layers = analyze(InPlace(), torch.randn(2, 4, 16), torch.randn(2, 4, 32))
    assert placements["add_"] == placements["relu_"] == S(2, 32)
    assert plan.edges[("add_", "c")].kind == "slice"  # a local slice of c, not of h's buffer
    assert_megatron_pair(layers)


def test_in_place_op_writing_a_shard_into_a_replicated_value_is_refused():
    placements, plan, _, layers = analyze(InPlace(into_input=True), torch.randn(2, 4, 16), torch.randn(2, 4, 32))
    assert_up_replicated(layers, "unsupported-op", placements)
    assert "add_" in layers["up"].culprit


class Glu(nn.Module):
    def __init__(self, d_up=64):
        super().__init__()
        self.w12, self.w3 = nn.Linear(16, d_up), nn.Linear(d_up // 2, 16)

    def forward(self, x):
        return self.w3(F.glu(self.w12(x), dim=-1))


@pytest.mark.parametrize("ws", [2, 4])
def test_glu_refines_the_fused_projection_into_halves(ws):
    placements, plan, report, layers = analyze(Glu(), torch.randn(2, 4, 16), ws=ws)
    assert placements["linear"] == S(2, 32, 32)  # each rank holds [w1_r | w2_r]
    assert plan.params["p_w12_weight"] == S(0, 32, 32)
    assert placements["glu"] == S(2, 32)
    assert layers["w12"].style == "colwise" and layers["w3"].style == "rowwise"
    assert layers["w3"].local_weight_shape == (16, 32 // ws)
    assert report.count("forward", "all_reduce") == 1


def test_glu_halves_not_divisible_keep_the_producer_replicated():
    placements, plan, _, layers = analyze(Glu(d_up=12), torch.randn(2, 4, 16), ws=4)  # halves of 6
    assert layers["w12"].style == "replicate" and layers["w12"].code == "not-divisible"
    assert "p_w12_weight" not in plan.params


def test_glu_segments():
    from passes.rules.indexing import glu_segments

    assert glu_segments((256,)) == (128, 128)
    assert glu_segments((128, 128)) == (128, 128)
    assert glu_segments((64, 192)) == (64, 64, 64, 64)


class RepeatKV(nn.Module):
    def __init__(self, output_size=False):
        super().__init__()
        self.output_size = output_size
        self.k, self.o = nn.Linear(16, 16), nn.Linear(64, 16)

    def forward(self, x):
        k = self.k(x).view(2, 4, 2, 8)  # 2 heads of 8
        if self.output_size:
            k = torch.repeat_interleave(k, 4, dim=2, output_size=8)
        else:
            k = k.repeat_interleave(4, dim=2)
        return self.o(k.reshape(2, 4, 64))


def test_repeat_interleave_of_sharded_heads_stays_local():
    placements, plan, _, layers = analyze(RepeatKV(), torch.randn(2, 4, 16))
    assert placements["view"] == S(2, 2)
    assert placements["repeat_interleave"] == S(2, 8)
    assert layers["k"].style == "colwise" and layers["o"].style == "rowwise"
def test_world_size_one_replicates_everything():
    placements, plan, report, layers = analyze(UpDown(Fn(torch.relu)), torch.randn(2, 4, 16), ws=1)
    assert {layer.style for layer in layers.values()} == {"replicate"}
    assert all(isinstance(p, Replicate) for p in placements.values())
    assert plan.params == {}


def test_repeat_interleave_output_size_becomes_local():
    from fxtp.core import local_ops

    placements, plan, _, layers = analyze(RepeatKV(output_size=True), torch.randn(2, 4, 16))
    assert placements["repeat_interleave"] == S(2, 8)
    assert plan.local_targets["repeat_interleave"] is local_ops.repeat_interleave  # drops the global size
    assert layers["k"].style == "colwise"
    local = local_ops.repeat_interleave(torch.arange(3.0).view(3, 1), 2, 0, output_size=12)
    assert local.flatten().tolist() == [0, 0, 1, 1, 2, 2]


class GQA(nn.Module):
    """8 query heads, 2 kv heads of 8, SDPA with enable_gqa (no repeat in the model)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(64, 64), nn.Linear(64, 16), nn.Linear(64, 16), nn.Linear(64, 64)

    def forward(self, x):
        q = self.q(x).view(2, 4, 8, 8).transpose(1, 2)
        k = self.k(x).view(2, 4, 2, 8).transpose(1, 2)
        v = self.v(x).view(2, 4, 2, 8).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(2, 4, 64))


def test_sdpa_enable_gqa_shards_kv_heads_when_they_divide():
    placements, plan, report, layers = analyze(GQA(), torch.randn(2, 4, 64), ws=2)
    assert placements["scaled_dot_product_attention"] == S(1, 8)
    assert placements["transpose_1"] == S(1, 2)
    assert {layers[n].style for n in "qkv"} == {"colwise"} and layers["o"].style == "rowwise"
    assert "scaled_dot_product_attention" not in plan.local_targets


def test_sdpa_enable_gqa_holds_kv_heads_per_rank_when_they_do_not_divide():
    from fxtp.core import local_ops

    placements, plan, report, layers = analyze(GQA(), torch.randn(2, 4, 64), ws=4)
    assert layers["q"].style == "colwise" and layers["o"].style == "rowwise"
    # k/v hold the kv heads their ranks' query heads read (NOTE: [grouped shards]), not replicated
    assert layers["k"].style == layers["v"].style == "colwise"
    assert plan.local_targets["scaled_dot_product_attention"] is local_ops.grouped_query_attention_local_kv
    assert report.count("forward", "all_reduce") == 1


@pytest.mark.parametrize("rank", range(4))
def test_grouped_query_attention_local_op_matches_the_slice(rank):
    from fxtp.core import local_ops

    q, k, v = torch.randn(2, 8, 5, 4), torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    local = local_ops.grouped_query_attention(2 * rank, 4, q[:, 2 * rank : 2 * rank + 2], k, v, None, 0.0, True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(local, full[:, 2 * rank : 2 * rank + 2])


class MQABroadcast(nn.Module):
    """One kv head broadcast over 4 query heads by SDPA itself (no enable_gqa, no repeat)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(64, 64), nn.Linear(64, 16), nn.Linear(64, 16), nn.Linear(64, 64)

    def forward(self, x):
        q = self.q(x).view(2, 4, 4, 16).transpose(1, 2)
        k = self.k(x).view(2, 4, 1, 16).transpose(1, 2)
        v = self.v(x).view(2, 4, 1, 16).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(2, 4, 64))


def test_sdpa_broadcast_kv_head_is_used_whole():
    """A kv head broadcast by SDPA is multi-query attention (``enable_gqa``, passes/normalize.py):
    every rank holds the one kv head, its gradient summed over the holders (NOTE: [grouped shards])."""
    placements, plan, report, layers = analyze(MQABroadcast(), torch.randn(2, 4, 64), ws=2)
    assert placements["scaled_dot_product_attention"] == S(1, 4)
    assert layers["q"].style == "colwise" and layers["o"].style == "rowwise"
    assert layers["k"].style == layers["v"].style == "colwise" and "kv heads [0:1] [0:1] per rank" in layers["k"].reason
    assert plan.local_targets["scaled_dot_product_attention"] is local_ops.grouped_query_attention_local_kv
    assert plan.holders == (("p_k_weight", "p_k_bias", "p_v_weight", "p_v_bias"),)


class SqueezeHeads(nn.Module):
    """(1, T, 32) -> (1, T, 4 heads, 8) -> squeeze(): at world_size 4 a rank holds 1 head."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = self.up(x).view(1, 3, 4, 8).transpose(1, 2).squeeze()  # (4, 3, 8): only the batch dim goes
        return self.down(h.transpose(0, 1).reshape(3, 32))


def test_squeeze_keeps_a_sharded_dim_of_local_size_one():
    placements, plan, _, layers = analyze(SqueezeHeads(), torch.randn(1, 3, 8), ws=4)
    assert placements["squeeze"] == S(0, 4)
    assert plan.local_targets["squeeze"] is aten.squeeze.dims
    assert plan.local_args["squeeze"][1] == [0]  # the batch dim only, not the local head dim
    assert layers["up"].style == "colwise" and layers["down"].style == "rowwise"
