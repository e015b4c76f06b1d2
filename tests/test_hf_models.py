"""Hugging Face models built from their config classes (random weights, nothing downloaded), on
real gloo process groups at world sizes 2 and 4, against the single-device model.

Tiny configs (fxtp/cli/examples.py): 2 layers, hidden 64, 4 heads, vocab 128, seq 16, dropout 0.
Each test checks outputs, every gradient and 3 SGD steps, Megatron's collective floor, and that
every layer left replicated says why.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import compare_training, megatron_floor

import fxtp
from fxtp.cli import examples

pytest.importorskip("transformers")

N_BLOCKS = 2


def _train(name: str, dtype=None, tol=None, **overrides):
    model, inputs = getattr(examples, name)(**overrides)
    if dtype is not None:
        model = model.to(dtype)
    return compare_training(model, inputs, **(tol or {}))


def _layers(result) -> dict[str, dict]:
    return {row["name"]: row for row in result["report"]["layers"]}


def _every_replicated_layer_says_why(result) -> None:
    for row in result["report"]["layers"]:
        if row["style"] == "replicate":
            assert row["code"] and row["reason"] and row["fix"], row


def test_gpt2(pool):
    """Conv1D layers (addmm with an (in, out) weight), the fused c_attn split into Q, K, V, and
    the LM head tied to the token embedding: one vocab-parallel weight for both."""
    (r, *_) = pool.run(_train, "gpt2")
    layers = _layers(r)
    for i in range(N_BLOCKS):
        attn, mlp = f"transformer.h.{i}.attn", f"transformer.h.{i}.mlp"
        assert layers[f"{attn}.c_attn"]["style"] == "colwise"
        assert "[64, 64, 64]" in layers[f"{attn}.c_attn"]["reason"]  # each rank: its Q|K|V heads
        assert layers[f"{attn}.c_attn"]["local_weight_shape"] == [64, 192 // pool.world_size]
        assert layers[f"{mlp}.c_fc"]["style"] == "colwise"
        assert layers[f"{attn}.c_proj"]["style"] == layers[f"{mlp}.c_proj"]["style"] == "rowwise"
    assert layers["transformer.wte"]["style"] == "rowwise"  # vocab-parallel
    assert layers["lm_head"]["style"] == "colwise"  # same weight, same shard
    assert layers["transformer.wpe"]["code"] == "small-embedding"
    assert (r["forward"], r["backward"]) == megatron_floor(r["report"], N_BLOCKS)
    _every_replicated_layer_says_why(r)


def _gpt2_uneven():
    """GPT-2 with 6 heads of 16 and a prime vocabulary of 131 (the ids stay below 128)."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(examples.gpt2_config(n_embd=96, n_head=6, vocab_size=131)).eval()
    return compare_training(model, examples.gpt2()[1])


