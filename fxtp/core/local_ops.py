"""Per-rank ops the rewrite emits where a sharded layer cannot run the original op as is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from fxtp.core.errors import FxtpInputError
from fxtp.core.placement import kv_unit_range

__all__ = [
    "EMITTED_COLLECTIVES",
    "add_bias_share",
    "EmittedCollectives",
    "vocab_parallel_embedding",
    "attention",
    "grouped_query_attention",
    "grouped_query_attention_local_kv",
    "index_copy_kv_heads",
    "kv_head_range",
    "repeat_interleave",
    "repeat_kv_heads",
    "token_count",
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


# NOTE: [causal masks]
# A traced Hugging Face model hands its attentions a boolean mask even where the eager model
# calls ``is_causal=True`` without one (NOTE: [attention operands] in passes/normalize.py),
# and ATen converts that mask into an additive float mask per attention and saves it for
# backward: ``(B, 1, T, T)`` floats per layer, on every rank (4 B * T**2 per sequence: 64 MiB a
# layer at T = 4096). :func:`attention` checks the mask's values instead: when it is exactly
# ``tril(ones(L, S))`` (broadcast over the leading dims), the result of ``is_causal=True`` is the
# same softmax over the same keys, so it calls that and nothing mask-shaped is saved. The answer
# is kept on the mask tensor, so the layers that share one mask pay one comparison per forward
# (and one device-to-host read). Under ``torch.compile`` the mask is used as it is (the check
# would break the graph).


def _causal(mask: torch.Tensor, length: int, source: int) -> bool:
    """Whether the boolean ``mask`` is ``tril(ones(length, source))`` broadcast (NOTE: [causal masks])."""
    known = mask.__dict__.get("_fxtp_causal")
    if known is None:
        known = (mask.dim() >= 2 and tuple(mask.shape[-2:]) == (length, source) and mask.device.type != "meta"
                 and torch.equal(mask, torch.ones(length, source, dtype=torch.bool, device=mask.device).tril().expand(mask.shape)))
        mask.__dict__["_fxtp_causal"] = known
    return known


def attention(
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
    """``scaled_dot_product_attention``, run with ``is_causal=True`` and no mask when the boolean
    ``attn_mask`` is exactly the causal mask (NOTE: [causal masks]); arguments, shapes and result
    as in ``torch.nn.functional.scaled_dot_product_attention``."""
    if (attn_mask is not None and attn_mask.dtype == torch.bool and not is_causal and not attn_mask.requires_grad
            and not torch.compiler.is_compiling() and _causal(attn_mask, query.shape[-2], key.shape[-2])):
        attn_mask, is_causal = None, True
    return torch.ops.aten.scaled_dot_product_attention.default(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                                               enable_gqa=enable_gqa)


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
    return attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)


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
    attend with, ``group`` query heads per kv head (NOTE: [grouped shards] in
    ``fxtp/core/placement.py``, which defines it: :func:`~fxtp.core.placement.kv_unit_range`):
    at 8 query heads, 2 kv heads, world_size 4, rank 1's heads 2, 3 give ``(0, 1)``; at 6 query
    heads, 3 kv heads, world_size 2, rank 0's heads 0..2 give ``(0, 2)``."""
    return kv_unit_range(q_start, q_count, group)


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


def repeat_kv_heads(x: torch.Tensor, dim: int, q_start: int, q_count: int, group: int, merged: bool) -> torch.Tensor:
    """This rank's query heads' kv heads, from the kv heads it holds (NOTE: [repeated kv heads]
    in ``passes/rules/repeat.py``).

    Args:
        x: the kv heads :func:`kv_head_range` ``(q_start, q_count, group)`` along ``dim``:
            ``(..., h, group, ...)`` expanded (``merged``, Hugging Face's ``repeat_kv`` before its
            reshape) or ``(..., h, ...)`` (``repeat_interleave``).
        q_start, q_count: this rank's first query head and number of query heads.
        group: query heads per kv head.

    Returns:
        ``(..., q_count, ...)``, contiguous: row ``j`` is kv head ``(q_start + j) // group``.
    """
    repeated = x.flatten(dim, dim + 1) if merged else torch.ops.aten.repeat_interleave.self_int(x, group, dim)
    return repeated.narrow(dim, q_start % group, q_count).contiguous()


class _BiasShare(torch.autograd.Function):
    """NOTE: [bias share]: ``x + bias / world_size`` forward; backward, ``bias``'s gradient is
    the incoming gradient summed to its shape (not divided by ``world_size``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor, world_size: int) -> torch.Tensor:
        ctx.bias_shape, ctx.bias_dtype = bias.shape, bias.dtype
        # in x's dtype: under autocast the linear's output (and so the single device's sum with its
        # bias) is in the autocast dtype (NOTE: [autocast policy of replaced ops])
        return x + (bias / world_size).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, grad.sum_to_size(ctx.bias_shape).to(ctx.bias_dtype), None


def add_bias_share(x: torch.Tensor, bias: torch.Tensor, world_size: int) -> torch.Tensor:
    """A rowwise layer's partial output with its bias folded in as one of ``world_size`` equal
    summands, so that its all_reduce can move past more partial values (NOTE: [bias share] in
    ``passes/moe/reductions.py``).

    Args:
        x: this rank's partial output ``(..., out)``. bias: the whole bias ``(out,)``.
        world_size: the ranks whose summands the later all_reduce adds.

    Returns:
        ``x + bias / world_size``; the all_reduce of the ranks' results is ``sum_r x_r + bias``.
        Backward: ``x``'s gradient is the incoming one; ``bias``'s is the incoming one summed
        to the bias's shape, which is the single device's: the incoming gradient is whole on
        every rank (it comes back through the all_reduce's identity backward and ops linear in
        the value with replicated operands).
    """
    return _BiasShare.apply(x, bias, world_size)


def token_count(x: torch.Tensor, dim: int, world_size: int) -> int:
    """The global size of dim ``dim`` of ``x``, this rank's token shard: a size query
    (``sym_size``) of a token-sharded value reads it without gathering the value
    (NOTE: [size of a token shard] in ``passes/sequence.py``). The token blocks are equal (the
    gathers and ``fxtp.core.collectives._check_tokens`` require it), so the global size is the
    local one times ``world_size``; under dynamic shapes it stays a ``SymInt``."""
    return x.size(dim) * world_size
