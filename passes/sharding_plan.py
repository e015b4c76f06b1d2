"""The plan the analysis returns and the rewrite, report and runtime consume.

``ShardingPlan`` is frozen data keyed by node names of the captured graph: every value's
placement, the parameters' shards, the local work on each edge, the reductions and their
biases, and one ``LayerDecision`` per matmul-like layer (a row of the report). ``KvHeads`` is
a replicated state stored as the kv heads each rank's query heads need (``passes/kv_heads.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from fxtp.core import local_ops
from fxtp.core.placement import Placement, Shard, local_ranges
from passes.moe.blocks import ExpertBlock
from passes.propagate import EdgeAction

__all__ = ["KvHeads", "LayerDecision", "ShardingPlan"]


@dataclass(frozen=True)
class KvHeads:
    """A state stored as the kv heads this rank's query heads need (NOTE: [kv heads kept by
    the ranks that need them]).

    Args:
        dim: the kv-head dim of the state (1 for a cache ``(B, Hkv, S, E)``).
        group: query heads per kv head, ``Hq // Hkv``.
        query: the attention query's placement, sharded on its heads dim in one segment of
            ``Hq`` heads (even or not, NOTE: [uneven shards]).
    """

    dim: int
    group: int
    query: Shard

    def local_range(self, rank: int, world_size: int) -> tuple[int, int]:
        """``(start, length)`` of the kv heads rank ``rank`` keeps."""
        ((q_start, q_count),) = local_ranges(self.query, rank, world_size)
        return local_ops.kv_head_range(q_start, q_count, self.group)

    def local(self, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """Rank ``rank``'s copy of the state ``full`` (a new tensor; ``meta`` stays ``meta``)."""
        start, length = self.local_range(rank, world_size)
        return full.detach().narrow(self.dim, start, length).clone()



@dataclass(frozen=True)
class LayerDecision:
    """One matmul-like layer's style and why; a row of the report."""

    name: str  # plan key: the module FQN, else the weight FQN (a split piece adds "[start:end]")
    node: str  # node name in the captured graph
    module: str  # module FQN of the call
    op: str  # "linear" or "embedding"
    weight: str  # parameter FQN
    weight_shape: tuple[int, ...]
    style: str
    local_weight_shape: tuple[int, ...]
    reason: str
    code: Optional[str] = None
    fix: Optional[str] = None
    culprit: Optional[str] = None  # format_node() of the node that decided it
    culprit_module: Optional[str] = None
    output_head: bool = False  # colwise, its logits all_gathered at the model output


@dataclass(frozen=True)
class ShardingPlan:
    """What the rewrite applies; node names refer to the captured graph."""

    world_size: int
    placements: Mapping[str, Any]  # node name -> placement (tuple for multi-output nodes)
    params: Mapping[str, Placement]  # placeholder name -> placement, sharded ones only
    local_args: Mapping[str, tuple[Any, ...]]  # node name -> args with local shape literals
    edges: Mapping[tuple[str, str], EdgeAction]  # (consumer, producer) -> local work
    reduces: Mapping[str, Optional[str]]  # Partial node -> bias node added after the all_reduce
    local_targets: Mapping[str, Any]  # node name -> op the rank runs instead (with local_args)
    layers: tuple[LayerDecision, ...]
    rounds: int
    # node -> the token shard it is cut to: a Partial node's reduce_scatter (instead of its
    # all_reduce), a replicated one's local slice; NOTE: [sequence parallelism] in passes/sequence.py
    scatters: Mapping[str, Shard] = field(default_factory=dict)
    tokens: frozenset[str] = frozenset()  # the values sharded on tokens (same NOTE)
    # placeholder -> the kv heads each rank keeps of a replicated cache (passes/kv_heads.py)
    kv_heads: Mapping[str, KvHeads] = field(default_factory=dict)
    # parameters held as grouped shards, in the groups whose gradients one all_reduce sums over
    # their holders (NOTE: [grouped shards] in fxtp/core/placement.py; passes/kv_heads.py)
    holders: tuple[tuple[str, ...], ...] = ()
    # the experts blocks run expert parallel (NOTE: [expert parallelism], passes/moe/parallel.py)
    experts: tuple[ExpertBlock, ...] = ()
    # rowwise node -> its bias, added as a 1/ws share on every rank before a deferred all_reduce
    # (``local_ops.add_bias_share``; NOTE: [bias share] in passes/moe/reductions.py)
    bias_shares: Mapping[str, str] = field(default_factory=dict)

