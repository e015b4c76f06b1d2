"""Exact parameter shapes of a tensor-parallel rank, with repeated blocks analyzed once.

NOTE: [repeated blocks]
A transformer is a stack of identical blocks: the plan of one block does not depend on how
many follow it. For a Hugging Face model (its ``config.num_hidden_layers`` and an
``nn.ModuleList`` of that many blocks whose parameters all have the same names, shapes and
dtypes), the planner analyzes the model rebuilt on ``meta`` with two blocks and counts block
1's parameters once per block of the real model, and the parameters outside the blocks once
(as meta-pytorch/autoparallel groups repeated blocks). The tests check the count against the
full-depth ``fxtp.analyze`` and a compiled rank. Two blocks, not one: a first or last block
next to the embedding or the head is never the one counted. Any other model (no config,
blocks that differ, two blocks or fewer) is analyzed whole. One capture serves every
tensor-parallel degree (``fxtp.api.plan_world_sizes``).

NOTE: [block kinds]
Some stacks hold more than one kind of block: DeepSeek-V3's first ``first_k_dense_replace``
blocks have a dense MLP and the others experts; Qwen2-MoE's ``mlp_only_layers`` are dense among
MoE blocks. Blocks are grouped by their parameters' names, shapes and dtypes (a kind), and the
model is rebuilt on ``meta`` with the shortest prefix of its blocks that holds every kind twice
(or as often as the model does): the rebuilt config keeps the family's own rule for which block
is which (``first_k_dense_replace``, ``mlp_only_layers`` indices below the depth), and its blocks
must have the real prefix's kinds, else the real model is analyzed whole. Each kind's blocks must
be planned alike; one of them is counted once per block of that kind in the real model
(``ParamShapes.kinds``). One kind is the case above (two blocks analyzed).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxtp.core.placement import Shard
from fxtp.planner.host import OpCounts, count_ops

__all__ = ["ParamShapes", "Blocks", "block_kinds", "repeated_blocks", "parameter_shapes"]

# (local shape, bytes per element) of one parameter tensor on rank 0
Piece = tuple[tuple[int, ...], int]


@dataclass(frozen=True)
class ParamShapes:
    """Rank 0's parameters at tensor-parallel degree ``tp``: local shapes and element sizes.

    ``block`` is one repeated block's (NOTE: [repeated blocks]), counted ``n_blocks`` times;
    ``other`` every parameter outside the blocks (the whole model when ``n_blocks`` is 0).
    A tied parameter is counted once. Rank 0 holds the most of an uneven shard.
    """

    tp: int
    other: tuple[Piece, ...]
    block: tuple[Piece, ...]
    n_blocks: int
    analyzed_blocks: int  # the depth fxtp analyzed (2 when extrapolated)
    # Bytes a rank sends outside the blocks, forward and backward, in ring collectives (NOTE:
    # [cost model] in fxtp/planner/costs.py), per byte of one (batch, seq, hidden) activation
    outside_sent: tuple[float, float] = (0.0, 0.0)
    styles: tuple[tuple[str, str], ...] = ()  # the analyzed graph's layer styles as plan= entries
    before: int = 0  # how many of ``other`` come before the blocks in the model (the embedding: FSDP's first unit)
    # Ring bytes a rank sends per backward for one block above Megatron's floor that do not
    # scale with the tokens: the weight-gradient all_reduce of grouped kv shards (NOTE:
    # [grouped shards] in fxtp/core/placement.py), counted once per block of the real model
    block_weight_sent: float = 0.0
    # A stack of several block kinds (NOTE: [block kinds]): each kind's pieces and its count in the
    # real model, in order of first appearance (``block`` is the first's); empty for one kind
    kinds: tuple[tuple[tuple[Piece, ...], int], ...] = ()
    ops: Optional[OpCounts] = None  # what a forward dispatches besides its GEMMs (NOTE: [host time]); None: unpriced
    # How many collectives carry ``outside_sent``, forward and backward: each costs its latency
    # (NOTE: [cost model] in fxtp/planner/costs.py)
    outside_collectives: tuple[int, int] = (0, 0)
    # which of ``other``'s and of ``block``'s pieces are tensor-parallel shards: fxtp's
    # ShardedParameters at dp 1, whose optimizer step dispatches through Python (NOTE: [host time])
    sharded: tuple[tuple[bool, ...], tuple[bool, ...]] = ((), ())

    def sharded_tensors(self) -> int:
        """How many of rank 0's parameter tensors are tensor-parallel shards."""
        return sum(self.sharded[0]) + self.n_blocks * sum(self.sharded[1])

    def block_kinds(self) -> tuple[tuple[tuple[Piece, ...], int], ...]:
        """Each block kind's pieces and count (``((block, n_blocks),)`` for one kind)."""
        return self.kinds or ((self.block, self.n_blocks),)

    def bytes(self) -> int:
        """Rank 0's parameter bytes in the model's own dtypes (what ``Report.param_bytes_per_rank`` says)."""
        return _bytes(self.other) + sum(n * _bytes(block) for block, n in self.block_kinds())

    def elements(self, dp: int = 1) -> int:
        """Elements rank 0 holds when FSDP2 also shards every parameter over ``dp`` ranks on
        dim 0 (``fully_shard`` pads dim 0 to a multiple of ``dp``: each holds ``ceil``)."""
        return _elements(self.other, dp) + sum(n * _elements(block, dp) for block, n in self.block_kinds())

    def unit_elements(self, dp: int = 1) -> tuple[int, tuple[tuple[int, int], ...], int]:
        """Elements on this rank of FSDP's units (torchtitan's wrapping), sharded over ``dp``: what
        comes before the blocks (the embedding), one block of each kind with its count, and what
        comes after (the final norm and the head)."""
        blocks = tuple((_elements(block, dp), n) for block, n in self.block_kinds())
        return (_elements(self.other[:self.before], dp), blocks, _elements(self.other[self.before:], dp))


