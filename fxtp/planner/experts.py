"""Mixtures of experts in ``fxtp.plan``: expert or tensor parallelism for the routed experts.

NOTE: [experts in the cost model]
fxtp shards a MoE block's routed experts one of two ways (docs/moe.md): tensor parallelism
inside every expert (the default) or expert parallelism (whole experts per rank, NOTE: [expert
parallelism] in fxtp/core/expert_dispatch.py). The rest of the block (attention, router, a
shared expert) is tensor parallel either way, so the two differ in the experts' parameter
shards (both about ``1/tp``; they differ where ``tp`` divides the experts but not their width,
or the reverse, and in gpt-oss's expert biases, which only expert parallelism shards) and in
the bytes a rank sends per MoE block and micro-batch of ``T`` tokens. In bytes of one
``(T, H)`` activation, with ``r = (t-1)/t`` (ring collectives, NOTE: [cost model]), top-k ``k``:

- tensor parallel: forward, the one all_reduce after the combine (Megatron's floor, already
  priced); backward, the floor's all_reduce of the experts' input, plus the routing weights'
  ``(T, k)`` gradient all_reduced, ``2 r k / H``, plus, with a shared expert, its input's
  gradient all_reduced apart, ``2 r``.
- expert parallel: the all_reduce after the combine stays (the MoE input is replicated by the
  attention's tensor parallelism); each rank sends its ``T/t`` tokens' ``k`` rows to the
  experts' ranks, ``r`` of them off the rank with a uniform routing, and back:
  ``2 r k / t`` forward and as much backward; backward all_gathers the token blocks'
  gradients of the input and the routing weights, ``r (1 + k / H)``, and has no all_reduce
  of the experts' input (``-2 r`` from the floor) unless a shared expert keeps one.

So expert parallelism sends less where ``4 k / t < 1`` (top-2 at ``t = 8``: even, then less
by the routing weights' all_reduce), and its GEMMs stay whole, which this model does not
price (torchtitan's reason to drop tensor parallelism inside experts, pytorch/torchtitan#3167).
The choice (:func:`choose_experts`) is per MoE layer: fewer predicted bytes sent, then fewer
parameter bytes per rank, then tensor parallelism. A model's MoE layers have the same sizes,
so they get the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

__all__ = ["MoeShape", "ExpertsChoice", "choose_experts", "EXPERT_KEYS"]

# config keys of the routed-expert count, by family: Mixtral/gpt-oss, Qwen2/3-MoE, DeepSeek
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class MoeShape:
    """A Hugging Face mixture of experts' sizes (NOTE: [experts in the cost model]).

    Attributes:
        experts: routed experts per MoE layer, ``E``. top_k: experts per token, ``k``.
        hidden: ``H``. expert_width: one expert's intermediate size.
        shared_width: the shared expert(s)' intermediate size, 0 without.
        modules: the experts modules' FQNs (one per MoE layer).
        expert_params: elements of one layer's routed experts.
    """

    experts: int
    top_k: int
    hidden: int
    expert_width: int
    shared_width: int
    modules: tuple[str, ...]
    expert_params: int

    @classmethod
    def of(cls, model: nn.Module) -> Optional["MoeShape"]:
        """The sizes of ``model`` if its config has routed experts, else None. The experts
        modules are those whose parameters are ``E``-by-something 3-D tensors."""
        config = getattr(model, "config", None)
        experts = next((getattr(config, k) for k in EXPERT_KEYS if isinstance(getattr(config, k, None), int)), None)
        if not experts:
            return None
        modules = tuple(name for name, m in model.named_modules() if name and _is_experts(m, experts))
        hidden = config.hidden_size
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        shared = getattr(config, "shared_expert_intermediate_size", None) or (
            (getattr(config, "n_shared_experts", None) or 0) * width)
        params = sum(p.numel() for p in model.get_submodule(modules[0]).parameters()) if modules else 0
        return cls(experts, getattr(config, "num_experts_per_tok", 1), hidden, width, shared, modules, params)

    def sent(self, tp: int, expert: bool) -> tuple[float, float]:
        """Bytes a rank sends per MoE layer beyond Megatron's floor, forward and backward, per
        byte of one ``(T, H)`` activation: the experts' plan's own (NOTE: [experts in the cost
        model]); negative where the plan sends less than the floor."""
        r, k, h, shared = (tp - 1) / tp, self.top_k, self.hidden, bool(self.shared_width)
        if not expert:
            return 0.0, r * (2 * k / h + (2 if shared else 0))
        forward = 2 * r * k / tp
        return forward, forward + r * (1 + k / h) - (0 if shared else 2 * r)


def _is_experts(module: nn.Module, experts: int) -> bool:
    own = list(module.parameters(recurse=False))
    return bool(own) and all(p.shape[0] == experts for p in own) and any(p.dim() == 3 for p in own)


@dataclass(frozen=True)
class ExpertsChoice:
    """The routed experts' plan at one tensor-parallel degree, and why."""

    tp: int
    expert: bool  # expert parallelism (else tensor parallelism inside the experts)
    reason: str


def choose_experts(moe: MoeShape, tp: int, payload: int, tp_bytes: int, ep_bytes: Optional[int],
                   training: bool) -> ExpertsChoice:
    """Expert or tensor parallelism for ``moe``'s routed experts at degree ``tp``
    (NOTE: [experts in the cost model]).

    Args:
        moe: the model's sizes. payload: bytes of a step's ``(T, H)`` activation on one
            tensor-parallel group (its dp rank's tokens).
        tp_bytes, ep_bytes: rank 0's parameter bytes under each plan (fxtp's analysis);
            ``ep_bytes`` None where expert parallelism cannot run (fewer experts than ranks).
        training: price backward too.
    """
    if tp == 1:
        return ExpertsChoice(tp, False, "tp 1: nothing to shard")
    if ep_bytes is None:
        return ExpertsChoice(tp, False, f"tensor parallel inside the experts: {moe.experts} experts are fewer than tp {tp}")
    layers = len(moe.modules)
    tp_sent, ep_sent = (round(layers * sum(moe.sent(tp, e)[: 2 if training else 1]) * payload) for e in (False, True))
    expert = (ep_sent, ep_bytes) < (tp_sent, tp_bytes)
    style = "expert parallel (whole experts per rank)" if expert else "tensor parallel inside the experts"
    step = "per step" if training else "per forward"
    reason = (f"{style} at tp {tp}: {layers} MoE layers of {moe.experts} experts of {moe.expert_width}, top-{moe.top_k}; "
              f"the experts' own collectives send {ep_sent:,} B per rank {step} expert parallel (all_to_all) vs "
              f"{tp_sent:,} B tensor parallel (all_reduce of the routing weights' gradient"
              f"{' and the shared expert input' if moe.shared_width else ''}); parameters per rank {ep_bytes:,} B vs "
              f"{tp_bytes:,} B (NOTE: [experts in the cost model] in fxtp/planner/experts.py)")
    return ExpertsChoice(tp, expert, reason)
