"""Hypothesis strategies drawing :class:`fuzz_models.Spec` models from the block grammar.

Sizes are small (hidden 15-64, 1-8 heads, batch <= 2, seq <= 8) and picked so that some divide
world sizes 2 and 4 and some do not (hidden 24 and 40, 3/5/6 heads, ffn 10 and 30, vocab 11 and
50), which fxtp shards unevenly (NOTE: [uneven shards]); hidden 20 (5 heads of 4: 2/1/1/1 at ws
4) and 15 (3 heads of 5 or 5 of 3: odd at ws 2 too) make every projection of a block uneven.
Tables of 96 and 128 rows are at least twice the hidden size, so fxtp makes them vocab-parallel.
Choices are listed plainest first, so a failure shrinks toward the plainest model that breaks.
``exclude``: feature names (:func:`fuzz_models.features`) never to draw, e.g. those of a
known bug.
"""

from __future__ import annotations

from typing import Any, Sequence

from fuzz_loop import Call, Load, Loop, Mode, Save, Step
from fuzz_models import Attn, Einsum, Embed, Mha, Mlp, Moe, Spec
from hypothesis import strategies as st

__all__ = ["specs", "loops"]

HIDDEN = (16, 32, 24, 48, 64, 40, 20, 15)
FFN = (16, 32, 10, 24, 30, 48, 64)
VOCAB = (16, 128, 11, 50, 96)
NORMS = ("none", "rms", "layer", "layer_noaffine")


def _pick(field: str, options: Sequence[Any], exclude: frozenset[str]) -> st.SearchStrategy:
    """One of ``options`` whose feature ``"<field>:<option>"`` is not excluded (the first,
    plainest option is never excluded)."""
    return st.sampled_from([o for i, o in enumerate(options) if i == 0 or f"{field}:{o}" not in exclude])


def _flag(name: str, exclude: frozenset[str]) -> st.SearchStrategy:
    return st.just(False) if name in exclude else st.booleans()


def _divisors(n: int, at_most: int = 8) -> list[int]:
    return [d for d in range(1, at_most + 1) if n % d == 0]


@st.composite
def mlps(draw: st.DrawFn, exclude: frozenset[str]) -> Mlp:
    gate = draw(_pick("gate", ("none", "swiglu", "chunk", "split", "strided", "unbind", "glu"), exclude))
    # an in-place activation on a view of a multi-output op (chunk, unbind) is an autograd error
    in_place = ("relu_", "relu_module_inplace") if gate in ("none", "swiglu") else ()
    act = draw(_pick("act", ("relu", "gelu", "silu", "tanh", *in_place), exclude))
    return Mlp(
        ffn=draw(st.sampled_from(FFN)),
        act=act,
        gate=gate,
        bias=draw(st.booleans().map(lambda b: not b)),
        norm=draw(_pick("norm", NORMS, exclude)),
        residual=draw(_pick("residual", ("none", "add", "iadd"), exclude)),
        dropout=draw(_flag("mlp.dropout", exclude)),
        lora=draw(_flag("mlp.lora", exclude)) if gate == "none" else False,
    )


