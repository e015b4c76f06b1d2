"""Op coverage: every core ATen op DTensor has a sharding strategy for has a path in fxtp.

The op set is the ``OpOverload``s tagged ``torch.Tag.core`` that DTensor's sharding propagator
has a strategy or rule for (159 in torch 2.13). An op has a path when fxtp has its own rule,
or when the fallback (``passes.rules.dtensor_fallback``) accepts a sharded input of a real
sample of the op and the result is right. "Right" is checked by simulating the ranks in
process, no process group: each rank's inputs are sliced from the full ones, the op runs on
them as the rewrite would run it (local args, local op), and every rank's output must equal
its slice of the full output (a ``Partial`` output: the sum over ranks).

Samples come from torch's OpInfo database (``op_db``, as ``test_dtensor_ops.py`` uses it):
each OpInfo's first samples are run under a dispatch mode that records the first call of
every core op; ops no OpInfo reaches get a hand-written sample in ``_EXTRA``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import pytest
import torch
from torch.fx import Graph, Node
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxtp.core.placement import REPLICATE, Partial, Placement, Replicate, Shard, local_ranges, shard_tensor
from passes.registry import Conflict, Decision, LayerState, RuleContext, ShardStart, get_rule
from passes.rules.dtensor_fallback import dtensor_ops
from passes.rules.variants import functional_variant, rule_for

aten = torch.ops.aten
WS = 5  # OpInfo samples are mostly made of sizes 5, 10 and 20 (S, M, L)

# Ops without a path, each with the reason. The test fails if one of them gains a path (then
# drop it here) or another op loses its path.
EXPECTED_NO_PATH = {
    "aten._local_scalar_dense.default": "reads one element (.item()): a shard holds only part of the tensor",
    "aten.any.default": "reduces every element to one bool: DTensor answers Partial(sum) of bools, not a float sum fxtp all_reduces",
    "aten.prod.default": "reduces every element to one product: DTensor answers Partial(product)",
    "aten.diagonal.default": "DTensor's strategy replicates its input on every dim",
    "aten.native_group_norm.default": "N, C and HxW are numbers DTensor rewrites to local sizes; fxtp has no rule for them",
    "aten.native_layer_norm_backward.default": "a backward op (never in fxtp's forward graphs): weight gradients are partial sums among several outputs",
    "aten.convolution_backward.default": "a backward op (never in fxtp's forward graphs): weight gradients are partial sums among several outputs",
}


def core_dtensor_ops() -> list[torch._ops.OpOverload]:
    """The op set: core ATen ops DTensor has a sharding strategy or rule for."""
    return sorted((op for op in dtensor_ops() if torch.Tag.core in op.tags), key=str)


# --------------------------------------------------------------------------------------------
# samples


def _t(*shape, dtype=torch.float32):
    gen = torch.Generator().manual_seed(sum(shape) + len(shape))
    if dtype == torch.bool:
        return torch.rand(*shape, generator=gen) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 4, shape, generator=gen, dtype=dtype)
    return torch.randn(*shape, generator=gen, dtype=dtype)


def _extra() -> dict[Any, list[tuple[tuple, dict]]]:
    """Hand-written samples for the core ops no OpInfo sample reaches."""
    x, y = _t(5, 10), _t(5, 10)
    scalar = {
        op: [((x, 2.0), {})]
        for op in (aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar, aten.eq.Scalar, aten.ne.Scalar,
                   aten.ge.Scalar, aten.gt.Scalar, aten.le.Scalar, aten.lt.Scalar, aten.fmod.Scalar, aten.remainder.Scalar,
                   aten.pow.Tensor_Scalar)
    }
    ints = _t(5, 10, dtype=torch.int64)
    pool_in = _t(5, 5, 4, 4)
    return {
        **scalar,
        **{op: [((ints, 3), {})] for op in (aten.bitwise_and.Scalar, aten.bitwise_or.Scalar, aten.bitwise_xor.Scalar)},
        aten.div.Scalar_mode: [((x, 2.0), {"rounding_mode": "floor"})],
        aten.pow.Scalar: [((2.0, x), {})],
        aten.clamp.default: [((x, -0.5, 0.5), {})],
        aten.alias.default: [((x,), {})],
        aten.any.dims: [((x > 0, [0]), {})],
        aten.atan2.out: [((x, y), {"out": torch.empty(5, 10)})],
        aten.scatter.value: [((x, 1, torch.randint(0, 10, (5, 2), generator=torch.Generator().manual_seed(0)), 1.5), {})],
        aten.index.Tensor: [((x, [torch.tensor([0, 2, 1])]), {})],
        aten.native_dropout.default: [((x, 0.0, False), {})],
        aten.convolution.default: [((_t(5, 5, 8), _t(10, 5, 3), _t(10), [1], [1], [1], False, [0], 1), {})],
        aten.avg_pool1d.default: [((_t(5, 5, 8), [2]), {})],
        aten.adaptive_avg_pool1d.default: [((_t(5, 5, 8), [4]), {})],
        aten.max_pool3d_with_indices.default: [((_t(5, 5, 4, 4, 4), [2, 2, 2]), {})],
        aten._native_batch_norm_legit_no_training.default: [((_t(5, 10, 2), _t(10), _t(10), torch.zeros(10), torch.ones(10), 0.1, 1e-5), {})],
        aten._native_batch_norm_legit.no_stats: [((_t(5, 10, 2), _t(10), _t(10), True, 0.1, 1e-5), {})],
        aten._adaptive_avg_pool2d_backward.default: [((_t(5, 5, 2, 2), _t(5, 5, 6, 6)), {})],
        aten.embedding_dense_backward.default: [((_t(5, 3, 10), torch.randint(0, 6, (5, 3), generator=torch.Generator().manual_seed(0)), 6, -1, False), {})],
        aten.native_layer_norm_backward.default: [
            ((_t(5, 10), _t(5, 10), [10], _t(5, 1), _t(5, 1).abs(), _t(10), _t(10), [True, True, True]), {})
        ],
        aten.convolution_backward.default: [
            ((_t(5, 10, 8), _t(5, 5, 8), _t(10, 5, 3), [10], [1], [1], [1], False, [0], 1, [True, True, True]), {})
        ],
        **{op: [((ints, ints.flip(0)), {})] for op in (aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor)},
        aten._adaptive_avg_pool2d.default: [((_t(5, 5, 4, 4), [2, 2]), {})],
        aten._adaptive_avg_pool3d.default: [((_t(5, 5, 4, 4, 4), [2, 2, 2]), {})],
        aten.avg_pool2d.default: [((_t(5, 5, 4, 4), [2, 2]), {})],
        aten.avg_pool3d.default: [((_t(5, 5, 4, 4, 4), [2, 2, 2]), {})],
        aten.max_pool2d_with_indices.default: [((_t(5, 5, 4, 4), [2, 2]), {})],
        aten.max_pool2d_with_indices_backward.default: [
            ((_t(5, 5, 2, 2), pool_in, [2, 2], [2, 2], [0, 0], [1, 1], False, torch.ops.aten.max_pool2d_with_indices(pool_in, [2, 2])[1]), {})
        ],
        aten.constant_pad_nd.default: [((_t(5, 10, 3), [1, 1]), {})],
        aten.native_layer_norm.default: [((x, [10], _t(10), _t(10), 1e-5), {})],
        aten.native_group_norm.default: [((_t(5, 10, 4), _t(10), _t(10), 5, 10, 4, 5, 1e-5), {})],
        aten.repeat.default: [((x, [2, 1]), {})],
        aten.grid_sampler_2d.default: [((_t(5, 3, 4, 4), _t(5, 2, 2, 2).tanh(), 0, 0, False), {})],
        aten.diagonal.default: [((_t(4, 6, 10), 0, 0, 1), {})],
        aten._fft_r2c.default: [((_t(5, 8), [1], 0, True), {})],
        aten._fft_c2r.default: [((torch.fft.rfft(_t(5, 8)), [1], 0, 8), {})],
        aten._local_scalar_dense.default: [((_t(1),), {})],
    }


def _shardable(sample: Any) -> bool:
    """Has a tensor with a dim the world size divides (else there is nothing to shard)."""
    return any(s >= WS and s % WS == 0 for t in pytree.tree_leaves(sample) if isinstance(t, torch.Tensor) for s in t.shape)


@functools.cache
def samples() -> dict[Any, list[tuple[tuple, dict]]]:
    """op -> a few ``(args, kwargs)`` it was really called with (fp32 CPU)."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = set(core_dtensor_ops())
    by_name: dict[str, list[Any]] = {}
    for op in ops:
        by_name.setdefault(op.overloadpacket.__name__.lstrip("_"), []).append(op)
    found: dict[Any, list[tuple[tuple, dict]]] = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            saved = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
            out = func(*args, **kwargs)
            if func in ops and len(found.setdefault(func, [])) < 6 and _shardable(saved):
                found[func].append(saved)
            return out

    for info in op_db:
        aliases = {info.name.lstrip("_"), info.name.split(".")[-1].lstrip("_"), (info.aten_name or "").lstrip("_")}
        targets = [op for name in aliases for op in by_name.get(name, [])]
        if all(len(found.get(op, [])) >= 6 for op in targets):  # no target, or enough samples
            continue
        try:
            for i, sample in enumerate(info.sample_inputs("cpu", torch.float32, requires_grad=False)):
                if i >= 12:
                    break
                with Record():
                    info.op(sample.input, *sample.args, **sample.kwargs)
        except Exception:  # a sample the op itself refuses: not ours to judge
            continue
    return {op: _extra().get(op, []) + found.get(op, []) for op in ops}


