"""Random numbers across tensor-parallel ranks: dropout and every other random op.

NOTE: [dropout across ranks]
fxtp's rule: every rank of a tensor-parallel group draws the *same* random numbers, in the same
order, as the single-device model would.

* Generators: ``fxtp.compile`` copies the tensor-parallel rank 0's default CPU generator (and the
  current CUDA device's, when CUDA is initialized) to the other ranks of the group
  (:func:`sync_generators`; a broadcast, only when a graph draws random numbers). From then on
  the ranks stay in step as long as they make the same random calls, which the same program
  does. A replicated value therefore gets the identical mask on every rank, with no manual seeding.
  A program that reseeds each rank differently after compile (``torch.manual_seed(seed + rank)``,
  common in data-parallel scripts) would silently give each rank another mask of a replicated
  value: before every call of a graph that draws random numbers, the runtime checks that the
  group's generators agree (:func:`generators_in_step`, one all_reduce of 2 int64, named in the
  report's summary) and raises
  ``FxtpRuntimeError`` where they do not.
* Replicated values: the graph's own random ops, unchanged.
* Sharded values (:func:`sharded_call`): an elementwise random op (dropout in all its forms,
  ``bernoulli``, ``rand_like``, ...; :data:`ELEMENTWISE`) runs on the *full* value, this rank's
  shard in its place and zeros elsewhere, and keeps this rank's slice (``local_ranges``): one
  global mask, each rank its slice. It consumes exactly what the single-device op consumes, so
  the generators stay in step (also under uneven shards) and, with the same seed, the outputs
  equal the single-device model's in train mode (bitwise on CPU).
* ``scaled_dot_product_attention`` with ``dropout_p > 0`` on sharded heads
  (:func:`sharded_attention`): the single-device CPU kernel is the math form (scale, ``q @ k^T``,
  mask, softmax, ``dropout`` of the ``(B, H, L, S)`` weights, ``@ v``); the rank runs that form on
  its heads with its slice of the full ``(B, H, L, S)`` mask, drawn as the single device draws
  it, so CPU results equal the single device's. CUDA's fused kernels draw their masks
  differently (Philox inside the kernel): there the masks are one global mask from the shared
  generator, consistent across ranks, but not the single device's bits.

The cost is the full mask (its size, transiently, on every rank); Megatron-LM's alternative,
per-rank streams, draws only the local mask but cannot match the single-device model. The
report's ``dropout-on-shard`` note names every such op; a random op on a sharded value that
none of this covers gets a ``random-per-rank`` note instead (independent draws per rank).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from fxtp.core import local_ops
from fxtp.core.autocast import ELIGIBLE
from fxtp.core.placement import Shard, local_ranges

__all__ = [
    "ELEMENTWISE", "draws_random", "generators_in_step", "is_random", "sharded_attention", "sharded_call", "sharded_random",
    "sync_generators", "token_random",
]

_aten = torch.ops.aten


def generators_in_step(group: "dist.ProcessGroup", device: torch.device) -> bool:
    """Whether every rank of ``group`` holds the same default generator state for ``device``
    (CPU's, or the current CUDA device's): a 56-bit digest of it, its max and min over ranks
    (one all_reduce of 16 bytes, with torch.distributed's own call: not a graph collective, so
    the report's counts of the graph's collectives stay what the graph runs)."""
    state = torch.cuda.get_rng_state() if device.type == "cuda" else torch.get_rng_state()
    digest = int.from_bytes(hashlib.blake2b(state.numpy().tobytes(), digest_size=7).digest(), "little")
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return int(both[0]) == -int(both[1])


def sync_generators(group: "dist.ProcessGroup") -> None:
    """Set every rank's default generator(s) to those of rank 0 of ``group`` (a collective).

    The CPU generator always; the current CUDA device's too when CUDA is initialized.
    """
    states: list[Optional[torch.Tensor]] = [torch.get_rng_state(), None]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states[1] = torch.cuda.get_rng_state()
    dist.broadcast_object_list(states, group=group, group_src=0)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])


# Random ops that draw one number per element of their first argument's shape, whatever its
# values: run on the full value, they draw exactly what the single device draws.
ELEMENTWISE = frozenset(
    {
        _aten.dropout.default,
        _aten.native_dropout.default,
        _aten.feature_dropout.default,
        _aten.alpha_dropout.default,
        _aten.feature_alpha_dropout.default,
        _aten.bernoulli.default,
        _aten.bernoulli.p,
        _aten.rand_like.default,
        _aten.randn_like.default,
        _aten.randint_like.default,
        _aten.randint_like.low_dtype,
    }
)
_TRAIN_FLAG = (_aten.dropout.default, _aten.native_dropout.default, _aten.feature_dropout.default,
               _aten.alpha_dropout.default, _aten.feature_alpha_dropout.default)


def is_random(target: Any, args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Whether a call draws random numbers (a dropout in eval mode, or an attention without
    dropout, does not)."""
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    if target in _TRAIN_FLAG:  # (input, p, train); ATen's dropouts return the input at p == 0, native_dropout draws
        return args[2] is not False and (args[1] != 0 or target is _aten.native_dropout.default)
    if target is _aten.scaled_dot_product_attention.default:
        return _dropout_p(args, kwargs) != 0
    return True


