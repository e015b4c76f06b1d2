"""Activation checkpointing in the rank graph: a region run under ``torch.utils.checkpoint``.

NOTE: [recomputed regions]
A region (``passes/regions/checkpointing.py``: a ``torch.utils.checkpoint`` call of the user's model,
NOTE: [checkpoint regions at capture], or one repeated block under
``activation_checkpointing=``) becomes a submodule of the rank graph, :class:`Recompute`, that
calls its body through ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the
forward keeps only the region's inputs, and backward runs the body again (its collectives
included, so every rank recomputes in the same order). ``early_stop=False``: the whole body
reruns, so the collectives a backward makes are the region's forward ones, every time, which
the report counts (``fxtp.explain.counts``); with early stopping they would depend on which
saved tensor autograd asks for last. ``preserve_rng_state`` (torch's default) gives a dropout
the same mask again. ``"selective"`` regions save the outputs of the ops in
:data:`SAVED_OPS` and recompute the rest (torchtitan's op-level selective checkpointing,
``torchtitan/models/llama3/infra/parallelize.py`` ``_save_list``), through
``torch.utils.checkpoint.create_selective_checkpoint_contexts``; collectives are recomputed,
never cached (a cached all_gather would keep the whole gathered tensor).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fxtp.core import activations

__all__ = ["Recompute", "SAVED_OPS", "TAG", "selective_context"]

TAG = "fxtp_checkpoint"  # node.meta["custom"][TAG]: the user's checkpoint call the op belongs to

_SAVED_NAMES = (  # torchtitan's _save_list, without the collectives (NOTE: [recomputed regions])
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
)
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in _SAVED_NAMES if hasattr(torch.ops.aten, name))


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> tuple[Any, Any]:
    """``context_fn`` of a ``"selective"`` region (NOTE: [recomputed regions])."""
    return create_selective_checkpoint_contexts(_policy)


class Recompute(nn.Module):
    """A region of the rank graph, recomputed in backward (NOTE: [recomputed regions]).

    Args:
        body: the region's ops as a ``GraphModule``; returns a tuple.
        context_fn: ``torch.utils.checkpoint``'s ``context_fn`` (a selective policy), or
            ``None`` for the whole region.
        name: the region's name in the report.
        preserve_rng_state: ``torch.utils.checkpoint``'s; ``False`` for a body that draws no
            random numbers (the generators' states need not be kept).
    """

    def __init__(self, body: nn.Module, context_fn: Optional[Callable[[], Any]] = None, name: str = "", *,
                 preserve_rng_state: bool = True) -> None:
        super().__init__()
        self.body = body
        self.context_fn = context_fn
        self.region = name
        self.preserve_rng_state = preserve_rng_state

    def forward(self, *args: Any) -> Any:
        # the graph through forward: NOTE: [block bodies run without module hooks] in fxtp/runtime/blocks.py
        if not torch.is_grad_enabled():
            return self.body.forward(*args)
        extra = {"context_fn": self.context_fn} if self.context_fn is not None else {}
        if self.preserve_rng_state and not torch.compiler.is_compiling():  # checkpoint keeps the CPU generator's state
            activations.count_held(torch.get_rng_state())
        return checkpoint(self.body.forward, *args, use_reentrant=False, early_stop=False,
                          preserve_rng_state=self.preserve_rng_state, **extra)