# --------------------------------------------------------------------------------------------
# one node, simulated ranks


def _node(op, args: tuple, kwargs: dict) -> tuple[Node, dict[Node, torch.Tensor]]:
    """A graph with one ``call_function`` of ``op``; tensors become placeholders whose
    ``meta["val"]`` is the real tensor (what the rules read)."""
    graph = Graph()
    full: dict[Node, torch.Tensor] = {}

    def place(a):
        if isinstance(a, torch.Tensor):
            n = graph.placeholder(f"t{len(full)}")
            n.meta["val"] = a
            full[n] = a
            return n
        return a

    nargs, nkwargs = pytree.tree_map(place, (args, kwargs))
    node = graph.call_function(op, tuple(nargs), dict(nkwargs))
    node.meta["val"] = op(*args, **kwargs)
    return node, full


def _decide(node: Node, placements: dict[Node, Placement]) -> Decision:
    ctx = RuleContext(node, WS, lambda a: placements.get(a, REPLICATE), lambda n: LayerState(None, None, None))
    rule = rule_for(node.target)
    assert rule is not None, node.target
    return rule(ctx)


def _simulate(node: Node, full: dict[Node, torch.Tensor], placements: dict[Node, Placement], dec: Decision) -> None:
    """Run every rank's part as the rewrite would and compare with the slices of the full result."""
    expected = node.meta["val"]
    outs = dec.out if isinstance(dec.out, tuple) else (dec.out,)
    per_rank = []
    for rank in range(WS):
        def local(a):
            if isinstance(a, ShardStart):
                return local_ranges(placements.get(a.value) or dec.wants[a.value], rank, WS)[0][0]
            if not isinstance(a, Node):
                return a
            p = dec.wants.get(a, placements.get(a, REPLICATE))
            return shard_tensor(full[a], p, rank, WS) if isinstance(p, Shard) else full[a].clone()

        args = dec.local_args if dec.local_args is not None else node.args
        largs, lkwargs = pytree.tree_map(local, (tuple(args), dict(node.kwargs)), is_leaf=lambda a: isinstance(a, ShardStart))
        target: Callable = dec.local_target or node.target
        per_rank.append(target(*largs, **lkwargs))
    exp = expected if isinstance(expected, (tuple, list)) else (expected,)
    for i, (p, e) in enumerate(zip(outs, exp)):
        if not isinstance(e, torch.Tensor):
            continue
        got = [r[i] if isinstance(r, (tuple, list)) else r for r in per_rank]
        if isinstance(p, Partial):
            total = sum(got)
            if dec.after_reduce is not None:
                total = total + full[dec.after_reduce]
            torch.testing.assert_close(total, e, msg=lambda m: f"{node.target} partial sum: {m}")
            continue
        for rank, g in enumerate(got):
            want = shard_tensor(e, p, rank, WS) if isinstance(p, Shard) else e
            torch.testing.assert_close(g, want, equal_nan=True, msg=lambda m: f"{node.target} output {i} rank {rank} ({p}): {m}")