def draws_random(graph: torch.fx.Graph) -> bool:
    """Whether ``graph`` draws random numbers (:func:`is_random` on any node)."""
    return any(n.op == "call_function" and is_random(n.target, n.args, n.kwargs) for n in graph.nodes)


def sharded_call(
    target: Any, args: tuple, kwargs: Mapping[str, Any], shard: Shard, rank: int, world_size: int, tokens: bool = False
) -> Optional[tuple[Callable[..., Any], tuple, dict[str, Any]]]:
    """The call that replaces a random op whose output is sharded as ``shard``: ``(fn, args,
    kwargs)``, or ``None`` when the op draws nothing or is not covered (NOTE: [dropout across ranks]).
    ``target`` may also be a rule's local op that wraps a random op
    (``local_ops.grouped_query_attention``, the GQA attention with whole k/v, and its form on the
    rank's own kv heads, ``grouped_query_attention_local_kv``). ``tokens``: the
    shard is sequence parallelism's token shard, whose size is read at run time
    (:func:`token_random`; NOTE: [sequence parallelism] in passes/sequence.py)."""
    if tokens and target in ELEMENTWISE and is_random(target, args, kwargs):
        return token_random, (target, shard.dim, rank, world_size, *args), dict(kwargs)
    where = (shard.dim, tuple(shard.segments), rank, world_size)
    if target in (local_ops.grouped_query_attention, local_ops.grouped_query_attention_local_kv):
        if _dropout_p(args[2:], kwargs) == 0:
            return None
        if target is local_ops.grouped_query_attention_local_kv:  # its own kv heads: NOTE: [grouped shards]
            args = (args[0] % args[1], *args[1:])
        return sharded_grouped_attention, (*where, *args), dict(kwargs)
    if not is_random(target, args, kwargs):
        return None
    # The masks below are drawn for the segments in units of 1: an uneven shard in another unit
    # has other ranges (NOTE: [uneven shards]); its planner rules keep it away from random ops.
    assert shard.unit == 1 or shard.divisible(world_size), f"fxtp internal error: random op on the uneven shard {shard}"
    if target in ELEMENTWISE:
        return sharded_random, (target, *where, *args), dict(kwargs)
    if target is _aten.scaled_dot_product_attention.default:
        return sharded_attention, (*where, *args), dict(kwargs)
    return None


def _full(x: torch.Tensor, shard: Shard, rank: int, world_size: int) -> torch.Tensor:
    """The full value with this rank's shard ``x`` in its place and zeros elsewhere (differentiable)."""
    pieces, pos, offset = [], 0, 0
    for start, length in local_ranges(shard, rank, world_size):
        if start > pos:
            pieces.append(x.new_zeros(_with(x.shape, shard.dim, start - pos)))
        pieces.append(x.narrow(shard.dim, offset, length))
        pos, offset = start + length, offset + length
    if pos < shard.size:
        pieces.append(x.new_zeros(_with(x.shape, shard.dim, shard.size - pos)))
    return torch.cat(pieces, shard.dim) if len(pieces) > 1 else pieces[0]


def _local(full: torch.Tensor, shard: Shard, rank: int, world_size: int) -> torch.Tensor:
    """This rank's slice of a full value."""
    pieces = [full.narrow(shard.dim, start, length) for start, length in local_ranges(shard, rank, world_size)]
    return torch.cat(pieces, shard.dim) if len(pieces) > 1 else pieces[0]


