"""The op rule registry: how placements flow through each ATen op.

A rule is a small function ``rule(ctx: RuleContext) -> Decision`` registered for one or more
``OpOverload``s (or ``operator.getitem``). It reads the placements of the node's tensor inputs
and the static shapes in ``node.meta["val"]`` and answers:

* the placement of the output (or of each output, for ops returning tuples),
* which replicated inputs must be sliced locally to a shard (``wants``), e.g. a colwise
  ``linear`` wants its weight ``Shard(0)``,
* the node's args rewritten with local shape literals (``local_args``), e.g. ``view`` sizes,
* for matmul-like layers, the layer's style (colwise / rowwise / replicate) for the report.

A rule that cannot accept its inputs raises :class:`Conflict` with a stable code; the planner
then keeps the producers replicated (or refines their layout, see NOTE: [segments]).

Registering an op twice is an error (DTensor's registry silently overwrites; we refuse).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import optimization_hint

from fxtp.core.placement import REPLICATE, Placement

__all__ = [
    "GATHER_INSTEAD",
    "WHOLE_KV_HEADS",
    "located",
    "Conflict",
    "Decision",
    "ShardStart",
    "LocalSize",
    "uneven_ok",
    "takes_uneven",
    "overlap_ok",
    "takes_overlap",
    "GroupName",
    "LayerNote",
    "LayerState",
    "RuleContext",
    "Rule",
    "register_rule",
    "get_rule",
    "registered_ops",
    "is_tensor_node",
    "shape_of",
    "module_of",
    "source_line",
]

# An op, or the qualified name of an op from an optional library (``"transformers::grouped_mm_fallback"``),
# which exists only once that library is imported: see :func:`get_rule`.
OpKey = Union[torch._ops.OpOverload, Callable[..., Any], str]
Outputs = Union[Placement, tuple[Placement, ...]]


@dataclass(frozen=True)
class LayerNote:
    """What a matmul-like layer became, for the report.

    ``style`` is ``colwise``, ``rowwise`` or ``replicate``; ``code`` is a stable rejection code
    (``None`` when the layer is sharded or simply needs nothing).
    """

    style: str
    reason: str
    code: Optional[str] = None
    fix: Optional[str] = None
    node: Optional[str] = None  # format_node() of the node that forced the decision
    module: Optional[str] = None  # that node's module FQN


@dataclass(frozen=True)
class ShardStart:
    """In ``Decision.local_args``: this rank's first index along ``value``'s sharded dim; the
    rewrite puts the number in (rules do not know the rank)."""

    value: Node


@dataclass(frozen=True)
class LocalSize:
    """In ``Decision.local_args`` (also inside a size list): this rank's size of ``shard``'s
    sharded dim, where it differs between ranks (NOTE: [uneven shards] in ``fxtp/core/placement.py``);
    the rewrite puts the number in. Rules write it through ``rules._common.local_size``."""

    shard: Any  # a fxtp.core.placement.Shard


@dataclass(frozen=True)
class GroupName:
    """In ``Decision.local_args``: the name of the tensor-parallel process group, for an emitted
    op that communicates itself (a vocab-parallel loss); the rewrite puts it in."""


@dataclass(frozen=True)
class Decision:
    """A rule's answer for one node.

    Attributes:
        out: placement of the output, or a tuple with one placement per output.
        wants: input node -> placement it must have. A replicated input that is wanted sharded
            is sliced locally (a parameter is stored sharded instead). Rules list every sharded
            input they accept, too: that is how a parameter stays sharded from round to round.
        local_args: the node's args with shape literals made local, or ``None`` to keep them.
        after_reduce: inputs applied after the all_reduce of a ``Partial`` output (the bias of
            a rowwise linear, see NOTE: [rowwise bias]).
        local_target: the op the rank runs instead of the node's own, with ``local_args``
            (a rowwise ``addmm`` becomes ``mm``; a vocab-parallel ``embedding`` masks ids).
        layer: set by matmul-like rules.
    """

    out: Outputs
    wants: dict[Node, Placement] = field(default_factory=dict)
    local_args: Optional[tuple[Any, ...]] = None
    after_reduce: Optional[Node] = None
    layer: Optional[LayerNote] = None
    local_target: Optional[OpKey] = None


# NOTE: [actionable fixes]
# Every rejection's fix names something the user can do: a ``plan=`` entry, a world size, or a
# code change at its source line. fxtp already keeps the producing layers replicated, so "keep
# the producer replicated" is no fix; what the user can do instead is force the layer sharded,
# and fxtp then gathers the value where the op needs it whole (``passes/plan.py``: a forced
# culprit is not demoted, the rejected input is gathered). ``{layer}`` in a fix becomes the
# layer's name (``passes.layers.layer_decision``), ``{line}`` the rejected op's source line
# (:func:`located`).
GATHER_INSTEAD = (
    "none needed (the producing layer stays replicated); plan={'{layer}': 'colwise'} keeps it sharded "
    "and all_gathers its output here instead"
)


# A grouped shard's rejection (NOTE: [grouped shards] in fxtp/core/placement.py): with kv heads
# that divide the world size, no rank shares one.
WHOLE_KV_HEADS = "none needed (the kv projections stay replicated); a world_size that divides the kv head count shards them"

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def located(fix: str, node: Node) -> str:
    """``fix`` with ``{line}`` replaced by ``node``'s :func:`source_line`, or by its module
    where the capture recorded no trace."""
    if "{line}" not in fix:
        return fix
    return fix.replace("{line}", source_line(node) or f"the call in {module_of(node) or 'the root module'}")


class Conflict(Exception):
    """A rule cannot accept the placements of its inputs.

    Args:
        code: stable rejection code (documented in the README).
        message: what is wrong, in the user's terms.
        fix: what the user can do.
        refine: a finer segment layout (NOTE: [segments]) for the sharded input that would make
            the rule succeed, if one exists.
        culprits: the layers to keep replicated; default: the layers whose shard reached here.
        blame: the inputs whose shard is at fault (default: every sharded input); the layers
            kept replicated are those whose shard reached these.
        unit: a split granularity (NOTE: [uneven shards]) for the producing layers' output
            that would make the rule succeed: the head size where a view splits heads that do
            not divide the world size.
        unit_segments: the segments under which ``unit`` applies (default: the layer's current
            ones): an uneven layout, where ``refine`` proposes even ones.
    """

    def __init__(
        self,
        code: str,
        message: str,
        fix: str = "",
        *,
        refine: Optional[tuple[int, ...]] = None,
        culprits: Optional[Sequence[Node]] = None,
        blame: Optional[Sequence[Node]] = None,
        unit: Optional[int] = None,
        unit_segments: Optional[tuple[int, ...]] = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.fix = fix
        self.refine = refine
        self.culprits = tuple(culprits) if culprits is not None else None
        self.blame = tuple(blame) if blame is not None else None
        self.unit = unit
        self.unit_segments = unit_segments


class RuleContext:
    """What a rule may ask about its node: input placements, static shapes, world_size, state."""

    def __init__(
        self,
        node: Node,
        world_size: int,
        placement_of: Callable[[Node], Any],
        layer_state: Callable[[Node], "LayerState"],
        is_param: Callable[[Node], bool] = lambda n: False,
    ) -> None:
        self.node = node
        self.world_size = world_size
        self._placement_of = placement_of
        self._layer_state = layer_state
        self.is_param = is_param  # is the input a parameter (or a split piece of one)?

    def placement(self, arg: Any) -> Placement:
        """Placement of an argument; non-tensor arguments are replicated."""
        if is_tensor_node(arg):
            return self._placement_of(arg)
        return REPLICATE

    def tuple_placement(self, arg: Node) -> tuple[Placement, ...]:
        """Placements of a multi-output node (``split``, ``unbind``, ``native_dropout``)."""
        p = self._placement_of(arg)
        assert isinstance(p, tuple), (arg, p)
        return p

    def layer(self) -> "LayerState":
        """The planner's current state for this node as a layer (demoted? forced? segments?)."""
        return self._layer_state(self.node)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return shape_of(self.node)


