"""``fxtp.compile(..., strategy=plan)`` (issue 25, item 5): the plan's tensor-parallel part is
what compile applies. No process group: compiled for inspection. The run on real ranks (a
dp x tp mesh from the plan, FSDP2 beside fxtp, against the single device) is
docs/plan_command.md's torchrun block, which tests/test_docs.py runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _helpers import graph_code

import fxtp
from fxtp.core.strategy import TensorParallelStrategy
from fxtp.planner import HARDWARE
from fxtp.planner.hardware import GiB

transformers = pytest.importorskip("transformers")

IDS = torch.zeros(2, 16, dtype=torch.long)


def tiny_llama(layers: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    return transformers.LlamaForCausalLM(config)


# 2 nodes of 2 on 1 Gb/s Ethernet: FSDP2 across them costs more than tp 2 inside them. On H100s' network
# a model this small is latency-bound and runs fastest as tp 1 x dp 4 (no tensor-parallel collective at all)
ETHERNET = dataclasses.replace(HARDWARE["h100"], inter_node_bw=125e6)


@pytest.fixture(scope="module")
def planned():
    model = tiny_llama(3)
    # pp=1: fxtp.parallelize applies tp x dp (unpinned, the search pipelines across the slow link: pp 2 x dp 2)
    return model, fxtp.plan(model, 4, device_memory=GiB, batch=8, seq=16, devices_per_node=2, hardware=ETHERNET, pp=1)


def test_strategy_applies_the_plans_layer_styles(planned):
    model, plan = planned
    assert (plan.tp, plan.dp) == (2, 2) and plan.analyzed_blocks == 2
    # the blocks' layers as globs over the block index: 2 blocks analyzed for 3
    assert plan.layer_styles["model.layers.*.mlp.down_proj"] == "rowwise"
    assert not any(".layers.0." in key or ".layers.1." in key for key in plan.layer_styles)
    pm = fxtp.compile(model, plan.tp, (IDS,), strategy=plan, dynamic=False)
    assert pm.plan == fxtp.analyze(model, plan.tp, (IDS,), dynamic=False).plan  # the full depth, every block as planned
    # the user's plan= is applied after the strategy's styles and wins
    mine = fxtp.compile(model, plan.tp, (IDS,), strategy=plan, dynamic=False,
                        plan={"model.layers.*.mlp.down_proj": "replicate", "model.layers.*.mlp.*_proj": "replicate"})
    assert mine.plan["model.layers.2.mlp.up_proj"] == "replicate" and mine.plan["model.layers.2.self_attn.q_proj"] == "colwise"
    assert plan.to_dict()["layer_styles"] == dict(plan.layer_styles)


def test_strategy_applies_sequence_parallelism_and_checkpointing(planned):
    model, plan = planned
    strategy = TensorParallelStrategy(2, sequence_parallel=True, activation_checkpointing="blocks",
                                      layer_styles=plan.layer_styles)
    pm = fxtp.compile(model, 2, (IDS,), strategy=strategy, dynamic=False)
    by_hand = fxtp.compile(model, 2, (IDS,), sequence_parallel=True, activation_checkpointing="blocks", dynamic=False)
    assert graph_code(pm) == graph_code(by_hand)
    assert pm.report.count("forward", "reduce_scatter") == by_hand.report.count("forward", "reduce_scatter") > 0


def test_a_strategy_that_disagrees_is_a_config_error(planned):
    model, plan = planned
    with pytest.raises(fxtp.FxtpConfigError, match="plan's tensor-parallel degree is 2"):
        fxtp.compile(model, 4, (IDS,), strategy=plan)
    with pytest.raises(fxtp.FxtpConfigError, match="sequence_parallel=True, but the plan runs without it"):
        fxtp.compile(model, 2, (IDS,), strategy=plan, sequence_parallel=True)
    other = "selective" if plan.activation_checkpointing == "blocks" else "blocks"
    with pytest.raises(fxtp.FxtpConfigError, match=f"activation_checkpointing='{other}', but the plan's is {plan.activation_checkpointing!r}"):
        fxtp.compile(model, 2, (IDS,), strategy=plan, activation_checkpointing=other)
    with pytest.raises(fxtp.FxtpConfigError, match="strategy must be a fxtp.ParallelPlan"):
        fxtp.compile(model, 2, (IDS,), strategy={"tp": 2})


def test_planning_rounds_do_not_grow_with_depth():
    """NOTE: [repeated blocks decided alike] (issue 25: the passes linear in the layer count):
    kv heads that do not divide the world size take several refinement rounds per block; the
    identical blocks take them together, so the rounds (each a propagation over the whole graph)
    are the same at 2 and 6 layers, and every block ends as the first."""
    from fxtp.api import plan_world_sizes

    rounds, styles = {}, {}
    for layers in (2, 6):
        with torch.device("meta"):
            model = tiny_llama(layers)
        _, plans = plan_world_sizes(model, (4,), (IDS.to("meta"),), example_kwargs={"use_cache": False})
        rounds[layers] = plans[4].rounds
        styles[layers] = {d.name: (d.style, d.code) for d in plans[4].layers}
    assert rounds[2] == rounds[6], rounds  # (grouped kv shards, NOTE: [grouped shards], settle in the first rounds)
    assert styles[6]["model.layers.5.self_attn.k_proj"] == styles[2]["model.layers.0.self_attn.k_proj"]
    assert {k.replace(".5.", ".1."): v for k, v in styles[6].items() if ".layers.5." in k} == {
        k: v for k, v in styles[2].items() if ".layers.1." in k}
