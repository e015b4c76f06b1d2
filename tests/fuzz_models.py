"""Small random models for the differential fuzzer: a picklable spec and the builder.

A :class:`Spec` is a few frozen dataclasses (it pickles to the gloo ranks, prints as code and
shrinks well under hypothesis); :func:`build` turns it into ``(model, example_inputs)`` from the
spec's seed, identically on every rank. The grammar (``tests/fuzz_strategies.py`` draws it):

    model   := [embedding] block+ [final norm] [head [cross-entropy]]
    block   := Mlp | Attn | Mha | Einsum | Moe    (each (B, T, hidden) -> (B, T, hidden); Moe: fuzz_moe.py)

:func:`features` names the grammar features a spec uses (``"gate:glu"``, ``"attn.head_scale"``,
...): the keys of the fuzz test's ``KNOWN_BROKEN`` set.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from fuzz_moe import Moe, MoeBlock
from torch import nn

__all__ = ["Mlp", "Attn", "Mha", "Einsum", "Moe", "Embed", "Spec", "Block", "build", "features"]


@dataclass(frozen=True)
class Mlp:
    """``[norm] -> up -> act -> down [-> dropout] [+ x]``; ``gate`` other than ``"none"`` gates
    the activation: ``"swiglu"`` with two linears, or one fused ``Linear(hidden, 2 * ffn)`` cut by
    ``"chunk"``, ``"split"``, ``"strided"`` (``[..., ::2]``), ``"unbind"`` (``view(..., 2, ffn)``)
    or ``F.glu``. ``act``: ``relu``, ``gelu``, ``silu``, ``tanh``, ``relu_`` (``Tensor.relu_``) or
    ``relu_module_inplace`` (``nn.ReLU(inplace=True)``). ``residual``: ``none``, ``add``
    (``x + y``) or ``iadd`` (``y += x``). ``lora``: rank-4 LoRA adapters (``B(A(x))``, peft's
    layout) on ``up`` (added in place: ``h += c``) and on ``down`` (needs ``gate="none"``)."""

    ffn: int
    act: str = "relu"
    gate: str = "none"
    bias: bool = True
    norm: str = "none"
    residual: str = "none"
    dropout: bool = False
    lora: bool = False


@dataclass(frozen=True)
class Attn:
    """Self-attention with ``heads`` query heads and ``kv_heads`` key/value heads (``kv_heads <
    heads``: grouped-query, repeated by ``repeat`` = ``expand`` / ``interleave`` / ``enable_gqa``;
    1: multi-query). ``proj``: ``separate`` q/k/v linears or one fused qkv linear cut by
    ``chunk`` / ``split`` / ``slice`` / ``unbind`` / ``strided``. ``rotary``: ``none``, ``real``
    (rotate-half, Hugging Face) or ``complex`` (``view_as_complex``, Meta's Llama). ``alibi``: an
    ALiBi bias buffer as ``attn_mask``. ``qk_norm``: a per-head norm on q and k. ``head_scale``: a
    ``(heads, 1, 1)`` parameter on the attention output; ``shared_head_linear``: one
    ``Linear(head_dim, head_dim)`` applied to every head. ``sdpa_dropout``: ``dropout_p=0.25``
    inside ``scaled_dot_product_attention`` in train mode (0 in eval, Hugging Face's idiom)."""

    heads: int
    kv_heads: int
    proj: str = "separate"
    repeat: str = "expand"
    rotary: str = "none"
    alibi: bool = False
    causal: bool = True
    qk_norm: str = "none"
    head_scale: bool = False
    shared_head_linear: bool = False
    sdpa_dropout: bool = False
    bias: bool = True
    norm: str = "none"
    residual: bool = True
    dropout: bool = False


@dataclass(frozen=True)
class Mha:
    """``nn.MultiheadAttention`` self-attention; ``weights``: none, unused, used (``weights @ h`` added)."""

    heads: int
    bias: bool = True
    norm: str = "none"
    residual: bool = True
    weights: str = "none"


@dataclass(frozen=True)
class Einsum:
    """Matmuls with a parameter operand: ``"einsum_ff"`` (``einsum("bth,hf->btf", x, W)`` -> gelu ->
    ``Linear(ffn, hidden)``), or ``up Linear -> per-head (heads, hd, hd) weight by "bmm_heads"
    (``bmm``) or "einsum_heads" -> down Linear``."""

    form: str
    ffn: int = 16
    heads: int = 2


@dataclass(frozen=True)
class Embed:
    """``nn.Embedding(vocab, hidden, padding_idx, max_norm, scale_grad_by_freq)`` on int64 ids
    (ids repeat, and include the padding index)."""

    padding_idx: Optional[int] = None
    scale_grad_by_freq: bool = False
    max_norm: Optional[float] = None


Block = Union[Mlp, Attn, Mha, Einsum, Moe]


@dataclass(frozen=True)
class Spec:
    """A whole model. ``head``: ``none``, ``linear`` (``Linear(hidden, vocab)``), ``linear_bias``
    or ``tied`` (sharing the embedding's table; needs ``embed``). ``loss``: the model returns
    ``cross_entropy(logits, targets)`` (needs a head; ``targets`` becomes a second input).
    ``train``: train mode (dropout draws masks; the check seeds every forward alike), else eval.
    ``also_hidden``: return ``(result, last hidden state)``."""

    hidden: int
    blocks: tuple[Block, ...]
    embed: Optional[Embed] = None
    vocab: int = 16
    final_norm: str = "none"
    head: str = "none"
    loss: bool = False
    train: bool = False
    also_hidden: bool = False
    batch: int = 2
    seq: int = 8
    seed: int = 0
    sequence_parallel: bool = False  # compile with sequence_parallel=True (NOTE: [sequence parallelism])
    clip: bool = False  # the training loop clips: torch.nn.utils.clip_grad_norm_(parameters, 0.1) before each step
    type_groups: bool = False  # parameter groups by module type (norms, embeddings: no decay), as HF's Trainer
    # "user": each block runs under torch.utils.checkpoint; "blocks" / "selective": compile with
    # activation_checkpointing= that (NOTE: [recomputed regions])
    checkpointing: str = "none"
    dynamic: bool = False  # compile with dynamic=True (symbolic batch/sequence); static: a third of its capture time
    expert_parallel: bool = False  # compile with expert_parallel=True: Moe blocks hold whole experts per rank
    aliased: bool = False  # compile on (ids, ids), run on independent inputs (NOTE: [independent example inputs])
    ignored: bool = False  # a prompt-only micro-batch (every target ignore_index) is accumulated first
    autocast: bool = False  # every forward under bf16 autocast


def features(spec: Spec) -> set[str]:
    """The grammar features ``spec`` uses: ``"<field>:<value>"`` for choices other than the
    plainest, ``"<block>.<flag>"`` for flags that are on (e.g. ``"gate:glu"``, ``"attn.head_scale"``,
    ``"embed.scale_grad_by_freq"``)."""
    out = {f"block:{type(b).__name__.lower()}" for b in spec.blocks}
    for block in spec.blocks:
        name = type(block).__name__.lower()
        for field in dataclasses.fields(block):
            value = getattr(block, field.name)
            if isinstance(value, bool):
                if value and field.name not in ("bias", "residual", "causal"):
                    out.add(f"{name}.{field.name}")
            elif isinstance(value, str) and value not in ("none", "separate", "relu", "expand"):
                out.add(f"{field.name}:{value}")
        if isinstance(block, Attn) and block.kv_heads < block.heads:
            out.add(f"repeat:{block.repeat}")
    if spec.embed is not None:
        out.add("embed")
        out |= {f"embed.{f.name}" for f in dataclasses.fields(spec.embed) if getattr(spec.embed, f.name) not in (None, False)}
    if spec.head != "none":
        out.add(f"head:{spec.head}")
    out |= {f.name for f in dataclasses.fields(spec) if getattr(spec, f.name) is True}  # the flags that are on
    if spec.checkpointing != "none":
        out.add(f"checkpointing:{spec.checkpointing}")
    return out


def _norm(kind: str, size: int) -> nn.Module:
    if kind == "layer":
        return nn.LayerNorm(size)
    if kind == "layer_noaffine":
        return nn.LayerNorm(size, elementwise_affine=False)
    if kind == "rms":
        return nn.RMSNorm(size)
    assert kind == "none", kind
    return nn.Identity()


class MlpBlock(nn.Module):
    def __init__(self, hidden: int, s: Mlp) -> None:
        super().__init__()
        self.s = s
        self.norm = _norm(s.norm, hidden)
        if s.gate == "none":
            self.up = nn.Linear(hidden, s.ffn, bias=s.bias)
        elif s.gate == "swiglu":
            self.w1, self.w3 = nn.Linear(hidden, s.ffn, bias=s.bias), nn.Linear(hidden, s.ffn, bias=s.bias)
        else:
            self.up = nn.Linear(hidden, 2 * s.ffn, bias=s.bias)
        self.relu = nn.ReLU(inplace=True)
        self.down = nn.Linear(s.ffn, hidden, bias=s.bias)
        if s.lora:
            self.up_a, self.up_b = nn.Linear(hidden, 4, bias=False), nn.Linear(4, s.ffn, bias=False)
            self.down_a, self.down_b = nn.Linear(s.ffn, 4, bias=False), nn.Linear(4, hidden, bias=False)
        self.drop = nn.Dropout(0.5) if s.dropout else nn.Identity()

    def _act(self, t: torch.Tensor) -> torch.Tensor:
        act = self.s.act
        if act == "relu_":
            return t.relu_()
        if act == "relu_module_inplace":
            return self.relu(t)
        return {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh}[act](t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, gate, ffn = self.norm(x), self.s.gate, self.s.ffn
        if gate == "none" and self.s.lora:
            u = self.up(h)
            u += self.up_b(self.up_a(h))
            u = self._act(u)
        elif gate == "none":
            u = self._act(self.up(h))
        elif gate == "swiglu":
            u = self._act(self.w1(h)) * self.w3(h)
        elif gate == "glu":
            u = F.glu(self.up(h), dim=-1)
        else:
            fused = self.up(h)
            if gate == "chunk":
                a, b = fused.chunk(2, dim=-1)
            elif gate == "split":
                a, b = fused.split([ffn, ffn], dim=-1)
            elif gate == "strided":
                a, b = fused[..., 0::2], fused[..., 1::2]
            else:
                assert gate == "unbind", gate
                a, b = fused.view(*fused.shape[:-1], 2, ffn).unbind(-2)
            u = self._act(a) * b
        y = self.down(u) + self.down_b(self.down_a(u)) if self.s.lora else self.down(u)
        y = self.drop(y)
        if self.s.residual == "add":
            return x + y
        if self.s.residual == "iadd":
            y += x
        return y


def _alibi(heads: int, seq: int, causal: bool) -> torch.Tensor:
    """ALiBi bias (Press et al. 2022): head i adds ``slope_i * (j - i)`` with slopes
    ``2^(-8 (i+1) / heads)``; shape ``(1, heads, seq, seq)``, ``-inf`` above the diagonal if causal."""
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)])
    pos = torch.arange(seq, dtype=torch.float32)
    bias = slopes[:, None, None] * (pos[None, :] - pos[:, None])[None]
    if causal:
        bias = bias.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    return bias[None]


