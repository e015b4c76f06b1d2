"""Expert parallelism (``expert_parallel=True``, NOTE: [expert parallelism] in
fxtp/core/expert_dispatch.py) on real gloo ranks at world sizes 2 and 4, against the
single-device model: outputs, every gradient, 3 SGD steps and the report's collectives against
the ones counted (``compare_training``); at ws 2 other token counts after one compile (the one
dynamic-shape check); at ws 4 an expert count that does not divide the world size (6 experts:
2/2/1/1) with clipping, the gathered state dict, the train-mode graph captured at the first
``pm.train()`` and greedy generation, token for token (a decode step's 2 tokens leave ranks 2
and 3 with nothing to send).

Tiny Hugging Face models (fxtp/cli/examples.py; 1 layer, hidden 64, top-2, 8 tokens a
sequence, static shapes): Mixtral, Qwen2-MoE (a gated shared expert), Qwen3-MoE, DeepSeek-V2
(MLA, 2 shared experts, scaled routing weights), gpt-oss (biased experts, interleaved clamped
SwiGLU, biased router), and a Mixtral on Hugging Face's ``batched_mm`` experts. Each family runs
at one world size (the attention and shared experts around the experts keep their
tensor-parallel plan there); DeepSeek-V2 (2 shared experts folded into the routed experts' one
all_reduce) under plain tensor parallelism at ws 2 and 4, gpt-oss at ws 2, each also on
``batched_mm`` experts (Mixtral and Qwen2-MoE: tests/test_moe.py); expert parallelism with sequence parallelism: Qwen2-MoE at ws 2,
Mixtral at ws 4. At ws 2 one dynamic compile also runs batches of 1 and generates greedily
(batches of 1 and 2) token for token. Meta-device reports of four published configs at
ws 8 close the file.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from _helpers import compare_shapes, compare_training, loss_of
from torch.export.graph_signature import InputKind

import fxtp
from fxtp.api import _analyze
from fxtp.arguments import CompileOptions
from fxtp.core.expert_dispatch import expert_ranges
from fxtp.core.placement import shard_tensor
from fxtp.cli import examples
from fxtp.runtime.blocks import rank_graphs
from fxtp.runtime.checkpoint import full_state_dict
from fxtp.runtime.sharded import local_tensor
from passes.moe.parallel import expert_parallel, select_blocks

pytest.importorskip("transformers")

N_BLOCKS = 1  # 1 layer per model: one MoE block shows every collective
SEQ = 8
EP_CASES = {2: ("mixtral", "gpt_oss", "deepseek_v2", "qwen3_moe"), 4: ("qwen2_moe",)}  # + "batched" at ws 4 (_uneven_checks)
TP_CASES = {2: ("deepseek_v2", "gpt_oss", "gpt_oss/batched_mm"), 4: ("deepseek_v2", "deepseek_v2/batched_mm")}  # family/impl
SP_CASES = {2: ("qwen2_moe",), 4: ("mixtral",)}  # expert and sequence parallelism together
CAPTURE = "export"  # what "auto" ends with on these models, without trying fx first
UNEVEN_EXPERTS = 6  # at ws 4: 2/2/1/1


def _build(case: str):
    if case == "batched":
        model, (ids,) = examples.mixtral(num_hidden_layers=N_BLOCKS, experts_implementation="batched_mm",
                                         num_local_experts=UNEVEN_EXPERTS)
    else:
        family, _, impl = case.partition("/")
        model, (ids,) = getattr(examples, family)(num_hidden_layers=N_BLOCKS, experts_implementation=impl or "grouped_mm")
    return model, (ids[:, :SEQ],)


def _uneven_checks() -> dict:
    """Batched_mm experts, 6 on 4 ranks: outputs and every gradient; ``pm.clip_grad_norm_`` and
    torch's ``clip_grad_norm_`` on ``pm.parameters()`` give the single device's total norm and
    clipped gradients; the gathered state dict is the model's; the train-mode graph, captured
    at the first ``pm.train()`` from the meta copy, dispatches the experts too and matches the
    model in train mode; greedy generation (eval) is token-identical."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    model, (ids,) = _build("batched")
    ref = copy.deepcopy(model)
    pm = fxtp.compile(model, ws, (ids,), expert_parallel=True, dynamic=False, capture=CAPTURE)
    out = {"local_rows": tuple(pm.get_parameter("model.layers.0.mlp.experts.gate_up_proj").shape)[0]}
    loss_of(pm(ids)).backward()
    loss_of(ref(ids)).backward()
    for fqn, p in pm.named_parameters():
        expected = shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], rank, ws)
        torch.testing.assert_close(local_tensor(p.grad), expected, msg=lambda m: f"gradient of {fqn}: {m}")
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    torch.testing.assert_close(pm.clip_grad_norm_(1e-3), want)  # clips to 1e-3 (the norm is larger)
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0), torch.tensor(1e-3), rtol=1e-4, atol=0)
    for fqn, p in pm.named_parameters():
        expected = shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], rank, ws)
        torch.testing.assert_close(local_tensor(p.grad), expected, msg=lambda m: f"clipped gradient of {fqn}: {m}")
    for key, value in full_state_dict(pm).items():
        assert torch.equal(value, ref.state_dict()[key]), key
    pm.train()
    ref.train()
    out["train_mode"] = pm.report.modes["train"]
    out["train_dispatches"] = any("dispatch_to_experts" in g.code for g in rank_graphs(pm, "train").values())
    torch.testing.assert_close(pm(ids), ref(ids))
    pm.eval()
    ref.eval()
    prompt = ids[:, :6]
    out["generate"] = torch.equal(pm.generate(prompt, max_new_tokens=3),
                                  ref.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0))
    return out


