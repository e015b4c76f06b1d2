"""Contiguous pipeline stages of a decoder's blocks, balanced by predicted time and memory.

NOTE: [pipeline stages]
A Hugging Face causal LM (``model.model.embed_tokens``, ``model.model.layers``,
``model.model.norm``, ``model.lm_head``: Llama, Mistral, Qwen2 and their kin) is cut into
``n`` contiguous stages of its blocks; the embedding goes with the first stage, the final norm
and the head with the last. A stage is a :class:`StageModule`: the model's own modules (shared,
never copied or mutated) under their original FQNs, with the blocks of other stages replaced by
a parameterless pass-through, so the model's own ``forward`` code (its rotary embedding, its
causal mask) runs unchanged on every stage and ``fxtp.compile`` captures the stage as it would
the model: each stage is an fxtp tensor-parallel module with its blocks as submodules (NOTE:
[rank program by block]). Stage ``0`` takes token ids ``(b, s)``; every other stage takes the
hidden states ``(b, s, hidden)``; the last returns logits ``(b, s, vocab)``, the others hidden
states.

The cut (:func:`balance`) minimizes the largest stage's cost, where a stage's cost is the larger
of its share of the predicted training FLOPs and its share of the predicted bytes (exact by
dynamic programming over the contiguous cuts). Per unit:

* a block: FLOPs ``2 * params + 4 * seq * hidden`` a token (its matmuls and attention's two
  ``s x s`` products, NOTE: [FLOPs] in fxtp/planner/model.py); bytes: 16 per parameter (fp32
  weight, gradient and AdamW's two moments) over tp, plus the activations one micro-batch saves
  (``TransformerShape.block_activations``) times the micro-batches the stage holds at once;
* the embedding: no FLOPs (a gather), its parameters' 16 bytes each over tp;
* the head (final norm, ``lm_head``, the loss): ``2 * vocab * hidden`` FLOPs a token, its
  parameters' bytes (a tied head's weight is a copy on the last stage) and the loss's fp32
  logits (``TransformerShape.loss_activations``).

Micro-batches in flight (Narayanan et al. 2021, section 2.2): GPipe holds all ``m``; 1F1B and
the interleaved schedules hold at most ``pp - r`` on pipeline rank ``r``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from fxtp.core.errors import FxtpConfigError

__all__ = ["StageModule", "StageCut", "balance", "blocks_of", "check_divisible", "in_flight", "unit_costs"]

_BYTES_PER_PARAM = 16  # fp32 weight, gradient, AdamW exp_avg and exp_avg_sq


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks of a Hugging Face causal LM, ``model.model.layers``.

    Raises:
        FxtpConfigError: ``model`` has no ``model.embed_tokens``, ``model.layers``, ``model.norm``
            and ``lm_head`` (pipeline stages are cut for decoder LMs only).
    """
    inner = getattr(model, "model", None)
    names = ("embed_tokens", "layers", "norm")
    if inner is None or not all(isinstance(getattr(inner, n, None), nn.Module) for n in names) \
            or not isinstance(getattr(model, "lm_head", None), nn.Module) or not isinstance(inner.layers, nn.ModuleList):
        raise FxtpConfigError(
            f"fxtp.pipeline: {type(model).__name__} is not a decoder LM with model.embed_tokens, model.layers (an "
            "nn.ModuleList), model.norm and lm_head, which is what pipeline stages are cut from. fix: pipeline a "
            "Hugging Face causal LM (Llama, Mistral, Qwen2) or compile the model with fxtp.compile without pipelining"
        )
    return inner.layers


class _PassThrough(nn.Module):
    """A block of another stage: returns its hidden states unchanged (no parameters)."""

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return hidden_states