def _tries(node: Node, full: dict[Node, torch.Tensor]):
    """Each tensor input sharded on each dim the world size divides, the others replicated;
    then every input of that dim's size sharded on it (``out=`` tensors, batch dims)."""
    def ok(t, d):
        return d < t.dim() and t.shape[d] >= WS and t.shape[d] % WS == 0

    for n, t in full.items():
        for d in range(t.dim()):
            if ok(t, d):
                yield {n: Shard(d, (int(t.shape[d]),))}
    for d in range(max((t.dim() for t in full.values()), default=0)):
        together = {n: Shard(d, (int(t.shape[d]),)) for n, t in full.items() if ok(t, d)}
        if len(together) > 1:
            yield together


def keeps_a_shard(op) -> bool:
    """Whether ``op``'s rule keeps some sample's shard. Every placement the rule accepts, on
    every sample, is checked against the full result; a wrong result or an uncoded error raises."""
    kept = False
    for args, kwargs in samples().get(op, []):
        node, full = _node(op, args, kwargs)
        for placements in _tries(node, full):
            try:
                dec = _decide(node, placements)
            except Conflict as c:
                assert c.code, (op, c)
                continue
            _simulate(node, full, placements, dec)
            outs = dec.out if isinstance(dec.out, tuple) else (dec.out,)
            kept |= any(isinstance(p, (Shard, Partial)) for p in outs)  # not a new_zeros-like replicated result
    return kept


