"""What ``tools/bench.py`` runs on: its settings and its models (torch's reference
Transformer, the built-in examples, a Llama for generation), and torch's hand plan that the
step time is compared against."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from fxtp.cli import examples
from fxtp.explain.report import megatron_floor

__all__ = ["Settings", "builtins", "dtensor_hand_plan", "generation_model", "megatron_collectives", "reference_transformer"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run measures. ``quick()`` is the CI smoke setting."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    seq: int = 64
    batch: int = 8
    vocab: int = 512
    warmup: int = 3
    steps: int = 20
    compile_layers: tuple[int, ...] = (2, 8, 32)
    compile_repeats: int = 3
    world_sizes: tuple[int, ...] = (2, 4, 8)
    full_size: bool = True  # the full-size meta configs (GPT-2 124M ... Qwen2-MoE) in the memory table
    new_tokens: int = 32  # generate: tokens per call

    @classmethod
    def quick(cls) -> "Settings":
        return cls(dim=64, n_layers=2, n_heads=4, seq=16, batch=2, vocab=128, warmup=1, steps=3,
                   compile_layers=(2,), compile_repeats=1, world_sizes=(2,), full_size=False, new_tokens=4)


def reference_transformer(s: Settings, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """torch's TP reference Transformer (no weight tying, no dropout) and (batch, seq) token ids."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(seed)
    args = ModelArgs(n_layers=s.n_layers, vocab_size=s.vocab, max_seq_len=s.seq, dim=s.dim, n_heads=s.n_heads,
                     dropout_p=0.0, weight_tying=False)
    ids = torch.randint(0, s.vocab, (s.batch, s.seq), generator=torch.Generator().manual_seed(seed + 1))
    return Transformer(args), (ids,)


def dtensor_hand_plan(model: nn.Module, mesh: Any) -> nn.Module:
    """torch's hand plan (as ``Transformer.parallelize`` with ``local_output_for_attn=True``, its
    fastest form): wq/wk/wv/w1 colwise, wo/w2 rowwise, the output colwise with a replicated
    (all_gathered) output; attention works on local heads."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"output": ColwiseParallel(output_layouts=Replicate())}
    for i, layer in enumerate(model.layers):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
        layer.attention.n_heads //= mesh.size()
    return parallelize_module(model, mesh, plan)


def builtins(s: Settings) -> dict[str, tuple[Callable[[], tuple[nn.Module, tuple]], int, bool]]:
    """name -> (builder, transformer blocks, whether the first block's input needs a gradient).
    ``mlp`` counts as one block of one region: 1 all_reduce forward, none backward (its input
    is a plain tensor)."""
    return {
        "tiny_gpt": (examples.tiny_gpt, examples.GPTConfig().n_layers, True),
        "mlp": (examples.mlp, 1, False),
        "gpt2": (examples.gpt2, 2, True),
        "llama": (examples.llama, 2, True),
        "bert": (examples.bert, 2, True),
        "reference_transformer": (lambda: reference_transformer(s), s.n_layers, True),
    }


def megatron_collectives(name: str, blocks: int, input_grad: bool, report: dict) -> dict[str, dict[str, int]]:
    """Megatron-LM's own collectives for this plan (``fxtp.explain.report.megatron_floor``); the lone
    MLP is one region: 1 all_reduce forward."""
    if name == "mlp":
        return {"forward": {"all_reduce": 1}, "backward": {}}
    forward, backward = megatron_floor(report, blocks, input_grad)
    return {"forward": forward, "backward": backward}


def generation_model(s: Settings, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """A Llama of the bench's size (half as many kv heads as heads) and a (1, seq) prompt."""
    torch.manual_seed(seed)
    model, _ = examples.llama(seed, hidden_size=s.dim, intermediate_size=4 * s.dim, num_hidden_layers=s.n_layers,
                              num_attention_heads=s.n_heads, num_key_value_heads=max(1, s.n_heads // 2),
                              vocab_size=s.vocab, max_position_embeddings=s.seq + s.new_tokens)
    prompt = torch.randint(1, s.vocab, (1, s.seq), generator=torch.Generator().manual_seed(seed))
    return model, prompt

