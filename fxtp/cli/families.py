"""Published configs of popular architectures, and what fxtp keeps of them per rank.

Each :data:`FAMILIES` entry holds the sizes of a model's ``config.json`` on the Hugging Face Hub
(hidden, heads, kv heads, MLP width, vocabulary, layers, tied head) and the transformers classes
that build it. :func:`measure` builds one on the ``meta`` device with ``num_hidden_layers`` cut
to 2, analyzes it and scales the bytes of one block to the published depth (the blocks are
identical: a block's plan and bytes do not depend on how many follow it), so a 7B config costs
seconds, not minutes. :func:`memory_table` renders the README's table from those figures;
``tests/test_families.py`` checks the README against a fresh measurement.

Example::

    python -m fxtp.cli.families        # prints the README's table (about a minute)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["FAMILIES", "Family", "Measured", "measure", "memory_table"]


@dataclass(frozen=True)
class Family:
    """A published config: ``config`` and ``model`` name transformers classes; ``sizes`` are
    the config's keyword arguments, ``layers`` its ``num_hidden_layers`` (its ``n_layer`` for
    BLOOM); ``source`` the Hub repository the sizes come from."""

    source: str
    config: str
    model: str
    layers: int
    sizes: dict[str, Any] = field(default_factory=dict)
    layers_key: str = "num_hidden_layers"


# A parameter of the first transformer block: ``model.layers.0.``, ``transformer.h.0.``, ...
_BLOCK_0 = re.compile(r"\.0\.")
_LLAMA_ROPE = {"rope_type": "default", "rope_theta": 500000.0}
_NO_DROPOUT = dict(attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0)

# Sizes of each model's config.json (the source repository); unlisted keys take the config
# class's defaults. Untied heads unless the config ties them (Gemma-2, BLOOM, OPT, BERT's none).
FAMILIES: dict[str, Family] = {
    "Llama-3.1-8B": Family("meta-llama/Llama-3.1-8B", "LlamaConfig", "LlamaForCausalLM", 32, dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        rope_parameters=_LLAMA_ROPE, tie_word_embeddings=False)),
    "Qwen2.5-7B": Family("Qwen/Qwen2.5-7B", "Qwen2Config", "Qwen2ForCausalLM", 28, dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "Qwen3-8B": Family("Qwen/Qwen3-8B", "Qwen3Config", "Qwen3ForCausalLM", 36, dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "Mistral-7B": Family("mistralai/Mistral-7B-v0.1", "MistralConfig", "MistralForCausalLM", 32, dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        tie_word_embeddings=False)),
    "Gemma-2-9B": Family("google/gemma-2-9b", "Gemma2Config", "Gemma2ForCausalLM", 42, dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256)),
    "StarCoder2-7B": Family("bigcode/starcoder2-7b", "Starcoder2Config", "Starcoder2ForCausalLM", 32, dict(
        vocab_size=49152, hidden_size=4608, intermediate_size=18432, num_attention_heads=36, num_key_value_heads=4,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)),
    "Phi-3-mini": Family("microsoft/Phi-3-mini-4k-instruct", "Phi3Config", "Phi3ForCausalLM", 32, dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32,
        tie_word_embeddings=False, **_NO_DROPOUT)),
    "Phi-3-medium": Family("microsoft/Phi-3-medium-4k-instruct", "Phi3Config", "Phi3ForCausalLM", 40, dict(
        vocab_size=32064, hidden_size=5120, intermediate_size=17920, num_attention_heads=40, num_key_value_heads=10,
        tie_word_embeddings=False, **_NO_DROPOUT)),
    "Falcon-7B": Family("tiiuae/falcon-7b", "FalconConfig", "FalconForCausalLM", 32, dict(
        vocab_size=65024, hidden_size=4544, num_attention_heads=71, multi_query=True, new_decoder_architecture=False,
        parallel_attn=True, alibi=False, bias=False)),
    "OLMo-2-7B": Family("allenai/OLMo-2-1124-7B", "Olmo2Config", "Olmo2ForCausalLM", 32, dict(
        vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "Pythia-6.9B": Family("EleutherAI/pythia-6.9b", "GPTNeoXConfig", "GPTNeoXForCausalLM", 32, dict(
        vocab_size=50432, hidden_size=4096, intermediate_size=16384, num_attention_heads=32, rotary_pct=0.25,
        tie_word_embeddings=False)),
    "BLOOM-7B1": Family("bigscience/bloom-7b1", "BloomConfig", "BloomForCausalLM", 30, dict(
        vocab_size=250880, hidden_size=4096, n_head=32), layers_key="n_layer"),
    "OPT-6.7B": Family("facebook/opt-6.7b", "OPTConfig", "OPTForCausalLM", 32, dict(
        vocab_size=50272, hidden_size=4096, ffn_dim=16384, num_attention_heads=32, max_position_embeddings=2048,
        word_embed_proj_dim=4096)),
    "BERT-large": Family("google-bert/bert-large-uncased", "BertConfig", "BertModel", 24, dict(
        vocab_size=30522, hidden_size=1024, intermediate_size=4096, num_attention_heads=16, max_position_embeddings=512)),
}


@dataclass(frozen=True)
class Measured:
    """What :func:`measure` found for one family at ``world_size``.

    ``fraction``: the most parameter bytes any rank holds over the model's, at the published
    depth (uneven shards: ranks differ). ``report``: the 2-layer model's report (rank 0's).
    ``blocks``: its number of transformer blocks (2)."""

    name: str
    world_size: int
    fraction: float
    report: Any
    blocks: int = 2


def _build(family: Family, layers: int) -> torch.nn.Module:
    import transformers

    cfg = getattr(transformers, family.config)(**family.sizes, **{family.layers_key: layers}, use_cache=False)
    with torch.device("meta"):
        return getattr(transformers, family.model)(cfg).to(torch.bfloat16).eval()


def measure(name: str, world_size: int = 8, seq: int = 16) -> Measured:
    """Analyze :data:`FAMILIES` ``[name]`` on ``meta`` in bf16 at ``world_size`` with 2 blocks
    and an input of ``(1, seq)`` token ids.

    Bytes at the published depth ``L``: ``embeddings + L * block``, with ``block`` the bytes of
    block 0's parameters (``Report.parameter_bytes``, by FQN) on each rank; the fraction is the
    largest over the ranks. BERT-large analyzed at its full 24 layers (70 s instead of 2 s) gives
    the same fraction, 0.129507.

    Raises:
        KeyError: ``name`` is not in :data:`FAMILIES`.
    """
    import fxtp

    family = FAMILIES[name]
    model = _build(family, 2)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    report = fxtp.analyze(model, world_size, (ids,), dynamic=False)
    total, by_rank = report.param_bytes, report.param_bytes_by_rank
    block = [b for fqn, b in report.parameter_bytes.items() if _BLOCK_0.search(fqn)]
    block_by_rank = [sum(per_rank) for per_rank in zip(*block)]
    block_total = sum(p.numel() * p.element_size() for fqn, p in model.named_parameters() if _BLOCK_0.search(fqn))
    extra = family.layers - 2
    fraction = max((r + extra * b) / (total + extra * block_total) for r, b in zip(by_rank, block_by_rank))
    return Measured(name, world_size, fraction, report)


def memory_table(measured: list[Measured]) -> str:
    """The README's table: two families a row, each with the most bytes a rank keeps."""
    cells = [f"{m.name} | {m.fraction:.1%}" for m in measured]
    if len(cells) % 2:
        cells.append(" | ")
    rows = [f"| {cells[i]} | {cells[i + 1]} |" for i in range(0, len(cells), 2)]
    header = ["| model | per rank | model | per rank |", "| --- | --- | --- | --- |"]
    return "\n".join(header + rows)


if __name__ == "__main__":
    print(memory_table([measure(name) for name in FAMILIES]))
