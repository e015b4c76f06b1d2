"""Normalize the captured graph once, before analysis.

Reads and writes the graph of a captured program in place (the program is fxtp's own copy, never
the user's model):

* ``_assert_tensor_metadata`` nodes (export's checks of ``.to()`` calls, which also pin the
  capture device) are removed.
* Device literals of factory ops (``arange(..., device=cpu)``) become the device of the first
  parameter (or input) at run time, so the emitted graph runs wherever the model lives.

    Matches:  arange = aten.arange.start(0, 16, device=device(type='cpu'), pin_memory=False)
    Rewrite:  device = getattr(p_tok_embeddings_weight, 'device')
              arange = aten.arange.start(0, 16, device=device, pin_memory=False)
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

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
        if node.op != "call_function" or not isinstance(node.kwargs.get("device"), torch.device) or anchor is None:
            continue
        if device_node is None:
            with graph.inserting_after(_last_placeholder(graph)):
                device_node = graph.call_function(getattr, (anchor, "device"))
        node.update_kwarg("device", device_node)
    graph.lint()
    return graph


def _device_anchor(graph: Graph) -> Node | None:
    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor) and node.users:
            return node
    return None


def _last_placeholder(graph: Graph) -> Node:
    return [n for n in graph.nodes if n.op == "placeholder"][-1]