def _batch_of_one(pm, ref) -> dict:
    """On a dynamic compile: a batch of 1 (3 tokens; sizes of 1 take graphs of their own, NOTE:
    [size-1 graphs]), outputs and every gradient; then greedy generation of 4 tokens, a token
    count per step the compile never saw, from prompts of batches 1 and 2: token-identical?"""
    rank, ws = dist.get_rank(), dist.get_world_size()
    _, (ids,) = _build("mixtral")
    one = ids[:1, :3]
    out, want = pm(one), ref(one)
    torch.testing.assert_close(out, want)
    loss_of(out).backward()
    loss_of(want).backward()
    for fqn, p in pm.named_parameters():
        expected = shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], rank, ws)
        torch.testing.assert_close(local_tensor(p.grad), expected, msg=lambda m: f"batch of 1, gradient of {fqn}: {m}")
    pm.eval()
    ref.eval()
    generated = [torch.equal(pm.generate(p, max_new_tokens=4), ref.generate(p, max_new_tokens=4, do_sample=False, pad_token_id=0))
                 for p in (ids[:1, :4], ids[:, :5])]
    return {"shape": tuple(out.logits.shape), "generate": generated}


def _checks() -> dict:
    """Every check of this world size, inside the ranks (one ``pool.run``); what the report,
    the plan and the runs say comes back."""
    ws, out = dist.get_world_size(), {"ep": {}, "tp": {}}
    for case in EP_CASES[ws]:
        r = compare_training(*_build(case), expert_parallel=True, dynamic=False, capture=CAPTURE)
        out["ep"][case] = {k: r[k] for k in ("forward", "backward", "plan")} | {
            "experts": {row["name"]: row for row in r["report"]["layers"] if ".experts." in row["name"]},
            "collectives": r["report"]["collectives"]}
    for case in TP_CASES[ws]:
        r = compare_training(*_build(case), dynamic=False, capture=CAPTURE)
        out["tp"][case] = r["forward"] | {"styles": sorted(row["style"] for row in r["report"]["layers"] if ".experts." in row["name"])}
    out["sp"] = {case: {k: compare_training(*_build(case), expert_parallel=True, sequence_parallel=True, dynamic=False,
                                            capture=CAPTURE)[k] for k in ("forward", "backward")} for case in SP_CASES[ws]}
    if ws == 2:  # one compile (dynamic shapes) runs 4, 10 and 6 tokens, then a batch of 1 and generation (_batch_of_one)
        model, (ids,) = _build("mixtral")
        calls = [(ids[:, :2],), (ids[:, :5],), (ids[:, :3],)]
        r = compare_shapes(model, (ids,), calls, expert_parallel=True, capture=CAPTURE, then=_batch_of_one)
        out["shapes"], out["batch_of_one"] = r["shapes"], r["then"]
    else:
        out["uneven"] = _uneven_checks()
    return out


