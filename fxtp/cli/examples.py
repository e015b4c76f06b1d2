"""Built-in example models with example inputs (tiny, random weights, nothing downloaded).

``mlp`` and ``tiny-gpt`` need torch only; the others need the ``examples`` extra
(:data:`EXTRA`: ``pip install 'fxtp[examples]'``): transformers for the Hugging Face models,
expecttest for torch's TP reference ``Transformer`` (``torch.testing._internal`` imports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPTConfig",
    "TinyGPT",
    "tiny_gpt",
    "mlp",
    "transformer",
    "gpt2",
    "llama",
    "bert",
    "gpt2_124m",
    "llama_7b",
    "llama3_8b",
    "llama31",
    "LLAMA31",
    "mixtral",
    "qwen2_moe",
    "mixtral_8x7b",
    "qwen2_moe_a2_7b",
    "Example",
    "EXAMPLES",
    "EXTRA",
    "EXTRA_PACKAGES",
]

# pyproject.toml's optional dependencies the built-ins beyond mlp/tiny-gpt (and `fxtp inspect
# config.json`) need, and the top-level packages it installs.
EXTRA = "examples"
EXTRA_PACKAGES = ("transformers", "expecttest")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    seq_len: int = 16
    dim: int = 64
    n_heads: int = 4
    n_layers: int = 2
    batch: int = 2


class _Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.dim // cfg.n_heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = _Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style decoder: embeddings, pre-norm blocks (causal attention + GELU MLP), LM head.

    Input: token ids ``(batch, seq_len)`` int64. Output: logits ``(batch, seq_len, vocab)`` fp32.
    """

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tiny_gpt(seed: int = 0, cfg: GPTConfig = GPTConfig()) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A :class:`TinyGPT` and example token ids, both from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TinyGPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=gen)
    return model, (ids,)


def mlp(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``Linear(64, 256) -> GELU -> Linear(256, 64)`` and an (8, 64) input."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    return model, (torch.randn(8, 64),)


def transformer(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """torch's own tensor-parallel reference model (``common_dtensor.Transformer``: 2 layers, dim 32,
    4 heads, vocab 64, seq 16, dropout 0, weight tying on) and (2, 16) token ids."""
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        ModelArgs,
        Transformer,
    )

    torch.manual_seed(seed)
    args = ModelArgs(n_layers=2, vocab_size=64, max_seq_len=16, dim=32, n_heads=4, dropout_p=0.0)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed + 1))
    return Transformer(args), (ids,)


# --- Hugging Face models, built from their config classes (random weights, nothing downloaded) ---
# Tiny configs: 2 layers, hidden 64, 4 heads, vocab 128, seq 16, dropout 0. ``use_cache=False``:
# a KV cache is an inference-time output that is not a tensor.

TINY_BATCH, TINY_SEQ, TINY_VOCAB = 2, 16, 128


def _ids(seed: int, vocab: int = TINY_VOCAB, device: str = "cpu") -> torch.Tensor:
    ids = torch.randint(0, vocab, (TINY_BATCH, TINY_SEQ), generator=torch.Generator().manual_seed(seed + 1))
    return ids.to(device)


def gpt2_config(**overrides):
    from transformers import GPT2Config

    base = dict(vocab_size=TINY_VOCAB, n_positions=TINY_SEQ, n_embd=64, n_layer=2, n_head=4,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                bos_token_id=0, eos_token_id=0)
    return GPT2Config(**{**base, **overrides})


def llama_config(**overrides):
    from transformers import LlamaConfig

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TINY_SEQ,
                use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaConfig(**{**base, **overrides})


def bert_config(**overrides):
    from transformers import BertConfig

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128, max_position_embeddings=TINY_SEQ, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertConfig(**{**base, **overrides})


def mixtral_config(**overrides):
    from transformers import MixtralConfig

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                max_position_embeddings=TINY_SEQ, router_jitter_noise=0.0, use_cache=False,
                bos_token_id=0, eos_token_id=0, pad_token_id=0, experts_implementation="grouped_mm")
    return MixtralConfig(**{**base, **overrides})


def qwen2_moe_config(**overrides):
    from transformers import Qwen2MoeConfig

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=128,
                shared_expert_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                max_position_embeddings=TINY_SEQ, use_cache=False, bos_token_id=0, eos_token_id=0,
                pad_token_id=0, experts_implementation="grouped_mm")
    return Qwen2MoeConfig(**{**base, **overrides})


# Tiny MoE configs of the other families (tests/test_expert_parallel.py): 2 layers, hidden 64,
# 4 heads (2 kv heads), routed experts of 64, top-2.
_MOE_TINY = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=TINY_SEQ, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                 num_experts_per_tok=2, experts_implementation="grouped_mm")


