"""Norms and means over a sharded dim: per-rank statistics summed over the ranks.

NOTE: [distributed norm]
A norm over a dim that a colwise layer shards (OLMo-2's RMSNorm of q and k over all heads,
before the head view; a LayerNorm after a colwise projection) needs statistics of the whole
dim, but each of them is a sum over it: ``sum(x**2)`` for an RMSNorm, ``sum(x)`` and
``sum(x**2)`` for a LayerNorm. Each rank sums its own features, one all_reduce of the partial
sums gives the whole dim's statistics, of shape ``(..., 1)`` (``(B, T, 1)``; ``(B, T, 2)`` for a
LayerNorm: one collective, the two sums stacked), and each rank normalizes its own features
with them and with its slice of the per-feature weight and bias. The projection stays
colwise; the all_reduce moves ``1 / hidden`` of the bytes a gather of the projection's output
would (vLLM's OLMo-2 all_gathers q and k for this norm).

Backward: every rank uses the summed statistics on its own features only, so the gradient of
the statistics is a partial sum too: the all_reduce's backward is an all_reduce
(:func:`fxtp.core.collectives.sum_statistics`), one more of the same ``(..., 1)`` size. The
weight's and bias's gradients are this rank's slices, with no communication.

The statistics are computed in fp32 (``torch``'s ``rms_norm`` and ``layer_norm`` upcast bf16 and
fp16 too). The LayerNorm's variance is ``E[x**2] - E[x]**2`` (one collective instead of two),
which loses precision when the mean is large against the spread; post-projection features are
centred, and the tests hold it to fp32 tolerance against ``torch.nn.functional.layer_norm``.

A norm the model writes out (``x.pow(2).mean(-1, keepdim=True)``, Hugging Face's RMSNorms) needs
no op of its own: a mean over the sharded dim is a ``Partial`` value, :func:`mean_of_shard` on
each rank, all_reduced like a rowwise layer's output; the replicated result enters the sharded
features' ops through ``f``, whose backward is that same all_reduce of the gradient.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint

from fxtp.core.autocast import fp32_policy_dtype
from fxtp.core.collectives import sum_statistics
from fxtp.core.local_ops import EMITTED_COLLECTIVES, EmittedCollectives

__all__ = ["mean_of_shard", "distributed_rms_norm", "distributed_layer_norm"]


def mean_of_shard(
    x: torch.Tensor, dim: Sequence[int], keepdim: bool = False, count: int = 1, *, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """This rank's summand of ``x.mean(dim, keepdim)`` where ``x`` is sharded on one of ``dim``:
    the sum of its own elements divided by ``count``, the global number of elements averaged
    (the sum over the ranks is the mean). Shapes and ``dtype`` as in ``torch.mean``."""
    return torch.sum(x, list(dim), keepdim, dtype=dtype) / count


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its computation dtype: fp32 for bf16, fp16 and fp32, fp64 for fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _statistics(x: torch.Tensor, ndims: int, features: int, group_name: str, *, centred: bool) -> tuple[torch.Tensor, ...]:
    """``(mean, E[x**2])`` (``centred``) or ``(E[x**2],)`` over the last ``ndims`` dims of
    the whole tensor, from this rank's shard ``x``, each ``x.shape[:-ndims] + (1,) * ndims``."""
    dims = list(range(x.dim() - ndims, x.dim()))
    x = _upcast(x)
    sums = [x.square().sum(dims, keepdim=True)]
    if centred:
        sums.insert(0, x.sum(dims, keepdim=True))
    total = sum_statistics(torch.cat(sums, dim=-1) if centred else sums[0], group_name) / features
    return tuple(total.split(1, dim=-1)) if centred else (total,)


def distributed_rms_norm(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[torch.Tensor],
    eps: Optional[float],
    features: int,
    group_name: str,
) -> torch.Tensor:
    """This rank's features of ``rms_norm(full_x, full_normalized_shape, full_weight, eps)``
    (NOTE: [distributed norm]).

    Args:
        x: this rank's shard, sharded on one of the last ``len(normalized_shape)`` dims, any
            float dtype.
        normalized_shape: the local sizes of those dims. weight: their local slice, or ``None``.
        eps: as in ``torch.nn.functional.rms_norm``; ``None`` is fp32's epsilon (its default
            for fp32, bf16 and fp16 inputs, which it computes in fp32).
        features: the global number of normalized elements per row (``hidden``).
        group_name: the tensor-parallel process group.

    Returns:
        ``x``'s shape and dtype. One all_reduce of fp32 ``x.shape[:-n] + (1,) * n`` forward, one
        backward.
    """
    (mean_square,) = _statistics(x, len(normalized_shape), features, group_name, centred=False)
    eps_val = torch.finfo(torch.float32).eps if eps is None else eps
    out = _upcast(x) * torch.rsqrt(mean_square + eps_val)
    if weight is not None:
        out = out * weight
    return out.type_as(x)


def distributed_layer_norm(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    features: int,
    group_name: str,
) -> torch.Tensor:
    """This rank's features of ``layer_norm(full_x, full_normalized_shape, full_weight,
    full_bias, eps)`` (NOTE: [distributed norm]); arguments as :func:`distributed_rms_norm`,
    ``bias`` being the local slice of the bias or ``None``.

    Returns:
        ``x``'s shape and dtype (fp32 under a CUDA, XPU or MPS autocast, as ``layer_norm``:
        NOTE: [autocast policy of replaced ops] in fxtp/core/autocast.py). One all_reduce of
        fp32 ``x.shape[:-n] + (1,) * (n - 1) + (2,)``
        (the sum and the sum of squares) forward, one backward.
    """
    mean, mean_square = _statistics(x, len(normalized_shape), features, group_name, centred=True)
    var = (mean_square - mean.square()).clamp_min(0)
    out = (_upcast(x) - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.to(fp32_policy_dtype("layer_norm", x, x.dtype))  # NOTE: [autocast policy of replaced ops]


def _norm_payload(stats: int) -> Any:
    def payload(args: tuple) -> tuple[int, int]:
        shape = tuple(args[0].meta["val"].shape)
        rows = math.prod(optimization_hint(s) for s in shape[: len(shape) - len(args[1])])
        return 4 * rows * stats, 4 * rows * stats  # fp32 statistics, forward and backward

    return payload


EMITTED_COLLECTIVES[distributed_rms_norm] = EmittedCollectives("all_reduce", 1, 1, _norm_payload(1))
EMITTED_COLLECTIVES[distributed_layer_norm] = EmittedCollectives("all_reduce", 1, 1, _norm_payload(2))