def test_expert_parallel_equals_the_single_device(pool):
    """Inside the ranks: outputs, every gradient, 3 SGD steps, the report's counts. Here the
    plan: whole experts per rank, front-loaded; per block, forward 2 all_to_all (pairs out, rows
    back) and one all_reduce after the combine (a shared expert's folded in: one, not two);
    backward the 2 all_to_all reversed and 2 all_gathers of the token blocks' gradients."""
    ws = pool.world_size
    (r, *_) = pool.run(_checks)
    assert set(r["ep"]) == set(EP_CASES[ws])
    for case, got in r["ep"].items():
        ranges = expert_ranges(4, ws)
        rows = got["experts"]
        assert len(rows) == 2 * N_BLOCKS and {row["style"] for row in rows.values()} == {"expert"}, case
        for row in rows.values():
            assert row["local_weight_shape"] == [ranges[0][1], *row["weight_shape"][1:]], case
            assert f"rank {ws - 1}: expert {ranges[-1][0]}" in row["reason"].replace("experts", "expert"), case
        assert got["forward"]["all_to_all"] == 2 * N_BLOCKS, case
        assert got["forward"]["all_reduce"] == 2 * N_BLOCKS + 1, case  # attention + experts per block; the lookup
        assert got["backward"]["all_to_all"] == 2 * N_BLOCKS and got["backward"]["all_gather"] == 2 * N_BLOCKS, case
        assert "expert" in set(got["plan"].values()), case
    assert set(r["tp"]) == set(TP_CASES[ws])
    for case, forward in r["tp"].items():
        assert forward.pop("styles") == sorted(["colwise", "rowwise"] * N_BLOCKS), case
        # gpt-oss's interleaved gate/up is read by strided slices, which keep the experts' colwise
        # shard (passes/rules/indexing.py): its experts are tensor parallel too, one all_reduce each;
        # on batched_mm experts as on grouped_mm ones (NOTE: [gathered experts] in passes/propagate.py).
        assert "all_to_all" not in forward and forward["all_reduce"] == 2 * N_BLOCKS + 1, case
    # With sequence parallelism (NOTE: [expert parallelism with sequence parallelism]): per block the attention's
    # and the MoE block's input all_gathered, their outputs reduce_scattered (a shared expert's summed in first);
    # the lookup's reduce_scatter, the head's input and logits gathered; no all_reduce in forward.
    assert set(r["sp"]) == set(SP_CASES[ws])
    for case, got in r["sp"].items():
        assert got["forward"] == {"reduce_scatter": 2 * N_BLOCKS + 1, "all_gather": 2 * N_BLOCKS + 2,
                                  "all_to_all": 2 * N_BLOCKS}, case
        assert got["backward"]["all_to_all"] == 2 * N_BLOCKS, case
    if ws == 2:  # the payload: every (token, expert) pair's row once each way, 16 tokens x top-2 x 64 x fp32
        stats = {c["phase"]: c for c in r["ep"]["mixtral"]["collectives"] if c["kind"] == "all_to_all"}
        assert stats["forward"]["bytes"] == N_BLOCKS * 2 * (2 * SEQ * 2 * 64 * 4)
        assert [s[0][:2] for s in r["shapes"]] == [(2, 2), (2, 5), (2, 3)]
        assert r["batch_of_one"] == {"shape": (1, 3, 128), "generate": [True, True]}
    else:
        uneven = r["uneven"]
        assert uneven["local_rows"] == expert_ranges(UNEVEN_EXPERTS, ws)[0][1] == 2
        assert uneven["train_mode"].startswith("captured at the first switch") and uneven["train_dispatches"]
        assert uneven["generate"]