@dataclass(frozen=True)
class Blocks:
    """The repeated blocks of a model: the ``nn.ModuleList`` at ``fqn`` holds ``count``;
    ``kinds`` the kind of each (NOTE: [block kinds]), empty when all are alike."""

    fqn: str
    count: int
    kinds: tuple[int, ...] = ()

    def kind_of(self, index: int) -> int:
        return self.kinds[index] if self.kinds else 0


def _bytes(pieces: tuple[Piece, ...]) -> int:
    return sum(math.prod(shape) * size for shape, size in pieces)


def _elements(pieces: tuple[Piece, ...], dp: int) -> int:
    return sum(-(-shape[0] // dp) * math.prod(shape[1:]) if shape else 1 for shape, _ in pieces)


def _signature(block: nn.Module) -> tuple:
    return tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())


def block_kinds(blocks: nn.ModuleList) -> tuple[int, ...]:
    """The kind of each block (NOTE: [block kinds]): 0, 1, ... in order of first appearance."""
    seen: dict[tuple, int] = {}
    return tuple(seen.setdefault(_signature(b), len(seen)) for b in blocks)


def repeated_blocks(model: nn.Module) -> Optional[Blocks]:
    """The model's stack of blocks (NOTE: [repeated blocks], NOTE: [block kinds]), or None."""
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if not isinstance(count, int) or count < 1:
        return None
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == count]
    if not lists:
        return None
    fqn, blocks = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    kinds = block_kinds(blocks)
    return Blocks(fqn, count, kinds if max(kinds) else ())


def _depth(blocks: Blocks) -> int:
    """The shortest prefix of the stack holding every kind twice, or as often as the stack does
    (NOTE: [block kinds]); 2 for one kind."""
    kinds = blocks.kinds or (0,) * blocks.count
    need = {k: min(2, kinds.count(k)) for k in set(kinds)}
    seen: dict[int, int] = {}
    for depth, k in enumerate(kinds, 1):
        seen[k] = seen.get(k, 0) + 1
        if all(seen.get(k, 0) >= n for k, n in need.items()):
            return depth
    return blocks.count


def _shallow(model: nn.Module, depth: int) -> nn.Module:
    """The Hugging Face ``model`` rebuilt on ``meta`` with ``depth`` blocks (per-layer config
    lists such as ``layer_types`` cut to ``depth``), in its dtype and mode; the model is not touched."""
    config = copy.deepcopy(model.config)
    count = config.num_hidden_layers
    for key, value in list(vars(config).items()):
        if isinstance(value, list) and len(value) == count:
            setattr(config, key, value[:depth])
    config.num_hidden_layers = depth
    dtype = next(model.parameters()).dtype
    with torch.device("meta"):
        shallow = type(model)._from_config(config, dtype=dtype)
    return shallow.train(model.training)


