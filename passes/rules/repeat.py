"""``repeat_interleave(x, repeats: int, dim)``: every element repeated ``repeats`` times.

Grouped-query attention broadcasts its kv heads this way (``k.repeat_interleave(n, dim=1)``,
neuronx-nemo-megatron, tpu-inference). Input index ``i`` becomes outputs ``[i*n, (i+1)*n)``, so
a rank's block of the input dim becomes its block of the output dim: a segment ``s`` becomes a
segment ``s*n`` (NOTE: [segments]) and the op runs locally; a global ``output_size`` is
dropped (``fxtp.core.local_ops.repeat_interleave``). A shard on another dim flows through. Tensor ``repeats`` (``self_Tensor``) are not handled here.
"""

from __future__ import annotations

import torch

from fxtp.core import local_ops
from fxtp.core.placement import REPLICATE, Shard
from passes.registry import GATHER_INSTEAD, Conflict, Decision, RuleContext, register_rule
from passes.rules._common import ndim, norm_dim

__all__: list[str] = []

aten = torch.ops.aten


@register_rule(aten.repeat_interleave.self_int)
def repeat_interleave_rule(ctx: RuleContext) -> Decision:
    args = list(ctx.node.args) + [None] * (4 - len(ctx.node.args))
    x, repeats = args[0], args[1]
    dim = args[2] if args[2] is not None else ctx.node.kwargs.get("dim")
    p = ctx.placement(x)
    if not isinstance(p, Shard):
        return Decision(REPLICATE)
    if dim is None:
        raise Conflict("view-crosses-shard", "repeat_interleave without dim flattens the sharded input", GATHER_INSTEAD)
    if norm_dim(dim, ndim(x)) != p.dim:
        return Decision(p)
    out = Shard(p.dim, tuple(s * repeats for s in p.segments))
    if args[3] is None and "output_size" not in ctx.node.kwargs:
        return Decision(out)
    # output_size (export passes it as a keyword) is the global size: run without it.
    return Decision(out, local_args=(x, repeats, dim), local_target=local_ops.repeat_interleave)
