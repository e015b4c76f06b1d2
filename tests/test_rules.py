"""Layer 1 of the test pyramid: the op rules and the planner, in process, no process groups.

Three levels:

* the shape helpers directly (``group_dims``, ``view_placement``, ``_split_pieces``),
* the registry's own contract (no silent re-registration),
* rules through tiny real graphs: ``fxtp.api._analyze`` captures the model, plans it, and we
  assert node placements, parameter placements, layer styles and rejection codes.

Reasons are free text that may be reworded; the tests assert codes, placements, shapes, and
only the substrings the message must contain (op names).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxtp.api import _analyze
from fxtp.placement import REPLICATE, Partial, Replicate, Shard, shard_tensor
from passes import registry
from passes.registry import Conflict, Decision, LocalSize, get_rule, register_rule, registered_ops
from passes.rules.shape import _split_pieces, group_dims, view_placement

aten = torch.ops.aten


# --------------------------------------------------------------------------------------------
# helpers


def analyze(model: nn.Module, *inputs: torch.Tensor, ws: int = 2):
    """``(placements by node name, sharding plan, report, {layer name: LayerDecision})``."""
    torch.manual_seed(0)
    captured, plan, report = _analyze(model, ws, tuple(inputs), {}, "auto", None, 0)
    names = {n.name for n in captured.program.graph.nodes}
    assert set(plan.placements) <= names
    return plan.placements, plan, report, {layer.name: layer for layer in report.layers}


def S(dim: int, *segments: int) -> Shard:
    return Shard(dim, tuple(segments))


def conflict_of(fn, *args) -> Conflict:
    with pytest.raises(Conflict) as info:
        fn(*args)
    return info.value


# --------------------------------------------------------------------------------------------
# group_dims


@pytest.mark.parametrize(
    "a, b, groups",
    [
        ((2, 16, 512), (2, 16, 8, 64), [([0], [0]), ([1], [1]), ([2], [2, 3])]),
        ((10, 2, 64), (10, 8, 16), [([0], [0]), ([1, 2], [1, 2])]),
        ((2, 3, 4), (6, 4), [([0, 1], [0]), ([2], [1])]),
        ((6, 4), (2, 3, 4), [([0], [0, 1]), ([1], [2])]),
        ((4, 1, 64), (4, 64), [([0], [0]), ([1, 2], [1])]),
        ((4, 64), (1, 4, 64, 1), [([0], [0, 1]), ([1], [2]), ([], [3])]),
        ((2, 4, 192), (2, 4, 3, 64), [([0], [0]), ([1], [1]), ([2], [2, 3])]),
    ],
)
def test_group_dims(a, b, groups):
    got = group_dims(a, b)
    assert got == groups
    # Every group pairs equal products and every dim appears exactly once, in order.
    for ins, outs in got:
        prod_a = 1
        for i in ins:
            prod_a *= a[i]
        prod_b = 1
        for j in outs:
            prod_b *= b[j]
        assert prod_a == prod_b
    assert [i for ins, _ in got for i in ins] == list(range(len(a)))
    assert [j for _, outs in got for j in outs] == list(range(len(b)))


def test_group_dims_rejects_different_numel():
    with pytest.raises(AssertionError):
        group_dims((2, 3), (7,))


# --------------------------------------------------------------------------------------------
# view_placement (NOTE: [view of a sharded dim])


def test_view_split_heads():
    # (B, T, E) S(2) -> (B, T, heads, hd): the heads dim is sharded, 4 heads per rank.
    assert view_placement(S(2, 512), (2, 16, 512), (2, 16, 8, 64), 2) == S(2, 8)
    assert view_placement(S(2, 512), (2, 16, 512), (2, 16, 8, 64), 8) == S(2, 8)


# --------------------------------------------------------------------------------------------
# uneven shards (NOTE: [uneven shards], NOTE: [uneven views])


def test_local_ranges_front_loaded():
    from fxtp.placement import local_ranges

    assert [local_ranges(Shard(0, (5,)), r, 4) for r in range(4)] == [[(0, 2)], [(2, 1)], [(3, 1)], [(4, 1)]]
    assert [local_ranges(Shard(0, (11,)), r, 2) for r in range(2)] == [[(0, 6)], [(6, 5)]]
    heads = Shard(0, (96,), unit=16)  # 6 heads of 16 at ws 4: 2/2/1/1 whole heads
    assert [local_ranges(heads, r, 4) for r in range(4)] == [[(0, 32)], [(32, 32)], [(64, 16)], [(80, 16)]]
    fused = Shard(0, (96, 96, 96), unit=16)  # Q|K|V: the same heads of each
    assert local_ranges(fused, 3, 4) == [(80, 16), (176, 16), (272, 16)]
    assert [fused.local_size(4, r) for r in range(4)] == [96, 96, 48, 48]
    assert not heads.divisible(4) and heads.divisible(2) and Shard(0, (5,)).divisible(5)


@pytest.mark.parametrize("shard", [S(1, 64), S(0, 64, 64, 64), Shard(0, (96,), unit=16)])
@pytest.mark.parametrize("ws", [2, 4])
def test_even_shards_keep_equal_blocks(shard, ws):
    """An even shard is the equal split, whatever its unit (the layouts before uneven shards)."""
    from fxtp.placement import local_ranges

    if not shard.divisible(ws):
        return
    for r in range(ws):
        blocks = [(offset + r * (seg // ws), seg // ws) for offset, seg in zip([0, *itertools.accumulate(shard.segments)], shard.segments)]
        assert local_ranges(shard, r, ws) == blocks


def test_shard_tensor_uneven_pieces_tile_the_tensor():
    full = torch.arange(22.0).reshape(11, 2)
    pieces = [shard_tensor(full, S(0, 11), r, 4) for r in range(4)]
    assert [p.shape[0] for p in pieces] == [3, 3, 3, 2]
    assert torch.equal(torch.cat(pieces), full)


def test_uneven_view_splits_whole_heads_and_merges_back():
    heads = Shard(2, (96,), unit=16)
    assert view_placement(heads, (2, 5, 96), (2, 5, 6, 16), 4) == Shard(2, (6,))  # 2/2/1/1 heads
    assert view_placement(Shard(2, (6,)), (2, 5, 6, 16), (2, 5, 96), 4) == heads  # and back
    assert view_placement(heads, (2, 5, 96), (10, 96), 4) == Shard(1, (96,), unit=16)  # a 1:1 pass keeps it
    # Half heads are whole in units of 2 of them; 24-wide pieces would cut a head: a conflict, as
    # is merging the uneven dim as an inner one.
    assert view_placement(heads, (2, 5, 96), (2, 5, 12, 8), 4) == Shard(2, (12,), unit=2)
    assert conflict_of(view_placement, heads, (2, 5, 96), (2, 5, 4, 24), 4).code == "not-divisible"
    assert conflict_of(view_placement, S(2, 5), (2, 5, 5), (2, 25), 4).code == "not-divisible"


def test_view_that_splits_heads_unevenly_asks_for_whole_heads():
    c = conflict_of(view_placement, S(2, 96), (2, 4, 96), (2, 4, 6, 16), 4)
    assert c.code == "not-divisible" and c.unit == 16
    # More ranks than heads: no unit would give every rank a head.
    assert conflict_of(view_placement, S(2, 64), (2, 4, 64), (2, 4, 4, 16), 8).unit is None


def test_view_split_heads_more_ranks_than_heads_is_not_divisible():
    c = conflict_of(view_placement, S(2, 512), (2, 16, 512), (2, 16, 8, 64), 16)
    assert c.code == "not-divisible"


def test_view_split_heads_more_ranks_than_heads_conflicts():
    # What holds today and must keep holding: it is a Conflict, never a placement.
    c = conflict_of(view_placement, S(2, 512), (2, 16, 512), (2, 16, 8, 64), 16)
    assert c.code in ("not-divisible", "view-crosses-shard")


def test_view_head_count_not_divisible():
    # 6 heads of 16 at world_size 4: the head dim 6 is not divisible by 4.
    c = conflict_of(view_placement, S(2, 96), (2, 4, 96), (2, 4, 6, 16), 4)
    assert c.code == "not-divisible"
    assert "6" in c.message


def test_view_merge_inner_dim_into_outer_gives_equal_segments():
    # (L, N, 64) S(2) -> (L, N*4, 16): each batch element's 4 heads split 2 | 2.
    assert view_placement(S(2, 64), (10, 2, 64), (10, 8, 16), 2) == S(1, 4, 4)
    # 4 ranks: one head of every batch element per rank.
    assert view_placement(S(2, 64), (10, 2, 64), (10, 8, 16), 4) == S(1, 4, 4)


def test_view_reverse_merge_back():
    # (L, N*4, 16) S(1, (4, 4)) -> (L, N, 64): back to one feature segment of 64.
    assert view_placement(S(1, 4, 4), (10, 8, 16), (10, 2, 64), 2) == S(2, 64)
    # Round trip.
    there = view_placement(S(2, 64), (10, 2, 64), (10, 8, 16), 2)
    assert view_placement(there, (10, 8, 16), (10, 2, 64), 2) == S(2, 64)


def test_view_fused_segments_unflatten():
    # Q|K|V fused, segments (64, 64, 64) -> (..., 3, 64): the 64-dim is sharded, 3 stays whole.
    assert view_placement(S(2, 64, 64, 64), (2, 4, 192), (2, 4, 3, 64), 2) == S(3, 64)
    assert view_placement(S(2, 64, 64, 64), (2, 4, 192), (2, 4, 3, 64), 4) == S(3, 64)


def test_view_fused_one_segment_proposes_refinement():
    # One segment of 192 would split the 3 (Q|K|V) across 2 ranks; (64, 64, 64) would be local.
    c = conflict_of(view_placement, S(2, 192), (2, 4, 192), (2, 4, 3, 64), 2)
    assert c.refine == (64, 64, 64)
    assert c.code == "not-divisible"
    # And the refinement it proposes indeed makes the view local.
    assert view_placement(S(2, *c.refine), (2, 4, 192), (2, 4, 3, 64), 2) == S(3, 64)


def test_view_unequal_segments_cannot_regroup():
    c = conflict_of(view_placement, S(2, 32, 64), (2, 4, 96), (2, 4, 6, 16), 4)
    assert c.code == "view-crosses-shard"
    assert c.refine is None


@pytest.mark.parametrize(
    "shard, a, b, out",
    [
        (S(1, 64), (4, 64), (4, 1, 64), S(2, 64)),  # unsqueeze
        (S(1, 32, 32), (4, 64), (4, 1, 64), S(2, 32, 32)),  # unsqueeze keeps segments
        (S(1, 32, 32), (4, 64), (1, 4, 64, 1), S(2, 32, 32)),  # size-1 dims on both sides
        (S(2, 32, 32), (4, 1, 64), (4, 64), S(1, 32, 32)),  # squeeze a size-1 dim before
        (S(1, 32, 32), (4, 64, 1), (4, 64), S(1, 32, 32)),  # squeeze a trailing size-1 dim
        (S(1, 32, 32), (1, 64), (64,), S(0, 32, 32)),
        (S(0, 32, 32), (64,), (1, 64), S(1, 32, 32)),
    ],
)
def test_view_size_one_dims_keep_segments(shard, a, b, out):
    assert view_placement(shard, a, b, 2) == out


@pytest.mark.parametrize(
    "shard, a, b, out",
    [
        # Flatten a sharded inner dim into the outer: one segment of 64 per row.
        (S(1, 64), (4, 64), (256,), S(0, 64, 64, 64, 64)),
        # Flatten a sharded outer dim: the rows of a rank are contiguous.
        (S(0, 64), (64, 4), (256,), S(0, 256)),
        # Merge batch dims, shard untouched.
        (S(2, 512), (2, 16, 512), (32, 512), S(1, 512)),
    ],
)
def test_view_flatten(shard, a, b, out):
    assert view_placement(shard, a, b, 2) == out


def test_view_placement_local_blocks_match_a_real_view():
    """The value check behind NOTE [view of a sharded dim]: the local block of the input,
    viewed locally, is the output's local block under the returned placement."""
    cases = [
        (S(2, 64), (10, 2, 64), (10, 8, 16)),
        (S(1, 4, 4), (10, 8, 16), (10, 2, 64)),
        (S(2, 64, 64, 64), (2, 4, 192), (2, 4, 3, 64)),
        (S(2, 512), (2, 16, 512), (2, 16, 8, 64)),
        (S(1, 64), (4, 64), (256,)),
        (S(1, 32, 32), (4, 64), (1, 4, 64, 1)),
    ]
    full = {}
    for shard, a, b in cases:
        for ws in (2, 4):
            out = view_placement(shard, a, b, ws)
            x = full.setdefault(a, torch.arange(torch.Size(a).numel(), dtype=torch.float32).reshape(a))
            y = x.reshape(b)
            for rank in range(ws):
                local_in = shard_tensor(x, shard, rank, ws)
                local_shape = list(b)
                local_shape[out.dim] = out.local_size(ws)
                torch.testing.assert_close(local_in.reshape(local_shape), shard_tensor(y, out, rank, ws))


