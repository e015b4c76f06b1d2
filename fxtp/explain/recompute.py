"""The report's part on activation checkpointing: the recomputed regions and their collectives.

Read from the rank graph, where the regions run (NOTE: [recomputed regions] in
fxtp/core/recompute.py): a backward reruns each region's forward collectives (an
expert-parallel block's two all_to_all included), so they are added to the backward's counts. A gathered token shard that only a region's ops use is no
longer saved as a shard and regathered (NOTE: [regathered activations]): the recompute gathers
it, so that all_gather is not counted twice.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from torch.fx import GraphModule

from fxtp.core import collectives as emitted
from fxtp.core import local_ops
from fxtp.core.expert_dispatch import combine_from_experts, dispatch_to_experts
from fxtp.core.recompute import Recompute
from fxtp.explain.counts import CollectiveStat, nbytes_of
from passes.regions.checkpointing import Region

__all__ = ["recomputed", "add_recompute"]

_KINDS = {
    emitted.reduce_from_tp: "all_reduce",
    emitted.gather_from_tp: "all_gather",
    emitted.gather_from_sp: "all_gather",
    emitted.reduce_scatter_to_sp: "reduce_scatter",
}


def recomputed(gm: GraphModule) -> list[tuple[str, collections.Counter, collections.Counter, int]]:
    """Per ``Recompute`` submodule of ``gm``: its region's name, forward collectives by kind
    (count, then bytes at the example's full sizes) and the regathered gathers it replaces."""
    out = []
    for module in gm.modules():
        if not isinstance(module, Recompute):
            continue
        counts: collections.Counter = collections.Counter()
        nbytes: collections.Counter = collections.Counter()
        replaced = 0
        graph = module.body.graph
        returned = set(next(n for n in graph.nodes if n.op == "output").all_input_nodes)
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in _KINDS:
                counts[_KINDS[node.target]] += 1
                nbytes[_KINDS[node.target]] += nbytes_of(node.args[0].meta.get("val"))
            elif node.target is dispatch_to_experts:  # NOTE: [expert parallelism]: one all_to_all of the pairs' rows
                hidden, index = (a.meta.get("val") for a in node.args[:2])
                counts["all_to_all"] += 1
                nbytes["all_to_all"] += nbytes_of(hidden) * index.shape[-1]
            elif node.target is combine_from_experts:  # and one of the experts' rows back
                counts["all_to_all"] += 1
                nbytes["all_to_all"] += nbytes_of(node.args[0].meta.get("val"))
            elif node.target in local_ops.EMITTED_COLLECTIVES:
                inside = local_ops.EMITTED_COLLECTIVES[node.target]  # not `emitted`: that names the collectives module
                counts[inside.kind] += inside.forward
                nbytes[inside.kind] += inside.payload(tuple(node.args))[0]
            else:
                continue
            if node.target is emitted.gather_from_sp and node.args[6] and node not in returned:
                replaced += 1
        out.append((module.region, counts, nbytes, replaced))
    return out


def add_recompute(report: Any, regions: tuple[Region, ...], gm: GraphModule) -> None:
    """Write the regions into ``report`` (``report.recompute``) and add their reruns to its
    backward counts."""
    if not regions:
        return
    runs = {name: (counts, nbytes, replaced) for name, counts, nbytes, replaced in recomputed(gm)}
    rows = []
    extra: collections.Counter = collections.Counter()
    extra_bytes: collections.Counter = collections.Counter()
    for region in regions:
        counts, nbytes, replaced = runs.get(region.name, (collections.Counter(), collections.Counter(), 0))
        extra.update(counts)
        extra_bytes.update(nbytes)
        extra["regathered"] += replaced
        rows.append(dataclasses.asdict(region) | {"recomputed_collectives": dict(counts)})
    stats = []
    for stat in report.collectives:
        if stat.phase == "backward":
            count = stat.count + extra[stat.kind] - (extra["regathered"] if stat.kind == "all_gather" else 0)
            stat = CollectiveStat(stat.phase, stat.kind, count, stat.bytes + extra_bytes[stat.kind])
        stats.append(stat)
    report.collectives = tuple(stats)
    report.recompute = tuple(rows)
