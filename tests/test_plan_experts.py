"""``fxtp.plan`` on mixtures of experts (NOTE: [experts in the cost model] in
fxtp/planner/experts.py): per MoE layer, expert or tensor parallelism for the routed experts by
the bytes each sends (top-k, tokens, tensor-parallel degree), then parameter bytes; the plan's
notes give the reason and ``strategy=plan`` applies the choice. No process group: compiled for
inspection (expert parallelism's numerics: tests/test_expert_parallel.py)."""

from __future__ import annotations

import pytest
import torch

import fxtp
from fxtp.cli import examples
from fxtp.planner.experts import MoeShape
from fxtp.planner.hardware import GiB

pytest.importorskip("transformers")


def _notes(plan) -> dict[int, str]:
    return {int(note.split(" at tp ")[1].split(":")[0]): note for note in plan.notes}


def test_tiny_moe_plan_chooses_per_degree_and_applies():
    """A tiny top-1 Mixtral (2 layers, 4 experts) on 4 devices: at tp 4 each rank sends its
    quarter of the tokens' rows, 2 r k / t of a (T, H) activation each way, and no all_reduce
    of the experts' input in backward: expert parallel; at tp 2 the all_to_all sends more than
    that all_reduce saves: tensor parallel. The chosen tp 4 plan compiles with its experts
    expert parallel: 2 all_to_all per MoE layer in forward. (A global batch of 1 sequence
    leaves tp 4 x dp 1 the one mesh: at this size collective latency makes tp 2 x dp 2 faster.)"""
    model, (ids,) = examples.mixtral(num_experts_per_tok=1)
    plan = fxtp.plan(model, 4, device_memory=GiB, example_inputs=(ids,), devices_per_node=4, batch=1)
    notes = _notes(plan)
    assert notes[4].startswith("expert parallel") and notes[2].startswith("tensor parallel"), notes
    assert "all_to_all" in notes[4] and "2 MoE layers of 4 experts of 128, top-1" in notes[4]
    assert plan.tp == 4, str(plan)
    experts = {k: v for k, v in plan.layer_styles.items() if ".experts." in k}
    assert experts == {f"model.layers.*.mlp.experts.{w}": "expert" for w in ("gate_up_proj", "down_proj")}, experts
    assert any(line.startswith("experts: expert parallel") for line in str(plan).splitlines())
    pm = fxtp.compile(model, plan.tp, (ids,), strategy=plan, dynamic=False)
    assert {v for k, v in pm.plan.items() if ".experts." in k} == {"expert"}
    assert pm.report.count("forward", "all_to_all") == 2 * 2


# Published configs (config.json on the Hugging Face Hub), full depth on meta: the planner
# analyzes two blocks and counts the rest (NOTE: [repeated blocks]).
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=151936, max_position_embeddings=4096, num_hidden_layers=48)


def test_published_moe_configs_on_meta():
    """Mixtral-8x7B (8 experts, top-2) on 8 devices: expert parallel at tp 8 (4 k / t = 1: the
    all_to_all send what the backward's experts-input all_reduce saved, and the routing weights'
    all_reduce is gone), tensor parallel at tp 2 and 4. Qwen3-30B-A3B (128 experts, top-8):
    tensor parallel at every degree (each rank would send 8 rows per token). The FLOPs count
    the top-k experts a token runs, not all of them."""
    mixtral, _ = examples.mixtral_8x7b(n_layers=32)
    plan = fxtp.plan(mixtral, 8, device_memory=80 * GiB, batch=8, seq=4096)
    notes = _notes(plan)
    assert [notes[t].split(" at ")[0] for t in (2, 4, 8)] == ["tensor parallel inside the experts"] * 2 + [
        "expert parallel (whole experts per rank)"], notes
    assert "32 MoE layers of 8 experts of 14336, top-2" in notes[8]
    moe = MoeShape.of(mixtral)
    assert len(moe.modules) == 32 and moe.expert_params == 8 * 3 * 4096 * 14336

    qwen, _ = examples.qwen3_moe(device="meta", **QWEN3_30B_A3B)
    plan = fxtp.plan(qwen, 8, device_memory=80 * GiB, batch=8, seq=4096)
    assert all(note.startswith("tensor parallel") for note in plan.notes) and len(plan.notes) == 3, plan.notes
    assert "expert" not in set(plan.layer_styles.values())
    # ~3.3B active of ~30.5B parameters: 6 N_active per token, not 6 N
    active = plan.chosen.step["compute"] * plan.devices * plan.hardware.peak_flops * plan.hardware.mfu / (8 * 4096)
    assert 6 * 2.5e9 < active < 6 * 4.5e9, active
