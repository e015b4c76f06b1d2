"""Grouped-query attention whose heads do not divide world_size (NOTE: [grouped shards] in
fxtp/core/placement.py): query heads split in whole heads front-loaded, every rank holding the
kv heads its query heads read, their gradients summed over the holders.

Published configs are analyzed on the ``meta`` device; tiny versions train on real gloo ranks at
world sizes 2, 3 and 4 against the single-device model (outputs, every gradient, 3 SGD steps).
"""

from __future__ import annotations

import pytest
import torch
from _helpers import compare_training, megatron_floor
from cases import Attention

import fxtp
from fxtp.core.placement import kv_unit_range, local_ranges, Shard

pytest.importorskip("transformers")


def _published(name: str, layers: int = 2) -> torch.nn.Module:
    """Qwen2.5-7B (Qwen/Qwen2.5-7B/config.json: hidden 3584, 28 heads, 4 kv heads, MLP 18944,
    vocab 152064, untied) and StarCoder2-7B (bigcode/starcoder2-7b/config.json: hidden 4608, 36
    heads, 4 kv heads, MLP 18432, vocab 49152, biases), bf16, with ``num_hidden_layers`` cut to
    ``layers`` (every block is the same; at 2 the embeddings weigh more than at full depth)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Starcoder2Config, Starcoder2ForCausalLM

    common = dict(num_hidden_layers=layers, num_key_value_heads=4, use_cache=False, tie_word_embeddings=False, dtype=torch.bfloat16)
    if name == "qwen2.5-7b":
        cls, cfg = Qwen2ForCausalLM, Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                                                 max_position_embeddings=32768, rms_norm_eps=1e-6, **common)
    else:
        cls, cfg = Starcoder2ForCausalLM, Starcoder2Config(vocab_size=49152, hidden_size=4608, intermediate_size=18432,
                                                           num_attention_heads=36, max_position_embeddings=16384, bos_token_id=0,
                                                           eos_token_id=0, **common)
    with torch.device("meta"):
        return cls(cfg).to(torch.bfloat16).eval()


@pytest.mark.parametrize("name,heads", [("qwen2.5-7b", 28), ("starcoder2-7b", 36)])
def test_published_uneven_gqa_at_world_size_8(name, heads):
    """Rank 1 holds the most (front-loaded query heads, and its heads read 2 kv heads): at most
    1/8 + 0.03 of the bytes, at Megatron's forward floor (2 per block + the embedding's)."""
    model = _published(name)
    report = fxtp.analyze(model, 8, (torch.zeros(1, 16, dtype=torch.long, device="meta"),), rank=1)
    d = report.to_dict()
    assert d["param_bytes"]["per_rank"] <= (1 / 8 + 0.03) * d["param_bytes"]["total"]
    assert report.count("forward", "all_reduce") == megatron_floor(d, 2)[0]["all_reduce"] == 5
    rows = {row["name"]: row for row in d["layers"]}
    attn = "model.layers.0.self_attn."
    assert [rows[attn + m]["style"] for m in ("q_proj", "k_proj", "v_proj", "o_proj")] == ["colwise"] * 3 + ["rowwise"]
    q_rows = -(-heads // 8) * 128  # ranks 0..3 hold ceil(heads / 8) query heads of 128
    assert rows[attn + "q_proj"]["local_weight_shape"][0] == q_rows  # the rows show rank 0's shards
    assert rows[attn + "k_proj"]["local_weight_shape"][0] == rows[attn + "v_proj"]["local_weight_shape"][0] == 128
    # rank 1's query heads (4..7 of 28 at 7 per kv head; 5..9 of 36 at 9) read kv heads 0 and 1
    assert kv_unit_range(q_rows // 128, q_rows // 128, heads // 4) == (0, 2)
    assert "kv heads [0:1] [0:2] [1:2] [1:3] [2:3] [2:4] [3:4] [3:4] per rank" in rows[attn + "k_proj"]["reason"]


# world_size -> (hidden, query heads, kv heads, how k/v are repeated): each a kind of kv split
# (at ws 2 the others' kv heads divide: the even split of before)
_TINY = {
    2: [(56, 7, 1, "enable_gqa")],  # multi-query, heads 4/3: both ranks hold the one kv head
    3: [(80, 10, 2, "interleave")],  # repeat_interleave, heads 4/3/3: rank 1's heads 4..6 read kv heads 0 and 1
    4: [(48, 6, 2, "expand"), (56, 7, 1, "enable_gqa")],  # Hugging Face's repeat_kv, heads 2/2/1/1: rank 1 reads both
}


def _train_tiny(ws: int) -> list[dict]:
    out = []
    for hidden, heads, kv_heads, repeat in _TINY[ws]:
        torch.manual_seed(0)
        model = Attention(hidden, heads, kv_heads, repeat=repeat)
        r = compare_training(model, (torch.randn(2, 8, hidden, generator=torch.Generator().manual_seed(1)),))
        out.append({k: r[k] for k in ("plan", "forward", "backward", "local_shapes", "code")})
    return out


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_tiny_uneven_gqa_trains_exactly(rank_pools, ws):
    """Outputs, every gradient (each rank's k/v rows against the matching slice of the single
    device's gradient: the holders' sum) and 3 SGD steps, through ``compare_training``; the
    local k/v weights are the kv heads the rank's query heads read."""
    results = rank_pools(ws).run(_train_tiny, ws)
    for (hidden, heads, kv_heads, repeat), per_rank in zip(_TINY[ws], zip(*results)):
        hd = hidden // heads
        r = per_rank[0]
        assert r["plan"] == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}, (heads, ws, r["plan"])
        assert r["forward"] == {"all_reduce": 1}
        # x needs no gradient: the one backward all_reduce sums the k/v gradients over their holders
        assert r["backward"] == {"all_reduce": 1}, (heads, ws)
        for rank, rank_result in enumerate(per_rank):
            ((q_start, q_count),) = local_ranges(Shard(0, (heads,)), rank, ws)
            kv = kv_unit_range(q_start, q_count, heads // kv_heads)[1]
            shapes = rank_result["local_shapes"]
            assert shapes["q.weight"] == (q_count * hd, hidden) and shapes["o.weight"] == (hidden, q_count * hd)
            assert shapes["k.weight"] == shapes["v.weight"] == (kv * hd, hidden), (heads, ws, rank)
        if repeat == "interleave":
            assert "repeat_kv_heads" in r["code"]  # a per-rank start into the repeated heads
        elif repeat == "expand":  # Hugging Face's repeat_kv runs as enable_gqa on the rank's own kv heads
            assert "grouped_query_attention_local_kv" in r["code"]


def _hf_eager(name: str):
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    small = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=16, use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    if name == "gemma2":  # eager for its soft-capping
        return Gemma2ForCausalLM(Gemma2Config(head_dim=16, **small)).eval()
    return LlamaForCausalLM(LlamaConfig(**small)).eval()


def _train_eager() -> dict:
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    return {name: compare_training(_hf_eager(name), (ids,))["report"] for name in ("gemma2", "llama")}


def test_eager_attention_with_fewer_kv_heads_than_ranks(rank_pools):
    """Hugging Face's eager attention (``repeat_kv`` = expand + reshape, then matmul/softmax):
    2 kv heads at ws 4 shard as the SDPA path does, exactly; the forward at Megatron's floor."""
    (reports, *_) = rank_pools(4).run(_train_eager)
    for name, report in reports.items():
        rows = {row["name"]: row for row in report["layers"]}
        attn = "model.layers.0.self_attn."
        assert [rows[attn + m]["style"] for m in ("q_proj", "k_proj", "v_proj", "o_proj")] == ["colwise"] * 3 + ["rowwise"], name
        assert rows[attn + "k_proj"]["local_weight_shape"] == [16, 64]  # one kv head of 16 per rank
        forward = next(c for c in report["collectives"] if c["phase"] == "forward" and c["kind"] == "all_reduce")
        assert forward["count"] == megatron_floor(report, 1)[0]["all_reduce"], name
