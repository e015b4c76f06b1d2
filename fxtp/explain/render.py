"""Deterministic renderings of a rank's emitted graph: annotated code and Graphviz DOT.

Both read ``node.meta["fxtp_placement"]`` (written by ``passes/rewrite.py``) and
``node.meta["val"]``; neither prints addresses, file paths or stack traces, so the output is
stable across runs and machines (the golden graphs in ``tests/golden/`` rely on it).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
from torch.fx import GraphModule, Node

__all__ = ["graph_text", "graph_dot", "PLACEMENT_LEGEND"]

PLACEMENT_LEGEND = (
    "R: replicated, S(d): sharded on dim d, P(sum): partial sums (all_reduced by g); "
    "shapes are global (the whole tensor)"
)

_DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
}

# ``   x = op(...);  a = b = None``: FX's release of dead values, noise when reading.
_RELEASE = re.compile(r";  (?:\w+ = )+None$")
_ASSIGN = re.compile(r"^    (\w+) = ")

# Megatron-LM's operators (fxtp.core.collectives), as the DOT labels and the legend name them.
_COLLECTIVES = {
    "copy_to_tp": "f: all_reduce bwd",
    "reduce_from_tp": "g: all_reduce fwd",
    "gather_from_tp": "all_gather fwd",
}

_FILL = {"R": "white", "S": "#c6dbef", "P": "#fdd0a2"}
_COLLECTIVE_FILL = "#fb6a4a"


def _describe_val(val: Any) -> Optional[str]:
    """``f32[8, 256]`` for a tensor, ``(f32[2], i64[2])`` for a tuple of them; None otherwise."""
    if isinstance(val, torch.Tensor):
        dtype = _DTYPES.get(val.dtype, str(val.dtype).removeprefix("torch."))
        return f"{dtype}[{', '.join(str(int(d)) for d in val.shape)}]"
    if isinstance(val, (tuple, list)) and val:
        parts = [_describe_val(v) for v in val]
        return f"({', '.join(p or '-' for p in parts)})" if any(parts) else None
    return None


def _val(node: Node) -> Any:
    """``meta["val"]``; for a node the rewrite inserted (collectives, local slices, the rowwise
    bias add), the global value of its first input, which it has the shape of."""
    seen = node
    while "val" not in seen.meta and seen.all_input_nodes and _inserted_kind(seen):
        seen = seen.all_input_nodes[0]
    return seen.meta.get("val")


def _inserted_kind(node: Node) -> bool:
    """Could the rewrite have inserted ``node`` (an ATen op or a collective)?"""
    return isinstance(node.target, torch._ops.OpOverload) or _collective(node) is not None


def _annotation(node: Node) -> str:
    parts = [node.meta.get("fxtp_placement"), _describe_val(_val(node))]
    return "  ".join(p for p in parts if p)


def _collective(node: Node) -> Optional[str]:
    target = node.target
    if node.op == "call_function" and getattr(target, "__module__", None) == "fxtp.core.collectives":
        return getattr(target, "__name__", str(target))
    return None


def graph_text(gm: GraphModule, *, title: str) -> str:
    """The rank's code (``gm.code`` without FX's dead-value releases), every value annotated with
    its placement and global shape as a comment; the parameters and inputs one per line.

    Example (``mlp``, rank 0 of 2)::

        def forward(
            self,
            p_0_weight,  # S(0)  f32[256, 64]
            ...
        ):
            copy_to_tp = fxtp_collectives_copy_to_tp(input_1, '')  # R  f32[8, 64]
            linear = torch.ops.aten.linear.default(copy_to_tp, p_0_weight, p_0_bias)  # S(1)  f32[8, 256]
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    lines = [f"# {title}", f"# {PLACEMENT_LEGEND}", "def forward(", "    self,"]
    lines += [f"    {n.target},  # {_annotation(n)}".rstrip(" #") for n in placeholders]
    lines.append("):")
    code = gm.graph.python_code(root_module="self").src
    body = code[code.index("):\n") + 3 :]
    for line in body.rstrip().splitlines():
        if not line.strip():
            continue
        line = _RELEASE.sub("", line)
        match = _ASSIGN.match(line)
        node = nodes.get(match.group(1)) if match else None
        note = _annotation(node) if node is not None else ""
        lines.append(f"{line}  # {note}" if note else line)
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _op_label(node: Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.overloadpacket.__name__}"
    return getattr(target, "__name__", str(target))


def graph_dot(gm: GraphModule, *, title: str, blocks: Optional[dict[str, GraphModule]] = None) -> str:
    """Graphviz DOT of the rank's graph: one box per value (parameters and inputs as ellipses),
    filled by placement (white R, blue S, orange P), collectives as red octagons naming the
    Megatron operator; each block's body (``blocks``: FQN -> its graph, NOTE: [rank program by
    block] in passes/regions/blocks.py) a cluster named by its FQN. Render with ``dot -Tsvg``."""
    legend = (
        f"{title}\\nwhite: replicated (R)   blue: sharded (S)   orange: partial sums (P)   "
        "red: collectives (f: all_reduce in backward, g: all_reduce in forward)"
    )
    lines = [
        "digraph fxtp {",
        f'  graph [rankdir=TB, labelloc=t, fontname="Helvetica", label="{legend}"];',
        '  node [shape=box, style="rounded,filled", fillcolor=white, fontname="Helvetica", fontsize=10];',
        '  edge [color="#636363", arrowsize=0.6];',
    ]
    lines += _dot_nodes(gm, "", "  ")
    for index, (fqn, body) in enumerate((blocks or {}).items()):
        lines.append(f"  subgraph cluster_{index} {{")
        lines.append(f'    label={_quote("block " + fqn)}; style=rounded; color="#636363";')
        lines += _dot_nodes(body, fqn + "/", "    ")
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_nodes(gm: GraphModule, prefix: str, indent: str) -> list[str]:
    """The DOT lines of ``gm``'s values and edges, their ids prefixed with ``prefix``."""
    lines = []
    for node in gm.graph.nodes:
        placement = node.meta.get("fxtp_placement", "")
        shape = _describe_val(_val(node)) or ""
        collective = _collective(node)
        if collective is not None:
            label = f"{collective}\n{_COLLECTIVES.get(collective, '')}\n{shape}"
            attrs = f'shape=octagon, style="filled,bold", fillcolor="{_COLLECTIVE_FILL}"'
        elif node.op == "placeholder":
            label = f"{node.target}\n{placement}  {shape}"
            attrs = f'shape=ellipse, style=filled, fillcolor="{_FILL.get(placement[:1], "white")}"'
        elif node.op == "output":
            label, attrs = "output", "shape=plaintext, style=solid"
        else:
            label = f"{node.name}\n{_op_label(node)}\n{placement}  {shape}"
            attrs = f'fillcolor="{_FILL.get(placement[:1], "white")}"'
        lines.append(f"{indent}{_quote(prefix + node.name)} [label={_quote(label.strip())}, {attrs}];")
    for node in gm.graph.nodes:
        for inp in node.all_input_nodes:
            lines.append(f"{indent}{_quote(prefix + inp.name)} -> {_quote(prefix + node.name)};")
    return lines