def _tiny_moe(model_class: str, config_class: str, seed: int, base: dict, overrides: dict):
    """``overrides`` may hold ``device="meta"``: the model and its ids on ``meta`` (shapes only)."""
    import transformers

    device = overrides.pop("device", "cpu")
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**_MOE_TINY, **base, **overrides})
    with torch.device(device):
        model = getattr(transformers, model_class)(config).eval()
    return model, (_ids(seed, device=device),)


def qwen3_moe(seed: int = 0, **overrides) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Tiny ``Qwen3MoeForCausalLM`` (4 experts of 64, top-2, normalized top-k, qk-norm) and (2, 16) ids."""
    base = dict(intermediate_size=128, moe_intermediate_size=64, num_experts=4, norm_topk_prob=True, head_dim=16)
    return _tiny_moe("Qwen3MoeForCausalLM", "Qwen3MoeConfig", seed, base, overrides)


def deepseek_v2(seed: int = 0, **overrides) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Tiny ``DeepseekV2ForCausalLM`` (MLA attention; 4 routed experts of 64, top-2, scaled by
    2.0; 2 shared experts as one MLP of 128) and (2, 16) ids."""
    base = dict(intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=2,
                kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
                routed_scaling_factor=2.0, first_k_dense_replace=0, num_key_value_heads=4)
    return _tiny_moe("DeepseekV2ForCausalLM", "DeepseekV2Config", seed, base, overrides)


def deepseek_v3(seed: int = 0, **overrides) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Tiny ``DeepseekV3ForCausalLM``: MLA attention with a low-rank query (``q_a_proj`` ->
    norm -> ``q_b_proj``); the first block dense (``first_k_dense_replace=1``), the others MoE
    (4 routed experts of 64, top-2 in one group, a shared expert), and (2, 16) ids."""
    base = dict(intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1, n_group=1,
                topk_group=1, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                head_dim=8, routed_scaling_factor=2.0, first_k_dense_replace=1, num_key_value_heads=4)
    return _tiny_moe("DeepseekV3ForCausalLM", "DeepseekV3Config", seed, base, overrides)


def gpt_oss(seed: int = 0, **overrides) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Tiny ``GptOssForCausalLM`` (4 experts of 64 with biases, interleaved gate/up, clamped
    SwiGLU; a biased router; sinks, sliding and full attention) and (2, 16) ids."""
    base = dict(intermediate_size=64, num_local_experts=4, head_dim=16, sliding_window=8,
                rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
                layer_types=["sliding_attention", "full_attention"] * (overrides.get("num_hidden_layers", 2) // 2)
                + ["sliding_attention"] * (overrides.get("num_hidden_layers", 2) % 2))
    model, ids = _tiny_moe("GptOssForCausalLM", "GptOssConfig", seed, base, overrides)
    with torch.no_grad():  # transformers initializes the experts' biases and the router to zero; random ones test more
        for name, p in model.named_parameters():
            if "bias" in name or "router" in name or "sinks" in name:
                p.normal_(0.0, 0.02)
    return model, ids


def gpt2(seed: int = 0, **overrides) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Tiny ``GPT2LMHeadModel`` (Conv1D layers, fused ``c_attn``, tied LM head) and (2, 16) ids."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config(**overrides)).eval(), (_ids(seed),)


def llama(seed: int = 0, **overrides) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Tiny ``LlamaForCausalLM`` (GQA: 4 heads, 2 kv heads; rotary; RMSNorm; SwiGLU) and (2, 16) ids."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**overrides)).eval(), (_ids(seed),)


def bert(seed: int = 0, **overrides) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Tiny ``BertModel`` (encoder and pooler) and (2, 16) ids; the attention mask is the default."""
    from transformers import BertModel

    torch.manual_seed(seed)
    return BertModel(bert_config(**overrides)).eval(), (_ids(seed),)


def mixtral(seed: int = 0, **overrides) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Tiny ``MixtralForCausalLM`` (4 experts, top-2, 3-D expert weights run by ``grouped_mm``;
    GQA, rotary) and (2, 16) ids."""
    from transformers import MixtralForCausalLM

    torch.manual_seed(seed)
    return MixtralForCausalLM(mixtral_config(**overrides)).eval(), (_ids(seed),)


def qwen2_moe(seed: int = 0, **overrides) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Tiny ``Qwen2MoeForCausalLM`` (4 routed experts, top-2, a gated shared expert) and (2, 16) ids."""
    from transformers import Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen2MoeForCausalLM(qwen2_moe_config(**overrides)).eval(), (_ids(seed),)


def gpt2_124m() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """GPT-2 124M shapes (12 layers, hidden 768, 12 heads, vocab 50257) on the ``meta`` device."""
    from transformers import GPT2LMHeadModel

    cfg = gpt2_config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg).eval()
    return model, (torch.zeros(1, 1024, dtype=torch.long, device="meta"),)


def llama_7b(n_layers: int = 32) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Llama-2-7B shapes (32 layers, hidden 4096, 32 heads, intermediate 11008, vocab 32000) on
    ``meta``; ``n_layers`` makes it shallower or deeper (the compile-time benchmark)."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=n_layers,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).eval()
    return model, (torch.zeros(1, 4096, dtype=torch.long, device="meta"),)


def llama3_8b(n_layers: int = 32) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Llama-3-8B shapes (32 layers, hidden 4096, 32 heads, 8 kv heads, intermediate 14336, vocab
    128256, rope theta 500000) on ``meta``."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=n_layers,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).eval()
    return model, (torch.zeros(1, 8192, dtype=torch.long, device="meta"),)


# Llama-3.1's published configs (meta-llama/Llama-3.1-{8B,70B,405B}/config.json): hidden, layers,
# heads, kv heads, MLP width; vocab 128256, bf16. For ``fxtp plan`` (and inspect, which at full
# depth takes minutes for 405B).
LLAMA31 = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336),
    "70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672),
    "405b": dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                 intermediate_size=53248),
}


def llama31(size: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Llama-3.1-8B, -70B or -405B shapes (``size`` ``"8b"``, ``"70b"`` or ``"405b"``) on ``meta`` in bf16;
    example input ``(1, 8192)`` token ids."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(vocab_size=128256, max_position_embeddings=131072,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **LLAMA31[size])
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    return model, (torch.zeros(1, 8192, dtype=torch.long, device="meta"),)


def mixtral_8x7b(n_layers: int = 32) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Mixtral-8x7B shapes (32 layers, hidden 4096, 32 heads, 8 kv heads, 8 experts of
    intermediate 14336, top-2, vocab 32000) on ``meta``."""
    from transformers import MixtralForCausalLM

    cfg = mixtral_config(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=n_layers,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=4096)
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg).eval()
    return model, (torch.zeros(1, 4096, dtype=torch.long, device="meta"),)


