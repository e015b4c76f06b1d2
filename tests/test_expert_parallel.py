"""Expert parallelism (``expert_parallel=True``, NOTE: [expert parallelism] in
fxtp/core/expert_dispatch.py) on real gloo ranks at world sizes 2 and 4, against the
single-device model: outputs, every gradient, 3 SGD steps, the report's collectives against the
ones counted (``compare_training``), other token counts after one compile, and greedy
generation, token for token (its decode steps leave some ranks with no token to send).

Tiny Hugging Face models (fxtp/explain/examples.py; 2 layers, hidden 64, top-2): Mixtral,
Qwen2-MoE (a gated shared expert), Qwen3-MoE, DeepSeek-V2 (MLA, 2 shared experts, scaled
routing weights), gpt-oss (biased experts, interleaved clamped SwiGLU, biased router), and a
Mixtral on Hugging Face's ``batched_mm`` experts with ``2 * ws - 1`` experts (uneven: 2/1 at
ws 2, 2/2/2/1 at ws 4). Meta-device shapes of four published configs at ws 8 close the file.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from _helpers import compare_shapes, compare_training

from torch.export.graph_signature import InputKind

import fxtp
from fxtp.api import _analyze
from fxtp.core.expert_dispatch import expert_ranges
from fxtp.explain import examples
from passes.moe.parallel import expert_parallel, select_blocks

pytest.importorskip("transformers")

N_BLOCKS = 1  # 1 layer per model (num_hidden_layers=1): one MoE block shows every collective
# Each family at one world size, the uneven batched_mm case at both (the suite's time; no new kind otherwise).
EP_CASES = {2: ("mixtral", "gpt_oss", "qwen3_moe", "batched"), 4: ("qwen2_moe", "deepseek_v2", "batched")}
TP_CASES = {2: ("deepseek_v2",), 4: ("qwen3_moe", "gpt_oss")}  # Mixtral, Qwen2-MoE: tests/test_moe.py


def _build(case: str, ws: int):
    if case == "batched":
        return examples.mixtral(num_hidden_layers=N_BLOCKS, experts_implementation="batched_mm", num_local_experts=2 * ws - 1)
    return getattr(examples, case)(num_hidden_layers=N_BLOCKS)


def _expert_checks(cases: tuple[str, ...]) -> dict:
    """``cases`` under expert parallelism (compare_training checks inside the ranks); what the
    report and the plan say comes back."""
    ws, out = dist.get_world_size(), {}
    for case in cases:
        r = compare_training(*_build(case, ws), expert_parallel=True)
        out[case] = {k: r[k] for k in ("forward", "backward", "plan", "local_shapes")} | {
            "experts": {row["name"]: row for row in r["report"]["layers"] if ".experts." in row["name"]},
            "collectives": r["report"]["collectives"]}
    return out


def _other_checks() -> dict:
    """Tensor parallelism for the families tests/test_moe.py does not run; at ws 2 other token
    counts after one compile (a batch or sequence of 1 takes fxtp's size-1 graph path: not covered here), at ws 4 greedy generation (a decode step's 2 tokens leave ranks
    2 and 3 with nothing to send)."""
    ws = dist.get_world_size()
    out = {"tp": {case: compare_training(*_build(case, ws))["forward"] for case in TP_CASES[ws]}}
    model, inputs = examples.qwen2_moe(num_hidden_layers=N_BLOCKS)
    ids = inputs[0]
    if ws == 2:
        calls = [(ids[:, :2],), (ids[:, :5],), (ids[:, :8],), (ids[:, :3],)]  # 4, 10, 16 and 6 tokens
        out["shapes"] = compare_shapes(model, inputs, calls, expert_parallel=True)["shapes"]
    else:
        pm = fxtp.compile(model, ws, inputs, expert_parallel=True)
        prompt = ids[:, :6]
        out["generate"] = torch.equal(pm.generate(prompt, max_new_tokens=4),
                                      model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0))
    return out


def test_every_family_equals_the_single_device(pool):
    """Outputs, every gradient, 3 SGD steps and the report's counts are checked inside the
    ranks; here the plan: whole experts per rank (front-loaded: ``2 * ws - 1`` experts give
    rank 0 two and the last rank one); per block, forward 2 all_to_all (pairs out, rows back)
    and one all_reduce after the combine (a shared expert's folded in: one, not two); backward
    the 2 all_to_all reversed and 2 all_gathers of the token blocks' gradients."""
    ws, cases = pool.world_size, EP_CASES[pool.world_size]
    r = pool.run(_expert_checks, cases[:2])[0] | pool.run(_expert_checks, cases[2:])[0]  # two calls: each within the pool's timeout
    for case, got in r.items():
        ranges = expert_ranges(2 * ws - 1 if case == "batched" else 4, ws)
        rows = got["experts"]
        assert len(rows) == 2 * N_BLOCKS and {row["style"] for row in rows.values()} == {"expert"}, case
        for row in rows.values():
            assert row["local_weight_shape"] == [ranges[0][1], *row["weight_shape"][1:]], case
            assert f"rank {ws - 1}: expert {ranges[-1][0]}" in row["reason"].replace("experts", "expert"), case
        assert got["forward"]["all_to_all"] == 2 * N_BLOCKS, case
        assert got["forward"]["all_reduce"] == 2 * N_BLOCKS + 1, case  # attention + experts per block; the lookup
        assert got["backward"]["all_to_all"] == 2 * N_BLOCKS and got["backward"]["all_gather"] == 2 * N_BLOCKS, case
        assert "expert" in set(got["plan"].values()), case
    assert r["batched"]["local_shapes"]["model.layers.0.mlp.experts.gate_up_proj"][0] == 2
    if "mixtral" in r:  # the payload: every (token, expert) pair's row once each way, 32 tokens x top-2 x 64 x fp32
        stats = {c["phase"]: c for c in r["mixtral"]["collectives"] if c["kind"] == "all_to_all"}
        assert stats["forward"]["bytes"] == N_BLOCKS * 2 * (32 * 2 * 64 * 4)


def test_tensor_parallel_tokens_and_generation(pool):
    """The other families under tensor parallelism (checked inside the ranks); one expert-parallel
    compile serves 4, 10, 16 and 6 tokens; greedy generation is token-identical."""
    (r, *_) = pool.run(_other_checks)
    for case, forward in r["tp"].items():
        # gpt-oss's interleaved, biased experts are not sharded by tensor parallelism yet (replicated,
        # exact): only the attention's all_reduce per block (issue 24 item 2 is open).
        assert forward["all_reduce"] == (1 if case == "gpt_oss" else 2) * N_BLOCKS + 1, case
    if pool.world_size == 2:
        assert [s[0][:2] for s in r["shapes"]] == [(2, 2), (2, 5), (2, 8), (2, 3)]
    else:
        assert r["generate"]


def test_plan_names_one_block():
    """``plan={module: "expert"}`` makes one block expert parallel, the other keeps tensor
    parallelism inside its experts; ``report.plan`` round-trips."""
    model, inputs = examples.mixtral()
    captured, plan, report = _analyze(model, 2, inputs, {}, "export", {"model.layers.1.mlp.experts": "expert"}, 0)
    styles = {row.name: row.style for row in report.layers if ".experts." in row.name}
    assert styles == {"model.layers.0.mlp.experts.gate_up_proj": "colwise", "model.layers.0.mlp.experts.down_proj": "rowwise",
                      "model.layers.1.mlp.experts.gate_up_proj": "expert", "model.layers.1.mlp.experts.down_proj": "expert"}
    again = fxtp.analyze(model, 2, inputs, plan=report.plan)
    assert [row.style for row in again.layers] == [row.style for row in report.layers]
    graph, fqns = captured.program.graph, _param_fqns(captured.program)
    with pytest.raises(fxtp.FxtpPlanError, match="names no experts module"):
        select_blocks(graph, fqns, {"model.layers.0.self_attn": "expert"}, False, 2)
    blocks, _ = select_blocks(graph, fqns, {}, True, 8)
    with pytest.raises(fxtp.FxtpConfigError, match="fewer than world_size"):
        expert_parallel(graph, dataclasses.replace(plan, world_size=8), blocks, fqns)


def _param_fqns(program) -> dict[str, str]:
    return {s.arg.name: s.target for s in program.graph_signature.input_specs if s.kind == InputKind.PARAMETER}


# Published configs (their config.json on the Hugging Face Hub), num_hidden_layers cut to 2 (the
# layers are alike; DeepSeek-V2-Lite's first is dense, so it keeps 1 MoE layer).
PUBLISHED = {
    "gpt-oss-20b": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                                    sliding_window=128, max_position_embeddings=4096)),
    "Qwen3-30B-A3B": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                                        num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                        vocab_size=151936, max_position_embeddings=4096)),
    "DeepSeek-V2-Lite": ("deepseek_v2", dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                                             n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                                             num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim=64,
                                             first_k_dense_replace=1, routed_scaling_factor=1.0, vocab_size=102400,
                                             max_position_embeddings=4096)),
}


@pytest.mark.parametrize("name", [*PUBLISHED, "Mixtral-8x7B"])
def test_published_configs_at_world_size_8(name):
    """On meta, 2 layers: under expert parallelism each rank keeps at most 1/8 + 0.03 of the
    parameter bytes, the experts' 1/8 exactly."""
    if name == "Mixtral-8x7B":
        model, inputs = examples.mixtral_8x7b(n_layers=2)
    else:
        builder, config = PUBLISHED[name]
        model, _ = getattr(examples, builder)(num_hidden_layers=2, device="meta", **config)
        inputs = (torch.zeros(1, 512, dtype=torch.long, device="meta"),)
    report = fxtp.analyze(model, 8, inputs, expert_parallel=True)
    assert report.param_bytes_per_rank / report.param_bytes <= 1 / 8 + 0.03, report.param_bytes_per_rank / report.param_bytes
    rows = [row for row in report.layers if row.style == "expert"]
    assert rows and all(row.local_weight_shape[0] * 8 == row.weight_shape[0] for row in rows)
    assert report.count("forward", "all_to_all") == 2 * (1 if name == "DeepSeek-V2-Lite" else 2)