def _param_fqns(program) -> dict[str, str]:
    return {s.arg.name: s.target for s in program.graph_signature.input_specs if s.kind == InputKind.PARAMETER}


def test_plan_names_one_block():
    """``plan={module: "expert"}`` makes one block expert parallel, the other keeps tensor
    parallelism inside its experts; ``report.plan`` round-trips; a plan key naming no experts
    module and fewer experts than ranks are refused."""
    model, inputs = examples.mixtral()
    captured, plan, report = _analyze(model, inputs, {}, CompileOptions(2, capture="export", plan={"model.layers.1.mlp.experts": "expert"}))
    styles = {row.name: row.style for row in report.layers if ".experts." in row.name}
    assert styles == {"model.layers.0.mlp.experts.gate_up_proj": "colwise", "model.layers.0.mlp.experts.down_proj": "rowwise",
                      "model.layers.1.mlp.experts.gate_up_proj": "expert", "model.layers.1.mlp.experts.down_proj": "expert"}
    again = fxtp.analyze(model, 2, inputs, plan=report.plan, dynamic=False, capture=CAPTURE)
    assert [row.style for row in again.layers] == [row.style for row in report.layers]
    graph, fqns = captured.program.graph, _param_fqns(captured.program)
    with pytest.raises(fxtp.FxtpPlanError, match="names no experts module"):
        select_blocks(graph, fqns, {"model.layers.0.self_attn": "expert"}, False, 2)
    blocks, _ = select_blocks(graph, fqns, {}, True, 8)
    with pytest.raises(fxtp.FxtpConfigError, match="fewer than world_size"):
        expert_parallel(graph, dataclasses.replace(plan, world_size=8), blocks, fqns)


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


@pytest.mark.parametrize("name,impl", [(name, "grouped_mm") for name in (*PUBLISHED, "Mixtral-8x7B")]
                         + [("Mixtral-8x7B", "batched_mm"), ("Qwen3-30B-A3B", "batched_mm")])
def test_published_configs_at_world_size_8(name, impl):
    """On meta, ``num_hidden_layers`` cut to 2, static shapes: under expert parallelism each
    rank keeps at most 1/8 + 0.03 of the parameter bytes, the experts' 1/8 exactly; under
    tensor parallelism (the default) too (measured: gpt-oss-20b 12.52%, Qwen3-30B-A3B 12.55%,
    DeepSeek-V2-Lite 13.04%, Mixtral-8x7B 12.50%; on ``batched_mm`` experts, NOTE: [gathered
    experts] in passes/propagate.py, the same), with one forward all_reduce per attention and
    per MoE block, plus the vocab-parallel lookup's."""
    if name == "Mixtral-8x7B":
        model, inputs = examples.mixtral_8x7b(n_layers=2)
    else:
        builder, config = PUBLISHED[name]
        model, _ = getattr(examples, builder)(num_hidden_layers=2, device="meta", **config)
        inputs = (torch.zeros(1, 512, dtype=torch.long, device="meta"),)
    model.set_experts_implementation(impl)  # transformers' public switch (modeling_utils.py)
    report = fxtp.analyze(model, 8, inputs, expert_parallel=True, dynamic=False, capture=CAPTURE)
    assert report.param_bytes_per_rank / report.param_bytes <= 1 / 8 + 0.03, report.param_bytes_per_rank / report.param_bytes
    rows = [row for row in report.layers if row.style == "expert"]
    assert rows and all(row.local_weight_shape[0] * 8 == row.weight_shape[0] for row in rows)
    assert report.count("forward", "all_to_all") == 2 * (1 if name == "DeepSeek-V2-Lite" else 2)
    tensor = fxtp.analyze(model, 8, inputs, dynamic=False, capture=CAPTURE)
    assert tensor.param_bytes_per_rank / tensor.param_bytes <= 1 / 8 + 0.03, tensor.param_bytes_per_rank / tensor.param_bytes
    assert "all_to_all" not in {c.kind for c in tensor.collectives if c.count} and "expert" not in set(tensor.plan.values())
    assert tensor.count("forward", "all_reduce") == 2 * 2 + 1
    styles = {row.style for row in tensor.layers if ".experts." in row.name}
    assert styles == {"colwise", "rowwise"}, styles


