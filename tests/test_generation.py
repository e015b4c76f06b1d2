"""``pm.generate`` (fxtp/runtime/generation.py, NOTE: [generation]) and state written in place stored
sharded (NOTE: [sharded state]), on real gloo process groups against the single device.

Greedy decoding must be token-identical to Hugging Face's ``model.generate`` (which runs its
own dynamic cache); sampling must draw the same token on every rank (and, with the same seed,
the single device's). Tiny configs, random weights, nothing downloaded.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fxtp
from fxtp.cli import examples
from fxtp.runtime import generation
from fxtp.core.errors import FxtpInputError

pytest.importorskip("transformers")


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                      use_cache=False)
    return Qwen2ForCausalLM(cfg).eval()


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=16, sliding_window=None, pad_token_id=0,
                        bos_token_id=0, eos_token_id=0, use_cache=False)
    return MistralForCausalLM(cfg).eval()


def _uneven(name: str) -> nn.Module:
    """6 heads of 16 (GPT-2; Qwen2 with 3 kv heads): at ws 4 (GPT-2) or 2 (Qwen2's kv heads) the
    heads split unevenly or stay whole (NOTE: [uneven shards]); the decoder must shard alike."""
    torch.manual_seed(0)
    if name == "gpt2-6-heads":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(n_embd=96, n_head=6, n_layer=2, vocab_size=128, n_positions=16, use_cache=False,
                                          bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                                        num_key_value_heads=3, vocab_size=128, max_position_embeddings=16, use_cache=False,
                                        pad_token_id=0, bos_token_id=0, eos_token_id=0)).eval()


def _fewer_kv_heads(name: str) -> nn.Module:
    """kv heads that do not divide world_size (each rank holds the kv heads its query heads read,
    NOTE: [grouped shards]): Llama with one kv head (MQA), Qwen2 8 heads / 2 kv heads, Mistral
    12 heads / 3 kv heads (at ws 4 ranks 1 and 2 need 2 of them), Qwen2 6 heads / 2 kv heads
    (uneven GQA: query heads 2/2/1/1, rank 1's heads 2, 3 read kv heads 0 and 1)."""
    torch.manual_seed(0)
    if name == "llama-mqa":
        return examples.llama(num_key_value_heads=1)[0]
    small = dict(vocab_size=128, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=16, use_cache=False,
                 pad_token_id=0, bos_token_id=0, eos_token_id=0)
    if name == "qwen2-8-heads":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, **small)).eval()
    if name == "qwen2-6q-2kv":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, **small)).eval()
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(hidden_size=96, num_attention_heads=12, num_key_value_heads=3, sliding_window=None,
                                            **small)).eval()


def _model(name: str) -> nn.Module:
    if name.endswith("6-heads"):
        return _uneven(name)
    if name in _KV_HEADS_KEPT_BY_RANK:
        return _fewer_kv_heads(name)
    if name == "qwen2":
        return _qwen2()
    if name == "mistral":
        return _mistral()
    return getattr(examples, name)()[0]


def _ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length))


def _greedy(name: str, shapes: list[tuple[int, int, int]]) -> dict:
    model = _model(name)
    pm = fxtp.compile(model, dist.get_world_size(), (_ids(2, 16),), dynamic=False)  # only its decoders run
    out = {"equal": [], "cache_shapes": []}
    for batch, length, new in shapes:
        prompt = _ids(batch, length)
        want = model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
        got = pm.generate(prompt, max_new_tokens=new)
        out["equal"].append((batch, length, new, torch.equal(got, want), got.tolist(), want.tolist()))
    decoder = pm._generation.decoders[(2, 16)]
    out["cache_shapes"] = sorted({tuple(decoder.get_buffer(k).shape) for k in decoder.written_state if decoder.get_buffer(k).dim() == 4})
    out["decoders"] = sorted(pm._generation.decoders)
    out["cache_bytes"] = generation.cache_bytes(pm)
    out["decoder_bytes"] = _decoder_bytes(pm)
    if name == "llama" and dist.get_world_size() == 2:
        out["sampled"] = _sampled(model, pm)
    return out


def _decoder_bytes(pm: nn.Module) -> int:
    """Bytes of the tensors the decoders hold that ``pm`` does not (counted by storage)."""
    def storages(module: nn.Module) -> dict[int, int]:
        tensors = [*module.parameters(), *module.buffers()]
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    own = storages(pm)
    held: dict[int, int] = {}
    for decoder in pm._generation.decoders.values():
        held |= {ptr: n for ptr, n in storages(decoder).items() if ptr not in own}
    return sum(held.values())


