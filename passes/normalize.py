"""Normalize the captured graph once, before analysis.

Reads and writes the graph of a captured program in place (the program is fxtp's own copy, never
the user's model):

* ``_assert_tensor_metadata`` nodes (export's checks of ``.to()`` calls, which also pin the
  capture device) are removed.
* Device literals, in any argument position (factory ops' ``device=``, ``aten.to.device``'s
  positional device, ``_to_copy(..., device=)``), become the device of the first parameter (or
  input) at run time, so the emitted graph runs wherever the model lives: a model captured on
  ``meta`` (NOTE: [meta models]) or on the cpu runs on the device its weights are loaded to.
* ``histc`` of an integer tensor (what Hugging Face's grouped_mm experts trace on a non-CPU
  device: CPU's ``histc`` takes floating inputs only) counts a float32 copy instead, which gives
  the same counts for values below 2**24 (expert ids), on every device.

    Matches:  arange = aten.arange.start(0, 16, device=device(type='cpu'), pin_memory=False)
              to_3 = aten.to.device(b_rotary_emb_inv_freq, device(type='meta'), torch.float32)
    Rewrite:  device = getattr(p_tok_embeddings_weight, 'device')
              arange = aten.arange.start(0, 16, device=device, pin_memory=False)
              to_3 = aten.to.device(b_rotary_emb_inv_freq, device, torch.float32)

* An ``index`` of one dim by a constant of one integer (Falcon's ``fused_qkv[..., [-2], :]``)
  becomes the ``slice`` of that one element, which keeps the dim as ``index`` does: the same
  values and gradient, and a form the rules read (NOTE: [slices of segments])::

      lift_fresh_copy = aten.lift_fresh_copy.default(c_lifted_tensor_0)   # tensor([-2])
      index = aten.index.Tensor(view, [None, None, lift_fresh_copy])       # view: (B, T, 73, 64)
    becomes
      index = aten.slice.Tensor(view, 2, 71, 72)

* Attention operands (NOTE: [attention operands] below): a traced ``repeat_kv`` of key and value
  becomes ``enable_gqa=True``, and so does a key and value of one head that the query's heads
  broadcast over (multi-query attention as Falcon writes it: the same semantics);
  :func:`causal_attention` (run on the rank graph) lets an attention with a causal boolean mask
  run ``is_causal=True``.

NOTE: [meta models]
A model built with its parameters on ``meta`` is captured with ``meta`` example inputs, so every
device the model code computes (``x.device``) is traced as the literal ``meta``; its weights
become real at load time (``ParallelModule.load_safetensors``/``load_full_state_dict``). Buffers
no checkpoint holds must be real when the model is built (see ``fxtp.runtime.checkpoint._check_meta``).

NOTE: [attention operands]
Hugging Face's attention takes a different path under ``torch.export`` than eagerly
(``transformers.masking_utils._ignore_causal_mask_sdpa`` refuses to skip the mask while
exporting, and ``integrations.sdpa_attention.use_gqa_in_sdpa`` refuses ``enable_gqa`` with a
mask): the captured graph builds a boolean causal mask ``(B, 1, T, T)`` and copies every kv head
to each of its query heads (``repeat_kv``) for every layer, where the eager model calls
``scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)``. Both copies are
saved for backward, per layer: a rank would hold bytes the single device never allocates (on
a tiny Llama with sequence parallelism at world_size 2, 0.555 of the single device's where 1/2
is the goal). fxtp rewrites the operands, exactly:

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

* a key and a value of one head that SDPA broadcasts over the query's heads (Falcon's multi-query
  attention, ``k`` of shape ``(B, 1, T, E)``, no ``enable_gqa``) get ``enable_gqa=True``: query
  head ``h`` attends with kv head ``h // Hq = 0`` either way, and the rules then treat it as the
  grouped-query attention it is (NOTE: [grouped shards] in ``fxtp/core/placement.py``);
* a boolean mask: in the rank graph (:func:`causal_attention`, after the rewrite) each attention
  with a boolean mask and no dropout runs ``fxtp.core.local_ops.attention``, which calls
  ``is_causal=True`` without the mask when the mask is exactly the causal one (NOTE: [causal
  masks] there): ATen otherwise turns the mask into an additive float mask of its own per
  layer (``convert_boolean_attn_mask``) and saves it for backward, ``(B, 1, T, T)`` floats a
  layer. Whether a traced mask is causal for every size the graph accepts is not decidable
  from the graph (a sliding window is causal up to its width, a packed-sequence mask while the
  positions do not restart), so the check is made on the values, at run time.

Reads ``node.meta["val"]``; :func:`normalize` edits the captured graph (fxtp's copy),
:func:`causal_attention` the rank graph.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxtp.core import local_ops


__all__ = ["normalize", "causal_attention"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default


def normalize(graph: Graph, constants: Optional[Mapping[str, torch.Tensor]] = None) -> Graph:
    """Normalize ``graph`` in place (see the module docstring) and return it. ``constants``: the
    values of the program's constant tensors, by placeholder name."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default:
            graph.erase_node(node)
    anchor = _device_anchor(graph)
    device_node: Node | None = None
    for node in list(graph.nodes):
        if node.op != "call_function" or anchor is None or not _has_device(node):
            continue
        if device_node is None:
            with graph.inserting_after(_last_placeholder(graph)):
                device_node = graph.call_function(getattr, (anchor, "device"))
        node.args = tuple(device_node if isinstance(a, torch.device) else a for a in node.args)
        node.kwargs = {k: device_node if isinstance(v, torch.device) else v for k, v in node.kwargs.items()}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.histc.default:
            _count_as_float(graph, node)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.index.Tensor:
            _index_as_slice(graph, node, constants or {})
    for node in list(graph.nodes):  # NOTE: [attention operands]
        if node.op == "call_function" and node.target is _SDPA:
            _unrepeat_kv(graph, node)
            _broadcast_kv(node)
    graph.lint()
    return graph