def sharded_path(op) -> Optional[str]:
    """How ``op`` runs with a sharded input: ``"own rule"``, ``"fallback"`` (checked by
    :func:`keeps_a_shard`), or ``None``."""
    if get_rule(op) is not None:
        return "own rule"
    return "fallback" if keeps_a_shard(op) else None


# --------------------------------------------------------------------------------------------
# tests


def test_the_op_set_is_dtensors_core_ops():
    ops = core_dtensor_ops()
    assert len(ops) >= 150  # 159 in torch 2.13
    assert aten.glu.default not in ops and aten.add.Tensor in ops and aten.cumsum.default in ops


def test_every_core_op_dtensor_shards_has_a_path():
    paths = {str(op): sharded_path(op) for op in core_dtensor_ops()}
    missing = sorted(op for op, path in paths.items() if path is None)
    assert missing == sorted(EXPECTED_NO_PATH), f"no path: {sorted(set(missing) - set(EXPECTED_NO_PATH))}; gained one: {sorted(set(EXPECTED_NO_PATH) - set(missing))}"
    covered = sum(path is not None for path in paths.values())
    own = sum(path == "own rule" for path in paths.values())
    print(f"\ncovered {covered} of {len(paths)} core ATen ops ({own} own rules, {covered - own} by the DTensor fallback)")


# fxtp's own rules on the same samples, where the simulation can express the input.
OWN_RULE_NOT_SIMULATED = {
    "aten.cat.default": "legacy cat of an empty (0,) tensor with a sharded one: the rule asks to slice the empty one",
    "aten.embedding.default": "a table sharded on its embedding dim: propagation refuses the vocab-parallel want "
    "(layout-mismatch in _apply_wants), which the one-node simulation does not apply",
}


def test_own_rules_match_the_slices_of_the_full_result():
    own = [op for op in core_dtensor_ops() if get_rule(op) is not None and str(op) not in OWN_RULE_NOT_SIMULATED]
    assert len(own) >= 70
    for op in own:
        keeps_a_shard(op)


# Per-op differential tests of the fallback, by hand, where the answer matters most.
_X = _t(5, 10, 20)


S0, S1, S2 = Shard(0, (5,)), Shard(1, (10,)), Shard(2, (20,))


@pytest.mark.parametrize(
    "op, args, kwargs, shard, out",
    [
        (aten.cumsum.default, (_X, 1), {}, S2, S2),  # a scan over another dim
        (aten.flip.default, (_X, [1]), {}, S2, S2),
        (aten.gather.default, (_X, 1, torch.zeros(5, 3, 20, dtype=torch.int64)), {}, S0, S0),
        (aten.sort.default, (_X, 1), {}, S2, (S2, S2)),
        (aten.topk.default, (_X, 2, 1), {}, S0, (S0, S0)),
        (aten.prod.dim_int, (_X, 1), {}, S2, Shard(1, (20,))),
        (aten.constant_pad_nd.default, (_X, [1, 1]), {}, S1, S1),
        (aten.atan2.default, (_X, _X.flip(0)), {}, S2, S2),
        (aten.native_layer_norm.default, (_X, [20], None, None, 1e-5), {}, S0, (S0, S0, S0)),
        (aten.logsumexp.default, (_X, [1]), {}, S2, Shard(1, (20,))),
    ],
)
def test_fallback_matches_the_slices_of_the_full_result(op, args, kwargs, shard, out):
    assert get_rule(op) is None  # the fallback answers it
    node, full = _node(op, args, kwargs)
    placements = {next(iter(full)): shard}
    dec = _decide(node, placements)
    assert dec.out == out
    _simulate(node, full, placements, dec)