def qwen2_moe_a2_7b(n_layers: int = 24) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Qwen1.5-MoE-A2.7B shapes (24 layers, hidden 2048, 16 heads, 60 experts of intermediate
    1408, top-4, a shared expert of 5632, vocab 151936) on ``meta``."""
    from transformers import Qwen2MoeForCausalLM

    cfg = qwen2_moe_config(vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                           shared_expert_intermediate_size=5632, num_hidden_layers=n_layers, num_attention_heads=16,
                           num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                           max_position_embeddings=4096)
    with torch.device("meta"):
        model = Qwen2MoeForCausalLM(cfg).eval()
    return model, (torch.zeros(1, 4096, dtype=torch.long, device="meta"),)


@dataclass(frozen=True)
class Example:
    """A built-in example: ``build()`` returns ``(model, example_inputs)``; ``meta``: its weights
    are on the ``meta`` device (analysis and graphs only, nothing to run)."""

    build: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]
    meta: bool = False


# The names ``fxtp inspect`` accepts (``tiny_gpt`` also spells ``tiny-gpt``).
EXAMPLES: dict[str, Example] = {
    "mlp": Example(mlp),
    "tiny-gpt": Example(tiny_gpt),
    "transformer": Example(transformer),
    "gpt2": Example(gpt2),
    "llama": Example(llama),
    "bert": Example(bert),
    "gpt2-124m": Example(gpt2_124m, meta=True),
    "llama-7b": Example(llama_7b, meta=True),
    "llama-3-8b": Example(llama3_8b, meta=True),
    "llama-3.1-8b": Example(lambda: llama31("8b"), meta=True),
    "llama-3.1-70b": Example(lambda: llama31("70b"), meta=True),
    "llama-3.1-405b": Example(lambda: llama31("405b"), meta=True),
    "mixtral": Example(mixtral),
    "qwen2-moe": Example(qwen2_moe),
    "qwen3-moe": Example(qwen3_moe),
    "deepseek-v2": Example(deepseek_v2),
    "gpt-oss": Example(gpt_oss),
    "mixtral-8x7b": Example(mixtral_8x7b, meta=True),
    "qwen2-moe-a2.7b": Example(qwen2_moe_a2_7b, meta=True),
}
