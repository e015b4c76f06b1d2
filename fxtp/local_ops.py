"""Per-rank ops the rewrite emits where a sharded layer cannot run the original op as is."""

from __future__ import annotations

import torch

__all__ = ["vocab_parallel_embedding"]


def vocab_parallel_embedding(
    weight: torch.Tensor, indices: torch.Tensor, start: int, padding_idx: int = -1, scale_grad_by_freq: bool = False
) -> torch.Tensor:
    """This rank's part of ``embedding(full_weight, indices)``: Megatron-LM's
    ``VocabParallelEmbedding`` (Shoeybi et al. 2019, section 3).

    Args:
        weight: the rank's rows ``[start, start + n)`` of the table, shape ``(n, dim)``.
        indices: global token ids, any shape, int64.
        start: the global id of ``weight``'s first row.
        padding_idx: the global padding id of the original embedding (``-1``: none); its row
            gets no gradient, as in ``F.embedding``.
        scale_grad_by_freq: as in ``F.embedding``: each row's gradient is divided by how often
            its id occurs in ``indices``. Ids outside this rank's rows are sent to an extra zero
            row (dropped from the gradient), so they do not count towards a real row's frequency.

    Returns:
        ``indices.shape + (dim,)``: the rows of ids in this rank's block, zeros elsewhere. The
        sum over ranks (an all_reduce) is the full lookup.
    """
    n = weight.shape[0]
    local = indices - start
    outside = (local < 0) | (local >= n)
    pad = padding_idx - start if 0 <= padding_idx - start < n else -1
    if scale_grad_by_freq:
        table = torch.cat([weight, weight.new_zeros(1, weight.shape[1])])
        return torch.ops.aten.embedding.default(table, local.masked_fill(outside, n), pad, True)
    out = torch.ops.aten.embedding.default(weight, local.masked_fill(outside, 0), pad)
    return out.masked_fill(outside.unsqueeze(-1), 0)