@st.composite
def attns(draw: st.DrawFn, hidden: int, exclude: frozenset[str]) -> Attn:
    heads = draw(st.sampled_from(_divisors(hidden)))
    kv_heads = draw(st.sampled_from(sorted(_divisors(heads), reverse=True)))
    same = kv_heads == heads
    proj = draw(_pick("proj", ("separate", "split", "slice", *(("chunk", "unbind", "strided") if same else ())), exclude))
    repeat = draw(_pick("repeat", ("expand", "interleave", "enable_gqa"), exclude)) if not same else "expand"
    rotary = draw(_pick("rotary", ("none", "real", "complex"), exclude)) if (hidden // heads) % 2 == 0 else "none"
    return Attn(
        heads=heads,
        kv_heads=kv_heads,
        proj=proj,
        repeat=repeat,
        rotary=rotary,
        alibi=draw(_flag("attn.alibi", exclude)),
        causal=draw(st.booleans().map(lambda b: not b)),
        qk_norm=draw(_pick("qk_norm", ("none", "rms", "layer"), exclude)),
        head_scale=draw(_flag("attn.head_scale", exclude)),
        shared_head_linear=draw(_flag("attn.shared_head_linear", exclude)),
        sdpa_dropout=draw(_flag("attn.sdpa_dropout", exclude)),
        bias=draw(st.booleans().map(lambda b: not b)),
        norm=draw(_pick("norm", NORMS, exclude)),
        residual=draw(st.booleans().map(lambda b: not b)),
        dropout=draw(_flag("attn.dropout", exclude)),
    )


@st.composite
def mhas(draw: st.DrawFn, hidden: int, exclude: frozenset[str]) -> Mha:
    return Mha(
        heads=draw(st.sampled_from(_divisors(hidden))),
        bias=draw(st.booleans().map(lambda b: not b)),
        norm=draw(_pick("norm", NORMS, exclude)),
        residual=draw(st.booleans().map(lambda b: not b)),
        weights=draw(_pick("weights", ("none", "unused", "used"), exclude)),
    )


@st.composite
def einsums(draw: st.DrawFn, hidden: int, exclude: frozenset[str]) -> Einsum:
    form = draw(st.sampled_from([f for f in ("einsum_ff", "bmm_heads", "einsum_heads") if f"form:{f}" not in exclude]))
    return Einsum(form=form, ffn=draw(st.sampled_from(FFN)), heads=draw(st.sampled_from(_divisors(hidden))))


@st.composite
def moes(draw: st.DrawFn, hidden: int, exclude: frozenset[str]) -> Moe:
    """Hugging Face's MoE blocks (fuzz_moe.py): 4 experts (even at ws 2 and 4) or 6 (2/2/1/1
    whole experts at 4), top-1 or top-2, routed experts of FFN's widths; ``grouped_mm`` only
    for widths that are multiples of 4 (torch's alignment), else ``batched_mm``. Either
    implementation under either plan (``Spec.expert_parallel`` is drawn apart)."""
    ffn = draw(st.sampled_from(FFN))
    aligned = hidden % 4 == 0 and ffn % 4 == 0
    return Moe(
        ffn=ffn,
        experts=draw(st.sampled_from((4, 6))),
        top_k=draw(st.sampled_from((2, 1))),
        shared=draw(_flag("moe.shared", exclude)),
        impl=draw(_pick("impl", ("grouped_mm", "batched_mm"), exclude)) if aligned else "batched_mm",
        residual=draw(st.booleans().map(lambda b: not b)),
    )


@st.composite
def embeds(draw: st.DrawFn, vocab: int, exclude: frozenset[str]) -> Embed:
    return Embed(
        padding_idx=draw(st.none() | st.just(0)) if "embed.padding_idx" not in exclude else None,
        scale_grad_by_freq=draw(_flag("embed.scale_grad_by_freq", exclude)),
        max_norm=draw(st.none() | st.just(1.0)) if "embed.max_norm" not in exclude else None,
    )


@st.composite
def specs(draw: st.DrawFn, exclude: frozenset[str] = frozenset()) -> Spec:
    """A random :class:`Spec` using no feature in ``exclude``."""
    hidden = draw(st.sampled_from(HIDDEN))
    vocab = draw(st.sampled_from(VOCAB))
    others = {"block:attn": attns(hidden, exclude), "block:mha": mhas(hidden, exclude), "block:einsum": einsums(hidden, exclude),
              "block:moe": moes(hidden, exclude)}
    kinds = [mlps(exclude), *(s for name, s in others.items() if name not in exclude)]
    blocks = tuple(draw(st.lists(st.one_of(kinds), min_size=1, max_size=3)))
    embed = draw(st.none() | embeds(vocab, exclude)) if "embed" not in exclude else None
    heads = ("none", "linear", "linear_bias", *(("tied",) if embed is not None else ()))
    head = draw(_pick("head", heads, exclude))
    loss = draw(_flag("loss", exclude)) if head != "none" else False
    return Spec(
        hidden=hidden,
        blocks=blocks,
        embed=embed,
        vocab=vocab,
        final_norm=draw(_pick("final_norm", NORMS, exclude)),
        head=head,
        loss=loss,
        train=draw(_flag("train", exclude)),
        also_hidden=draw(_flag("also_hidden", exclude)),
        batch=draw(st.sampled_from((2, 1))),
        seq=draw(st.sampled_from((8, 4, 5))),
        seed=draw(st.integers(0, 3)),
        sequence_parallel=draw(_flag("sequence_parallel", exclude)),
        clip=draw(_flag("clip", exclude)),
        type_groups=draw(_flag("type_groups", exclude)),
        checkpointing=draw(_pick("checkpointing", ("none", "user", "blocks", "selective"), exclude)),
        dynamic=draw(_flag("dynamic", exclude)),
        expert_parallel=draw(_flag("expert_parallel", exclude)) if any(isinstance(b, Moe) for b in blocks) else False,
        aliased=draw(_flag("aliased", exclude)) if loss and embed is not None else False,
        ignored=draw(_flag("ignored", exclude)) if loss else False,
        # with MoE blocks too: Hugging Face's experts' .to(hidden.dtype) is in the graph captured under autocast
        # (NOTE: [autocast graphs] in fxtp/core/autocast.py; test_fuzz_regressions' autocast-mlp-then-moe), and with an
        # in-place residual (y += x keeps y's dtype: NOTE: [in-place arithmetic at fx capture], autocast-iadd-residual)
        autocast=draw(_flag("autocast", exclude)),
    )


# token counts: divisible by 2 and 4, by 2 only, by neither, and 1 (NOTE: [size-1 graphs])
TOKENS = (8, 4, 12, 1, 2, 6, 3, 5)


@st.composite
def loops(draw: st.DrawFn) -> Loop:
    """A random :class:`fuzz_loop.Loop`: a tiny HF Llama (or GPT-2), its compile, and up to 10
    user-loop operations ending in an optimizer step (which compares the gradients)."""
    labels = draw(st.booleans().map(lambda b: not b))
    kinds = ("ids", "some", "all") if labels else ("none",)
    calls = st.builds(Call, tokens=st.sampled_from(TOKENS), batch=st.sampled_from((1, 2)), labels=st.sampled_from(kinds),
                      grad=st.sampled_from(("grad", "no_grad", "inference_mode")))
    ops = st.one_of(calls, st.builds(Step, clip=st.sampled_from(("none", "pm", "torch"))), st.builds(Mode, st.booleans()),
                    st.builds(Load, seed=st.sampled_from((0, 1))), st.just(Save()))
    family = draw(st.sampled_from(("llama", "gpt2")))
    return Loop(
        ops=(*draw(st.lists(ops, min_size=1, max_size=10)), Step()),
        family=family,
        layers=draw(st.sampled_from((1, 2))),
        kv_heads=draw(st.sampled_from((4, 2))) if family == "llama" else 4,
        tokens=draw(st.sampled_from((8, 4, 12))),
        batch=draw(st.sampled_from((1, 2))),
        sequence_parallel=draw(st.booleans()),
        dynamic=draw(st.booleans().map(lambda b: not b)),
        labels=labels,
        dropout=draw(st.booleans()),
        seed=draw(st.integers(0, 3)),
    )