def _sampled(model: nn.Module, pm: nn.Module) -> dict:
    prompt = _ids(2, 4)
    torch.manual_seed(1234 + dist.get_rank())  # the ranks' generators differ: rank 0's draw decides
    got = pm.generate(prompt, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    every = [torch.empty_like(got) for _ in range(dist.get_world_size())]
    dist.all_gather(every, got)
    torch.manual_seed(1234)
    want = model.generate(prompt, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, pad_token_id=0)
    return {"same_on_ranks": all(torch.equal(t, got) for t in every), "equal_single": torch.equal(got, want)}


# NOTE: [kv heads kept by the ranks that need them]: (model, world_size) -> the kv heads of the
# cache each rank keeps, where the kv heads do not divide world_size; 2 layers, k and v each.
_KV_HEADS_KEPT_BY_RANK = {
    "llama-mqa": {2: [1, 1], 4: [1, 1, 1, 1]},  # 4 heads, 1 kv head: each rank keeps it
    "qwen2-8-heads": {4: [1, 1, 1, 1]},  # 8 heads, 2 kv heads: ranks 0, 1 keep kv head 0; ranks 2, 3 kv head 1
    "mistral-12-heads": {4: [1, 2, 2, 1]},  # 12 heads, 3 kv heads: rank 1's heads 3..5 use kv heads 0, 1
    "qwen2-6q-2kv": {4: [1, 2, 1, 1]},  # 6 heads 2/2/1/1, 2 kv heads: uneven GQA (test_gqa.py trains it)
}


@pytest.mark.parametrize(
    "name", ["llama", "gpt2", "mixtral", "qwen2", "mistral", "gpt2-6-heads", "qwen2-6-heads", *_KV_HEADS_KEPT_BY_RANK]
)
def test_greedy_generate_is_token_identical(pool, name):
    at = {"llama": (2, 4), "gpt2-6-heads": (4,), **{n: tuple(ws) for n, ws in _KV_HEADS_KEPT_BY_RANK.items()}}.get(name, (2,))
    if pool.world_size not in at:
        pytest.skip(f"{name} is checked at ws {at} (llama: 2 kv heads on 4 ranks; GPT-2: 6 heads 2/2/1/1; fewer kv heads than ranks)")
    shapes = [(2, 6, 8), (2, 3, 5), (1, 4, 6)] if name == "llama" and pool.world_size == 2 else [(2, 5, 6)]
    results = pool.run(_greedy, name, shapes)
    for r in results:
        for batch, length, new, equal, got, want in r["equal"]:
            assert equal, f"{name} ws{pool.world_size} batch {batch} prompt {length} +{new}: {got} != {want}"
    r = results[0]
    # One decoder per batch size: prompt lengths 6 and 3 share the 16-position cache.
    assert r["decoders"] == ([(1, 16), (2, 16)] if len(shapes) == 3 else [(2, 16)])
    if name == "llama" and pool.world_size == 2:  # 2 kv heads of 16: one per rank, the cache split by heads
        assert r["cache_shapes"] == [(2, 1, 16, 16)]
    if name == "llama" and pool.world_size == 4:  # 2 kv heads on 4 ranks: k/v whole; ranks 0, 1 keep kv head 0
        for r in results:
            assert r["cache_shapes"] == [(2, 1, 16, 16)]
            assert r["cache_bytes"] == 2 * 2 * (2 * 1 * 16 * 16) * 4 + 2 * 8  # and the 2 position counters
    for rank, (r, heads) in enumerate(zip(results, _KV_HEADS_KEPT_BY_RANK.get(name, {}).get(pool.world_size, []))):
        head_dim = {"llama-mqa": 16}.get(name, 8)
        assert r["cache_shapes"] == [(2, heads, 16, head_dim)], (rank, r["cache_shapes"])
    for r in results:  # the decoders hold their cache and nothing else of their own
        assert r["cache_bytes"] == r["decoder_bytes"], r
    if name == "llama" and pool.world_size == 2:  # sampling: rank 0 draws, every rank appends its token
        for r in results:
            assert r["sampled"]["same_on_ranks"] and r["sampled"]["equal_single"], r["sampled"]


@pytest.mark.parametrize("heads,kv_heads,ws", [(8, 2, 4), (12, 3, 4), (6, 3, 2), (4, 1, 4), (6, 2, 4)])
def test_kept_kv_heads_attend_as_the_whole_cache(heads, kv_heads, ws):
    """NOTE: [kv heads kept by the ranks that need them]: each rank writes the kv heads its query
    heads need (``local_ops.kv_head_range``, even or uneven query shards) and attends with them
    as the single device's ``enable_gqa`` attention does with the whole cache."""
    from fxtp.core import local_ops
    from fxtp.core.placement import Shard, local_ranges

    torch.manual_seed(0)
    q, k, v = torch.randn(2, heads, 3, 8), torch.randn(2, kv_heads, 3, 8), torch.randn(2, kv_heads, 3, 8)
    mask = torch.ones(3, 5, dtype=torch.bool).tril(2)
    full_k, full_v = (torch.zeros(2, kv_heads, 5, 8).index_copy_(2, torch.arange(3), t) for t in (k, v))
    want = nn.functional.scaled_dot_product_attention(q, full_k, full_v, attn_mask=mask, enable_gqa=True)
    group = heads // kv_heads
    for rank in range(ws):
        ((start, count),) = local_ranges(Shard(1, (heads,)), rank, ws)
        first, n = local_ops.kv_head_range(start, count, group)
        assert (first, n) == (start // group, (start + count - 1) // group - start // group + 1)
        caches = [torch.zeros(2, n, 5, 8), torch.zeros(2, n, 5, 8)]
        for cache, source in zip(caches, (k, v)):
            local_ops.index_copy_kv_heads(cache, 2, torch.arange(3), source, start, count, group, 1)
        got = local_ops.grouped_query_attention_local_kv(start, group, q[:, start:start + count], *caches, mask)
        torch.testing.assert_close(got, want[:, start:start + count], rtol=0, atol=1e-6)


class _Decoder(nn.Module):
    """A hand-written decode step with a static KV cache buffer written in place (not a Hugging
    Face model): 4 heads of 8, q/k/v/o Linear(32, 32)."""

    def __init__(self, batch: int = 2, max_len: int = 8) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))
        self.register_buffer("k_cache", torch.zeros(batch, 4, max_len, 8), persistent=False)
        self.register_buffer("v_cache", torch.zeros(batch, 4, max_len, 8), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, 4, 8).transpose(1, 2) for f in (self.q, self.k, self.v))
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        n = int(self.k_cache.shape[2])
        mask = torch.arange(n)[None, :] <= pos[:, None]
        y = nn.functional.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(b, t, 32))