def test_gpt2_uneven_heads_and_vocabulary(pool):
    """NOTE: [uneven shards]: 6 heads at ws 4 are 2/2/1/1 whole heads of each of Q, K, V in the
    fused c_attn (3/3 at ws 2, even); 131 vocabulary rows are 66/65 and 33/33/33/32, one shard
    for the tied embedding and head."""
    results = pool.run(_gpt2_uneven)
    ws = pool.world_size
    layers = _layers(results[0])
    heads = [6 // ws + (r < 6 % ws) for r in range(ws)]
    rows = [131 // ws + (r < 131 % ws) for r in range(ws)]
    for i in range(N_BLOCKS):
        attn = f"transformer.h.{i}.attn"
        assert layers[f"{attn}.c_attn"]["style"] == "colwise" and layers[f"{attn}.c_proj"]["style"] == "rowwise"
    assert layers["transformer.wte"]["style"] == "rowwise" and layers["lm_head"]["style"] == "colwise"
    for r, result in enumerate(results):
        shapes = result["local_shapes"]
        assert shapes["transformer.h.0.attn.c_attn.weight"] == (96, 3 * 16 * heads[r])
        assert shapes["transformer.h.0.attn.c_proj.weight"] == (16 * heads[r], 96)
        assert shapes["transformer.wte.weight"] == (rows[r], 96)
    assert (results[0]["forward"], results[0]["backward"]) == megatron_floor(results[0]["report"], N_BLOCKS)


def test_llama_gqa(pool):
    """GQA (4 heads, 2 kv heads), rotary embeddings, RMSNorm as pow/mean/rsqrt, SwiGLU."""
    (r, *_) = pool.run(_train, "llama")
    layers = _layers(r)
    ws = pool.world_size
    for i in range(N_BLOCKS):
        p = f"model.layers.{i}."
        assert layers[p + "self_attn.q_proj"]["style"] == "colwise"
        assert layers[p + "self_attn.o_proj"]["style"] == "rowwise"
        assert [layers[p + f"mlp.{m}_proj"]["style"] for m in ("gate", "up", "down")] == ["colwise", "colwise", "rowwise"]
        # ws 2: one kv head per rank; ws 4: each rank holds the kv head its 2 query heads read
        assert layers[p + "self_attn.k_proj"]["style"] == layers[p + "self_attn.v_proj"]["style"] == "colwise"
        assert layers[p + "self_attn.k_proj"]["local_weight_shape"] == [16, 64]
    forward, backward = megatron_floor(r["report"], N_BLOCKS)
    assert r["forward"] == forward
    # ws 4: the k/v gradients are summed over the ranks that hold them, one all_reduce per block
    assert r["backward"] == (backward if ws == 2 else {"all_reduce": backward["all_reduce"] + N_BLOCKS})
    _every_replicated_layer_says_why(r)


@pytest.mark.parametrize("kv_heads", [1, 4], ids=["mqa", "mha"])
def test_llama_kv_head_counts(pool, kv_heads):
    """MQA (1 kv head, fewer than world_size) and as many kv heads as query heads."""
    (r, *_) = pool.run(_train, "llama", num_key_value_heads=kv_heads)
    layers = _layers(r)
    k = layers["model.layers.0.self_attn.k_proj"]
    assert k["style"] == "colwise"  # MQA: every rank holds the one kv head (NOTE: [grouped shards])
    assert layers["model.layers.0.self_attn.q_proj"]["style"] == "colwise"
    assert r["forward"] == megatron_floor(r["report"], N_BLOCKS)[0]
    _every_replicated_layer_says_why(r)


def test_llama_bf16(pool):
    """A bf16 model, checked with a bf16 tolerance (8 mantissa bits; summation order differs)."""
    (r, *_) = pool.run(_train, "llama", dtype=torch.bfloat16, tol={"rtol": 2e-2, "atol": 2e-2})
    assert _layers(r)["model.layers.0.mlp.gate_proj"]["style"] == "colwise"
    assert r["forward"] == megatron_floor(r["report"], N_BLOCKS)[0]


def test_bert(pool):
    """Encoder with the default attention mask, token-type and position tables, pooler."""
    (r, *_) = pool.run(_train, "bert")
    layers = _layers(r)
    for i in range(N_BLOCKS):
        p = f"encoder.layer.{i}."
        for m in ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"):
            assert layers[p + m]["style"] == "colwise", m
        assert layers[p + "attention.output.dense"]["style"] == layers[p + "output.dense"]["style"] == "rowwise"
    assert layers["embeddings.word_embeddings"]["style"] == "rowwise"
    for table in ("position_embeddings", "token_type_embeddings"):
        assert layers[f"embeddings.{table}"]["code"] == "small-embedding"
    assert layers["pooler.dense"]["code"] == "needs-gather"  # a square layer at the output
    assert (r["forward"], r["backward"]) == megatron_floor(r["report"], N_BLOCKS)
    _every_replicated_layer_says_why(r)


class _LossOnly(torch.nn.Module):
    """``model(input_ids=ids, labels=labels).loss``: the loss computed inside the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels).loss


def _train_with_labels():
    model, (ids,) = examples.llama()
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt that is not trained on
    return compare_training(_LossOnly(model), (ids, labels))


def test_llama_labels_keep_the_head_colwise(pool):
    """``labels=``: Hugging Face's cross entropy on the colwise head's logits is vocab-parallel
    (3 all_reduce of (N,)), so lm_head stays colwise and its logits are never gathered."""
    (r, *_) = pool.run(_train_with_labels)
    head = _layers(r)["model.lm_head"]
    assert head["style"] == "colwise" and "cross_entropy" in head["reason"]
    floor_fwd, _ = megatron_floor(r["report"], N_BLOCKS)
    assert r["forward"] == {"all_reduce": floor_fwd["all_reduce"] + 3}


def _llama(**config):
    import transformers

    torch.manual_seed(0)
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **(sizes | config), use_cache=False, pad_token_id=None, eos_token_id=None, bos_token_id=None)).eval()


class _CrossAttention(torch.nn.Module):
    """Queries from ``x``, keys and values from ``memory``: compiled with ``(x, x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.out = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x, memory, memory, need_weights=False)[0])


def _aliased_examples() -> dict:
    """Issue 35, item 1: example inputs that are one tensor (``labels=ids``; ``(x, x)``), a view
    of another, or another view of one storage, compile to independent graph inputs: every
    later call equals the model on the inputs it is given (outputs, every gradient, 2 SGD steps)."""
    import copy

    import torch.distributed as dist

    ws = dist.get_world_size()
    gen = torch.Generator().manual_seed(3)
    ids, other, labels = (torch.randint(0, 128, (2, 8), generator=gen) for _ in range(3))
    plans = {}
    for frontend in ("export",):  # every frontend: tests/test_api.py
        model = _llama()
        pm = fxtp.compile(copy.deepcopy(model), ws, (ids,), example_kwargs={"labels": ids}, dynamic=False, capture=frontend)
        got, want = pm(other, labels=labels), model(other, labels=labels)
        torch.testing.assert_close(got.logits, want.logits)
        torch.testing.assert_close(got.loss, want.loss)
        plans[frontend] = pm.plan["lm_head"]
    torch.manual_seed(0)
    x, memory = torch.randn(2, 6, 32, generator=gen), torch.randn(2, 6, 32, generator=gen)
    wide = torch.randn(2, 12, 32, generator=gen)
    for name, example in {"same": (x, x), "view": (x, x.view(2, 6, 32)), "one storage": (wide[:, :6], wide[:, 6:])}.items():
        result = compare_training(_CrossAttention(), (x, memory), steps=2, compile_inputs=example)
        plans[name] = result["plan"]["attn.out_proj"]
    return plans


def test_aliased_example_inputs_stay_separate(pool):
    (plans, *_) = pool.run(_aliased_examples)
    assert plans == {"export": "colwise", "same": "rowwise", "view": "rowwise", "one storage": "rowwise"}


def _longrope() -> dict:
    """Issue 35, item 2: Phi-3's longrope rotary (its factors switch once the sequence passes
    ``original_max_position_embeddings`` = 8), compiled at 6 tokens: exact at 12, 24 and 6
    again, and the user's model bitwise as it was (buffers, plain tensor attributes such as
    ``long_inv_freq``), fresh or after a run past 8 tokens. Llama's dynamic NTK rotary is
    refused, and a refused compile leaves its model as it was too."""
    import copy

    import torch.distributed as dist
    import transformers
    from _helpers import assert_model_unchanged, model_state

    ws = dist.get_world_size()
    half = 8
    config = transformers.Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, original_max_position_embeddings=8, use_cache=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                      "long_factor": [2.0 + 0.3 * i for i in range(half)]})
    gen = torch.Generator().manual_seed(4)
    errors = {}
    for warm in (0, 12):  # a fresh model; one that ran past 8 tokens (its long_inv_freq set, inv_freq long)
        torch.manual_seed(0)
        model = transformers.Phi3ForCausalLM(config).eval()
        if warm:
            model(torch.randint(0, 128, (2, warm), generator=gen))
        ref, before = copy.deepcopy(model), model_state(model)
        pm = fxtp.compile(model, ws, (torch.randint(0, 128, (2, 6), generator=gen),))
        assert_model_unchanged(model, before)
        for seq in (12, 24, 6):
            x = torch.randint(0, 128, (2, seq), generator=gen)
            got, want = pm(x).logits, ref(x).logits
            errors[(warm, seq)] = (got - want).abs().max().item()
            torch.testing.assert_close(got, want, msg=lambda m, seq=seq: f"longrope at {seq} tokens: {m}")
        assert_model_unchanged(model, before, "running pm")
        for seq in (12, 6):  # the user's model still computes its own logits (its rotary may now write to itself)
            x = torch.randint(0, 128, (2, seq), generator=gen)
            torch.testing.assert_close(model(x).logits, ref(x).logits, rtol=0, atol=0)
    ntk = _llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8)
    before = model_state(ntk)
    try:
        fxtp.compile(ntk, ws, (torch.randint(0, 128, (2, 6), generator=gen),))
    except fxtp.FxtpError as exc:
        refused = str(exc)
    else:
        raise AssertionError("dynamic NTK rotary compiled")
    assert_model_unchanged(ntk, before, "a refused fxtp.compile")
    return {"refused": refused, "worst": max(errors.values())}


def test_longrope_is_exact_at_every_length_and_the_model_stays_as_it_was(pool):
    (r, *_) = pool.run(_longrope)
    assert r["worst"] < 1e-4
    assert "modeling_rope_utils.py" in r["refused"] and "seq_len > max_seq_len_cached" in r["refused"], r["refused"]