# --------------------------------------------------------------------------------------------
# _split_pieces


def test_split_aligned_per_piece_shards():
    assert _split_pieces(S(0, 64, 64, 64), [64, 64, 64], 2) == [S(0, 64), S(0, 64), S(0, 64)]
    assert _split_pieces(S(2, 64, 64, 64), [64, 128], 2) == [S(2, 64), S(2, 64, 64)]
    # Grouped-query layout: q 64 | k 32 | v 32.
    assert _split_pieces(S(1, 64, 32, 32), [64, 32, 32], 4) == [S(1, 64), S(1, 32), S(1, 32)]


def test_split_misaligned_refines_to_common_refinement():
    c = conflict_of(_split_pieces, S(0, 192), [64, 64, 64], 2)
    assert c.code == "split-crosses-shard"
    assert c.refine == (64, 64, 64)
    c = conflict_of(_split_pieces, S(0, 64, 64, 64), [96, 96], 2)
    assert c.code == "split-crosses-shard"
    assert c.refine == (64, 32, 32, 64)
    # The refinement makes the split aligned.
    assert _split_pieces(S(0, *c.refine), [96, 96], 2) == [S(0, 64, 32), S(0, 32, 64)]


@pytest.mark.parametrize("sizes, ws", [([64, 64, 64], 3), ([96, 96], 64), ([63, 129], 2)])
def test_split_not_divisible(sizes, ws):
    c = conflict_of(_split_pieces, S(0, 192), sizes, ws)
    assert c.code == "not-divisible"
    assert c.refine is None


