"""The models of ../shared/cases/README.md (public bug reports), one builder per case.

Each builder returns ``(model, example_inputs)`` from a fixed seed. B, T = 2, 8 unless the case
says otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CASES", "build_case"]

B, T = 2, 8


def _inputs(*shapes, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=gen) for s in shapes)


class HeadLiteralAttention(nn.Module):
    """Case 1 (PiPPy PR 922): head count written as literals in ``view``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(512, 512) for _ in range(4))

    def forward(self, x):
        q = self.q(x).view(2, 8, 8, 64).transpose(1, 2)
        k = self.k(x).view(2, 8, 8, 64).transpose(1, 2)
        v = self.v(x).view(2, 8, 8, 64).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(2, 8, 512))


class Attention(nn.Module):
    """Separate q/k/v/o projections; ``kv_heads < heads`` repeats kv heads (grouped-query)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, repeat: str = "expand") -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.repeat = heads, kv_heads, hidden // heads, repeat
        self.q = nn.Linear(hidden, heads * self.hd)
        self.k = nn.Linear(hidden, kv_heads * self.hd)
        self.v = nn.Linear(hidden, kv_heads * self.hd)
        self.o = nn.Linear(heads * self.hd, hidden)

    def _repeat_kv(self, t):
        n = self.heads // self.kv_heads
        if n == 1:
            return t
        if self.repeat == "interleave":
            return t.repeat_interleave(n, dim=1)
        if self.repeat == "enable_gqa":
            return t  # scaled_dot_product_attention(..., enable_gqa=True) pairs the heads
        b, h, s, d = t.shape  # Hugging Face's repeat_kv
        return t[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self._repeat_kv(self.k(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2))
        v = self._repeat_kv(self.v(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.repeat == "enable_gqa")
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class FusedQKVChunk(nn.Module):
    """Case 5A: Linear(64, 192) -> chunk(3) -> heads."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = (t.view(B, T, 4, 16).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(B, T, 64))


class FusedQKVUnbind(nn.Module):
    """Case 5B: Linear(64, 192) -> view(B, T, 4, 3, 16) -> unbind(3) (per-head interleaved)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(B, T, 4, 3, 16).unbind(3))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(B, T, 64))


class TiedLM(nn.Module):
    """Case 7: embedding and head share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(32, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.fc(self.emb(ids))))


class VocabLoss(nn.Module):
    """Case 8: Linear(16, 11) -> cross_entropy."""

    def __init__(self, classes: int = 11) -> None:
        super().__init__()
        self.head = nn.Linear(16, classes)

    def forward(self, x, target):
        return F.cross_entropy(self.head(x).flatten(0, 1), target.flatten())


class NormAfter(nn.Module):
    """Case 9: A LayerNorm over the sharded features, B per-head RMSNorm, C RMSNorm then heads."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        if variant == "A":
            self.up, self.norm, self.down = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 32)
        elif variant == "B":
            self.up, self.norm, self.down = nn.Linear(32, 64), nn.RMSNorm(16), nn.Linear(64, 32)
        else:
            self.up, self.norm, self.down = nn.Linear(32, 32), nn.RMSNorm(32), nn.Linear(32, 32)

    def forward(self, x):
        h = self.up(x)
        if self.variant == "A":
            return self.down(self.norm(h))
        if self.variant == "B":
            return self.down(self.norm(h.view(B, T, 4, 16)).view(B, T, 64))
        return self.down(self.norm(h).view(B, T, 2, 16).view(B, T, 32))


class DropoutResidual(nn.Module):
    """Case 10: Linear -> Dropout -> Linear -> Dropout -> + x."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(32, 64), nn.Linear(64, 32), nn.Dropout(0.25)

    def forward(self, x):
        return x + self.drop(self.down(self.drop(self.up(x))))


