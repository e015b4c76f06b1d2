"""Per-rank ops the rewrite emits where a sharded layer cannot run the original op as is."""

from __future__ import annotations

import torch

__all__ = ["vocab_parallel_embedding", "grouped_query_attention", "repeat_interleave"]


def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, start: int, padding_idx: int = -1) -> torch.Tensor:
    """This rank's part of ``embedding(full_weight, indices)``: Megatron-LM's
    ``VocabParallelEmbedding`` (Shoeybi et al. 2019, section 3).

    Args:
        weight: the rank's rows ``[start, start + n)`` of the table, shape ``(n, dim)``.
        indices: global token ids, any shape, int64.
        start: the global id of ``weight``'s first row.
        padding_idx: the global padding id of the original embedding (``-1``: none); its row
            gets no gradient, as in ``F.embedding``.

    Returns:
        ``indices.shape + (dim,)``: the rows of ids in this rank's block, zeros elsewhere. The
        sum over ranks (an all_reduce) is the full lookup.
    """
    n = weight.shape[0]
    local = indices - start
    outside = (local < 0) | (local >= n)
    local = local.masked_fill(outside, 0)
    pad = padding_idx - start if 0 <= padding_idx - start < n else -1
    out = torch.ops.aten.embedding.default(weight, local, pad)
    return out.masked_fill(outside.unsqueeze(-1), 0)


def grouped_query_attention(
    q_start: int,
    group: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: "torch.Tensor | None" = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: "float | None" = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """This rank's query heads of ``scaled_dot_product_attention(..., enable_gqa=True)`` with
    ``key`` and ``value`` whole (NOTE: [enable_gqa] in ``passes/rules/attention.py``).

    Args:
        q_start: the global index of this rank's first query head.
        group: query heads per kv head (``Hq // Hkv``).
        query: ``(..., hq, L, E)``: this rank's ``hq`` query heads.
        key, value: ``(..., Hkv, S, E)`` and ``(..., Hkv, S, Ev)``: every kv head.
        attn_mask, dropout_p, is_causal, scale: as in ``scaled_dot_product_attention``.
        enable_gqa: accepted for the original call's keywords; the heads are matched here.

    Returns:
        ``(..., hq, L, Ev)``: query head ``q_start + j`` attends with kv head
        ``(q_start + j) // group``, as on one device.
    """
    heads = torch.arange(q_start, q_start + query.shape[-3], device=key.device) // group
    key, value = key.index_select(-3, heads), value.index_select(-3, heads)
    return torch.ops.aten.scaled_dot_product_attention.default(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)


def repeat_interleave(x: torch.Tensor, repeats: int, dim: int, output_size: "int | None" = None) -> torch.Tensor:
    """``x.repeat_interleave(repeats, dim)`` on this rank's shard of ``dim``.

    Args:
        x: this rank's block of the input.
        repeats, dim: as in ``torch.repeat_interleave`` (int repeats).
        output_size: the original call's global output size, a hint only; not passed on (the
            local output is ``x.shape[dim] * repeats``).
    """
    return torch.ops.aten.repeat_interleave.self_int(x, repeats, dim)