def _with(shape: torch.Size, dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def sharded_random(
    op: Any, dim: int, segments: tuple[int, ...], rank: int, world_size: int, x: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    """``op(full, *args, **kwargs)`` restricted to this rank's shard ``x`` of ``full`` (sharded
    on ``dim`` in ``segments``): the same shape and dtype as ``op(x, ...)``, and for a tuple
    result (``native_dropout``) each element's slice."""
    shard = Shard(dim, tuple(segments))
    out = op(_full(x, shard, rank, world_size), *args, **kwargs)
    if isinstance(out, tuple):
        return tuple(_local(o, shard, rank, world_size) for o in out)
    return _local(out, shard, rank, world_size)


def token_random(op: Any, dim: int, rank: int, world_size: int, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """:func:`sharded_random` on a token shard: ``x`` is block ``rank`` of ``world_size`` equal
    blocks along ``dim``, the full size read from ``x`` at run time, so the token count may
    change between calls (dynamic shapes)."""
    return sharded_random(op, dim, (x.shape[dim] * world_size,), rank, world_size, x, *args, **kwargs)


def _dropout_p(args: tuple, kwargs: Mapping[str, Any]) -> float:
    return args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)


def sharded_attention(
    dim: int,
    segments: tuple[int, ...],
    rank: int,
    world_size: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` in train mode on this rank's heads (``query`` etc.
    sharded on ``dim``, a dim before the last two), dropping out with this rank's slice of the
    full ``(..., L, S)`` mask. Follows ATen's ``_scaled_dot_product_attention_math`` (the
    single-device CPU path) step by step, under autocast too (its cast of the inputs, then the
    math form in float32), so on CPU the result and its gradients are the single device's, bitwise.

    Shapes: ``query`` (..., H_local, L, E), ``key``/``value`` (..., H_kv_local, S, E); returns
    (..., H_local, L, E_v).
    """
    device = query.device.type
    if torch.is_autocast_enabled(device):  # SDPA's autocast policy is lower_precision_fp (autocast_mode.cpp)
        low = torch.get_autocast_dtype(device)
        query, key, value = (t.to(low) if t.dtype in ELIGIBLE else t for t in (query, key, value))
        if attn_mask is not None and attn_mask.dtype in ELIGIBLE:
            attn_mask = attn_mask.to(low)
    with torch.autocast(device, enabled=False):  # the math form runs below autocast, as ATen's does
        return _math_attention(dim, segments, rank, world_size, query, key, value, attn_mask, dropout_p, is_causal,
                               scale, enable_gqa)


def _math_attention(
    dim: int, segments: tuple[int, ...], rank: int, world_size: int, query: torch.Tensor, key: torch.Tensor,
    value: torch.Tensor, attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool, scale: Optional[float],
    enable_gqa: bool,
) -> torch.Tensor:
    """:func:`sharded_attention`'s body, with autocast off: ATen's math form keeps half and bfloat16
    query, key and value in float32 "for accuracy" (mask, softmax and dropout in float32) and casts
    the result back; a form run in bfloat16 rounds otherwise, which a ReLU after it can turn into
    a gradient off by a whole token's contribution (the fuzz regression sp-autocast-dropout-strided)."""
    origin = query.dtype
    if origin in (torch.float16, torch.bfloat16):
        query, key, value = query.float(), key.float(), value.float()
    length, source = query.size(-2), key.size(-2)
    factor = math.sqrt(abs(scale)) if scale is not None else math.sqrt(1.0 / math.sqrt(query.size(-1)))
    query = query * (-factor if scale is not None and scale < 0 else factor)
    if is_causal:
        attn_mask = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask.logical_not(), float("-inf"), torch.zeros((), dtype=query.dtype, device=query.device))
    if enable_gqa:
        groups = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    attn = torch.matmul(query, key.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn = attn + attn_mask
    attn = _safe_softmax(attn)
    if dropout_p >= 1:
        attn = attn * torch.zeros((), dtype=attn.dtype, device=attn.device)
    elif dropout_p > 0:
        shard = Shard(dim, tuple(segments))
        full_shape = _with(attn.shape, dim, shard.size)
        noise = torch.empty(full_shape, dtype=attn.dtype, device=attn.device).bernoulli_(1 - dropout_p)
        attn = attn * _local(noise, shard, rank, world_size).div_(1 - dropout_p)
    return torch.matmul(attn, value).to(origin)


def sharded_grouped_attention(
    dim: int, segments: tuple[int, ...], rank: int, world_size: int, q_start: int, group: int,
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """``local_ops.grouped_query_attention`` in train mode: this rank's query heads attend with
    the kv heads they use (NOTE: [enable_gqa] in ``passes/rules/attention.py``), dropping out with
    this rank's slice of the full mask as :func:`sharded_attention` does.

    Shapes: ``query`` (..., H_local, L, E); ``key``/``value`` (..., H_kv, S, E), every kv head;
    returns (..., H_local, L, E_v).
    """
    key, value = local_ops.kv_heads_of(q_start, group, query, key, value)
    kwargs = {k: v for k, v in kwargs.items() if k != "enable_gqa"}
    return sharded_attention(dim, segments, rank, world_size, query, key, value, *args, **kwargs)


def _safe_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim that gives 0, not NaN, for a row masked entirely; what the
    math attention uses. NOTE: ``aten._safe_softmax`` is private; this is its one call site."""
    return torch.ops.aten._safe_softmax.default(x, -1)
