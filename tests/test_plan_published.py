"""The cost model against published runs (issue 34 items 3 and 4): the table's ratios computed
from the sources' figures (tools/published_runs.py), efficiency by hardware and GEMM size, the
tensor-parallel overlap option, and the plan's close calls. No ranks: the planner's own code."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import pytest
import torch

import fxtp
from fxtp.planner import HARDWARE
from fxtp.planner.comm import Group, ring_time
from fxtp.planner.close_call import MEASURED_ERROR, close_calls
from fxtp.planner.costs import Choice, Workload, compute_efficiency, estimate
from fxtp.planner.hardware import gemm_efficiency

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import published_runs  # noqa: E402

transformers = pytest.importorskip("transformers")


def _recorded() -> dict:
    with open(os.path.join(ROOT, "docs", "bench_plan.json")) as f:
        return json.load(f)["published"]


def test_published_ratios_are_recomputed_from_the_sources_figures():
    """Two runs re-priced here (a GPT at tp 2 and a Llama at tp 8 with async TP) give the
    recorded ratios, and the docs' table prints them; every run's measured seconds follow from
    its published figure; the median and worst, and the close-call threshold, from the ratios."""
    recorded = {r["name"]: r for r in _recorded()["rows"]}
    assert [r.name for r in published_runs.RUNS] == list(recorded)
    for run in published_runs.RUNS:
        assert recorded[run.name]["measured_s"] == pytest.approx(run.measured_s, rel=1e-12)
    picked = [r for r in published_runs.RUNS if r.name in ("Megatron GPT-3.6B 64xA100 TP2",
                                                              "torchtitan Llama-3-8B 64xH100 FSDP8 TP8 async TP")]
    table = published_runs.table(tuple(picked))
    with open(os.path.join(ROOT, "docs", "plan_command.md")) as f:
        docs = f.read()
    for row, line in zip(table.rows, published_runs.markdown(table).splitlines()[2:]):
        assert row["predicted_s"] == pytest.approx(recorded[row["name"]]["predicted_s"], rel=1e-9)
        assert line in docs, line
    # Megatron's own FLOPs count: 96 B s l h^2 (1 + s/6h + V/16lh) at 138 TFLOP/s on 64 GPUs
    meg = next(r for r in picked if r.unit != "tokens/s/GPU")
    flops = 96 * 512 * 2048 * 30 * 3072**2 * (1 + 2048 / (6 * 3072) + 51200 / (16 * 30 * 3072))
    assert meg.measured_s == pytest.approx(flops / (64 * 138e12))
    errors = sorted(abs(math.log(r["ratio"])) for r in recorded.values())
    median = (errors[(len(errors) - 1) // 2] + errors[len(errors) // 2]) / 2
    assert _recorded()["median_abs_log_ratio"] == pytest.approx(median)
    assert _recorded()["worst_abs_log_ratio"] == pytest.approx(errors[-1])
    assert MEASURED_ERROR == round(median, 3)


def test_gemm_efficiency_is_mfu_times_the_filled_waves():
    h100 = HARDWARE["h100"]
    assert (HARDWARE["a100"].mfu, h100.mfu, HARDWARE["a100"].sms, h100.sms) == (0.52, 0.47, 108, 132)
    # 132 tiles of 256 x 128: one full wave; one more tile: a second wave with 1 of 132 SMs busy
    assert gemm_efficiency(h100, 256, 128 * 132) == pytest.approx(0.47)
    assert gemm_efficiency(h100, 256, 128 * 133) == pytest.approx(0.47 * 133 / 264)
    assert gemm_efficiency(dataclasses.replace(h100, sms=0), 256, 128 * 133) == 0.47
    shape = _llama8b_shape()
    # Llama-3-8B at 8192 tokens: MLP 14336 wide -> 32 x 112 tiles, 3584 on 132 SMs: 27.15 waves
    big, small = compute_efficiency(h100, shape, 8192, 1), compute_efficiency(h100, shape, 2048, 8)
    assert 0.45 < big < 0.47 and small < big - 0.05
    assert compute_efficiency(dataclasses.replace(h100, sms=0), shape, 2048, 8) == pytest.approx(0.47)


def _llama8b_shape():
    from fxtp.planner.model import TransformerShape

    return TransformerShape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, gated_mlp=True,
                            flash=True, matmul_params=7_000_000_000, block_params=218_000_000)


def test_tp_overlap_hides_sequence_parallel_collectives_up_to_the_matmuls():
    from fxtp.planner.params import ParamShapes

    shape, hw = _llama8b_shape(), HARDWARE["h100"]
    params = ParamShapes(tp=8, other=(), block=(), n_blocks=32, analyzed_blocks=2)  # dp 1 below: no FSDP terms
    plain, over = (Workload(8, 8192, True, "adamw", 8, tp_overlap=o) for o in (None, "async-tp"))
    for sp in (True, False):
        c = Choice(8, 1, sp, None, 1, 8)
        a, b = estimate(c, shape, params, hw, plain), estimate(c, shape, params, hw, over)
        if not sp:  # both runtimes need sequence parallelism: nothing hidden
            assert b.step == a.step
            continue
        matmul = 6 * shape.block_params / 8 * 8192 / (hw.peak_flops * compute_efficiency(hw, shape, 8192, 8))
        # a block's 5 all_gather/reduce_scatter pairs of the (1, 8192, 4096) bf16 activations (NOTE: [collective time])
        block = 2 * 5 * ring_time("all_gather", 8192 * 4096 * 2, Group.tp(8, 8), hw)
        assert b.step["tp_comm_hidden"] == pytest.approx(8 * shape.layers * min(block, matmul))
        assert b.step["tp_comm"] == pytest.approx(a.step["tp_comm"] - b.step["tp_comm_hidden"])
        assert b.step["compute"] == a.step["compute"] and a.step["tp_comm_hidden"] == 0


def test_tp_overlap_is_checked_and_reported():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=16, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    with pytest.raises(fxtp.FxtpConfigError, match="tp_overlap must be None or one of async-tp, megatron"):
        fxtp.plan(model, 4, device_memory=2**30, batch=4, seq=16, tp_overlap="nccl")
    plan = fxtp.plan(model, 4, device_memory=2**30, batch=4, seq=16, tp_overlap="megatron", tp=4)
    d = plan.to_dict()
    assert d["tp_overlap"] == "megatron" and d["close_calls"] == [] and "tp_comm_hidden" in d["step_s"]


def _price(comm: float):
    """A constructed pair of rows: tp 1 spends 4 s of work at mfu, tp 8 3.5 s plus ``comm`` s."""
    return lambda hw, tp: (4.0 / hw.mfu + 0.2) if tp == 1 else (3.5 / hw.mfu + comm)


def test_a_close_call_says_which_assumption_flips_the_winner_and_where():
    hw = HARDWARE["h100"]
    price = _price(1.5)
    best, other = price(hw, 1), price(hw, 8)
    lines = close_calls(hw, price, 1, best, {8: other})
    # 0.5 / mfu = 1.3 at mfu = 0.385: below it, tp 8 is faster
    assert lines[0].startswith(f"tp 8 is {other / best - 1:.1%} slower than tp 1, within the model's measured error")
    assert lines[1] == "tp 1 wins while achieved efficiency (mfu) is above 0.38; below, tp 8 (the hardware table's: 0.47)"
    assert len(lines) == 2  # the bandwidths do not enter this price


def test_a_clear_win_has_no_close_call():
    hw = HARDWARE["h100"]
    price = _price(5.0)
    assert close_calls(hw, price, 1, price(hw, 1), {8: price(hw, 8)}) == ()


def test_a_calibrated_hardware_has_no_close_call_on_what_it_measured():
    """A Hardware with measured rates and collectives prices with them, not with ``mfu`` or the
    bandwidths: the assumption lines are left out; the measured-error line stays."""
    hw = dataclasses.replace(HARDWARE["h100"], achieved_flops=((1, 4e14), (8, 4e14)),
                             collectives=(("all_reduce", 8, 1e-5, 1e11),))
    price = _price(1.5)  # moving mfu would flip it (the test above): not for measured rates
    lines = close_calls(hw, price, 1, price(hw, 1), {8: price(hw, 8)})
    assert len(lines) == 1 and "within the model's measured error" in lines[0], lines


def test_a_calibrated_rate_prices_the_degrees_it_measured_only():
    """``achieved_flops`` replaces the rate at the degrees it lists; another degree keeps the
    peak at the efficiency by hardware and GEMM size; each estimate says the rate it used."""
    from fxtp.planner.params import ParamShapes

    shape, h100 = _llama8b_shape(), HARDWARE["h100"]
    calibrated = dataclasses.replace(h100, achieved_flops=((8, 1e14),))
    work = Workload(8, 8192, True, "adamw", 8)
    for tp, expected in ((8, 1e14), (4, h100.peak_flops * compute_efficiency(h100, shape, 8192, 4))):
        params = ParamShapes(tp=tp, other=(), block=(), n_blocks=32, analyzed_blocks=2)
        c = Choice(tp, 8 // tp, False, None, 1, 8 // (8 // tp))
        e = estimate(c, shape, params, calibrated, work)
        assert e.rate == pytest.approx(expected)
        assert e.step["compute"] == pytest.approx(shape.flops_per_token(8192) * 8 * 8192 / (8 * expected))
