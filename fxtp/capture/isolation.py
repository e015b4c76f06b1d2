"""What a capture is given is its own: example inputs that share no storage, and a copy of the
model that the capture may write to.

NOTE: [independent example inputs]
``torch.export`` makes two example inputs that are one tensor object one graph input
(pytorch/pytorch#144683, #139646): ``model(ids, labels=ids)``, the training idiom, compiles to a
graph that reads ``labels`` as ``input_ids`` on every later call, and a cross-attention block
compiled with ``(x, x)`` attends to its queries whatever memory it is given. Views of one
another and other tensors over one storage alias the same way. :func:`independent_inputs`
clones every example tensor that shares its storage with an earlier one, before any frontend
runs, so each input is a graph input of its own; a ``ShapesCollection`` keyed by the example
tensors follows its tensors to their clones.

NOTE: [capture on a copy]
Capturing runs the model's Python, and that Python may write to the model: Hugging Face's
longrope rotary sets ``self.long_inv_freq`` in ``forward`` (a ``FakeTensor`` while tracing),
its dynamic NTK rotary ``register_buffer``s a new ``inv_freq``, and a model may ``add_`` to a
buffer or keep a count. ``torch.fx.symbolic_trace`` runs such writes on real buffers and plain
tensor attributes, and non-strict ``torch.export`` on plain tensor attributes; a write left by
one attempt also breaks the next (export's static fallback, the next frontend). fxtp never
writes to the user's model, so every capture attempt runs on :func:`capture_copy`: each module
a new object with its own ``__dict__`` and containers, its buffers and plain tensor attributes
cloned (aliasing between them kept), its parameters the model's own (every frontend traces
them as proxies or fake tensors, never writes them: a copy would double the weights' memory).
Objects that are neither modules, tensors nor plain containers (a config, a cache object) are
shared.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.export import ShapesCollection

__all__ = ["independent_inputs", "capture_copy"]


def _storage(t: torch.Tensor) -> Optional[Any]:
    """The storage object of ``t`` (one Python object per storage), or ``None`` for a tensor
    without one (a sparse tensor, a subclass without storage)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(t.requires_grad)


def independent_inputs(args: tuple, kwargs: dict, shapes: Any = None) -> tuple[tuple, dict, Any]:
    """``args``/``kwargs`` with every tensor that shares storage with an earlier one (the same
    object, a view of it, another view of its storage) replaced by a clone (NOTE: [independent
    example inputs]); ``shapes``, a ``ShapesCollection``, then also holds each clone's entry.
    The inputs themselves are returned where nothing aliases.

    Returns:
        ``(args, kwargs, shapes)``.
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    seen: list[Any] = []
    ids: set[int] = set()
    clones: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # position -> (original, clone)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        storage = _storage(leaf)
        if id(leaf) in ids or (storage is not None and any(storage is s for s in seen)):
            clones[i] = (leaf, _clone(leaf))
            continue
        ids.add(id(leaf))
        if storage is not None:
            seen.append(storage)
    if not clones:
        return args, kwargs, shapes
    for i, (_, copied) in clones.items():
        leaves[i] = copied
    new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
    if isinstance(shapes, ShapesCollection):
        shapes = _follow(shapes, [(original, copied) for original, copied in clones.values()], [x for x in leaves if isinstance(x, torch.Tensor)])
    return tuple(new_args), dict(new_kwargs), shapes


def _follow(shapes: ShapesCollection, pairs: list[tuple[torch.Tensor, torch.Tensor]], tensors: list[torch.Tensor]) -> ShapesCollection:
    """A new ``ShapesCollection`` over ``tensors`` (the inputs after cloning) with each clone
    given its original's entry. torch offers no public way to ask whether a tensor has an
    entry (``__getitem__`` inserts an empty one), so its ``_shapes`` (``{id(tensor): shape}``)
    is read here, and only here."""
    entries: dict[int, Any] = shapes._shapes  # noqa: SLF001 - see the docstring
    out = ShapesCollection()
    for t in tensors:
        if id(t) in entries:
            out[t] = entries[id(t)]
    for original, copied in pairs:
        if id(original) in entries:
            out[copied] = entries[id(original)]
    return out


def capture_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` a capture may write to (NOTE: [capture on a copy]): modules and
    their containers new, buffers and plain tensor attributes cloned, parameters shared."""
    memo: dict[int, Any] = {id(p): p for _, p in model.named_parameters(remove_duplicate=False)}
    return _copy(model, memo)


def _copy(value: Any, memo: dict[int, Any]) -> Any:
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, nn.Parameter):
        return value
    if isinstance(value, torch.Tensor):
        result: Any = _clone(value)
    elif isinstance(value, nn.Module):
        result = copy.copy(value)
        memo[id(value)] = result  # before its attributes: a module may refer back to a parent
        result.__dict__ = {k: _copy(v, memo) for k, v in value.__dict__.items()}
        return result
    elif type(value) in (dict, OrderedDict):
        result = type(value)((k, _copy(v, memo)) for k, v in value.items())
    elif type(value) in (list, tuple):
        result = type(value)(_copy(v, memo) for v in value)
    elif type(value) is set:
        result = set(value)
    else:
        return value
    memo[id(value)] = result
    return result
