"""KV heads kept by the ranks that need them: which layers hold them, and a plan pass for the
generation decoder's cache.

``grouped_kv_layers`` (read by ``passes.plan`` before its rounds) finds the k/v projections of
grouped-query attentions whose kv heads do not divide world_size and gives each the layout
NOTE: [grouped shards] (``fxtp/core/placement.py``) describes: every rank holds the kv heads its
query heads read. The rules then carry that shard to the attention (``passes/rules/repeat.py``,
``passes/rules/attention.py``); where one refuses it, the layer stays replicated and the
attention gathers the kv heads it needs (NOTE: [enable_gqa]). This is the one place that
decides which layers hold kv heads; a fused projection's layout can ask it too.

NOTE: [kv heads kept by the ranks that need them]
A static KV cache is a state ``(B, Hkv, S, E)`` written in place by ``index_copy_(state, 2,
cache_position, k)`` and read by the attention (NOTE: [sharded state] in
``passes/rules/variants.py``). When the kv heads divide world_size, the k/v projections are
colwise and the cache is stored sharded by its heads. When they do not (2 kv heads on 4 ranks,
one kv head: MQA), the projections hold the kv heads their ranks read (NOTE: [grouped shards])
and the cache is stored so by the rules. Where that layout is refused, the projections stay
whole and so, without this pass, does the cache on every rank, though rank ``r``'s query heads ``[q0, q0 + n)`` attend with kv heads ``[q0 // g,
ceil((q0 + n) / g))`` only (``g = Hq // Hkv``, ``local_ops.kv_head_range``). At 8 query heads,
2 kv heads and world_size 4, ranks 0 and 1 keep kv head 0 and ranks 2 and 3 kv head 1: half the
cache each. At 6 query heads and 3 kv heads on 2 ranks, rank 0 keeps kv heads 0, 1 and rank 1
kv heads 1, 2 (a kv head shared by two ranks' query heads is kept by both). The ranges overlap,
so this is no ``Shard`` (NOTE: [segments]): it is :class:`KvHeads`, kept in
``ShardingPlan.kv_heads`` beside the placements (which still say ``R``: the value every rank
computes with is the whole cache, restricted to what its heads read).

``keep_needed_kv_heads`` finds, in the captured graph and its plan, each replicated state whose
only uses are writers ``index_copy_`` of a replicated source along a dim other than the heads,
and whose writers' only uses are attentions that read it as their ``key`` or ``value``:

* ``scaled_dot_product_attention(q, k, v, ..., enable_gqa=True)`` already run as
  ``local_ops.grouped_query_attention`` (NOTE: [enable_gqa] in ``passes/rules/attention.py``);
* Hugging Face's ``repeat_kv`` (the path with a mask)::

      unsqueeze = aten.unsqueeze.default(index_copy_, 2)
      expand = aten.expand.default(unsqueeze, [B, Hkv, g, S, E])
      reshape = aten.reshape.default(expand, [B, Hkv * g, S, E])
      scaled_dot_product_attention = aten.scaled_dot_product_attention.default(q, reshape, ..., mask)

  with the repeated heads sliced to the query's shard on their way in.

Both of an attention's ``key`` and ``value`` must be such states, its ``q`` sharded on its heads
in one segment, no dropout. The updated plan (the rewrite needs no change):

* the state's placeholder -> :class:`KvHeads` (the runtime stores rows ``local_range`` of it);
* each writer runs ``local_ops.index_copy_kv_heads`` (the source, entering through ``f`` as a
  replicated value entering sharded work does, is narrowed to the rank's kv heads);
* each attention runs ``local_ops.grouped_query_attention_local_kv`` on the written states
  directly (the ``repeat_kv`` views and their slice are left dead for the rewrite to drop).

Only ``fxtp.runtime.generation``'s decoder asks for this pass (``fxtp.api``): its graph runs in eval
mode only, under ``no_grad``; the training graphs and their reports are never touched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Collection, Mapping, Optional

import torch
from torch.fx import Graph, Node

from fxtp.core import local_ops
from fxtp.core.placement import Placement, Shard
from passes.sharding_plan import KvHeads, ShardingPlan
from passes.propagate import EdgeAction
from passes.registry import LocalSize, ShardStart, is_tensor_node, module_of, shape_of
from passes.rules.indexing import slice_bounds

__all__ = ["KvHeads", "KvLayout", "keep_needed_kv_heads", "grouped_kv_layers", "kv_reads", "held_together"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default


@dataclass(frozen=True)
class KvLayout:
    """A layer's output layout of kv heads (NOTE: [grouped shards]): its ``segments`` in heads of
    ``unit`` features, ``groups[i]`` query heads reading each kv head of segment ``i`` (1: a
    segment of query heads, or of anything else a fused projection holds)."""

    unit: int
    segments: tuple[int, ...]
    groups: tuple[int, ...]


def grouped_kv_layers(graph: Graph, layers: Collection[Node], world_size: int) -> dict[str, KvLayout]:
    """``{layer: layout}`` for the layers among ``layers`` that compute the kv heads of a
    grouped-query attention whose kv heads do not divide ``world_size`` (NOTE: [grouped shards]).

    A layer is the one layer nearest the kv value ``(..., Hkv, S, E)`` the attention repeats
    (:func:`kv_reads`): with ``Hkv * E`` outputs it is one grouped segment; a fused projection
    (Phi-3's ``qkv_proj``) is taken apart by slices of its last dim, each kv value from one of
    them, and gets one segment per slice, the kv ones grouped (:func:`_fused_layout`). kv heads
    that divide ``world_size`` are sharded as they are, and fewer query heads than ranks leave a
    rank without any. Reads ``node.meta["val"]``."""
    layer_set = frozenset(layers)
    found: dict[Node, dict[tuple[int, int], tuple[int, int]]] = {}
    refused: set[Node] = set()
    for node in graph.nodes:
        for value, dim, group in kv_reads(node):
            shape = shape_of(value)
            heads = shape[dim]
            if dim != len(shape) - 3 or heads % world_size == 0 or heads * group < world_size:
                continue  # (..., Hkv, S, E) only; kv heads that divide are sharded as they are
            layer = _nearest_layer(value, layer_set)
            if layer is None:
                continue
            out = shape_of(layer)[-1]
            piece = (0, out) if out == heads * shape[-1] else _slice_of(value, layer)
            if piece is None or piece[1] - piece[0] != heads * shape[-1]:
                continue  # not the Hkv heads of E, whole or one slice of a fused output
            hint = (shape[-1], group)
            if found.setdefault(layer, {}).setdefault(piece, hint) != hint:
                refused.add(layer)  # read as kv heads in two ways: no one layout
    layouts = {layer: _fused_layout(layer, pieces) for layer, pieces in found.items() if layer not in refused}
    return {layer.name: layout for layer, layout in layouts.items() if layout is not None}


def _fused_layout(layer: Node, pieces: Mapping[tuple[int, int], tuple[int, int]]) -> Optional[KvLayout]:
    """The layout of ``layer``'s output whose kv ``pieces`` (``(start, end)`` -> ``(unit, group)``)
    are grouped: one segment per slice of the output (every slice of the last dim cuts it), the
    rest plain; ``None`` where the kv pieces disagree on the unit or a segment is no whole units."""
    out = shape_of(layer)[-1]
    units = {unit for unit, _ in pieces.values()}
    cuts = {0, out, *(b for piece in pieces for b in piece)}
    for user in [u for v in (layer, *_head_views(layer)) for u in v.users]:
        bounds = _feature_slice(user, layer)
        if bounds is not None:
            cuts |= set(bounds)
    cuts = sorted(cuts)
    segments = tuple(b - a for a, b in zip(cuts, cuts[1:]))
    if len(units) != 1 or any(s % next(iter(units)) for s in segments):
        return None
    groups = tuple(pieces.get((a, b), (0, 1))[1] for a, b in zip(cuts, cuts[1:]))
    return KvLayout(next(iter(units)), segments, groups)


def _head_views(layer: Node) -> list[Node]:
    """The views of ``layer``'s output that split its last dim into ``(heads, E)`` (Falcon's
    ``fused_qkv.view(B, T, H + 2, E)``)."""
    out = shape_of(layer)
    return [u for u in layer.users if u.op == "call_function" and u.target in (aten.view.default, aten.reshape.default)
            and tuple(shape_of(u)[:-2]) == tuple(out[:-1]) and shape_of(u)[-2] * shape_of(u)[-1] == out[-1]]


def _feature_slice(node: Node, layer: Node) -> Optional[tuple[int, int]]:
    """``(start, end)`` in ``layer``'s output features of ``node`` when it is a unit-step
    ``slice`` or a ``narrow`` with static bounds of that output's last dim (``x[..., a:b]``,
    ``x.narrow(-1, a, n)``) or of the heads dim of one of its :func:`_head_views`, else ``None``."""
    if node.op != "call_function" or node.target not in (aten.slice.Tensor, aten.narrow.default) or not is_tensor_node(node.args[0]):
        return None
    source, size = node.args[0], shape_of(node.args[0])
    scale, want = (1, len(size) - 1) if source is layer else (size[-1], len(size) - 2)
    dim = node.args[1] if len(node.args) > 1 else 0
    if source is not layer and source not in _head_views(layer) or not isinstance(dim, int) or dim % len(size) != want:
        return None
    if node.target is aten.narrow.default:
        start, length = node.args[2:4]
        if not (isinstance(start, int) and isinstance(length, int)):
            return None
        start += size[want] if start < 0 else 0
        return start * scale, (start + length) * scale
    bounds = slice_bounds(size[want], *(list(node.args[2:]) + [None] * (3 - len(node.args[2:]))))
    return None if bounds is None or bounds[2] != 1 else (bounds[0] * scale, bounds[1] * scale)


def _slice_of(value: Node, layer: Node) -> Optional[tuple[int, int]]:
    """The bounds of the one slice of ``layer``'s last dim among ``value``'s ancestors (up to
    ``layer``), or ``None`` where there is none or several."""
    found: set[tuple[int, int]] = set()
    seen, todo = {value}, [value]
    while todo:
        node = todo.pop()
        bounds = _feature_slice(node, layer)
        if bounds is not None:
            found.add(bounds)
            continue
        for a in node.all_input_nodes:
            if a not in seen and a is not layer:
                seen.add(a)
                todo.append(a)
    return next(iter(found)) if len(found) == 1 else None


def held_together(params: Mapping[str, Placement], owners: Mapping[str, Collection[str]], nodes: Mapping[str, Node]) -> tuple[tuple[str, ...], ...]:
    """The parameters of ``params`` held as grouped shards, in groups whose gradients one
    all_reduce sums over their holders (``ShardingPlan.holders``): those of the layers called
    by one module (an attention's k and v projections, weights and biases), whose gradients are
    ready together. ``owners``: parameter -> the layer nodes that shard it."""
    groups: dict[str, list[str]] = {}
    for name, placement in params.items():
        if isinstance(placement, Shard) and placement.overlaps:
            owner = min(owners.get(name, ()), default=None)
            key = module_of(nodes[owner]).rpartition(".")[0] if owner in nodes else name
            groups.setdefault(key, []).append(name)
    return tuple(tuple(names) for names in groups.values())


def kv_reads(node: Node) -> list[tuple[Node, int, int]]:
    """``(kv value, heads dim, group)`` for each kv value ``node`` repeats for grouped-query
    attention, ``group`` query heads per kv head: ``scaled_dot_product_attention(q, k, v,
    enable_gqa=True)`` (its ``k`` and ``v``), Hugging Face's ``repeat_kv`` (``reshape(expand(
    unsqueeze(x, d + 1), [.., Hkv, g, ..]), [.., Hkv * g, ..])``) and ``repeat_interleave(x, g, d)``."""
    if node.op != "call_function":
        return []
    if node.target is _SDPA and node.kwargs.get("enable_gqa", False):
        q, k, v = node.args[:3]
        d = len(shape_of(q)) - 3
        hq, hk = shape_of(q)[d], shape_of(k)[d]
        return [(k, d, hq // hk), (v, d, hq // hk)] if d >= 0 and hk < hq and hq % hk == 0 and shape_of(v)[d] == hk else []
    if node.target is aten.repeat_interleave.self_int and len(node.args) >= 3 and isinstance(node.args[1], int):
        x = node.args[0]
        d = node.args[2] % len(shape_of(x))
        return [(x, d, node.args[1])] if node.args[1] > 1 else []
    if node.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        expand = node.args[0]
        if not (isinstance(expand, Node) and expand.target is aten.expand.default):
            return []
        unsqueeze = _whole(expand.args[0])  # x[:, :, None, :, :] keeps its full slices under dynamic shapes
        if not (isinstance(unsqueeze, Node) and unsqueeze.target is aten.unsqueeze.default and is_tensor_node(unsqueeze.args[0])):
            return []
        x, (shape, out) = unsqueeze.args[0], (shape_of(expand), shape_of(node))
        d = unsqueeze.args[1] % len(shape) - 1
        if d < 0 or shape[d + 1] < 2 or tuple(out) != (*shape[:d], shape[d] * shape[d + 1], *shape[d + 2:]):
            return []
        return [(x, d, shape[d + 1])]
    return []


def _whole(node: object) -> object:
    """``node`` without the slices around it that keep every element (``x[:, :]``)."""
    while isinstance(node, Node) and node.target is aten.slice.Tensor and is_tensor_node(node.args[0]) and shape_of(node) == shape_of(node.args[0]):
        node = node.args[0]
    return node


def _nearest_layer(value: Node, layers: frozenset[Node]) -> Optional[Node]:
    """The one layer among ``value``'s nearest layer ancestors (not through another layer), or
    ``None`` where there are none or several."""
    found: set[Node] = set()
    seen, todo = {value}, [value]
    while todo:
        node = todo.pop()
        if node in layers:
            found.add(node)
            continue
        for a in node.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return next(iter(found)) if len(found) == 1 else None


@dataclass(frozen=True)
class _Read:
    """An attention reading two written states as key and value."""

    attention: Node
    query: Node
    group: int
    writers: tuple[Node, Node]  # the index_copy_ whose results are its key, value
    entries: tuple[Node, Node]  # the writers' users on the way: the attention, or repeat_kv's unsqueeze


def keep_needed_kv_heads(graph: Graph, plan: ShardingPlan, states: Collection[str]) -> ShardingPlan:
    """``plan`` with every cache of ``states`` (placeholder names of written states) that only
    replicated k/v write and only GQA attentions read kept as the kv heads each rank needs; the
    plan as it was where there is none. Reads ``node.meta["val"]``; does not modify ``graph``."""
    if plan.world_size == 1:
        return plan
    placeholders = [n for n in graph.nodes if n.op == "placeholder" and n.name in states and n.name not in plan.params]
    writers = {w: p for p in placeholders for w in p.users if _is_writer(w, p, plan)}
    reads = [r for r in (_read(n, writers, plan) for n in graph.nodes if n.target is _SDPA) if r is not None]
    kept = _kept(placeholders, writers, reads, plan)
    while True:  # an attention whose key or value is not kept leaves its other state whole too
        reads = [r for r in reads if all(writers[w] in kept for w in r.writers)]
        still = _kept(list(kept), writers, reads, plan)
        if still.keys() == kept.keys():
            break
        kept = still
    if not reads:
        return plan
    local_targets, local_args, edges = dict(plan.local_targets), dict(plan.local_args), dict(plan.edges)
    for w, p in writers.items():
        if p in kept:
            read = next(r for r in reads if w in r.writers)
            _, dim, index, source = w.args[:4]
            local_targets[w.name] = local_ops.index_copy_kv_heads
            local_args[w.name] = (p, dim, index, source, ShardStart(read.query), LocalSize(kept[p].query), kept[p].group, kept[p].dim)
            edges[(w.name, source.name)] = EdgeAction("enter")
    for r in reads:
        node = r.attention
        local_targets[node.name] = local_ops.grouped_query_attention_local_kv
        local_args[node.name] = (ShardStart(r.query), r.group, r.query, *r.writers, *node.args[3:])
        for kv in node.args[1:3]:
            edges.pop((node.name, kv.name), None)
    return dataclasses.replace(
        plan, local_targets=local_targets, local_args=local_args, edges=edges, kv_heads={p.name: kept[p] for p in kept}
    )


def _kept(placeholders: list[Node], writers: dict[Node, Node], reads: list["_Read"], plan: ShardingPlan) -> dict[Node, KvHeads]:
    """The states whose every use is a writer whose every use is one of ``reads``, with one
    query layout and group among those reads."""
    kept: dict[Node, KvHeads] = {}
    for p in placeholders:
        mine = [r for r in reads if p in (writers[r.writers[0]], writers[r.writers[1]])]
        entries = {e for r in mine for w, e in zip(r.writers, r.entries) if writers[w] is p}
        if not mine or any(w not in writers or not w.users for w in p.users) or {u for w in p.users for u in w.users} != entries:
            continue
        layouts = {(r.group, plan.placements[r.query.name]) for r in mine}
        if len(layouts) == 1:
            ((group, query),) = layouts
            kept[p] = KvHeads(dim=len(shape_of(p)) - 3, group=group, query=query)
    return kept


def _is_writer(node: Node, state: Node, plan: ShardingPlan) -> bool:
    """``index_copy_(state, dim, index, source)`` of a replicated source, not along the heads."""
    if node.target is not aten.index_copy_.default or node.args[0] is not state or node.name in plan.local_targets:
        return False
    nd = len(shape_of(state))
    source = node.args[3]
    return (
        nd >= 3
        and node.args[1] % nd != nd - 3
        and is_tensor_node(source)
        and not isinstance(plan.placements.get(source.name), Shard)
        and is_tensor_node(node.args[2])
        and not isinstance(plan.placements.get(node.args[2].name), Shard)
    )


def _read(node: Node, writers: dict[Node, Node], plan: ShardingPlan) -> Optional[_Read]:
    """The attention ``node`` as a reader of two written states, or ``None``."""
    q, k, v = node.args[:3]
    dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    query = plan.placements.get(q.name)
    nd = len(shape_of(q))
    if dropout != 0 or not isinstance(query, Shard) or query.dim != nd - 3 or len(query.segments) != 1 or query.unit != 1:
        return None
    if plan.local_targets.get(node.name) is local_ops.grouped_query_attention:
        group = plan.local_args[node.name][1]
        found = [(t, group, node) if t in writers else None for t in (k, v)]
    elif node.name not in plan.local_targets:
        found = [_repeated(t, writers, plan, node, query) for t in (k, v)]
    else:
        return None
    if None in found or found[0][1] != found[1][1]:
        return None
    return _Read(node, q, found[0][1], (found[0][0], found[1][0]), (found[0][2], found[1][2]))


def _repeated(value: Node, writers: dict[Node, Node], plan: ShardingPlan, attention: Node, query: Shard) -> Optional[tuple[Node, int, Node]]:
    """``(writer, g, unsqueeze)`` for ``reshape(expand(unsqueeze(writer, d + 1), [.., Hkv, g, ..]), [.., Hkv * g, ..])``
    (``repeat_kv``, ``d`` the heads dim) read by ``attention`` through a slice to ``query``."""
    chain = [value]
    for _ in range(2):
        chain.append(chain[-1].args[0] if chain[-1].op == "call_function" and chain[-1].args else None)
        if not is_tensor_node(chain[-1]):
            return None
    reshape, expand, unsqueeze = chain
    writer = unsqueeze.args[0] if unsqueeze.args else None
    if (reshape.target, expand.target, unsqueeze.target) != (aten.reshape.default, aten.expand.default, aten.unsqueeze.default):
        return None
    if writer not in writers or any(len(n.users) != 1 for n in chain):
        return None
    heads = query.dim
    kv, repeated = shape_of(writer), shape_of(reshape)
    group = shape_of(expand)[heads + 1] if len(shape_of(expand)) == len(kv) + 1 else 0
    action = plan.edges.get((attention.name, reshape.name))
    if (
        unsqueeze.args[1] != heads + 1
        or group < 1
        or repeated != (*kv[:heads], kv[heads] * group, *kv[heads + 1:])
        or repeated[heads] != query.size
        or action is None
        or action.kind != "slice"
        or action.placement != query
    ):
        return None
    return writer, group, unsqueeze
