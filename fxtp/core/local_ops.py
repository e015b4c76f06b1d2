"""Per-rank ops the rewrite emits where a sharded layer cannot run the original op as is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from fxtp.core.errors import FxtpInputError

__all__ = [
    "EMITTED_COLLECTIVES",
    "EmittedCollectives",
    "vocab_parallel_embedding",
    "grouped_query_attention",
    "grouped_query_attention_local_kv",
    "index_copy_kv_heads",
    "kv_head_range",
    "repeat_interleave",
]


@dataclass(frozen=True)
class EmittedCollectives:
    """The collectives an emitted op runs itself, for the report (``fxtp/explain/counts.py``).

    Attributes:
        kind: the collective (``"all_reduce"``).
        forward: how many one call runs.
        backward: how many its backward runs, when its first argument needs a gradient.
        payload: ``(forward bytes, backward bytes)`` in all, from the op's arguments in the
            graph (tensors as nodes whose ``meta["val"]`` has the global sizes).
    """

    kind: str
    forward: int
    backward: int
    payload: Callable[[tuple], tuple[int, int]]


# Emitted op -> the collectives it runs; the ops' modules register theirs.
EMITTED_COLLECTIVES: dict[Callable[..., Any], EmittedCollectives] = {}


def check_ids(ids: torch.Tensor, size: int, what: str, where: str, ignore_index: "int | None" = None) -> None:
    """Raise where the single device would: a sharded lookup only sees its own rows, so an id
    outside ``[0, size)`` would otherwise give zeros (a silently wrong answer) instead of the
    single device's ``IndexError``.

    Args:
        ids: int64 ids, any shape. size: the global number of rows (or classes).
        what: the lookup, for the message ("embedding", "cross_entropy"). where: its module FQN.
        ignore_index: an id that is allowed (cross_entropy's ``ignore_index``).

    Raises:
        FxtpInputError: on CPU, naming the first bad id, the module and the range. On other
            devices, and under ``torch.compile``, a device-side assert instead (what the single
            device's CUDA kernel does), so the check adds no host synchronization.
    """
    bad = (ids < 0) | (ids >= size)
    if ignore_index is not None:
        bad &= ids != ignore_index
    message = (f"fxtp: {what} at {where or 'the root module'} got an id outside [0, {size}) "
               f"(the single-device model raises IndexError here too). fix: keep the ids in [0, {size})")
    if ids.device.type != "cpu" or torch.compiler.is_compiling():
        # NOTE: ``torch._assert_async`` is private; this is its one call site. It is what keeps
        # the check free of a host sync (the single device's kernel asserts on the device too).
        torch._assert_async(bad.logical_not().all(), message)
    elif bool(bad.any()):
        raise FxtpInputError(f"{message}; first bad id: {int(ids[bad][0])}")


def vocab_parallel_embedding(
    weight: torch.Tensor,
    indices: torch.Tensor,
    start: int,
    vocab: int,
    where: str,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
) -> torch.Tensor:
    """This rank's part of ``embedding(full_weight, indices)``: Megatron-LM's
    ``VocabParallelEmbedding`` (Shoeybi et al. 2019, section 3).

    Args:
        weight: the rank's rows ``[start, start + n)`` of the table, shape ``(n, dim)``.
        indices: global token ids, any shape, int64.
        start: the global id of ``weight``'s first row.
        vocab: the global number of rows; an id outside ``[0, vocab)`` raises (:func:`check_ids`).
        where: the embedding's module FQN, for that error.
        padding_idx: the global padding id of the original embedding (``-1``: none); its row
            gets no gradient, as in ``F.embedding``.
        scale_grad_by_freq: as in ``F.embedding``: each row's gradient is divided by how often
            its id occurs in ``indices``. Ids outside this rank's rows are sent to an extra zero
            row (dropped from the gradient), so they do not count towards a real row's frequency.

    Returns:
        ``indices.shape + (dim,)``: the rows of ids in this rank's block, zeros elsewhere. The
        sum over ranks (an all_reduce) is the full lookup.
    """
    check_ids(indices, vocab, "embedding", where)
    n = weight.shape[0]
    local = indices - start
    outside = (local < 0) | (local >= n)
    pad = padding_idx - start if 0 <= padding_idx - start < n else -1
    if scale_grad_by_freq:
        table = torch.cat([weight, weight.new_zeros(1, weight.shape[1])])
        return torch.ops.aten.embedding.default(table, local.masked_fill(outside, n), pad, True)
    out = torch.ops.aten.embedding.default(weight, local.masked_fill(outside, 0), pad)
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
    key, value = kv_heads_of(q_start, group, query, key, value)
    return torch.ops.aten.scaled_dot_product_attention.default(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)


def kv_heads_of(
    q_start: int, group: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kv heads this rank's query heads attend with, one per query head: ``key`` and
    ``value`` ``(..., Hkv, S, E)`` become ``(..., hq, S, E)``, row ``j`` being kv head
    ``(q_start + j) // group`` (``repeat_interleave`` of the heads, restricted to this rank)."""
    heads = torch.arange(q_start, q_start + query.shape[-3], device=key.device) // group
    return key.index_select(-3, heads), value.index_select(-3, heads)


def kv_head_range(q_start: int, q_count: int, group: int) -> tuple[int, int]:
    """``(start, length)`` of the kv heads that query heads ``[q_start, q_start + q_count)``
    attend with, ``group`` query heads per kv head (NOTE: [kv heads kept by the ranks that need
    them] in ``passes/kv_heads.py``): at 8 query heads, 2 kv heads, world_size 4, rank 1's heads
    2, 3 give ``(0, 1)``; at 6 query heads, 3 kv heads, world_size 2, rank 0's heads 0..2 give
    ``(0, 2)``."""
    start = q_start // group
    return start, -(-(q_start + q_count) // group) - start


def index_copy_kv_heads(
    state: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, q_start: int, q_count: int, group: int,
    head_dim: int,
) -> torch.Tensor:
    """``state.index_copy_(dim, index, source)`` where ``state`` holds only this rank's kv heads.

    Args:
        state: ``(..., h, S, E)`` along ``head_dim``: kv heads :func:`kv_head_range` ``(q_start,
            q_count, group)`` of the global state (a static KV cache), written in place.
        dim, index: as in ``index_copy_`` (the positions; never ``head_dim``).
        source: ``(..., Hkv, T, E)``: every kv head (the k/v projection stays whole).
        q_start, q_count: this rank's first query head and number of query heads.
        group: query heads per kv head. head_dim: the heads dim of ``state`` and ``source``.

    Returns:
        ``state``, written.
    """
    start, length = kv_head_range(q_start, q_count, group)
    return state.index_copy_(dim, index, source.narrow(head_dim, start, length))


def grouped_query_attention_local_kv(
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
    """:func:`grouped_query_attention` with ``key`` and ``value`` holding only the kv heads this
    rank's query heads use, :func:`kv_head_range` (``(..., h, S, E)``, written by
    :func:`index_copy_kv_heads`): local kv head ``(q_start + j) // group - q_start // group``,
    which is ``(q_start % group + j) // group``."""
    return grouped_query_attention(q_start % group, group, query, key, value, attn_mask, dropout_p, is_causal, scale=scale)


def repeat_interleave(x: torch.Tensor, repeats: int, dim: int, output_size: "int | None" = None) -> torch.Tensor:
    """``x.repeat_interleave(repeats, dim)`` on this rank's shard of ``dim``.

    Args:
        x: this rank's block of the input.
        repeats, dim: as in ``torch.repeat_interleave`` (int repeats).
        output_size: the original call's global output size, a hint only; not passed on (the
            local output is ``x.shape[dim] * repeats``).
    """
    return torch.ops.aten.repeat_interleave.self_int(x, repeats, dim)
