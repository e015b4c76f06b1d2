"""The fuzzer's mixture-of-experts block: Hugging Face's own sparse MoE blocks, whose routed
experts fxtp shards inside each expert (tensor parallelism) or as whole experts per rank
(``Spec.expert_parallel``; docs/moe.md). Built from a config class with random weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Moe", "MoeBlock"]


@dataclass(frozen=True)
class Moe:
    """``[norm] -> MoE [+ x]``: ``experts`` routed experts of width ``ffn``, ``top_k`` per token,
    run by ``impl`` (``grouped_mm``, Hugging Face's default, whose rows torch wants 16-byte
    aligned: ``hidden`` and ``ffn`` multiples of 4, or ``batched_mm``); ``shared``: a
    Qwen2-MoE block (a gated shared expert of width ``ffn`` added), else Mixtral's."""

    ffn: int
    experts: int = 4
    top_k: int = 2
    shared: bool = False
    impl: str = "grouped_mm"
    residual: bool = True


class MoeBlock(nn.Module):
    def __init__(self, hidden: int, s: Moe) -> None:
        super().__init__()
        import transformers

        self.s = s
        common = dict(hidden_size=hidden, num_experts_per_tok=s.top_k, experts_implementation=s.impl)
        if s.shared:
            config = transformers.Qwen2MoeConfig(moe_intermediate_size=s.ffn, shared_expert_intermediate_size=s.ffn,
                                                 num_experts=s.experts, norm_topk_prob=True, **common)
            self.moe = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config)
        else:
            config = transformers.MixtralConfig(intermediate_size=s.ffn, num_local_experts=s.experts,
                                                router_jitter_noise=0.0, **common)
            self.moe = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
        with torch.no_grad():  # transformers leaves the experts' 3-D parameters uninitialized
            for p in self.moe.parameters():
                p.normal_(0.0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's grouped_mm takes float32/bfloat16 only: the float64 judge runs batched_mm (same products)
        config = self.moe.experts.config
        impl = config._experts_implementation
        config._experts_implementation = "batched_mm" if x.dtype == torch.float64 else impl
        try:
            y = self.moe(x)
        finally:
            config._experts_implementation = impl
        return x + y if self.s.residual else y