class AttentionDropout(nn.Module):
    """Case 17: q/k/v/o Linear(64, 64), 4 heads, SDPA with dropout_p=0.25 (in either mode, as written)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, 4, 16).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
        return self.o(y.transpose(1, 2).reshape(b, t, 64))


class ShapeBranch(nn.Module):
    """Case 12: a shape-dependent branch symbolic_trace cannot follow."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.up(x)
        if h.shape[1] > 1:
            h = h + torch.tril(torch.ones(h.shape[1], h.shape[2], device=h.device))
        return self.down(torch.relu(h))


class SelfAttentionMHA(nn.Module):
    """Case 14: nn.MultiheadAttention as self-attention (packed in_proj_weight)."""

    def __init__(self, weights: str = "none") -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(64, 4, batch_first=True)
        self.weights = weights  # "none": need_weights=False; "unused": computed, not used; "used": both returned

    def forward(self, x):
        out, weights = self.mha(x, x, x, need_weights=self.weights != "none")
        return (out, weights) if self.weights == "used" else out


class GluFFN(nn.Module):
    """Case 18 (torchtitan 827): RMSNorm -> fused w12 -> glu -> w3 -> + x."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.w12, self.w3 = nn.RMSNorm(64), nn.Linear(64, 256), nn.Linear(128, 64)

    def forward(self, x):
        return self.w3(F.glu(self.w12(self.norm(x)), dim=-1)) + x


class InPlaceMLP(nn.Module):
    """Case 21 (pytorch/examples PR 1099): Linear -> ``h *= gain`` -> ``h += c`` ->
    ReLU(inplace) -> Linear. The in-place ops come before the ReLU: relu's backward reads its
    own output, so mutating it afterwards fails on one device too."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(64, 256), nn.ReLU(inplace=True), nn.Linear(256, 64)
        self.gain = nn.Parameter(torch.rand(256) + 0.5)

    def forward(self, x, c):
        h = self.up(x)
        h.mul_(self.gain)
        h += c
        return self.down(self.act(h))


def _seeded(fn):
    def build():
        torch.manual_seed(0)
        return fn()

    return build


CASES = {
    "1-head-literal": _seeded(lambda: (HeadLiteralAttention(), _inputs((B, T, 512)))),
    "2-uneven": _seeded(lambda: (nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 5)), _inputs((B, T, 5)))),
    "3-heads-96": _seeded(lambda: (Attention(96, 6, 6), _inputs((B, T, 96)))),
    "4-gqa": _seeded(lambda: (Attention(64, 8, 2), _inputs((B, T, 64)))),
    "4-gqa-interleave": _seeded(lambda: (Attention(64, 8, 2, repeat="interleave"), _inputs((B, T, 64)))),
    "5a-fused-chunk": _seeded(lambda: (FusedQKVChunk(), _inputs((B, T, 64)))),
    "5b-fused-unbind": _seeded(lambda: (FusedQKVUnbind(), _inputs((B, T, 64)))),
    "6-rowwise-bias": _seeded(lambda: (_bias_mlp(), _inputs((B, T, 8)))),
    "7-tied": _seeded(lambda: (TiedLM(), (torch.randint(0, 32, (B, T), generator=torch.Generator().manual_seed(1)),))),
    "8-vocab-11": _seeded(
        lambda: (VocabLoss(), (*_inputs((B, T, 16)), torch.randint(0, 11, (B, T), generator=torch.Generator().manual_seed(2))))
    ),
    "9a-layernorm": _seeded(lambda: (NormAfter("A"), _inputs((B, T, 32)))),
    "9b-per-head-rmsnorm": _seeded(lambda: (NormAfter("B"), _inputs((B, T, 32)))),
    "9c-rmsnorm-then-heads": _seeded(lambda: (NormAfter("C"), _inputs((B, T, 32)))),
    "10-dropout-eval": _seeded(lambda: (DropoutResidual().eval(), _inputs((B, T, 32)))),
    "11-replicated-input": _seeded(
        lambda: (nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 11)), _inputs((4, 16, 16)))
    ),
    "12-shape-branch": _seeded(lambda: (ShapeBranch(), _inputs((B, T, 16)))),
    "13-encoder-fast-path": _seeded(
        lambda: (nn.TransformerEncoderLayer(64, nhead=4, dim_feedforward=128, batch_first=True).eval(), _inputs((2, 10, 64)))
    ),
    "14-mha": _seeded(lambda: (SelfAttentionMHA(), _inputs((B, T, 64)))),
    # need_weights=True: the head-averaged weights are a partial sum over the ranks' heads (1 more all_reduce),
    # dropped with them where the model does not use them (the report counted it: 2 reported, 1 ran)
    "14-mha-weights-unused": _seeded(lambda: (SelfAttentionMHA("unused"), _inputs((B, T, 64)))),
    "14-mha-weights-used": _seeded(lambda: (SelfAttentionMHA("used"), _inputs((B, T, 64)))),
    "18-glu": _seeded(lambda: (GluFFN(), _inputs((B, T, 64)))),
    "19-gqa-enable-gqa": _seeded(lambda: (Attention(64, 8, 2, repeat="enable_gqa"), _inputs((B, T, 64)))),
    "21-in-place": _seeded(lambda: (InPlaceMLP(), _inputs((B, T, 64), (B, T, 256)))),
    "17-sdpa-dropout": _seeded(lambda: (AttentionDropout(), _inputs((B, T, 64)))),
}


