"""Elementwise random ops (``bernoulli``, ``rand_like``, ...): the output keeps the input's
placement. The rewrite draws a sharded one as this rank's slice of one global mask
(``fxtp.core.rng.sharded_call``, NOTE: [dropout across ranks]); the dropouts' rules are in
``pointwise`` (``dropout``, ``feature_dropout``, ``alpha_dropout``, ``native_dropout``).
"""

from __future__ import annotations

import torch

from passes.registry import Decision, RuleContext, register_rule

__all__: list[str] = []

aten = torch.ops.aten


@register_rule(
    aten.bernoulli.default,
    aten.bernoulli.p,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.randint_like.default,
    aten.randint_like.low_dtype,
    aten.feature_alpha_dropout.default,
)
def random_like_rule(ctx: RuleContext) -> Decision:
    """One draw per element of the first argument: its placement is the output's."""
    return Decision(ctx.placement(ctx.node.args[0]))
