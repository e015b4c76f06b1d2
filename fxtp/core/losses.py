"""The vocab-parallel cross entropy: ``cross_entropy`` on logits sharded on the classes.

NOTE: [vocab-parallel cross entropy]
Megatron-LM's ``_VocabParallelCrossEntropy`` (core/tensor_parallel/cross_entropy.py), with
everything ``torch.nn.functional.cross_entropy`` takes for class-index targets. With the logits
``x`` sharded on the class dim, each rank all_reduces (max) the row maxima ``m``, then (sum)
the sum of exponentials ``Z`` of ``x - m``, then (sum) one stacked payload: the target's logit
(found on exactly one rank) and, as needed, the target's class weight ``w_t``, the row sums
``sum_c w_c (x_c - m)`` for label smoothing and the sum of the class weights ``W``. With
``L = log Z`` (over ``x - m``) and ``eps`` the label smoothing, over ``C`` classes, row ``i``'s loss is
torch's (``aten/src/ATen/native/LossNLL.cpp``, ``cross_entropy_loss_label_smoothing``)::

    nll_i    = w_t (L - (x_t - m))                  # -w_t log p_t
    smooth_i = W L - sum_c w_c (x_c - m)             # -sum_c w_c log p_c
    loss_i   = (1 - eps) nll_i + eps / C smooth_i    # 0 where target == ignore_index

(``w = 1``, ``W = C`` without class weights) and ``mean`` divides the sum by ``sum_i w_t`` over
the targets not ignored (their count without weights). Backward needs no communication: the
gradient of this rank's logits is ``(1 - eps) w_t (p - onehot) + eps / C (W p - w)`` times the
incoming gradient, with ``p`` the softmax under the global normalizer and ``w`` this rank's
slice of the class weights. Three all_reduce of ``(N,)`` (``(N, k)`` for the last) instead of
an all_gather of the ``(N, C)`` logits.

NOTE: [ignored rows get exact zeros]
A micro-batch whose targets are all ``ignore_index`` (a prompt-only sample) has a ``mean`` of
0 / 0: NaN, in torch as here. torch's ``nll_loss`` backward writes the gradient of the targets
it counts and leaves the ignored rows' exact zeros, so gradient accumulation over such a
micro-batch stays finite. Here the ignored rows are ``masked_fill``ed to 0, not multiplied by
the mask: the backward of the fill is a fill, so the rows get 0 and not ``inf * 0 = NaN``
(``1 / 0`` from the mean's division); a row's own loss (inf or NaN logits) is dropped alike.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint

from fxtp.core.autocast import fp32_policy_dtype
from fxtp.core.collectives import all_reduce
from fxtp.core.local_ops import EMITTED_COLLECTIVES, EmittedCollectives, check_ids

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row losses (fp32 ``(N,)``, ignored rows included) and the targets' class weights."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, logits: torch.Tensor, target: torch.Tensor, start: int, group_name: str,
        weight: Optional[torch.Tensor], smoothing: float, classes: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = logits.float()
        row_max = all_reduce(x.detach().amax(dim=-1), group_name, "max")
        shifted = x - row_max.unsqueeze(-1)
        local = target - start
        outside = (local < 0) | (local >= x.shape[-1])
        local = local.masked_fill(outside, 0)
        exp = shifted.exp()
        sum_exp = all_reduce(exp.sum(dim=-1), group_name)
        w = weight.float() if weight is not None else None
        stats = [shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)]
        if w is not None:
            stats.append(w.gather(0, local).masked_fill(outside, 0.0))
        if smoothing:
            stats.append((shifted * w).sum(dim=-1) if w is not None else shifted.sum(dim=-1))
        flat = torch.stack(stats, dim=-1).flatten()
        if w is not None and smoothing:
            flat = torch.cat([flat, w.sum().reshape(1)])
        flat = all_reduce(flat, group_name)
        rows = flat[: target.numel() * len(stats)].view(-1, len(stats)).unbind(-1)
        log_z = sum_exp.log()
        w_t = rows[1] if w is not None else torch.ones_like(log_z)
        loss = w_t * (log_z - rows[0])
        total_w = flat[-1] if w is not None and smoothing else float(classes)
        if smoothing:
            loss = (1 - smoothing) * loss + smoothing / classes * (total_w * log_z - rows[-1])
        ctx.smoothing, ctx.classes, ctx.total_w, ctx.weighted = smoothing, classes, total_w, w is not None
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside, w_t, *((w,) if w is not None else ()))
        ctx.mark_non_differentiable(w_t)
        return loss, w_t

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _grad_w_t: Optional[torch.Tensor]):  # type: ignore[override]
        softmax, local, outside, w_t, *w = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), (~outside).unsqueeze(-1).to(softmax.dtype))
        out = (softmax - onehot) * w_t.unsqueeze(-1)
        if ctx.smoothing:
            smooth = softmax * ctx.total_w - (w[0] if w else 1.0)
            out = (1 - ctx.smoothing) * out + ctx.smoothing / ctx.classes * smooth
        return out * grad.unsqueeze(-1), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    start: int,
    classes: int,
    where: str,
    reduction: int,
    ignore_index: int,
    group_name: str,
    weight: Optional[torch.Tensor] = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """This rank's part of ``cross_entropy(full_logits, target, full_weight, reduction=...,
    ignore_index=..., label_smoothing=...)`` with ``logits`` sharded on the class dim: NOTE:
    [vocab-parallel cross entropy]. The result is the full loss on every rank.

    Args:
        logits: ``(N, n)``: this rank's classes ``[start, start + n)`` of the ``(N, C)`` logits,
            any float dtype (the loss is computed in fp32, as Hugging Face's losses upcast).
        target: ``(N,)`` int64 global class ids; ``ignore_index`` ones add nothing.
        start: the global id of this rank's first class.
        classes: ``C``, the global number of classes; a target outside ``[0, C)`` other than
            ``ignore_index`` raises (:func:`fxtp.core.local_ops.check_ids`). where: the loss's
            module FQN.
        reduction: ATen's enum: 0 none, 1 mean (over the targets not ignored, weighted by
            their class weights), 2 sum.
        ignore_index: a target id whose loss and gradient are zero.
        group_name: the tensor-parallel process group.
        weight: this rank's slice ``(n,)`` of the class weights, or ``None``.
        label_smoothing: as in ``cross_entropy``, in ``[0, 1]``.

    Returns:
        ``(N,)`` per-target losses (reduction 0) or a scalar, in ``logits``' dtype (fp32 under
        autocast, as ``cross_entropy``: NOTE: [autocast policy of replaced ops] in
        fxtp/core/autocast.py). A mean over no target (all ``ignore_index``) is NaN, as torch's,
        and its gradient exact zeros (NOTE: [ignored rows get exact zeros]).
    """
    check_ids(target, classes, "cross_entropy", where, ignore_index)
    valid = target != ignore_index
    loss, w_t = _VocabParallelCrossEntropy.apply(logits, target, start, group_name, weight, float(label_smoothing), classes)
    # NOTE: [autocast policy of replaced ops]: cross_entropy is fp32 under autocast
    dtype = fp32_policy_dtype("cross_entropy_loss", logits, logits.dtype)
    # NOTE: [ignored rows get exact zeros]
    loss = loss.masked_fill(~valid, 0.0).to(dtype)
    if reduction == 0:
        return loss
    if reduction == 2:
        return loss.sum()
    return loss.sum() / (w_t.masked_fill(~valid, 0.0) if weight is not None else valid).sum()


def _payload(args: tuple) -> tuple[int, int]:
    """Forward bytes: the row maxima, the sums of exponentials and the stacked statistics."""
    rows = optimization_hint(args[0].meta["val"].shape[0])
    weighted = len(args) > 8 and args[8] is not None
    smoothing = len(args) > 9 and args[9] != 0.0
    stacked = rows * (1 + weighted + smoothing) + (weighted and smoothing)
    return 4 * (2 * rows + stacked), 0


EMITTED_COLLECTIVES[vocab_parallel_cross_entropy] = EmittedCollectives("all_reduce", 3, 0, _payload)