class AttnBlock(nn.Module):
    def __init__(self, hidden: int, s: Attn, seq: int) -> None:
        super().__init__()
        self.s, self.hd = s, hidden // s.heads
        q_out, kv_out = s.heads * self.hd, s.kv_heads * self.hd
        self.sizes = [q_out, kv_out, kv_out]
        self.norm = _norm(s.norm, hidden)
        if s.proj == "separate":
            self.q, self.k, self.v = (nn.Linear(hidden, n, bias=s.bias) for n in self.sizes)
        else:
            self.qkv = nn.Linear(hidden, sum(self.sizes), bias=s.bias)
        self.o = nn.Linear(q_out, hidden, bias=s.bias)
        self.q_norm, self.k_norm = _norm(s.qk_norm, self.hd), _norm(s.qk_norm, self.hd)
        if s.head_scale:
            self.head_scale = nn.Parameter(torch.rand(s.heads, 1, 1) + 0.5)
        if s.shared_head_linear:
            self.per_head = nn.Linear(self.hd, self.hd)
        if s.rotary != "none":
            inv_freq = 1.0 / 10000 ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd)
            freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)  # (T, hd / 2)
            if s.rotary == "real":
                emb = torch.cat([freqs, freqs], dim=-1)
                self.register_buffer("cos", emb.cos(), persistent=False)
                self.register_buffer("sin", emb.sin(), persistent=False)
            else:
                self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs), persistent=False)
        if s.alibi:
            self.register_buffer("alibi", _alibi(s.heads, seq, s.causal), persistent=False)
        self.drop = nn.Dropout(0.5) if s.dropout else nn.Identity()

    def _project(self, h: torch.Tensor) -> list[torch.Tensor]:
        b, t, _ = h.shape
        proj, s = self.s.proj, self.s
        if proj == "separate":
            parts = [self.q(h), self.k(h), self.v(h)]
        else:
            qkv = self.qkv(h)
            if proj == "unbind":
                return list(qkv.view(b, t, s.heads, 3, self.hd).unbind(3))
            if proj == "chunk":
                parts = list(qkv.chunk(3, dim=-1))
            elif proj == "split":
                parts = list(qkv.split(self.sizes, dim=-1))
            elif proj == "strided":
                parts = [qkv[..., i::3] for i in range(3)]
            else:
                assert proj == "slice", proj
                a, c = self.sizes[0], self.sizes[0] + self.sizes[1]
                parts = [qkv[..., :a], qkv[..., a:c], qkv[..., c:]]
        return [p.view(b, t, -1, self.hd) for p in parts]

    def _rope_complex(self, t: torch.Tensor) -> torch.Tensor:
        """Meta's Llama ``apply_rotary_emb`` on ``(B, T, n, hd)`` (``contiguous``: a strided qkv cut
        has no unit last stride, which ``view_as_complex`` needs)."""
        tc = torch.view_as_complex(t.float().contiguous().reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(tc * self.freqs_cis[None, :, None, :]).flatten(3).type_as(t)

    def _rope_real(self, t: torch.Tensor) -> torch.Tensor:
        """Hugging Face's ``apply_rotary_pos_emb`` on ``(B, n, T, hd)``."""
        half = t.shape[-1] // 2
        rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * self.cos + rotated * self.sin

    def _repeat(self, t: torch.Tensor) -> torch.Tensor:
        n = self.s.heads // self.s.kv_heads
        if n == 1 or self.s.repeat == "enable_gqa":
            return t
        if self.s.repeat == "interleave":
            return t.repeat_interleave(n, dim=1)
        b, h, s, d = t.shape  # Hugging Face's repeat_kv
        return t[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        s = self.s
        q, k, v = self._project(self.norm(x))
        q, k = self.q_norm(q), self.k_norm(k)
        if s.rotary == "complex":
            q, k = self._rope_complex(q), self._rope_complex(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if s.rotary == "real":
            q, k = self._rope_real(q), self._rope_real(k)
        k, v = self._repeat(k), self._repeat(v)
        kwargs = {"enable_gqa": True} if s.repeat == "enable_gqa" and s.kv_heads < s.heads else {}
        kwargs["dropout_p"] = 0.25 if s.sdpa_dropout and self.training else 0.0
        if s.alibi:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.alibi, **kwargs)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=s.causal, **kwargs)
        if s.head_scale:
            y = y * self.head_scale
        if s.shared_head_linear:
            y = F.gelu(self.per_head(y))
        y = self.drop(self.o(y.transpose(1, 2).reshape(b, t, -1)))
        return x + y if s.residual else y


class MhaBlock(nn.Module):
    def __init__(self, hidden: int, s: Mha) -> None:
        super().__init__()
        self.s = s
        self.norm = _norm(s.norm, hidden)
        self.mha = nn.MultiheadAttention(hidden, s.heads, bias=s.bias, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        y, weights = self.mha(h, h, h, need_weights=self.s.weights != "none")
        y = y + weights @ h if self.s.weights == "used" else y
        return x + y if self.s.residual else y


class EinsumBlock(nn.Module):
    def __init__(self, hidden: int, s: Einsum) -> None:
        super().__init__()
        self.s = s
        if s.form == "einsum_ff":
            self.w_in = nn.Parameter(torch.randn(hidden, s.ffn) / math.sqrt(hidden))
            self.down = nn.Linear(s.ffn, hidden)
        else:
            hd = hidden // s.heads
            self.up, self.down = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
            self.w = nn.Parameter(torch.randn(s.heads, hd, hd) / math.sqrt(hd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, hidden = x.shape
        if self.s.form == "einsum_ff":
            return self.down(F.gelu(torch.einsum("bth,hf->btf", x, self.w_in)))
        n = self.s.heads
        h = self.up(x)
        if self.s.form == "bmm_heads":
            per_head = h.reshape(b * t, n, hidden // n).transpose(0, 1)  # (n, B*T, hd)
            h = torch.bmm(per_head, self.w).transpose(0, 1).reshape(b, t, hidden)
        else:
            assert self.s.form == "einsum_heads", self.s.form
            h = torch.einsum("btnd,nde->btne", h.view(b, t, n, hidden // n), self.w).reshape(b, t, hidden)
        return self.down(h)


class FuzzModel(nn.Module):
    """The model of a :class:`Spec`."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        if spec.embed is not None:
            e = spec.embed
            self.emb = nn.Embedding(
                spec.vocab, spec.hidden, padding_idx=e.padding_idx, max_norm=e.max_norm, scale_grad_by_freq=e.scale_grad_by_freq
            )
        self.blocks = nn.ModuleList(_block(spec.hidden, b, spec.seq) for b in spec.blocks)
        self.final_norm = _norm(spec.final_norm, spec.hidden)
        if spec.head != "none":
            self.head = nn.Linear(spec.hidden, spec.vocab, bias=spec.head == "linear_bias")
            if spec.head == "tied":
                self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> Union[torch.Tensor, tuple]:
        h = self.emb(x) if self.spec.embed is not None else x
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False) if self.spec.checkpointing == "user" else block(h)
        h = self.final_norm(h)
        out = h
        if self.spec.head != "none":
            out = self.head(h)
            if targets is not None:
                out = F.cross_entropy(out.flatten(0, 1), targets.flatten())
        return (out, h) if self.spec.also_hidden else out


def _block(hidden: int, s: Block, seq: int) -> nn.Module:
    if isinstance(s, Attn):
        return AttnBlock(hidden, s, seq)
    return {Mlp: MlpBlock, Mha: MhaBlock, Einsum: EinsumBlock, Moe: MoeBlock}[type(s)](hidden, s)


def build(spec: Spec) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``(model, example_inputs)`` of ``spec``, from ``spec.seed``; in train mode if ``spec.train``.

    Inputs: ``x`` float32 ``(batch, seq, hidden)``, or with an embedding int64 ids
    ``(batch, seq)`` in which one id repeats 4 times and the padding index (if any) occurs;
    with ``loss`` also int64 ``targets (batch, seq)``."""
    torch.manual_seed(spec.seed)
    model = FuzzModel(spec).train(spec.train)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    shape = (spec.batch, spec.seq)
    if spec.embed is None:
        inputs: tuple[torch.Tensor, ...] = (torch.randn(*shape, spec.hidden, generator=gen),)
    else:
        ids = torch.randint(0, spec.vocab, shape, generator=gen)
        ids.view(-1)[1:5] = 3 % spec.vocab  # one id 4 times: scale_grad_by_freq divides by 4
        if spec.embed.padding_idx is not None:
            ids.view(-1)[-1] = spec.embed.padding_idx
        inputs = (ids,)
    if spec.loss:
        inputs += (torch.randint(0, spec.vocab, shape, generator=gen),)
    return model, inputs
