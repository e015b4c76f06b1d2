"""Layer 1 of the test pyramid: the op rules and the planner, in process, no process groups.

Three levels:

* the shape helpers directly (``group_dims``, ``view_placement``, ``split_pieces``),
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
from _rule_graphs import S, conflict_of

from fxtp.core.placement import REPLICATE, Shard, shard_tensor
from passes import registry
from passes.registry import Decision, get_rule, register_rule, registered_ops
from passes.rules.indexing import split_pieces
from passes.rules.shape import group_dims, view_placement

aten = torch.ops.aten


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
    from fxtp.core.placement import local_ranges

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
    from fxtp.core.placement import local_ranges

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
# split_pieces


def test_split_aligned_per_piece_shards():
    assert split_pieces(S(0, 64, 64, 64), [64, 64, 64], 2) == [S(0, 64), S(0, 64), S(0, 64)]
    assert split_pieces(S(2, 64, 64, 64), [64, 128], 2) == [S(2, 64), S(2, 64, 64)]
    # Grouped-query layout: q 64 | k 32 | v 32.
    assert split_pieces(S(1, 64, 32, 32), [64, 32, 32], 4) == [S(1, 64), S(1, 32), S(1, 32)]


def test_split_misaligned_refines_to_common_refinement():
    c = conflict_of(split_pieces, S(0, 192), [64, 64, 64], 2)
    assert c.code == "split-crosses-shard"
    assert c.refine == (64, 64, 64)
    c = conflict_of(split_pieces, S(0, 64, 64, 64), [96, 96], 2)
    assert c.code == "split-crosses-shard"
    assert c.refine == (64, 32, 32, 64)
    # The refinement makes the split aligned.
    assert split_pieces(S(0, *c.refine), [96, 96], 2) == [S(0, 64, 32), S(0, 32, 64)]


@pytest.mark.parametrize("sizes, ws", [([64, 64, 64], 3), ([96, 96], 64), ([63, 129], 2)])
def test_split_not_divisible(sizes, ws):
    """No even layout: the split asks for its pieces as segments split unevenly (NOTE: [uneven shards])."""
    c = conflict_of(split_pieces, S(0, 192), sizes, ws)
    assert c.code == "not-divisible"
    assert c.refine is None
    assert (c.unit_segments, c.unit) == (tuple(sizes), 1)


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