# --------------------------------------------------------------------------------------------
# registry


def _fake_op(*args):  # a throwaway op key, never part of a graph
    raise AssertionError("never called")


def test_register_rule_refuses_duplicates():
    def rule_a(ctx):
        return Decision(REPLICATE)

    def rule_b(ctx):
        return Decision(REPLICATE)

    assert get_rule(_fake_op) is None
    try:
        assert register_rule(_fake_op)(rule_a) is rule_a
        assert get_rule(_fake_op) is rule_a
        assert _fake_op in registered_ops()
        with pytest.raises(KeyError, match="rule_a"):
            register_rule(_fake_op)(rule_b)
        assert get_rule(_fake_op) is rule_a  # not overwritten
        # A real op too: nothing is replaced.
        relu_rule = get_rule(aten.relu.default)
        assert relu_rule is not None
        with pytest.raises(KeyError):
            register_rule(aten.relu.default)(rule_b)
        assert get_rule(aten.relu.default) is relu_rule
    finally:
        registry._RULES.pop(_fake_op, None)
    assert get_rule(_fake_op) is None


def _fake_op_2(*args):
    raise AssertionError("never called")


def test_register_rule_duplicate_is_atomic():
    def rule(ctx):
        return Decision(REPLICATE)

    try:
        with pytest.raises(KeyError):
            register_rule(_fake_op_2, aten.relu.default)(rule)
        assert get_rule(_fake_op_2) is None
    finally:
        registry._RULES.pop(_fake_op_2, None)