@pytest.mark.parametrize("dim", [2, -1])  # -1: torch 2.13's scan_strategy does not normalize it
def test_fallback_refuses_a_redistribution_naming_the_op(dim):
    node, full = _node(aten.cumsum.default, (_X, dim), {})  # a scan over the sharded dim
    with pytest.raises(Conflict) as info:
        _decide(node, {next(iter(full)): S2})
    assert info.value.code == "unsupported-op" and "aten.cumsum.default" in info.value.message


def test_fallback_refuses_a_number_computed_from_a_shard():
    node, full = _node(aten.is_same_size.default, (_X, _X.clone()), {})  # DTensor answers Replicate
    with pytest.raises(Conflict) as info:
        _decide(node, {next(iter(full)): S2})
    assert info.value.code == "unsupported-op" and "bool" in info.value.message


def test_broadcast_to_makes_the_sharded_size_local():
    """``broadcast_to`` (Falcon-40B's k and v over their group's query heads) runs with the
    shard's size where the global one was: DTensor answers it only by its decomposition into
    ``expand``, whose sizes it would make local itself, so fxtp has the rule."""
    node, full = _node(aten.broadcast_to.default, (_t(4, 5, 1, 20), [4, 5, 3, 20]), {})
    heads = Shard(1, (5,))
    placements = {next(iter(full)): heads}
    dec = _decide(node, placements)
    assert dec.out == heads and dec.local_args[1] == [4, 1, 3, 20]
    _simulate(node, full, placements, dec)


def test_fallback_refuses_sizes_dtensor_makes_local_only_in_a_decomposition():
    """An op with a size list that DTensor answers only by decomposing it (``_reshape_alias``:
    ``S(1)`` in, ``S(1)`` out) would run on the shard with the global sizes: refused, naming
    the op, so its producer stays replicated."""
    node, full = _node(aten._reshape_alias.default, (_t(4, 5, 6), [4, 5, 6], [30, 6, 1]), {})
    assert get_rule(node.target) is None
    with pytest.raises(Conflict) as info:
        _decide(node, {next(iter(full)): Shard(1, (5,))})
    assert info.value.code == "unsupported-op" and "aten._reshape_alias.default" in info.value.message
    assert "size arguments" in info.value.message


def test_fallback_keeps_segments_only_on_a_dim_that_maps_one_to_one():
    node, full = _node(aten.cumsum.default, (_X, 1), {})
    x = next(iter(full))
    fused = Shard(2, (10, 10))
    dec = _decide(node, {x: fused})
    assert dec.out == fused
    _simulate(node, full, {x: fused}, dec)
    node, full = _node(aten.prod.dim_int, (_X, 2), {})  # reduces the fused dim: a Partial product
    with pytest.raises(Conflict):
        _decide(node, {next(iter(full)): fused})


def test_fallback_slices_a_replicated_operand_it_wants_sharded():
    node, full = _node(aten.atan2.default, (_X, _t(20)), {})
    x, y = full
    dec = _decide(node, {x: S2})
    assert dec.wants[y] == Shard(0, (20,))
    _simulate(node, full, {x: S2}, dec)


@pytest.mark.parametrize(
    "op, functional",
    [
        (aten.relu_.default, aten.relu.default),
        (aten.add_.Tensor, aten.add.Tensor),
        (aten.mul_.Tensor, aten.mul.Tensor),
        (aten.masked_fill_.Scalar, aten.masked_fill.Scalar),
        (aten.add.out, aten.add.Tensor),
        (aten.max.dim_max, aten.max.dim),
        (aten.relu.default, None),
    ],
)
def test_in_place_and_out_variants_resolve_to_their_functional_op(op, functional):
    assert functional_variant(op) == functional


def test_in_place_op_keeps_the_layout_of_what_it_writes():
    node, full = _node(aten.add_.Tensor, (_X.clone(), _X.flip(0)), {})
    a, b = full
    dec = _decide(node, {a: S2})  # writes into a sharded value: local
    assert dec.out == S2 and dec.wants[b] == S2
    with pytest.raises(Conflict) as info:  # writes into a replicated value with a shard: refused
        _decide(node, {b: S2})
    assert info.value.code == "unsupported-op" and "mutated layout" in info.value.message


def test_out_variant_follows_the_functional_fallback():
    node, full = _node(aten.atan2.out, (_X, _X.flip(0)), {"out": torch.empty(5, 10, 20)})
    a, b, out = full
    dec = _decide(node, {a: S2, b: S2, out: S2})
    assert dec.out == S2
    with pytest.raises(Conflict):  # the out tensor is whole: the local op would fill a slice of it
        _decide(node, {a: S2, b: S2})