def _count_as_float(graph: Graph, node: Node) -> None:
    x = node.args[0]
    val = x.meta.get("val") if isinstance(x, Node) else None
    if not isinstance(val, torch.Tensor) or val.is_floating_point():
        return
    with graph.inserting_before(node):
        as_float = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.float32})
    as_float.meta["val"] = val.to(torch.float32)
    as_float.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    node.args = (as_float, *node.args[1:])


def _has_device(node: Node) -> bool:
    values: list[Any] = [*node.args, *node.kwargs.values()]
    return any(isinstance(v, torch.device) for v in values)


def _device_anchor(graph: Graph) -> Node | None:
    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor) and node.users:
            return node
    return None


def _last_placeholder(graph: Graph) -> Node:
    return [n for n in graph.nodes if n.op == "placeholder"][-1]


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


def _constant_index(node: object, constants: Mapping[str, torch.Tensor]) -> Optional[int]:
    """The one integer of a constant 1-element index tensor (through ``lift_fresh_copy``/``detach_``)."""
    while isinstance(node, Node) and node.target in (aten.lift_fresh_copy.default, aten.detach_.default, aten.detach.default):
        node = node.args[0]
    value = constants.get(node.name) if isinstance(node, Node) and node.op == "placeholder" else None
    if value is None or value.is_meta or value.numel() != 1 or value.dim() != 1 or value.dtype not in (torch.int64, torch.int32):
        return None  # a meta constant has no value (NOTE: [index lists on meta] in fxtp/capture/index_lists.py)
    return int(value.item())


def _index_as_slice(graph: Graph, node: Node, constants: Mapping[str, torch.Tensor]) -> None:
    """``x[..., [i], ...]`` (one dim indexed by a constant of one integer) -> ``x[..., i:i + 1, ...]``."""
    x, indices = node.args[:2]
    src = _val(x)
    dims = [d for d, i in enumerate(indices) if i is not None]
    if src is None or len(dims) != 1:
        return
    (d,) = dims
    i, size = _constant_index(indices[d], constants), src.shape[d]
    if i is None or not isinstance(size, int) or not -size <= i < size:
        return
    if any(isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable for u in node.users):
        return  # a write into the copy must not reach x through a view
    i %= size
    with graph.inserting_before(node):
        piece = graph.call_function(aten.slice.Tensor, (x, d, i, i + 1))
    piece.meta = dict(node.meta)
    node.replace_all_uses_with(piece)
    graph.erase_node(node)
    lifted = indices[d]
    while isinstance(lifted, Node) and lifted.op == "call_function" and not lifted.users:  # detach_, lift_fresh_copy
        source = lifted.args[0]
        graph.erase_node(lifted)
        lifted = source


def _broadcast_kv(node: Node) -> None:
    """A key and value of one head broadcast over the query's heads: ``enable_gqa=True``."""
    q, k, v = (_val(a) for a in node.args[:3])
    if node.kwargs.get("enable_gqa", False) or q is None or k is None or v is None or min(q.dim(), k.dim(), v.dim()) < 3:
        return
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    same_batch = q.dim() == k.dim() == v.dim() and _same_shape(list(q.shape[:-3]), list(k.shape[:-3])) and _same_shape(
        list(k.shape[:-3]), list(v.shape[:-3]))
    if isinstance(hq, int) and hq > 1 and hk == hv == 1 and same_batch:
        node.kwargs = {**node.kwargs, "enable_gqa": True}


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
    for n in dead:  # the repeat chains (reshape, expand, slices, unsqueeze), where nothing else reads them
        while isinstance(n, Node) and not n.users and n.op == "call_function" and n not in (key[0], value[0]):
            source = n.args[0]
            graph.erase_node(n)
            n = source


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
