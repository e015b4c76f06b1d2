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
* Attention operands (``attention_forms.py``, NOTE: [attention operands]): Hugging Face's traced
  ``repeat_kv`` becomes ``enable_gqa=True``, and a boolean mask several attentions read is
  converted to its additive float form once.

    Matches:  arange = aten.arange.start(0, 16, device=device(type='cpu'), pin_memory=False)
              to_3 = aten.to.device(b_rotary_emb_inv_freq, device(type='meta'), torch.float32)
    Rewrite:  device = getattr(p_tok_embeddings_weight, 'device')
              arange = aten.arange.start(0, 16, device=device, pin_memory=False)
              to_3 = aten.to.device(b_rotary_emb_inv_freq, device, torch.float32)

NOTE: [meta models]
A model built with its parameters on ``meta`` is captured with ``meta`` example inputs, so every
device the model code computes (``x.device``) is traced as the literal ``meta``; its weights
become real at load time (``ParallelModule.load_safetensors``/``load_full_state_dict``). Buffers
no checkpoint holds must be real when the model is built (see ``fxtp.runtime.checkpoint._check_meta``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Graph, Node

from passes.attention_forms import normalize_attention

__all__ = ["normalize"]

aten = torch.ops.aten


def normalize(graph: Graph) -> Graph:
    """Normalize ``graph`` in place (see the module docstring) and return it."""
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
    normalize_attention(graph)
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