def _bias_mlp() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        model[2].bias.copy_(torch.tensor([100.0, 200.0, 300.0]))
    return model


def build_case(name: str):
    return CASES[name]()


# Second set (found by trying fxtp itself): cases 15, 16, 20, 22, 23.


class SharedHeadLinear(nn.Module):
    """Case 15 and its kind: a replicated parameter meets a head-sharded value.

    ``variant``: ``"linear"`` one Linear(16, 16) applied to every head; ``"scale"`` a per-head
    scale parameter (4, 1, 1); ``"norm"`` an RMSNorm(16) with weight on every head.
    """

    def __init__(self, variant: str = "linear") -> None:
        super().__init__()
        self.variant = variant
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))
        self.shared = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.rand(4, 1, 1) + 0.5)
        self.norm = nn.RMSNorm(16)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, 4, 16).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)  # (B, 4, T, 16), sharded on heads
        if self.variant == "linear":
            y = F.gelu(self.shared(y))
        elif self.variant == "scale":
            y = y * self.scale
        else:
            y = self.norm(y)
        return self.o(y.transpose(1, 2).reshape(b, t, 64))


class EmbeddingMLP(nn.Module):
    """Case 16: an embedding with options -> Linear(32, 32) -> tanh -> Linear(32, 16)."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, 32, **options)
        self.up, self.down = nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, ids):
        return self.down(torch.tanh(self.up(self.emb(ids))))


def _repeated_ids():
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(3))
    ids[0, :5] = 7  # one id five times
    ids[1, 0] = 7
    return (ids,)


class LoRALinear(nn.Module):
    """Case 20: base Linear plus a LoRA pair A (in -> 8) and B (8 -> out)."""

    def __init__(self, d_in: int, d_out: int, r: int = 8) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.A = nn.Linear(d_in, r, bias=False)
        self.B = nn.Linear(r, d_out, bias=False)

    def forward(self, x):
        return self.base(x) + self.B(self.A(x))


class LoRAMLP(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.up, self.down = LoRALinear(64, 128), LoRALinear(128, 64)
        if not bias:  # PEFT on Llama: bias-free base layers
            self.up.base.bias = self.down.base.bias = None

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class PeftLoRALinear(nn.Module):
    """Case 20, as PEFT writes it (``peft.tuners.lora.layer.Linear``): ``base_layer`` plus
    ``lora_B(lora_A(dropout(x))) * scaling`` (alpha 16, r 8), adapters in ``ModuleDict``s."""

    def __init__(self, d_in: int, d_out: int, r: int = 8, alpha: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.base_layer = nn.Linear(d_in, d_out)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(d_in, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, d_out, bias=False)})
        self.lora_dropout = nn.ModuleDict({"default": nn.Dropout(dropout) if dropout else nn.Identity()})
        self.scaling = alpha / r

    def forward(self, x):
        adapter = self.lora_B["default"](self.lora_A["default"](self.lora_dropout["default"](x)))
        return self.base_layer(x) + adapter * self.scaling


class PeftLoRAMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = PeftLoRALinear(64, 128), PeftLoRALinear(128, 64)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class LatentKV(nn.Module):
    """Case 22 (MLA-style): kv_a Linear(64, 48); its first 32 columns -> RMSNorm -> kv_b (colwise),
    the other 16 (the rope part) bypass kv_b."""

    def __init__(self) -> None:
        super().__init__()
        self.kv_a, self.norm = nn.Linear(64, 48), nn.RMSNorm(32)
        self.kv_b, self.o = nn.Linear(32, 64), nn.Linear(64, 64)
        self.rope = nn.Linear(16, 64)

    def forward(self, x):
        latent, rope = self.kv_a(x).split([32, 16], dim=-1)
        h = F.silu(self.kv_b(self.norm(latent)))
        return self.o(h) + self.rope(rope)


CASES.update(
    {
        "15-shared-head-linear": _seeded(lambda: (SharedHeadLinear("linear"), _inputs((B, T, 64)))),
        "15-per-head-scale": _seeded(lambda: (SharedHeadLinear("scale"), _inputs((B, T, 64)))),
        "15-head-norm": _seeded(lambda: (SharedHeadLinear("norm"), _inputs((B, T, 64)))),
        "16a-scale-grad-by-freq": _seeded(lambda: (EmbeddingMLP(scale_grad_by_freq=True), _repeated_ids())),
        "16b-max-norm": _seeded(lambda: (EmbeddingMLP(max_norm=1.0), _repeated_ids())),
        "16c-padding-idx": _seeded(lambda: (EmbeddingMLP(padding_idx=7), _repeated_ids())),
        "20-lora": _seeded(lambda: (LoRAMLP(), _inputs((B, T, 64)))),
        # 64 tokens: B's 8 x 64 weight has no more elements than A's (64, 8) output (NOTE: [deferred reduction])
        "20b-lora-no-bias": _seeded(lambda: (LoRAMLP(bias=False), _inputs((B, 32, 64)))),
        "20c-peft-lora": _seeded(lambda: (PeftLoRAMLP(), _inputs((B, T, 64)))),
        "22-latent-kv": _seeded(lambda: (LatentKV(), _inputs((B, T, 64)))),
        "23-seed-linear": _seeded(lambda: (nn.Linear(100, 10), _inputs((B, 100)))),
    }
)


class TinyLMLoss(nn.Module):
    """Loss parallel: a language model whose loss is computed inside (Hugging Face ``labels=``):
    the colwise head's logits feed cross_entropy with ``ignore_index`` targets."""

    def __init__(self, vocab: int = 64, dim: int = 16, with_logits: bool = False) -> None:
        super().__init__()
        self.emb, self.up, self.down = nn.Embedding(vocab, dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.with_logits = with_logits

    def forward(self, ids, labels):
        h = self.emb(ids)
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.head(h)
        loss = F.cross_entropy(logits.float()[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        return (loss, logits) if self.with_logits else loss


def _lm_inputs(vocab: int = 64):
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100  # ignored targets (padding, a prompt)
    return ids, labels


CASES.update(
    {
        "lm-loss": _seeded(lambda: (TinyLMLoss(), _lm_inputs())),
        "lm-loss-and-logits": _seeded(lambda: (TinyLMLoss(with_logits=True), _lm_inputs())),
        "vocab-12-loss": _seeded(
            lambda: (VocabLoss(12), (*_inputs((B, T, 16)), torch.randint(0, 12, (B, T), generator=torch.Generator().manual_seed(2))))
        ),
    }
)