def _shallow(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s children, parameters and buffers (dicts copied,
    so replacing a child here leaves ``module`` alone)."""
    new = copy.copy(module)
    new._modules, new._parameters, new._buffers = dict(module._modules), dict(module._parameters), dict(module._buffers)
    return new


class StageModule(nn.Module):
    """One pipeline stage of a causal LM (NOTE: [pipeline stages]): ``model.embed_tokens`` on the
    first stage, ``model.layers.{i}`` for its blocks, ``model.norm`` and ``lm_head`` on the last,
    under the model's FQNs. Shares the model's modules; never mutates it.

    ``forward(x)``: the first stage takes token ids ``(b, s)`` (int64), the others hidden states
    ``(b, s, hidden)``; the last returns logits ``(b, s, vocab)``, the others hidden states.
    """

    def __init__(self, model: nn.Module, blocks: range, *, first: bool, last: bool) -> None:
        super().__init__()
        layers = blocks_of(model)
        decoder = _shallow(model.model)
        decoder.layers = nn.ModuleList([layer if i in blocks else _PassThrough() for i, layer in enumerate(layers)])
        if not first:
            decoder.embed_tokens = None
        if not last:
            decoder.norm = nn.Identity()
        self.model = decoder
        self.lm_head = model.lm_head if last else None
        self.first, self.last, self.blocks = first, last, blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            hidden = self.model(input_ids=x, use_cache=False).last_hidden_state
        else:
            hidden = self.model(inputs_embeds=x, use_cache=False).last_hidden_state
        return self.lm_head(hidden) if self.last else hidden


@dataclass(frozen=True)
class StageCut:
    """The blocks of every stage, in stage order, with each stage's predicted shares.

    Attributes:
        blocks: per stage, the indices of ``model.model.layers`` it holds (may be empty for a
            first stage holding only the embedding or a last holding only the head).
        time: per stage, its share of the predicted training FLOPs (sums to 1).
        memory: per stage, its bytes over the model's (state, and one stage's average micro-batches
            in flight of activations).
    """

    blocks: tuple[range, ...]
    time: tuple[float, ...]
    memory: tuple[float, ...]


def unit_costs(model: nn.Module, *, micro_batch: int, seq: int, tp: int) -> tuple[list[float], list[float], list[float]]:
    """Per unit (embedding, each block, head; NOTE: [pipeline stages]): forward FLOPs a token,
    state bytes on a tensor-parallel rank, and activation bytes one micro-batch saves there."""
    from fxtp.planner.model import TransformerShape

    layers = blocks_of(model)
    shape = TransformerShape.of(model, "model.layers")
    hidden = shape.hidden
    block_flops = [2.0 * sum(p.numel() for p in b.parameters() if p.dim() >= 2) + 4.0 * seq * hidden for b in layers]
    block_state = [_BYTES_PER_PARAM * sum(p.numel() for p in b.parameters()) / tp for b in layers]
    block_acts = [float(shape.block_activations(micro_batch, seq, tp, sp=False, ac=None, e=4))] * len(layers)
    embed = sum(p.numel() for p in model.model.embed_tokens.parameters())
    head = sum(p.numel() for p in model.lm_head.parameters()) + sum(p.numel() for p in model.model.norm.parameters())
    flops = [0.0, *block_flops, 2.0 * shape.vocab * hidden]
    state = [_BYTES_PER_PARAM * embed / tp, *block_state, _BYTES_PER_PARAM * head / tp]
    acts = [float(micro_batch * seq * hidden * 4), *block_acts, float(shape.loss_activations(micro_batch, seq, tp))]
    return flops, state, acts


def balance(flops: list[float], state: list[float], acts: list[float], in_flight: list[int]) -> StageCut:
    """The contiguous cut of the units (embedding, blocks, head) into ``len(in_flight)`` non-empty
    stages minimizing the largest stage cost (NOTE: [pipeline stages]); stage ``k`` holds
    ``in_flight[k]`` micro-batches' activations.

    Raises:
        FxtpConfigError: fewer units than stages.
    """
    n, stages = len(flops), len(in_flight)
    if n < stages:
        raise FxtpConfigError(
            f"fxtp.pipeline: {stages} stages need at least {stages} units (embedding, {n - 2} blocks, head); "
            f"fix: use at most {n} stages (fewer pipeline ranks or stages per rank)"
        )
    total_t = sum(flops) or 1.0
    total_m = sum(state) + sum(acts) * sum(in_flight) / stages or 1.0

    def cost(k: int, i: int, j: int) -> tuple[float, float]:  # stage k holds units [i, j)
        t = sum(flops[i:j]) / total_t
        m = sum(state[i:j]) + in_flight[k] * sum(acts[i:j])
        return t, m / total_m

    inf = float("inf")
    best: list[list[float]] = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut: list[list[int]] = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] < inf:
                    value = max(best[k - 1][i], max(cost(k - 1, i, j)))
                    if value < best[k][j] - 1e-12:
                        best[k][j], cut[k][j] = value, i
    bounds, j = [], n
    for k in range(stages, 0, -1):
        bounds.append((cut[k][j], j))
        j = cut[k][j]
    bounds.reverse()
    shares = [cost(k, i, j) for k, (i, j) in enumerate(bounds)]
    blocks = tuple(range(max(i, 1) - 1, min(j, n - 1) - 1) for i, j in bounds)  # unit u >= 1 is block u - 1
    return StageCut(blocks=blocks, time=tuple(t for t, _ in shares), memory=tuple(m for _, m in shares))


def in_flight(schedule: str, pp: int, stage_ranks: list[int], n_microbatches: int) -> list[int]:
    """Micro-batches whose activations stage ``k`` holds at once (NOTE: [pipeline stages])."""
    if schedule.lower() == "gpipe":
        return [n_microbatches] * len(stage_ranks)
    return [min(n_microbatches, pp - r) for r in stage_ranks]


def check_divisible(batch: int, n_microbatches: int, where: Optional[str] = None) -> None:
    """Raise unless the global batch splits into equal micro-batches."""
    if n_microbatches < 1 or batch % n_microbatches:
        raise FxtpConfigError(
            f"fxtp.pipeline: the global batch of {batch} does not split into {n_microbatches} equal micro-batches"
            f"{where or ''}; fix: use an n_microbatches that divides {batch}"
        )