def _mla_checks() -> dict:
    """DeepSeek-V3's MLA (low-rank query, ``kv_b_proj`` expanding the latent into every head's
    key and value, the key filled into a ``new_empty`` buffer by ``copy_``, NOTE: [filled buffers]
    in passes/rules/index_copy.py), first block dense, second MoE: plain tensor parallelism
    (outputs, every gradient, 3 SGD steps), then sequence parallelism on one dynamic compile
    called at other batch sizes and token counts; each rank's parameter elements, counted on
    ``pm.parameters()`` by torch."""
    ws = dist.get_world_size()
    model, (ids,) = examples.deepseek_v3()
    r = compare_training(model, (ids[:, :SEQ],), dynamic=False, capture=CAPTURE)
    styles = {row["name"]: row["style"] for row in r["report"]["layers"] if ".self_attn." in row["name"]}
    three = torch.cat([ids, ids[:1].flip(1)])  # a batch of 3 (a batch of 1 takes a graph of its own)
    calls = [(ids[:, :ws],), (three[:, :3 * ws],), (ids[:, :2 * ws],)]
    held = lambda pm, ref: (sum(local_tensor(p).numel() for p in pm.parameters()), sum(p.numel() for p in ref.parameters()))
    s = compare_shapes(model, (ids[:, :SEQ],), calls, sequence_parallel=True, capture=CAPTURE, then=held)
    return {"styles": styles, "held": s["then"], "shapes": [x[0][:2] for x in s["shapes"]],
            "dims": s["report"]["inputs"], "report": r["report"]["param_bytes"]}


def test_mla_shards_kv_b_proj_by_heads(pool):
    """vLLM's MLA plan: ``q_b_proj`` and ``kv_b_proj`` colwise by heads, ``o_proj`` rowwise, the
    latent projections (``q_a_proj``, ``kv_a_proj_with_mqa``, read by a norm over the latent)
    replicated; exact under tensor parallelism, and under sequence parallelism at batches and
    token counts other than the compile's (its MoE block flattens the gathered tokens with the
    batch: no size is specialized). Parameters per rank (torch's count on ``pm.parameters()``):
    ws 2 54.3%, ws 4 31.4% of the model's (57.2% and 35.8% with ``kv_b_proj`` replicated)."""
    ws = pool.world_size
    (r, *_) = pool.run(_mla_checks)
    for block in (0, 1):
        prefix = f"model.layers.{block}.self_attn."
        assert {k[len(prefix):]: v for k, v in r["styles"].items() if k.startswith(prefix)} == {
            "q_a_proj": "replicate", "q_b_proj": "colwise", "kv_a_proj_with_mqa": "replicate", "kv_b_proj": "colwise",
            "o_proj": "rowwise"}
    assert r["shapes"] == [(2, ws), (3, 3 * ws), (2, 2 * ws)]
    assert all("symbol" in d for spec in r["dims"] for d in spec["dims"]), r["dims"]  # batch and tokens stay symbols
    held, total = r["held"]
    assert held / total == pytest.approx({2: 0.5429, 4: 0.3143}[ws], abs=1e-4), held / total
    assert r["report"]["by_rank"][0] / r["report"]["total"] == pytest.approx(held / total, abs=1e-9)
