"""What a decoder transformer costs: FLOPs per token and activation bytes per block.

NOTE: [activation bytes]
The bytes a block saves for backward, after Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", section 4.1), counted for the blocks Llama-style
and GPT-2-style models run today instead of their GPT-3 block. Per block, for a micro-batch of
``b`` sequences of ``s`` tokens, hidden ``h``, ``a`` query and ``g`` kv heads, MLP width ``f``,
activations of ``e`` bytes (2: bf16 autocast or an FSDP2 ``param_dtype=bf16``):

- each of the 2 norms: a fused ``nn.LayerNorm`` (GPT-2) saves its input, and its output is
  the next linears' input: ``2 sbh e`` (Korthikanti's LayerNorm terms count the input).
  Hugging Face's RMSNorm (Llama, Qwen2, Mistral: ``LlamaRMSNorm.forward``) runs as ops in fp32:
  ``pow`` saves the fp32 input, ``weight *`` the normalized value, and the output is the next
  linears' input: ``(4 + 2e) sbh`` bytes (``3 sbh e`` in fp32, ``4 sbh e`` in bf16). Counted
  with ``saved_tensors_hooks`` on the single device and checked against the allocator
  (tests/test_plan_run.py).
- attention: q ``sbh e``, k and v ``2 sbh e g/a`` (GQA), and the attention's output ``sbh e``,
  which SDPA saves and the output projection reads without a copy (SDPA's flash kernel
  returns it in ``(b, s, heads, d)`` memory order; eager attention's is a contiguous copy
  only the projection saves).
  Korthikanti's ``5as/h`` term (the ``s x s`` scores, softmax and dropout) is not stored by
  SDPA's flash/memory-efficient kernels (Dao et al. 2022, FlashAttention, section 3.1), which
  keep a logsumexp of ``4 abs`` bytes instead; ``attn_implementation="eager"`` keeps the
  softmax output, ``e abs^2`` bytes, and it is counted.
- MLP: a gated (SwiGLU) MLP saves gate, SiLU(gate), up and their product: ``4 sbf e``; a
  plain one (GELU) the up projection and its activation: ``2 sbf e``.
- dropout masks are not counted (Llama trains without dropout; GPT-2's ``p=0.1`` masks would
  add ``2 sbh`` bytes a block).

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) divides the attention and MLP terms by
``tp`` (heads and MLP columns are sharded; kv heads too when ``g`` divides by ``tp``, a rank
keeps the one group its query heads read when ``tp`` is a multiple of ``g``, NOTE: [grouped
shards] in fxtp/core/placement.py, else all ``g``); sequence parallelism divides the norm terms by ``tp`` as well
(Korthikanti section 4.2.2; fxtp saves a colwise layer's gathered input as its shard, NOTE:
[regathered activations]). Outside the blocks: the final norm as a block's (``/tp`` with
sequence parallelism; its output is the head's input). The loss (``loss_activations``, over
``n = sbV / tp`` logits a rank): Hugging Face's loss takes ``logits.float()`` (a copy unless
fp32); fxtp's vocab-parallel cross entropy (NOTE: [vocab-parallel cross entropy] in
fxtp/core/losses.py) holds ``x - max`` and its exp (``8 n`` bytes) beside the output's logits
gathered whole (``e n tp``). Gathering them holds more before: fxtp's all_gather
(``fxtp.core.collectives.all_gather``) gathers a contiguous copy of the shard into one buffer
and concatenates its chunks into the output while the shard, the copy and the buffer are
alive (``2 e n + 2 e n tp``); gloo's all_gather (CPU ranks) holds as much inside the
collective, gathering into a flat tensor of the output's size and copying it out
(``ProcessGroupGloo::allgather``); on CPU ranks in bf16 (not what a calibration runs) Hugging
Face's fp32 copy of the shard comes while fxtp still holds its buffers (NOTE: [gloo frees] in
fxtp/core/collectives.py), ``4 n`` not counted. At hidden 64, 32 x 256 tokens, tp 4 on gloo, a heap
trace per op peaked there: 65.6 MiB a step, priced 59.2 before this moment was counted, 65.2
since. At ``tp`` 1 torch's ``log_softmax`` holds its output (``4 n``). As backward starts: the
saved softmax, the gradient it makes and the logits' (``12 n``). The most of these is counted.

Activation checkpointing, as fxtp's runtime runs it (NOTE: [recomputed regions] in
fxtp/core/recompute.py): ``"blocks"`` (each block under ``torch.utils.checkpoint``) keeps a
block's input only (``sbh e``, ``/tp`` with sequence parallelism), and while a block's
backward recomputes it, that block holds its activations as without checkpointing
(``recomputed_block``; its input is the checkpoint's when the first norm saves it as is).
``"selective"`` is torchtitan's op-level policy: a block keeps its input and the outputs of
its matmuls and of the attention op (q ``sbh e / tp``, k and v, the attention's output and
logsumexp, gate and up ``2 sbf e / tp``, and the two rowwise projections' partial sums whole,
``2 sbh e``) and recomputes the rest (norms, rotary embedding, SiLU, products), which its
backward rebuilds as ``"blocks"`` does. While a block's backward runs it also holds the
gradients of its output and its input (``residual_gradients``, ``2 sbh e``). Measured in
tests/test_plan_memory.py.

NOTE: [FLOPs]
Model FLOPs per token, forward and backward: ``6 N + 12 L h s`` (Chowdhery et al. 2022, PaLM,
appendix B; torchtitan's ``get_num_flop_per_token`` counts the same): ``N`` the parameters
that run in matmuls (embedding lookups excluded, a head tied to the embedding included), the
second term the attention scores and their product with v. Recomputation adds a forward of
what it recomputes: ``2 N_blocks + 4 L h s`` per token for ``"blocks"``; none for
``"selective"``, which keeps the matmuls' and the attention op's outputs and recomputes only
elementwise ops (NOTE: [activation bytes]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from fxtp.core.errors import FxtpConfigError
from fxtp.planner.experts import MoeShape
from fxtp.planner.params import block_kinds

__all__ = ["TransformerShape", "AC_POLICIES"]

AC_POLICIES: tuple[Optional[str], ...] = (None, "selective", "blocks")


@dataclass(frozen=True)
class TransformerShape:
    """The sizes the cost model reads (NOTE: [activation bytes], NOTE: [FLOPs]).

    Attributes:
        hidden, layers, heads, kv_heads, intermediate, vocab: the config's sizes.
        gated_mlp: a SwiGLU-style MLP (three matrices of width ``intermediate``).
        flash: attention by SDPA (no ``s x s`` activations saved); False for ``"eager"``.
        fused_norms: the block's norms are ``nn.LayerNorm`` (one saved input); else they run
            as ops in fp32, as Hugging Face's RMSNorm (NOTE: [activation bytes]).
        norm_params: parameters of the norms, whole model (replicated: under sequence
            parallelism each rank's gradient of them is partial, NOTE: [cost model]).
        matmul_params: parameters that run in matmuls, whole model (NOTE: [FLOPs]).
        block_params: parameters of one block, whole (not sharded).
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    gated_mlp: bool
    flash: bool
    matmul_params: int
    block_params: int
    fused_norms: bool = True
    norm_params: int = 0
    # A stack of several block kinds (NOTE: [block kinds] in fxtp/planner/params.py): each kind's
    # parameters that a token runs and its count, in order of first appearance; empty for one kind
    kinds: tuple[tuple[int, int], ...] = ()

    def block_kinds(self) -> tuple[tuple[int, int], ...]:
        """Each block kind's parameters a token runs, and its count (one kind: ``block_params``)."""
        return self.kinds or ((self.block_params, self.layers),)

    @classmethod
    def of(cls, model: nn.Module, blocks_fqn: str) -> "TransformerShape":
        """Read the sizes of a Hugging Face decoder ``model`` whose blocks are at ``blocks_fqn``.

        Raises:
            FxtpConfigError: a model without such a config.
        """
        config = getattr(model, "config", None)
        hidden, heads = (getattr(config, k, None) for k in ("hidden_size", "num_attention_heads"))
        if not isinstance(hidden, int) or not isinstance(heads, int):
            raise FxtpConfigError(
                f"fxtp.plan prices Hugging Face decoder models (config.hidden_size, num_attention_heads, "
                f"num_hidden_layers); {type(model).__name__} has no such config. fix: plan a transformers model "
                "or its config.json"
            )
        dense = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
        stack = model.get_submodule(blocks_fqn)
        kinds = block_kinds(stack)
        moe = MoeShape.of(model)
        experts = {name for name in (moe.modules if moe is not None else ())}
        idle_block = moe.expert_params * (moe.experts - moe.top_k) // moe.experts if moe is not None else 0
        per_kind = []  # (parameters a token runs, MLP width, gated, count), NOTE: [block kinds] in params.py
        for k in range(max(kinds) + 1):
            i = kinds.index(k)
            block = stack[i]
            has_experts = any(name.startswith(f"{blocks_fqn}.{i}.") for name in experts)
            active = sum(p.numel() for p in block.parameters()) - (idle_block if has_experts else 0)
            if has_experts:  # NOTE: [experts in the cost model]: a token runs top_k of the experts
                width, gated = moe.top_k * moe.expert_width + moe.shared_width, True
            else:
                width = dense
                gated = len([p for p in block.parameters() if p.dim() == 2 and dense in p.shape]) >= 3
            per_kind.append((active, width, gated, kinds.count(k)))
        layers = config.num_hidden_layers
        return cls(
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            intermediate=round(sum(w * n for _, w, _, n in per_kind) / len(kinds)),  # a block's, on average
            vocab=config.vocab_size,
            gated_mlp=all(g for _, _, g, _ in per_kind),
            flash=getattr(config, "_attn_implementation", "sdpa") != "eager",
            matmul_params=_matmul_params(model) - len(experts) * idle_block,
            block_params=round(sum(a * n for a, _, _, n in per_kind) / len(kinds)),  # on average
            fused_norms=all(isinstance(m, nn.LayerNorm) for m in stack.modules() if _is_norm(m)),
            norm_params=sum(p.numel() for m in model.modules() if _is_norm(m) for p in m.parameters(recurse=False)),
            kinds=tuple((a, n) for a, _, _, n in per_kind) if len(per_kind) > 1 else (),
        )

    def flops_per_token(self, seq: int, ac: Optional[str] = None) -> float:
        """Model FLOPs per token of a training step, recomputation included (NOTE: [FLOPs])."""
        attention = self.layers * self.hidden * seq
        flops = 6 * self.matmul_params + 12 * attention
        if ac == "blocks":
            flops += 2 * self.layers * self.block_params + 4 * attention
        return float(flops)

    def block_activations(self, batch: int, seq: int, tp: int, *, sp: bool, ac: Optional[str], e: int = 2) -> int:
        """Bytes one block saves for backward on a tensor-parallel rank (NOTE: [activation bytes])."""
        return int(sum(self._saved(batch, seq, tp, sp, e)[ac].values()))

    def recomputed_block(self, batch: int, seq: int, tp: int, *, sp: bool, ac: Optional[str], e: int = 2) -> int:
        """Bytes a checkpointed block holds besides what it saved while its backward recomputes
        it (0 without checkpointing; NOTE: [activation bytes])."""
        if ac is None:
            return 0
        saved = self._saved(batch, seq, tp, sp, e)
        kept = sum(v for k, v in saved[ac].items() if k in saved[None])  # saved outputs the plain block saves too
        # the block's input, which the checkpoint keeps: the first norm saves it as is when it is
        # fused or runs in fp32 (a bf16 RMSNorm saves an fp32 copy, counted in its norm)
        shared = saved["blocks"]["input"] if self.fused_norms or e == 4 else 0
        return int(sum(saved[None].values()) - kept - shared)

    def residual_gradients(self, batch: int, seq: int, tp: int, *, sp: bool, e: int = 2) -> int:
        """Bytes of the gradients a block's backward takes and gives: its output's and its input's
        (the residual stream's; token shards under sequence parallelism)."""
        sbh = batch * seq * self.hidden * e
        return 2 * (sbh // tp if sp else sbh)

    def _saved(self, batch: int, seq: int, tp: int, sp: bool, e: int) -> dict[Optional[str], dict[str, float]]:
        """What a block saves under each policy, by tensor (NOTE: [activation bytes])."""
        sbh = batch * seq * self.hidden * e
        norm = self._norm(batch, seq, e)
        q = sbh / tp
        kv = 2 * sbh * self._kv_per_rank(tp) / self.heads
        mlp = batch * seq * self.intermediate * e / tp
        scores = e * self.heads * batch * seq * seq / tp
        lse = 4 * self.heads * batch * seq / tp
        gated = 2 if self.gated_mlp else 1
        # SDPA's flash kernels save a logsumexp; eager attention its softmax's output (the probs)
        attention = {"lse": lse} if self.flash else {"probs": scores}
        plain = {"norms": 2 * norm / tp if sp else 2 * norm, "q": q, "kv": kv, "out": q, **attention,
                 "mlp_in": gated * mlp, "mlp_act": gated * mlp}
        # "selective": the outputs of the matmuls (the two rowwise ones whole: their partial sums)
        # and of the attention op (eager: the scores' bmm, the softmax is recomputed)
        selective = {"input": sbh / tp if sp else sbh, "q": q, "kv": kv, "out": q, "o_proj": sbh, "down": sbh,
                     **({"lse": lse} if self.flash else {"scores": scores}), "mlp_in": gated * mlp}
        return {None: plain, "selective": selective, "blocks": {"input": sbh / tp if sp else sbh}}

    def _kv_per_rank(self, tp: int) -> int:
        """Kv heads a rank holds: ``g / tp`` sharded, one group's when ``tp`` is a multiple of ``g``
        (NOTE: [grouped shards] in passes/kv_heads.py), else all ``g``."""
        g = self.kv_heads
        return g // tp if g % tp == 0 else 1 if tp % g == 0 and self.heads % tp == 0 else g

    def _norm(self, batch: int, seq: int, e: int) -> int:
        """Bytes one norm saves, its output (the next linears' input) included."""
        return batch * seq * self.hidden * (2 * e if self.fused_norms else 4 + 2 * e)

    def other_activations(self, batch: int, seq: int, tp: int, *, sp: bool, e: int = 2) -> int:
        """Bytes saved outside the blocks but the loss: the final norm and the head's input
        (NOTE: [activation bytes])."""
        saved = self._norm(batch, seq, e)  # its output is the head's input
        return saved // tp if sp else saved

    def loss_activations(self, batch: int, seq: int, tp: int, e: int = 2) -> int:
        """The most the loss holds on a rank, its forward or the start of its backward (NOTE:
        [activation bytes])."""
        n = batch * seq * self.vocab // tp  # this rank's logits
        copy = 0 if e == 4 else 4  # Hugging Face's loss takes logits.float()
        if tp > 1:  # the output's logits gathered, then fxtp's vocab-parallel cross entropy (x - max, its exp)
            whole = e * n * tp
            forward = max(2 * e * n + 2 * whole, n * (e + copy + 8) + whole)  # the shard, its copy, the gathered, the output
        else:  # torch's cross_entropy: one log_softmax
            forward = n * (e + copy + 4)
        return max(forward, 12 * n)  # backward: the saved softmax, the gradient it makes, the logits'

    def kv_cache(self, batch: int, seq: int, tp: int, *, e: int = 2) -> int:
        """Bytes of a KV cache for ``batch`` sequences of ``seq`` tokens on one rank (heads sharded)."""
        kv = self.kv_heads // tp if self.kv_heads % tp == 0 else self.kv_heads
        return 2 * self.layers * batch * seq * kv * (self.hidden // self.heads) * e


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _matmul_params(model: nn.Module) -> int:
    """Parameters outside embedding lookups, plus a head that is tied to an embedding."""
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    tied = head is not None and id(getattr(head, "weight", None)) in lookups
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen and id(p) not in lookups:
            total += p.numel()
        seen.add(id(p))
    return total + (head.weight.numel() if tied else 0)