def test_rules_cover_the_ops_they_claim():
    for op in (aten.view.default, aten.chunk.default, aten.cat.default, aten.softmax.int, aten.layer_norm.default,
               aten.rms_norm.default, aten.linear.default, aten.matmul.default, aten.transpose.int,
               aten.permute.default, aten.select.int, aten.scaled_dot_product_attention.default):
        assert get_rule(op) is not None, op
    assert get_rule(aten.cumsum.default) is None  # used below as an op without an own rule (DTensor answers)


# --------------------------------------------------------------------------------------------
# rules through small graphs


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


def test_layer_norm_over_features_replicates_producer():
    placements, plan, _, layers = analyze(UpDown(nn.LayerNorm(32)), torch.randn(2, 4, 16))
    assert_up_replicated(layers, "reduces-sharded-dim", placements)
    assert "layer_norm" in layers["up"].culprit
    assert plan.params == {}


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


class ChunkThenNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 192)

    def forward(self, x):
        a, b, c = self.qkv(x).chunk(3, dim=-1)
        return F.layer_norm(a, (64,)) + b + c


def test_conflict_after_chunk_replicates_the_fused_producer():
    placements, plan, _, layers = analyze(ChunkThenNorm(), torch.randn(2, 64))
    assert layers["qkv"].style == "replicate"
    assert layers["qkv"].code == "reduces-sharded-dim"
    assert plan.params == {}


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
    from passes.rules.glu import glu_segments

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
    from fxtp import local_ops

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


def test_sdpa_enable_gqa_gathers_kv_heads_per_rank_when_they_do_not_divide():
    from fxtp import local_ops

    placements, plan, report, layers = analyze(GQA(), torch.randn(2, 4, 64), ws=4)
    assert layers["q"].style == "colwise" and layers["o"].style == "rowwise"
    assert layers["k"].style == layers["v"].style == "replicate"
    assert plan.local_targets["scaled_dot_product_attention"] is local_ops.grouped_query_attention
    assert plan.local_args["scaled_dot_product_attention"][1] == 4  # q heads per kv head
    assert report.count("forward", "all_reduce") == 1


@pytest.mark.parametrize("rank", range(4))
def test_grouped_query_attention_local_op_matches_the_slice(rank):
    from fxtp import local_ops

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
    placements, plan, report, layers = analyze(MQABroadcast(), torch.randn(2, 4, 64), ws=2)
    assert placements["scaled_dot_product_attention"] == S(1, 4)
    assert layers["q"].style == "colwise" and layers["o"].style == "rowwise"
    assert layers["k"].style == "replicate"
    assert plan.edges[("scaled_dot_product_attention", "transpose_1")].kind == "enter"  # whole, f for its gradient


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
