"""What fxtp knows about calling a Hugging Face model, applied before capture.

NOTE: [Hugging Face call defaults]
A Hugging Face model built from its config has ``config.use_cache=True``, so its ``forward``
returns a KV cache object (``DynamicCache``), which is not a tensor: no frontend can capture
it (torch.export fails on the output, after tracing the whole model). fxtp captures such a
model with ``use_cache=False`` (as ``fxtp inspect config.json`` does), and the
``ParallelModule`` passes ``use_cache=False`` itself on every call that does not give it, so
``pm(ids)`` runs as ``model(ids)`` does. The output keeps the model's structure with no cache
(``cache`` / ``past_key_values`` is ``None``); the report says so in one line, and a call with
``use_cache=True`` is an ``FxtpInputError`` that says why. Cached decoding is ``pm.generate``'s
(a static cache sharded by kv heads, NOTE: [generation] in fxtp/runtime/generation.py).

A model is a Hugging Face one when a class of its MRO comes from ``transformers``: fxtp reads
``type(model).__mro__`` and never imports transformers here.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

__all__ = ["call_defaults", "is_transformers_model", "spec_with_defaults"]


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model``'s class, or one it derives from, is defined in ``transformers``."""
    return any(cls.__module__.split(".", 1)[0] == "transformers" for cls in type(model).__mro__)


def call_defaults(model: nn.Module, kwargs: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Keyword inputs fxtp adds to a call of ``model`` that does not give them, and one report
    line per output they leave out (NOTE: [Hugging Face call defaults]).

    Returns:
        ``({"use_cache": False}, (line,))`` for a Hugging Face model whose ``config.use_cache``
        is true, whose ``forward`` takes ``use_cache`` and whose example inputs do not set it;
        else ``({}, ())``.
    """
    if "use_cache" in kwargs or not is_transformers_model(model):
        return {}, ()
    if not getattr(getattr(model, "config", None), "use_cache", False):
        return {}, ()
    try:
        takes = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}, ()
    if not takes:
        return {}, ()
    line = (
        "the KV cache (cache / past_key_values) is not returned (None): config.use_cache is True, and fxtp captured "
        "and calls the model with use_cache=False (a cache object is not a tensor output); pm.generate decodes with "
        "a sharded cache"
    )
    return {"use_cache": False}, (line,)


def spec_with_defaults(dynamic_shapes: Any, defaults: dict[str, Any]) -> Any:
    """A user's ``dynamic_shapes`` dict (keyed by argument name, which torch.export wants to be
    every argument) with ``None`` for the keywords fxtp added; any other spec unchanged."""
    if not isinstance(dynamic_shapes, dict) or not defaults:
        return dynamic_shapes
    return {**{k: None for k in defaults}, **dynamic_shapes}