def _to_meta(tree: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"), tree)


def _payload(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of one ``(batch, seq, hidden)`` activation of the example (token ids in, the
    model's floating dtype): the unit the outside collectives are priced in; 0 when unknown."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    ids = next((t for t in (*args, kwargs.get("input_ids")) if isinstance(t, torch.Tensor)), None)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if not isinstance(hidden, int) or ids is None or ids.is_floating_point() or dtype is None:
        return 0
    return ids.numel() * hidden * dtype.itemsize


def parameter_shapes(
    model: nn.Module, tps: tuple[int, ...], example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any],
    expert_parallel: bool = False,
) -> dict[int, ParamShapes]:
    """Rank 0's parameter shapes at each tensor-parallel degree in ``tps`` (NOTE: [repeated blocks]),
    with the bytes the plan's collectives send outside the blocks (``ParamShapes.outside_sent``).
    With ``expert_parallel`` also the expert-parallel plan's, under ``-tp`` (from the same
    capture; none where the experts are fewer than ``tp``).

    Raises:
        FxtpError: as ``fxtp.analyze`` (capture, inputs).
    """
    from fxtp.api import plan_world_sizes

    blocks = repeated_blocks(model)
    analyzed, inputs, kwargs, depth = model, example_inputs, example_kwargs, 0
    prefix = _depth(blocks) if blocks is not None else 0
    if blocks is not None and blocks.count > prefix and hasattr(type(model), "_from_config"):
        shallow = _shallow(model, prefix)
        again = repeated_blocks(shallow)
        if again is not None and again.fqn == blocks.fqn and _same_blocks(model, shallow, blocks.fqn):
            analyzed, inputs, kwargs, depth = shallow, _to_meta(example_inputs), _to_meta(example_kwargs), prefix
        elif blocks.kinds:  # the rebuilt prefix's kinds differ from the model's: analyze it whole
            depth = blocks.count
    elif blocks is not None:
        depth = blocks.count
    program, plans = plan_world_sizes(analyzed, tps, inputs, example_kwargs=kwargs, expert_parallel=expert_parallel)
    payload = _payload(model, example_inputs, example_kwargs)
    out = _collect(program, plans, blocks, depth, payload)
    if out is None:  # the two blocks were planned differently: count the real model's
        program, plans = plan_world_sizes(model, tps, example_inputs, example_kwargs=example_kwargs,
                                          expert_parallel=expert_parallel)
        out = _collect(program, plans, blocks, blocks.count, payload)
    assert out is not None
    hidden = getattr(getattr(model, "config", None), "hidden_size", 0)
    ops = count_ops(program, blocks.fqn if blocks is not None and depth else None, hidden, inputs, kwargs)
    return {key: dataclasses.replace(shapes, ops=ops) for key, shapes in out.items()}


def _collect(
    program: Any, plans: dict[int, Any], blocks: Optional[Blocks], depth: int, payload: int
) -> Optional[dict[int, ParamShapes]]:
    """Rank 0's pieces per degree, blocks grouped; None where ``depth`` is short of the model's
    and its blocks 0 and 1 got different shards (extrapolating would be wrong)."""
    from fxtp.explain.counts import collectives, grad_inputs
    from fxtp.explain.report import parameter_placements

    nodes, needs_grad = {n.name: n for n in program.graph.nodes}, grad_inputs(program)
    fqns = program.graph_signature.inputs_to_parameters
    out = {}
    for key, plan in plans.items():
        tp = abs(key)  # -tp: the expert-parallel plan
        held = _held_sent(plan, nodes, needs_grad, fqns, blocks.fqn if blocks is not None and depth else None, tp)
        # the blocks counted as blocks: extrapolated from ``depth`` of them, or all of a stack no deeper
        # (a 2-block model is FSDP2's 2 block units and a root as a 32-block one is, not one unit)
        by_block = blocks is not None and 0 < depth <= blocks.count
        stats = collectives(program, plan, nodes, needs_grad)
        outside = _outside_sent(stats, tp, depth if blocks is not None else 0, payload,
                                sum(v for k, v in held.items() if k is not None) if by_block else 0.0)
        in_blocks = sum(1 for names in plan.holders if blocks is not None and depth and tp > 1
                        for grad in [[n for n in names if n in needs_grad]] if grad
                        and _block_index(fqns.get(grad[0], ""), blocks.fqn) is not None)  # one all_reduce a holder
        counted = _outside_count(stats, tp, depth if blocks is not None else 0, in_blocks)
        seen: set[int] = set()
        other: list[Piece] = []
        before: Optional[int] = None
        per_block: dict[int, list[Piece]] = {}
        other_sharded: list[bool] = []
        block_sharded: dict[int, list[bool]] = {}
        for fqn, placement in parameter_placements(program, plan).items():
            tensor = program.state_dict[fqn]
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            shape = list(tensor.shape)
            if isinstance(placement, Shard):
                shape[placement.dim] = placement.local_size(tp, 0)
            piece = (tuple(shape), tensor.element_size())
            index = _block_index(fqn, blocks.fqn) if blocks is not None and depth else None
            if index is not None and before is None:
                before = len(other)
            (other if index is None else per_block.setdefault(index, [])).append(piece)
            (other_sharded if index is None else block_sharded.setdefault(index, [])).append(isinstance(placement, Shard))
        styles = _styles(plan, blocks if by_block else None, depth)
        kinds: dict[int, tuple[tuple[Piece, ...], float]] = {}  # kind -> (pieces, held), alike in each kind
        alike = by_block and styles is not None
        for i in range(depth if alike else 0):
            seen_here = (tuple(per_block.get(i, ())), held.get(i, 0.0))
            alike = alike and kinds.setdefault(blocks.kind_of(i), seen_here) == seen_here
        if blocks is None or not depth:
            out[key] = ParamShapes(tp, tuple(other), (), 0, 0, outside, styles, outside_collectives=counted,
                                   sharded=(tuple(other_sharded), ()))
        elif by_block and not alike and depth < blocks.count:
            return None
        elif alike:
            counts = [sum(1 for i in range(blocks.count) if blocks.kind_of(i) == k) for k in sorted(kinds)]
            pieces = [kinds[k][0] for k in sorted(kinds)]
            first = next(i for i in range(depth) if blocks.kind_of(i) == min(kinds))  # the block ``pieces[0]`` is
            sent = sum(n * kinds[k][1] for k, n in zip(sorted(kinds), counts)) / blocks.count  # per block, on average
            out[key] = ParamShapes(tp, tuple(other), pieces[0], blocks.count, depth, outside, styles, before or 0, sent,
                                   tuple(zip(pieces, counts)) if len(kinds) > 1 else (), outside_collectives=counted,
                                   sharded=(tuple(other_sharded), tuple(block_sharded.get(first, ()))))
        else:  # the whole stack analyzed, two blocks of one kind sharded unlike: priced as one unit
            pieces = tuple(other + [p for i in sorted(per_block) for p in per_block[i]])
            outside = _outside_sent(stats, tp, depth, payload)
            flags = tuple(other_sharded + [f for i in sorted(block_sharded) for f in block_sharded[i]])
            out[key] = ParamShapes(tp, pieces, (), 0, depth, outside, _styles(plan, None, depth),
                                   outside_collectives=_outside_count(stats, tp, depth, 0), sharded=(flags, ()))
    return out


def _held_sent(plan: Any, nodes: dict[str, Any], needs_grad: set[str], fqns: dict[str, str], blocks_fqn: Optional[str],
               tp: int) -> dict[Optional[int], float]:
    """Ring bytes a rank sends per backward in the weight-gradient all_reduces of grouped kv
    shards (``ShardingPlan.holders``, as ``fxtp.explain.counts.collectives`` counts them), by
    block index (None: outside the blocks)."""
    from fxtp.explain.counts import nbytes_of

    out: dict[Optional[int], float] = {}
    for names in plan.holders:
        names = [n for n in names if n in needs_grad]
        if not names or tp == 1:
            continue
        fqn = fqns.get(names[0], "")
        index = _block_index(fqn, blocks_fqn) if blocks_fqn is not None else None
        out[index] = out.get(index, 0.0) + 2 * (tp - 1) / tp * sum(nbytes_of(nodes[n].meta["val"]) for n in names)
    return out


def _outside_sent(stats: Any, tp: int, depth: int, payload: int, held: float = 0.0) -> tuple[float, float]:
    """Bytes a rank sends per forward and backward outside the ``depth`` analyzed blocks, per
    payload byte: the plan's collectives as ring collectives (an all_reduce ``2 (t-1)/t`` of its
    bytes, an all_gather or reduce_scatter ``(t-1)/t``; an all_to_all, whose bytes are summed
    over the ranks, ``(t-1)/t`` of a rank's share) less Megatron's 2 all_reduces of one payload
    per block and phase (NOTE: [cost model]), and less ``held``, the blocks' grouped kv
    weight-gradient all_reduces (``ParamShapes.block_weight_sent`` counts them per block)."""
    if tp == 1 or not payload:
        return (0.0, 0.0)
    sent = {"forward": 0.0, "backward": -held}
    for stat in stats:
        share = 2 if stat.kind == "all_reduce" else 1 / tp if stat.kind == "all_to_all" else 1
        sent[stat.phase] += share * (tp - 1) / tp * stat.bytes
    floor = depth * 2 * 2 * (tp - 1) / tp * payload
    return (max(0.0, sent["forward"] - floor) / payload, max(0.0, sent["backward"] - floor) / payload)


def _outside_count(stats: Any, tp: int, depth: int, held: int) -> tuple[int, int]:
    """How many collectives :func:`_outside_sent`'s bytes take, forward and backward: the plan's
    less Megatron's 2 per block and phase and less ``held`` (the blocks' grouped kv
    weight-gradient all_reduces, one per holder, priced with the block)."""
    if tp == 1:
        return (0, 0)
    count = {"forward": 0, "backward": -held}
    for stat in stats:
        count[stat.phase] += stat.count
    return (max(0, count["forward"] - 2 * depth), max(0, count["backward"] - 2 * depth))


def _styles(plan: Any, blocks: Optional[Blocks], depth: int = 0) -> Optional[tuple[tuple[str, str], ...]]:
    """The plan's ``{layer: style}`` as ``plan=`` entries (glob patterns, ``[`` escaped); with
    ``blocks`` (``depth`` blocks analyzed for many), the blocks' layers as ``{fqn}.*.`` globs
    (a layer name whose style differs between block kinds: one entry per block of the real
    model, NOTE: [block kinds]), or None where two analyzed blocks of one kind differ."""
    out: dict[str, str] = {}
    per_block: dict[int, dict[str, str]] = {i: {} for i in range(depth)}
    for layer in plan.layers:
        name = layer.name.partition(":")[0]  # a module called twice: its calls share the module's key
        index = _block_index(name, blocks.fqn) if blocks is not None else None
        if index is not None:
            rest = name[len(blocks.fqn) + 1:].partition(".")[2]
            per_block[index][rest] = layer.style
            continue
        key = name.replace("[", "[[]")
        out[key] = layer.style if out.get(key, layer.style) == layer.style else "replicate"
    if blocks is None:
        return tuple(out.items())
    per_kind: dict[int, dict[str, str]] = {}
    for i, styles in per_block.items():
        if per_kind.setdefault(blocks.kind_of(i), styles) != styles:
            return None
    entries = list(out.items())
    glob = f"{blocks.fqn}.*." if blocks.fqn else "*."
    head = f"{blocks.fqn}." if blocks.fqn else ""
    for rest in dict.fromkeys(r for styles in per_kind.values() for r in styles):
        found = {styles[rest] for styles in per_kind.values() if rest in styles}
        if len(found) == 1:
            entries.append((glob + rest.replace("[", "[[]"), found.pop()))
            continue
        for i in range(blocks.count):
            style = per_kind[blocks.kind_of(i)].get(rest)
            if style is not None:
                entries.append((f"{head}{i}.{rest}".replace("[", "[[]"), style))
    return tuple(entries)


def _block_index(fqn: str, prefix: str) -> Optional[int]:
    head = f"{prefix}." if prefix else ""
    if not fqn.startswith(head):
        return None
    index = fqn[len(head):].partition(".")[0]
    return int(index) if index.isdigit() else None


def _same_blocks(model: nn.Module, shallow: nn.Module, fqn: str) -> bool:
    """The rebuilt model's blocks are the real model's first ones, kind for kind (NOTE: [block
    kinds]), and the parameters outside the blocks are the same."""
    full, cut = model.get_submodule(fqn), shallow.get_submodule(fqn)
    other = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters() if _block_index(n, fqn) is None}
    kept = {n: (tuple(p.shape), p.dtype) for n, p in shallow.named_parameters() if _block_index(n, fqn) is None}
    return all(_signature(full[i]) == _signature(b) for i, b in enumerate(cut)) and other == kept
