"""The static KV cache shaped as the model's attentions write it.

NOTE: [cache shapes from the writes]
transformers' export wrapper (``TorchExportableModuleWithStaticCache``) allocates its
``StaticCache`` ahead of time from the config (``configuration_utils.get_head_shapes``:
``num_key_value_heads``, else ``num_attention_heads``), since export cannot trace the cache's
lazy allocation. A config that names its kv heads otherwise gets a cache of the wrong heads and
the capture fails in the cache's ``index_copy_``: Falcon (``multi_query=True``: 1 kv head;
``num_kv_heads``; ``new_decoder_architecture=True`` broadcasts k and v to every query head
before the cache), GPT-BigCode's ``multi_query``. Hugging Face's own ``generate`` allocates on
the first ``update``, from the key and value it is given, so it never reads those attributes.

fxtp does the same: :func:`fit_cache_to_writes` runs the (meta-device) model once on one token
with a ``DynamicCache``, which keeps the key and value each attention writes, and re-allocates
every layer of the wrapper's cache whose heads or head dims differ from those. Nothing is
computed (meta tensors), and models whose config is right are left as they were. A model the
meta device cannot run to the end (a kernel with no meta implementation, such as MoE's
``grouped_mm`` in float32) keeps the config's shapes for the layers after the failing op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["written_kv_shapes", "fit_cache_to_writes"]

# (kv heads, key head_dim, value head_dim, dtype) of one layer's cache
_Shape = tuple[int, int, int, torch.dtype]


def written_kv_shapes(model: nn.Module, batch: int) -> dict[int, _Shape]:
    """``{layer index: (kv heads, key head_dim, value head_dim, dtype)}`` of the key and value
    each attention of ``model`` (a Hugging Face causal LM whose parameters are on ``meta``)
    writes to its cache, from one forward of ``batch`` tokens on ``meta``; the layers reached
    before an op the meta device cannot run (NOTE: [cache shapes from the writes])."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.zeros(batch, 1, dtype=torch.long, device="meta")
    try:
        with torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
    except (RuntimeError, NotImplementedError):
        pass  # no meta kernel for some op: the layers before it are recorded, the rest keep the config's shapes
    shapes: dict[int, _Shape] = {}
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if getattr(layer, "is_initialized", False) and isinstance(keys, torch.Tensor) and keys.dim() == 4:
            shapes[i] = (int(keys.shape[1]), int(keys.shape[-1]), int(values.shape[-1]), keys.dtype)
    return shapes


def fit_cache_to_writes(static_cache: Any, model: nn.Module, batch: int) -> list[int]:
    """Re-allocate (on ``meta``) the layers of ``static_cache`` (transformers' ``StaticCache``,
    early-initialized from the config) whose kv heads or head dims differ from what ``model``'s
    attentions write (:func:`written_kv_shapes`). Returns the indices of the layers changed."""
    changed = []
    for i, shape in written_kv_shapes(model, batch).items():
        if i >= len(static_cache.layers):
            break
        layer = static_cache.layers[i]
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.shape[2] == 0:
            continue  # not a static layer, or an empty one (a KV-sharing layer's)
        heads, key_dim, value_dim, dtype = shape
        if (keys.shape[1], keys.shape[-1], values.shape[-1], keys.dtype) == shape:
            continue
        layer.lazy_initialization(
            torch.zeros(batch, heads, 0, key_dim, dtype=dtype, device=keys.device),
            torch.zeros(batch, heads, 0, value_dim, dtype=dtype, device=keys.device),
        )
        changed.append(i)
    return changed
