"""Normalize the operands of ``scaled_dot_product_attention``: what the single device's eager
attention does, not what its traced fallback materializes.

NOTE: [attention operands]
Hugging Face's attention takes a different path under ``torch.export`` than eagerly
(``transformers.masking_utils._ignore_causal_mask_sdpa`` refuses to skip the mask while
exporting, and ``integrations.sdpa_attention.use_gqa_in_sdpa`` refuses ``enable_gqa`` with a
mask): the captured graph builds a boolean causal mask ``(B, 1, T, T)`` and copies every kv head
to each of its query heads (``repeat_kv``) for every layer, where the eager model calls
``scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)``. Both copies are
saved for backward, per layer: a rank would hold bytes the single device never allocates (on
a tiny Llama with sequence parallelism at world_size 2, 0.555 of the single device's where 1/2
is the goal). This pass rewrites the captured graph's operands, exactly:

* ``repeat_kv``: a key and a value whose heads are each repeated ``g`` times in place (an
  ``unsqueeze`` after the heads dim, an ``expand`` of it to ``g``, a ``reshape`` merging the
  two, with no-op ``slice`` s on the way) are passed unrepeated with ``enable_gqa=True``, whose
  semantics are the same (query head ``h`` attends with kv head ``h // g``, torch's
  ``scaled_dot_product_attention`` docs). The rank then saves its own kv heads, not their
  copies (NOTE: [enable_gqa] in ``passes/rules/attention.py`` pairs them with its query heads)::

      unsqueeze = aten.unsqueeze.default(k, 2)
      expand = aten.expand.default(unsqueeze, [B, 4, 2, T, 16])
      reshape = aten.reshape.default(expand, [B, 8, T, 16])
      sdpa = aten.scaled_dot_product_attention.default(q, reshape, reshape_1, mask, scale=0.25)
    becomes
      sdpa = aten.scaled_dot_product_attention.default(q, k, v, mask, scale=0.25, enable_gqa=True)

* a boolean mask: in the rank graph (:func:`causal_attention`, after the rewrite) each attention
  with a boolean mask and no dropout runs ``fxtp.core.local_ops.attention``, which calls
  ``is_causal=True`` without the mask when the mask is exactly the causal one (NOTE: [causal
  masks] there): ATen otherwise turns the mask into an additive float mask of its own per
  layer (``convert_boolean_attn_mask``) and saves it for backward, ``(B, 1, T, T)`` floats a
  layer. Whether a traced mask is causal for every size the graph accepts is not decidable
  from the graph (a sliding window is causal up to its width, a packed-sequence mask while the
  positions do not restart), so the check is made on the values, at run time.

Reads ``node.meta["val"]``; :func:`normalize_attention` edits the captured graph (fxtp's copy),
:func:`causal_attention` the rank graph.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxtp.core import local_ops

__all__ = ["normalize_attention", "causal_attention"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default


def normalize_attention(graph: Graph) -> None:
    """Rewrite ``graph``'s attentions in place (NOTE: [attention operands])."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _SDPA:
            _unrepeat_kv(graph, node)


def _val(node: object) -> Optional[torch.Tensor]:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _same(a: object, b: object) -> bool:
    return statically_known_true(a == b)


def _same_shape(a: torch.Size | list, b: torch.Size | list) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _repeated(node: object) -> Optional[tuple[Node, int]]:
    """``(source, g)`` when ``node`` is ``source`` ``(..., H, S, E)`` with each head repeated
    ``g`` times in place (``repeat_kv``'s unsqueeze, expand, reshape); else ``None``."""
    if not isinstance(node, Node) or node.target not in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        return None
    expand = node.args[0]
    if not isinstance(expand, Node) or expand.target is not aten.expand.default:
        return None
    x, inner = expand.args[0], None
    while isinstance(x, Node) and (x.target is aten.slice.Tensor and _noop_slice(x)
                                   or x.target is aten.unsqueeze.default and inner is None):
        inner = x if x.target is aten.unsqueeze.default else inner
        x = x.args[0]
    source, out, wide = _val(x), _val(node), _val(expand)
    if inner is None or source is None or out is None or wide is None or source.dim() < 3:
        return None
    nd = source.dim()
    if inner.args[1] % (nd + 1) != nd - 2:  # the new dim sits right after the heads
        return None
    g = wide.shape[nd - 2]
    if not isinstance(g, int) or g < 2:
        return None
    expected = [*source.shape[: nd - 3], source.shape[nd - 3] * g, *source.shape[nd - 2:]]
    if not _same_shape(list(wide.shape), [*source.shape[: nd - 2], g, *source.shape[nd - 2:]]):
        return None
    return (x, g) if _same_shape(list(out.shape), expected) else None


def _noop_slice(node: Node) -> bool:
    val, src = _val(node), _val(node.args[0])
    return val is not None and src is not None and _same_shape(list(val.shape), list(src.shape)) and (
        len(node.args) < 5 or node.args[4] == 1)


def _unrepeat_kv(graph: Graph, node: Node) -> None:
    if node.kwargs.get("enable_gqa", False):
        return
    q, k, v = node.args[:3]
    key, value = _repeated(k), _repeated(v)
    if key is None or value is None or key[1] != value[1]:
        return
    dead = [k, v]
    node.args = (q, key[0], value[0], *node.args[3:])
    node.kwargs = {**node.kwargs, "enable_gqa": True}
    for n in dead:  # the repeat chains, where nothing else reads them
        while isinstance(n, Node) and not n.users and n.op == "call_function":
            inputs = n.all_input_nodes
            graph.erase_node(n)
            n = inputs[0] if len(inputs) == 1 else None


def causal_attention(graph: Graph) -> None:
    """Run each attention of the rank graph ``graph`` that has a boolean mask and no dropout as
    ``fxtp.core.local_ops.attention`` (NOTE: [attention operands], [causal masks]); in place."""
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        if _val(mask) is not None and _val(mask).dtype == torch.bool and dropout == 0:
            node.target = local_ops.attention
