"""Published training runs with known layouts, and the planner's predicted/measured step time
for each (issue 34, item 3). Every run records its source (repository file at a commit, or
paper and table), the figure as published, and the layout; ``measured_s`` turns the figure into
seconds per optimizer step by the source's own definition; :func:`predicted_s` prices the
pinned layout with fxtp's cost model (``fxtp.planner.costs.estimate``), the parameters from
fxtp's analysis of the model's shapes on the meta device.

    python tools/bench_plan.py --published        # the table, the median and worst |log ratio|
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

import torch

TORCHTITAN_A100 = "pytorch/torchtitan docs/performance.md @0413364 (Llama 3/2 on 64 A100-80GB, FSDP2)"
TORCHTITAN_H100 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @b5bcd76, table 1/3"
TORCHTITAN_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @b5bcd76, bf16 rows"
FMS = "foundation-model-stack/fms-fsdp README.md @0d31998, table (128 A100, seq 4096)"
FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md @061f2c7"
MEGATRON = "Narayanan et al. 2021 (arXiv 2104.04473), table 1 (Megatron-LM's weak-scaling runs, A100-80GB)"

# shapes: Llama (meta-llama config.json files) and MPT (llm-foundry's benchmark yamls: a GPT-2
# block, d_model/n_layers/n_heads, 4x MLP, vocab 50368; the table's NumParams equals the GPT-2
# count of these shapes exactly); Megatron's GPT (table 1: heads, hidden, layers; vocab 51200)
LLAMA = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256),
    "llama3-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       intermediate_size=28672, vocab_size=128256),
    "llama2-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      intermediate_size=11008, vocab_size=32000),
    "llama2-13b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                       intermediate_size=13824, vocab_size=32000),
    "llama2-34b": dict(hidden_size=8192, num_hidden_layers=48, num_attention_heads=64, num_key_value_heads=8,
                       intermediate_size=22016, vocab_size=32000),
    "llama2-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       intermediate_size=28672, vocab_size=32000),
}
GPT = {  # (hidden, layers, heads, vocab)
    "mpt-7b": (4096, 32, 32, 50368), "mpt-13b": (5120, 40, 40, 50368), "mpt-30b": (7168, 48, 64, 50368),
    "mpt-70b": (8192, 80, 64, 50368),
    "gpt-1.7b": (2304, 24, 24, 51200), "gpt-3.6b": (3072, 30, 32, 51200), "gpt-7.5b": (4096, 36, 32, 51200),
    "gpt-18.4b": (6144, 40, 48, 51200),
}


@dataclass(frozen=True)
class Run:
    """One published run: its layout, and its figure as published (``figure``, ``unit``)."""

    name: str
    source: str
    model: str  # a key of LLAMA or GPT
    hardware: str
    devices: int
    tp: int
    seq: int
    micro_batch: int  # sequences per micro-batch on a dp rank
    accumulation: int
    ac: Optional[str]  # "blocks" (full), "selective", None
    figure: float
    unit: str  # "tokens/s/GPU" or "TFLOP/s/GPU (Megatron's count, recomputation included)"
    sp: bool = False
    tp_overlap: Optional[str] = None
    note: str = ""

    @property
    def dp(self) -> int:
        return self.devices // self.tp

    @property
    def batch(self) -> int:
        """Global batch, sequences per optimizer step."""
        return self.dp * self.micro_batch * self.accumulation

    @property
    def measured_s(self) -> float:
        """Seconds per optimizer step the figure means (tokens/s per GPU: the global batch's
        tokens over devices x that rate; Megatron's TFLOP/s: their eq. 3 FLOPs,
        ``96 B s l h^2 (1 + s/6h + V/16lh)``, over devices x that rate)."""
        if self.unit == "tokens/s/GPU":
            return self.batch * self.seq / (self.devices * self.figure)
        h, layers, _, vocab = GPT[self.model]
        flops = 96 * self.batch * self.seq * layers * h * h * (1 + self.seq / (6 * h) + vocab / (16 * layers * h))
        return flops / (self.devices * self.figure * 1e12)


TOK, MEG = "tokens/s/GPU", "TFLOP/s/GPU"
HSDP = "HSDP (sharded in a node, replicated across): priced as FSDP over all 128"
RUNS: tuple[Run, ...] = (
    Run("torchtitan Llama-3-8B 64xA100 FSDP", TORCHTITAN_A100, "llama3-8b", "a100", 64, 1, 8192, 1, 1, "selective", 2973, TOK,
        note="selective op AC, WPS 2973"),
    Run("torchtitan Llama-3-70B 64xA100 FSDP", TORCHTITAN_A100, "llama3-70b", "a100", 64, 1, 8192, 1, 1, "blocks", 331, TOK,
        note="full AC, WPS 331"),
    Run("torchtitan Llama-2-13B 64xA100 FSDP", TORCHTITAN_A100, "llama2-13b", "a100", 64, 1, 4096, 2, 1, None, 2162, TOK,
        note="no AC, WPS 2162"),
    Run("torchtitan Llama-2-70B 64xA100 FSDP", TORCHTITAN_A100, "llama2-70b", "a100", 64, 1, 4096, 2, 1, "blocks", 353, TOK,
        note="full AC, WPS 353"),
    Run("torchtitan Llama-3.1-8B 8xH100 FSDP", TORCHTITAN_H100, "llama3-8b", "h100", 8, 1, 8192, 2, 1, "selective", 5762, TOK,
        note="table 1 'FSDP' (no compile); 500 W HBM2e H100s, peak below the SXM's"),
    Run("torchtitan Llama-3.1-8B 128xH100 FSDP", TORCHTITAN_H100, "llama3-8b", "h100", 128, 1, 8192, 2, 1, "selective", 5605,
        TOK, note="table 3 'FSDP'; 500 W HBM2e H100s"),
    Run("torchtitan Llama-3-70B 256xH100 FSDP32 TP8", TORCHTITAN_ASYNC, "llama3-70b", "h100", 256, 8, 8192, 16, 1, "blocks",
        597.3, TOK, sp=True, note="vanilla TP, compile, full AC; 500 W H100s"),
    Run("torchtitan Llama-3-70B 256xH100 FSDP32 TP8 async TP", TORCHTITAN_ASYNC, "llama3-70b", "h100", 256, 8, 8192, 16, 1,
        "blocks", 652.4, TOK, sp=True, tp_overlap="async-tp", note="async TP, compile, full AC"),
    Run("torchtitan Llama-3-8B 64xH100 FSDP8 TP8", TORCHTITAN_ASYNC, "llama3-8b", "h100", 64, 8, 8192, 12, 1, "selective",
        4378, TOK, sp=True, note="vanilla TP, compile, per-op SAC"),
    Run("torchtitan Llama-3-8B 64xH100 FSDP8 TP8 async TP", TORCHTITAN_ASYNC, "llama3-8b", "h100", 64, 8, 8192, 12, 1,
        "selective", 4809.4, TOK, sp=True, tp_overlap="async-tp", note="async TP, compile, per-op SAC"),
    Run("fms-fsdp Llama-2-7B 128xA100", FMS, "llama2-7b", "a100", 128, 1, 4096, 2, 1, None, 3760, TOK, note=HSDP),
    Run("fms-fsdp Llama-2-13B 128xA100", FMS, "llama2-13b", "a100", 128, 1, 4096, 1, 1, None, 1700, TOK, note=HSDP),
    Run("fms-fsdp Llama-2-34B 128xA100", FMS, "llama2-34b", "a100", 128, 1, 4096, 8, 1, "blocks", 772, TOK, note="FSDP, AC"),
    Run("fms-fsdp Llama-2-70B 128xA100", FMS, "llama2-70b", "a100", 128, 1, 4096, 6, 1, "blocks", 380, TOK, note="FSDP, AC"),
    Run("llm-foundry MPT-7B 8xH100", FOUNDRY, "mpt-7b", "h100", 8, 1, 2048, 6, 1, None, 10643, TOK, note="H100 BF16 table"),
    Run("llm-foundry MPT-13B 8xH100", FOUNDRY, "mpt-13b", "h100", 8, 1, 2048, 2, 1, None, 4792, TOK, note="H100 BF16 table"),
    Run("llm-foundry MPT-70B 64xH100", FOUNDRY, "mpt-70b", "h100", 64, 1, 2048, 8, 4, "blocks", 1039, TOK,
        note="H100 BF16 table"),
    Run("llm-foundry MPT-7B 8xA100", FOUNDRY, "mpt-7b", "a100", 8, 1, 2048, 6, 2, None, 4641, TOK, note="A100 80GB table"),
    Run("llm-foundry MPT-13B 8xA100", FOUNDRY, "mpt-13b", "a100", 8, 1, 2048, 2, 3, None, 2262, TOK, note="A100 80GB table"),
    Run("llm-foundry MPT-30B 8xA100", FOUNDRY, "mpt-30b", "a100", 8, 1, 2048, 3, 21, "blocks", 916, TOK,
        note="A100 80GB table"),
    Run("llm-foundry MPT-70B 64xA100", FOUNDRY, "mpt-70b", "a100", 64, 1, 2048, 8, 4, "blocks", 410, TOK,
        note="A100 80GB table"),
    Run("Megatron GPT-1.7B 32xA100 TP1", MEGATRON, "gpt-1.7b", "a100", 32, 1, 2048, 16, 1, "blocks", 137, MEG,
        note="DDP, not FSDP; micro-batch not published (priced: the rank's 16 at once)"),
    Run("Megatron GPT-3.6B 64xA100 TP2", MEGATRON, "gpt-3.6b", "a100", 64, 2, 2048, 16, 1, "blocks", 138, MEG,
        note="DDP; micro-batch not published"),
    Run("Megatron GPT-7.5B 128xA100 TP4", MEGATRON, "gpt-7.5b", "a100", 128, 4, 2048, 16, 1, "blocks", 142, MEG,
        note="DDP; micro-batch not published"),
    Run("Megatron GPT-18.4B 256xA100 TP8", MEGATRON, "gpt-18.4b", "a100", 256, 8, 2048, 32, 1, "blocks", 135, MEG,
        note="DDP; micro-batch not published"),
)

# published, not expressible: pipeline parallelism, which the planner does not model
NOT_EXPRESSED = (
    "Dubey et al. 2024 (The Llama 3 Herd of Models), table 4: Llama-3-405B on 8192-16384 H100, TP 8, PP 16: pipeline parallel",
    "Narayanan et al. 2021, table 1, 39.1B-1T rows: PP 2-64",
    "torchtitan benchmarks/llama3_h100_202412_torchtitan.md tables 2, 4-6: context parallel, Float8 or PP",
)


def _model(name: str, seq: int) -> torch.nn.Module:
    if name in LLAMA:
        from transformers import LlamaForCausalLM

        from fxtp.cli.examples import llama_config

        cfg = llama_config(max_position_embeddings=max(seq, 8192), **LLAMA[name])
        with torch.device("meta"):
            return LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    from transformers import GPT2Config, GPT2LMHeadModel

    h, layers, heads, vocab = GPT[name]
    cfg = GPT2Config(n_embd=h, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=seq, use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return GPT2LMHeadModel._from_config(cfg, dtype=torch.bfloat16)


@lru_cache(maxsize=None)
def _analyzed(name: str, seq: int, tp: int):
    """The model's shape and rank 0's parameters at ``tp`` (fxtp's analysis of two blocks)."""
    from fxtp.planner.model import TransformerShape
    from fxtp.planner.params import parameter_shapes, repeated_blocks
    from fxtp.planner.search import _inputs

    model = _model(name, seq)
    blocks = repeated_blocks(model)
    args, kwargs = _inputs(model, None, None)
    return TransformerShape.of(model, blocks.fqn), parameter_shapes(model, (tp,), args, kwargs)[tp]


def predicted_s(run: Run) -> float:
    """The cost model's seconds per optimizer step for ``run``'s pinned layout."""
    from fxtp.planner.costs import Choice, Workload, estimate
    from fxtp.planner.hardware import HARDWARE

    hw = HARDWARE[run.hardware]
    shape, params = _analyzed(run.model, run.seq, run.tp)
    work = Workload(run.batch, run.seq, True, "adamw", hw.devices_per_node, tp_overlap=run.tp_overlap)
    choice = Choice(run.tp, run.dp, run.sp, run.ac, run.micro_batch, run.accumulation)
    return estimate(choice, shape, params, hw, work).step["total"]


@dataclass
class Table:
    rows: list[dict] = field(default_factory=list)

    @property
    def errors(self) -> list[float]:
        return sorted(abs(math.log(r["ratio"])) for r in self.rows)

    @property
    def median(self) -> float:
        e = self.errors
        return (e[(len(e) - 1) // 2] + e[len(e) // 2]) / 2

    @property
    def worst(self) -> float:
        return max(self.errors)


def table(runs: tuple[Run, ...] = RUNS) -> Table:
    """Each run's predicted and measured seconds and their ratio."""
    out = Table()
    for r in runs:
        predicted = predicted_s(r)
        out.rows.append({"name": r.name, "source": r.source, "figure": f"{r.figure:g} {r.unit}", "hardware": r.hardware,
                         "layout": f"tp {r.tp} x dp {r.dp}" + (" sp" if r.sp else "") + f", ac {r.ac or 'none'}, "
                         f"{r.micro_batch} x {r.accumulation}, seq {r.seq}" + (f", {r.tp_overlap}" if r.tp_overlap else ""),
                         "measured_s": r.measured_s, "predicted_s": predicted, "ratio": predicted / r.measured_s, "note": r.note})
    return out


def markdown(t: Table) -> str:
    lines = ["| run | hardware | layout | published | measured s/step | predicted | predicted/measured |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['name']} | {r['hardware']} | {r['layout']} | {r['figure']} | {r['measured_s']:.3g} | {r['predicted_s']:.3g} "
              f"| {r['ratio']:.2f} |" for r in t.rows]
    lines.append(f"\nmedian |log ratio| {t.median:.3f} ({math.exp(t.median) - 1:.0%}), worst {t.worst:.3f} "
                 f"({math.exp(t.worst) - 1:.0%}), {len(t.rows)} runs")
    return "\n".join(lines)
