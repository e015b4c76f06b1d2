"""Differential fuzzing (issue 10, item 5): random small models against the single-device model.

Hypothesis draws a :class:`fuzz_models.Spec` from the block grammar (``fuzz_strategies.specs``);
every gloo rank builds it from its seed and runs ``fuzz_check.differential``: at world sizes 2
and 4, ``fxtp.compile`` (static or dynamic shapes: ``Spec.dynamic`` is drawn too) must either
equal the single-device model (outputs, every gradient, 2 SGD steps), with a code on every
replicated layer and the report's collective counts equal to the ones the run measures, or
raise an ``FxtpError``. A failure shrinks to the smallest model that
breaks, printed as a ``Spec(...)`` to paste into ``test_fuzz_regressions.py``.

``FXTP_FUZZ_EXAMPLES=N`` runs N examples per world size (default: the CI budget below), the same
ones on every run; ``FXTP_FUZZ_SEED=S`` draws another sequence (a longer hunt than CI's);
``pytest --hypothesis-show-statistics`` shows how many were sharded, replicated or rejected.
"""

from __future__ import annotations

import os

from fuzz_check import check_outcomes, differential
from fuzz_models import Embed, Mlp, Moe, Spec
from fuzz_strategies import specs
from hypothesis import HealthCheck, event, example, given, seed, settings

# Grammar features with a known bug, never drawn here (each is a regression test in
# test_fuzz_regressions.py); remove an entry when its fix lands.
KNOWN_BROKEN: dict[str, str] = {}

EXAMPLES = int(os.environ.get("FXTP_FUZZ_EXAMPLES", "12"))
SEED = os.environ.get("FXTP_FUZZ_SEED")


@settings(
    max_examples=EXAMPLES,
    derandomize=SEED is None,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(spec=specs(exclude=frozenset(KNOWN_BROKEN)))
# A MoE block under each plan on every run, whatever the draws: Qwen2-MoE's (a shared expert) on
# batched_mm experts with tensor parallelism inside the experts (grouped_mm's: tests/test_moe.py),
# Mixtral's top-1 with 6 experts expert parallel
@example(spec=Spec(hidden=16, blocks=(Moe(ffn=16, shared=True, impl="batched_mm"),), train=True))
@example(spec=Spec(hidden=16, blocks=(Moe(ffn=32, experts=6, top_k=1),), batch=1, expert_parallel=True))
# parameter groups by module type over norms of each kind and an embedding (NOTE: [blocks of a ParallelModule])
@example(spec=Spec(hidden=16, blocks=(Mlp(ffn=32, norm="layer"), Mlp(ffn=32, norm="rms")), embed=Embed(), head="linear",
                   type_groups=True))
@seed(int(SEED or 0))
def test_fxtp_equals_single_device_or_rejects(pool, spec):
    outcomes = pool.run(differential, spec)
    event(check_outcomes(spec, outcomes))  # pytest --hypothesis-show-statistics shows the mix
    event("some layer sharded" if any(style != "replicate" for style in outcomes[0].plan.values()) else "all replicated")
    if outcomes[0].uneven:
        event("uneven shards")
    if spec.sequence_parallel:
        event("sequence_parallel=True")
    if spec.clip:
        event("clip_grad_norm_ in the loop")
    if spec.type_groups:
        event("parameter groups by module type")
    if spec.checkpointing != "none":
        event(f"checkpointing={spec.checkpointing}")
    event("dynamic=True" if spec.dynamic else "dynamic=False")
    for flag in ("aliased", "ignored", "autocast"):  # issue 35's draws
        if getattr(spec, flag):
            event(f"{flag}=True")
    if any(isinstance(b, Moe) for b in spec.blocks):
        event("MoE block, " + ("expert parallel" if spec.expert_parallel else "tensor parallel"))