@dataclass(frozen=True)
class LayerState:
    """The planner's state for one layer node, read by matmul-like rules."""

    demoted: Optional[LayerNote]  # why it must stay replicated, if it must
    forced: Optional[str]  # the style a user plan asks for
    segments: Optional[tuple[int, ...]]  # refined output segments, NOTE: [segments]
    slice_input: bool = False  # rowwise on a replicated input sliced locally, NOTE: [rowwise fallback]
    whole_input: Optional[LayerNote] = None  # why its input must arrive replicated, NOTE: [tied uses]
    unit: int = 1  # split granularity of its output (whole heads), NOTE: [uneven shards]
    # per output segment: the query heads that read each of its kv heads (1: no kv heads), NOTE: [grouped shards]
    groups: tuple[int, ...] = ()
    columns: bool = False  # a table sharded by columns, NOTE: [column-sharded embedding]


Rule = Callable[[RuleContext], Decision]
_RULES: dict[OpKey, Rule] = {}


def register_rule(*ops: OpKey) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the rule of each op in ``ops``.

    Raises:
        KeyError: an op already has a rule.
    """

    def wrap(fn: Rule) -> Rule:
        taken = [op for op in ops if op in _RULES]
        if taken:
            raise KeyError(f"op {taken[0]} already has a rule: {_RULES[taken[0]].__name__}")
        _RULES.update((op, fn) for op in ops)
        return fn

    return wrap


def uneven_ok(fn: Rule) -> Rule:
    """Mark ``fn`` as handling uneven shards (NOTE: [uneven shards] in ``fxtp/core/placement.py``):
    its output shard keeps the input's unit and rank-dependent sizes go in as ``LocalSize``.
    The planner refuses an uneven input to any other rule (``not-divisible``)."""
    fn.fxtp_uneven = True  # type: ignore[attr-defined]
    return fn


def takes_uneven(rule: Optional[Rule]) -> bool:
    return bool(getattr(rule, "fxtp_uneven", False))


def overlap_ok(fn: Rule) -> Rule:
    """Mark ``fn`` (already ``uneven_ok``) as handling grouped shards, whose units several ranks
    hold (NOTE: [grouped shards] in ``fxtp/core/placement.py``): it keeps ``Shard.groups`` on
    its output, or turns the kv units into the query heads that read them, and never sums over
    the grouped dim (the holders would count a unit twice). The planner refuses a grouped shard
    to any other rule (``not-divisible``)."""
    assert takes_uneven(fn), f"{fn.__name__}: mark it uneven_ok first"
    fn.fxtp_overlap = True  # type: ignore[attr-defined]
    return fn


def takes_overlap(rule: Optional[Rule]) -> bool:
    return bool(getattr(rule, "fxtp_overlap", False))


def get_rule(op: OpKey) -> Optional[Rule]:
    """The rule of ``op``: registered for the op itself, or for its qualified name
    (``OpOverload.name()``, e.g. ``"transformers::grouped_mm_fallback"`` for its default overload)."""
    rule = _RULES.get(op)
    if rule is None and isinstance(op, torch._ops.OpOverload):
        rule = _RULES.get(op.name())
    return rule


def registered_ops() -> list[OpKey]:
    return list(_RULES)


def is_tensor_node(arg: Any) -> bool:
    return isinstance(arg, Node) and isinstance(arg.meta.get("val"), torch.Tensor)


def module_of(node: Node) -> str:
    """FQN of the innermost module that called ``node`` (from export's ``nn_module_stack``)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return str(path)


def source_line(node: Node) -> str:
    """The user's source line that made ``node``, as ``file.py:LINE `code` `` (the innermost frame
    of export's ``meta["stack_trace"]`` outside torch: the model's call of ``nn.Linear``, not
    ``F.linear`` in torch), or ``""`` when the capture recorded none."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n[ \t]*([^\n]*)', node.meta.get("stack_trace") or "")
    frames = [frame for frame in frames if not frame[0].startswith(_TORCH_DIR)]
    if not frames:
        return ""
    path, line, code = frames[-1]
    return f"{os.path.basename(path)}:{line} `{code.strip()}`"


def shape_of(node: Node) -> tuple[int, ...]:
    """The node's shape as ints; a dynamic (symbolic) size gives its example value, read
    without adding a guard (``optimization_hint``): planning reasons on the example's sizes,
    and ``passes.dynamic`` checks that no decision depends on a dynamic one."""
    return tuple(optimization_hint(s) for s in node.meta["val"].shape)


