"""Each linear layer's alternative styles and their predicted collective and parameter bytes.

NOTE: [layer alternatives]
The passes choose a layer's style and keep no figures for the styles they did not choose, so
the report computes them here from the layer's shapes in the captured graph (its input's and
output's ``meta["val"]``, its weight and bias), in the report's own convention
(:class:`~fxtp.explain.counts.CollectiveStat`: the full tensors' payload bytes, per pass over the
example input; parameter bytes on rank 0, ``ceil`` of an uneven shard). For a linear layer
``y = x W^T (+ b)`` over ``t`` ranks (Megatron, Shoeybi et al. 2019, section 3):

- ``replicate``: no collective; the whole weight and bias on each rank.
- ``colwise (paired)``, its output staying sharded into a rowwise layer: forward none,
  backward an all_reduce of the input's gradient (when the input needs one); ``W`` and ``b``
  by rows.
- ``rowwise (paired)``, its input arriving sharded from a colwise layer: forward an
  all_reduce of the output, backward none; ``W`` by columns, the bias whole.
- ``colwise, gathered`` (alone): the pair's colwise figures plus a forward all_gather of the
  output (and, in backward, the slice of its gradient, no collective).
- ``rowwise, sliced`` (alone): the pair's rowwise figures plus the backward all_gather of the
  input's gradient (the forward slices the input locally).

Priced without sequence parallelism (under it an all_reduce becomes an all_gather and
reduce_scatter pair moving the same bytes). The chosen alternative is the one named by the
layer's style; a colwise layer is taken as gathered when it is the output head
(``LayerDecision.output_head``), else as one of a pair.
"""

from __future__ import annotations

import math
from typing import Any

from fxtp.explain.counts import fmt_bytes, nbytes_of

__all__ = ["layer_alternatives", "alternatives_text"]


def _bytes(val: Any) -> int:
    return nbytes_of(val) if val is not None else 0


def layer_alternatives(layer: Any, nodes: dict[str, Any], state: dict[str, Any], world_size: int,
                       needs_grad: set[str]) -> list[dict[str, Any]]:
    """The alternatives of one ``linear`` layer (NOTE: [layer alternatives]); ``[]`` for others.

    Args:
        layer: its ``LayerDecision``.
        nodes: the captured graph's nodes by name (``meta["val"]`` read).
        state: the captured program's state dict (parameter FQN -> tensor): the weight's dtype.
        world_size: the tensor-parallel degree ``t``.
        needs_grad: the names of the nodes whose value needs a gradient.

    Returns:
        Per alternative: ``style``, ``forward_bytes`` and ``backward_bytes`` (collective payload
        bytes, full tensors), ``param_bytes_per_rank`` (rank 0's), ``chosen``.
    """
    node = nodes.get(layer.node)
    if layer.op != "linear" or node is None or len(node.args) < 2 or world_size <= 1:
        return []
    x = node.args[0]
    x_bytes = _bytes(x.meta.get("val")) if hasattr(x, "meta") else 0
    grad_bytes = x_bytes if getattr(x, "name", None) in needs_grad else 0
    y_bytes = _bytes(node.meta.get("val"))
    weight = state.get(layer.weight)
    if weight is None or len(layer.weight_shape) != 2:
        return []
    bias_node = node.args[2] if len(node.args) > 2 else None
    bias = _bytes(bias_node.meta.get("val")) if hasattr(bias_node, "meta") else 0
    out_f, in_f = layer.weight_shape  # a split piece's own rows (NOTE: [fused slices])
    size = weight.element_size()
    rows = math.ceil(out_f / world_size) * in_f * size + (math.ceil(bias / size / world_size) * size if bias else 0)
    cols = out_f * math.ceil(in_f / world_size) * size + bias
    chosen = {"replicate": "replicate", "colwise": "colwise, gathered" if layer.output_head else "colwise (paired)",
              "rowwise": "rowwise (paired)"}.get(layer.style)
    table = [
        ("replicate", 0, 0, out_f * in_f * size + bias),
        ("colwise (paired)", 0, grad_bytes, rows),
        ("rowwise (paired)", y_bytes, 0, cols),
        ("colwise, gathered", y_bytes, grad_bytes, rows),
        ("rowwise, sliced", y_bytes, grad_bytes, cols),
    ]
    return [{"style": s, "forward_bytes": f, "backward_bytes": b, "param_bytes_per_rank": p, "chosen": s == chosen}
            for s, f, b, p in table]


def alternatives_text(layers: tuple[Any, ...], alternatives: dict[str, list[dict[str, Any]]]) -> str:
    """One line per layer with alternatives: each style's forward+backward collective bytes and
    parameter bytes per rank, the chosen one starred (``--verbose``)."""
    lines = ["alternatives per layer (style: collective bytes fwd+bwd, parameter bytes per rank; * chosen):"]
    for layer in layers:
        alts = alternatives.get(layer.name)
        if alts:
            parts = [f"{'*' if a['chosen'] else ''}{a['style']}: {fmt_bytes(a['forward_bytes'] + a['backward_bytes'])}, "
                     f"{fmt_bytes(a['param_bytes_per_rank'])}" for a in alts]
            lines.append(f"  {layer.name}: " + "; ".join(parts))
    return "\n".join(lines) if len(lines) > 1 else ""