def _custom_decode_steps() -> dict:
    torch.manual_seed(0)
    model = _Decoder()
    single = _Decoder()
    single.load_state_dict(model.state_dict())
    x = torch.randn(2, 8, 32)
    pm = fxtp.compile(model, dist.get_world_size(), (x[:, :1], torch.tensor([0])), dynamic=False)
    errors = []
    with torch.no_grad():
        for t in range(8):
            errors.append(float((pm(x[:, t:t + 1], torch.tensor([t])) - single(x[:, t:t + 1], torch.tensor([t]))).abs().max()))
    styles = {row.name: row.style for row in pm.report.layers}
    return {"errors": errors, "styles": styles, "cache": tuple(pm.get_buffer("k_cache").shape),
            "model_cache_untouched": bool((model.k_cache == 0).all())}


def test_cache_buffer_written_in_place_is_stored_sharded(pool):
    """NOTE: [sharded state]: each rank keeps its heads' part of the cache; 8 decode steps equal
    the single device's, and the user's model keeps its own (zero) cache."""
    for r in pool.run(_custom_decode_steps):
        assert max(r["errors"]) < 1e-5, r["errors"]
        assert r["styles"] == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
        assert r["cache"] == (2, 4 // pool.world_size, 8, 8)
        assert r["model_cache_untouched"]


def test_generate_refuses_what_it_cannot_do():
    model, (ids,) = examples.llama()
    pm = fxtp.compile(model, 1, (ids,), dynamic=False)
    with pytest.raises(FxtpInputError, match="exceeds the model's 16 positions"):
        pm.generate(ids[:, :10], max_new_tokens=7)
    with pytest.raises(FxtpInputError, match="pads some prompt on the right"):
        pm.generate(ids[:, :4], max_new_tokens=2, attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(FxtpInputError, match="shaped like input_ids"):
        pm.generate(ids[:, :4], max_new_tokens=2, attention_mask=torch.ones(2, 5))
    with pytest.raises(FxtpInputError, match=r"num_beams=3 \(beam search\) is not supported.*model.generate"):
        pm.generate(ids[:, :4], max_new_tokens=2, num_beams=3)
    gpt2, (ids2,) = examples.gpt2()
    with pytest.raises(FxtpInputError, match="holds the pad token 5"):  # pad != eos: HF would mask it
        fxtp.compile(gpt2, 1, (ids2,)).generate(torch.tensor([[3, 5, 7]]), max_new_tokens=2, pad_token_id=5)
    with pytest.raises(FxtpInputError, match="int64"):
        pm.generate(ids[:, :4].float(), max_new_tokens=2)
    mlp, inputs = examples.mlp()
    with pytest.raises(FxtpInputError, match="Hugging Face causal LM"):
        fxtp.compile(mlp, 1, inputs).generate(torch.zeros(1, 2, dtype=torch.long))


def _left_padded(batch: int, lengths: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of ``lengths`` tokens, left-padded with 0 to ``length``, and their mask, as a
    tokenizer with ``padding_side='left'`` makes them."""
    ids = _ids(batch, length)
    mask = torch.zeros(batch, length, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, length - n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


def _padded(name: str) -> dict:
    model = _model(name)
    pm = fxtp.compile(model, dist.get_world_size(), (_ids(2, 16),), dynamic=False)  # only its decoders run
    out = {}
    for batch, lengths, new in [(3, [3, 6, 1], 7), (2, [4, 2], 5), (3, [6, 6, 6], 4)]:
        prompt, mask = _left_padded(batch, lengths, max(lengths))
        want = model.generate(prompt, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
        got = pm.generate(prompt, attention_mask=mask, max_new_tokens=new)
        out[str(lengths)] = (torch.equal(got, want), got.tolist(), want.tolist())
    prompt, mask = _left_padded(2, [2, 5], 5)
    torch.manual_seed(7 + dist.get_rank())  # rank 0 draws
    got = pm.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20)
    torch.manual_seed(7)
    want = model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20,
                          pad_token_id=0)
    out["sampled"] = (torch.equal(got, want), got.tolist(), want.tolist())
    out["decoders"] = (sorted(pm._generation.decoders), sorted(pm._generation.padded))
    return out


@pytest.mark.parametrize("ws,name", [(2, "llama"), (2, "gpt2"), (4, "llama")])
def test_left_padded_prompts_of_different_lengths(rank_pools, ws, name):
    """Hugging Face's padded batches (``attention_mask``, left padding, a prompt of one token
    beside one of six) decode token-identically to ``model.generate``, greedy and sampled with a
    seed; an unpadded batch keeps the unpadded decoder; one padded decoder per batch size."""
    for r in rank_pools(ws).run(_padded, name):
        decoders = r.pop("decoders")
        for key, (equal, got, want) in r.items():
            assert equal, f"{name} ws{ws} {key}: {got} != {want}"
        assert decoders == ([(3, 16)], [(2, 16), (3, 16)]), decoders


def test_static_cache_takes_the_kv_heads_the_attentions_write():
    """NOTE: [cache shapes from the writes]: transformers' export recipe sizes the cache from
    ``config.num_key_value_heads``, else ``num_attention_heads``: 6 kv heads for a multi-query
    Falcon of 6 heads, whose attention writes 1. fxtp re-allocates those layers from one forward
    on ``meta``; a cache right already is left as it was: Falcon-40B's (2 kv groups, its k and v
    written broadcast to the 6 query heads, as the fallback guesses) and a Llama's."""
    from transformers import FalconConfig, FalconForCausalLM, LlamaConfig, LlamaForCausalLM, StaticCache
    from transformers.configuration_utils import get_head_shapes

    from fxtp.runtime import static_cache

    falcon = dict(vocab_size=128, hidden_size=48, num_attention_heads=6, num_hidden_layers=2, alibi=False, use_cache=True)
    cases = [  # (model, config, kv heads written, head_dim, layers re-allocated)
        (FalconForCausalLM, FalconConfig(multi_query=True, new_decoder_architecture=False, **falcon), 1, 8, [0, 1]),
        (FalconForCausalLM, FalconConfig(num_kv_heads=2, new_decoder_architecture=True, **falcon), 6, 8, []),
        (LlamaForCausalLM, LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, use_cache=True), 2, 16, []),
    ]
    for cls, cfg, written, head_dim, fitted in cases:
        with torch.device("meta"):
            model = cls(cfg).eval()
        heads = get_head_shapes(cfg)[0]
        cache = StaticCache(config=cfg, max_cache_len=16)
        cache.early_initialization(2, heads, head_dim, torch.float32, torch.device("meta"))
        changed = static_cache.fit_cache_to_writes(cache, model, 2)
        assert changed == fitted, (cls.__name__, heads, changed)
        assert [tuple(layer.keys.shape) for layer in cache.layers] == [(2, written, 16, head_dim)] * 2
        assert [tuple(layer.values.shape) for layer in cache.layers] == [(2, written, 16, head_dim)] * 2
