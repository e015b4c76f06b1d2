"""The passes between a capture and the rewrite, in order (``passes/README.md``): normalize the
captured graph, plan its layers, expert-parallel blocks, deferred reductions, a decoder cache's
kv heads, sequence parallelism. ``fxtp.api`` runs them after each capture."""

from __future__ import annotations

from typing import Mapping

import torch
from torch.export.graph_signature import InputKind

from fxtp.capture.frontends import written_state
from passes.kv_heads import keep_needed_kv_heads
from passes.moe.parallel import check_sequence_parallel, expert_parallel, select_blocks
from passes.moe.reductions import defer_reductions
from passes.normalize import normalize
from passes.plan import ShardingPlan, plan_sharding
from passes.sequence import sequence_parallel

__all__ = ["normalized", "plan_program"]


def normalized(program: torch.export.ExportedProgram) -> tuple[dict[str, str], dict[str, str]]:
    """Normalize the captured graph in place (fxtp's own copy); ``({placeholder: FQN} of the
    parameters and written state, the written state's)``."""
    constants = {
        spec.arg.name: program.constants[spec.target]
        for spec in program.graph_signature.input_specs
        if spec.kind == InputKind.CONSTANT_TENSOR and spec.target in program.constants
    }
    normalize(program.graph_module.graph, constants)
    program.graph_module.recompile()
    param_fqns = {
        spec.arg.name: spec.target for spec in program.graph_signature.input_specs if spec.kind == InputKind.PARAMETER
    }
    written = written_state(program)
    return param_fqns | written, written  # NOTE: [sharded state] in passes/rules/variants.py


def plan_program(program: torch.export.ExportedProgram, param_fqns: Mapping[str, str], written: Mapping[str, str], ws: int,
                 overrides: Mapping[str, str], sequence: bool = False, kv_heads: bool = False,
                 experts: bool = False) -> ShardingPlan:
    """The plan of a :func:`normalized` program at ``ws`` (the graph is not modified):
    ``overrides`` are ``plan=``'s layer styles; ``experts``: expert parallelism (NOTE: [expert
    parallelism] in fxtp/core/expert_dispatch.py); ``kv_heads``: a decoder cache keeps the kv
    heads each rank reads (passes/kv_heads.py); ``sequence``: sequence parallelism, after
    expert parallelism (NOTE: [expert parallelism with sequence parallelism] in
    passes/moe/parallel.py).

    Raises:
        FxtpConfigError: an expert-parallel block with fewer experts than ranks.
        FxtpPlanError: an override that cannot be honoured; a token shard reaching an
            expert-parallel block's input.
    """
    blocks, overrides = select_blocks(program.graph, param_fqns, overrides, experts, ws)
    sharding = plan_sharding(program.graph, param_fqns, ws, overrides)
    sharding = defer_reductions(program.graph, expert_parallel(program.graph, sharding, blocks, param_fqns))
    if kv_heads:  # NOTE: [kv heads kept by the ranks that need them] in passes/kv_heads.py
        sharding = keep_needed_kv_heads(program.graph, sharding, written)
    if sequence:  # NOTE: [sequence parallelism] in passes/sequence.py
        sharding = sequence_parallel(program.graph, sharding, frozenset(param_fqns))
        check_sequence_parallel(sharding)
    return sharding
