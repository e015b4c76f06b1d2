"""The planner's pipeline dimension (issue 33 item 4): the bubble, the bytes between stages, the
micro-batches in flight, a stage's own parameters, and the balanced cut, priced by
``fxtp.planner.pipeline_costs`` on constructed shapes (no ranks, no capture)."""

from __future__ import annotations

import itertools

import pytest

from fxtp.pipelining.report import bubble_fraction
from fxtp.planner import HARDWARE
from fxtp.planner.comm import p2p_time
from fxtp.planner.costs import Choice, Workload, estimate
from fxtp.planner.model import TransformerShape
from fxtp.planner.params import ParamShapes
from fxtp.planner.pipeline_costs import estimate_pipeline, held_micro_batches, schedule_runs, stage_blocks

HIDDEN, SEQ, LAYERS, VOCAB = 1024, 2048, 16, 32000
SHAPE = TransformerShape(hidden=HIDDEN, layers=LAYERS, heads=16, kv_heads=16, intermediate=4096, vocab=VOCAB, gated_mlp=False,
                         flash=True, matmul_params=LAYERS * 12 * HIDDEN**2 + VOCAB * HIDDEN, block_params=12 * HIDDEN**2)


def _params(tp: int) -> ParamShapes:
    """A block of 12 h^2 parameters (bf16), an embedding before the blocks and a head after,
    sharded over ``tp`` on dim 0."""
    embedding, head = ((VOCAB // tp, HIDDEN), 2), ((VOCAB // tp, HIDDEN), 2)
    return ParamShapes(tp, (embedding, head), (((12 * HIDDEN // tp, HIDDEN), 2),), LAYERS, 2, before=1)


def _run(pp: int, tp: int, dp: int, m: int, schedule: str = "1F1B", v: int = 1, b: int = 1, ac=None):
    work = Workload(batch=dp * m * b, seq=SEQ, training=True, optimizer="adamw", devices_per_node=8)
    choice = Choice(tp, dp, False, ac, b, m, pp, schedule, v)
    return (estimate_pipeline if pp > 1 else estimate)(choice, SHAPE, _params(tp), HARDWARE["h100"], work)


@pytest.mark.parametrize("schedule, v", [("1F1B", 1), ("Interleaved1F1B", 2)])
def test_the_bubble_is_narayanans_formula_over_the_slowest_rank(schedule, v):
    """Narayanan et al. 2021 s2.2: 1F1B idles (p - 1) / (m + p - 1) of the step, interleaved
    (p - 1) / (v m + p - 1); the step is the slowest rank's busy time over (1 - bubble) plus
    FSDP2's exposed communication."""
    pp, m = 4, 8
    e = _run(pp, 2, 2, m, schedule, v)
    f = (pp - 1) / (v * m + pp - 1)
    assert bubble_fraction(schedule, pp, m, v)[0] == pytest.approx(f)
    busy = e.step["compute"] + e.step["tp_comm"] + e.step["p2p"]
    assert e.step["bubble"] == pytest.approx(busy * f / (1 - f))
    assert e.step["total"] == pytest.approx(busy / (1 - f) + e.step["fsdp_exposed"])
    assert 0 < e.step["fsdp_exposed"] <= e.step["fsdp_comm"]


def test_interleaving_shrinks_the_bubble_and_sends_twice_the_bytes():
    one, two = _run(4, 1, 1, 8), _run(4, 1, 1, 8, "Interleaved1F1B", 2)
    assert two.step["bubble"] / two.step["total"] < one.step["bubble"] / one.step["total"]
    payload = 1 * SEQ * HIDDEN * 2  # a micro-batch's bf16 activation
    # a middle rank sends its stage's activation forward and the gradient back, per micro-batch;
    # with 2 stages a rank, twice
    assert one.comm_bytes["pp"] == 2 * 8 * payload and two.comm_bytes["pp"] == 4 * 8 * payload
    # across nodes (4 x 1 x 1 ranks on one node: NVLink) each receive is one send's time
    assert one.step["p2p"] == pytest.approx(2 * 8 * p2p_time(payload, False, HARDWARE["h100"]))


def test_the_first_rank_holds_pp_micro_batches_under_1f1b_and_more_interleaved():
    assert [held_micro_batches("1F1B", 4, r, 8, 1) for r in range(4)] == [4, 3, 2, 1]
    assert [held_micro_batches("1F1B", 4, r, 2, 1) for r in range(4)] == [2, 2, 2, 1]
    # torch's interleaved warmup on rank 0, in full micro-batches of the rank's blocks, is
    # Korthikanti et al. 2022's pp (1 + (pp - 1) / (pp v)) (section 4.2.3)
    pp, v, m = 4, 2, 8
    assert held_micro_batches("Interleaved1F1B", pp, 0, m, v) / v == pp * (1 + (pp - 1) / (pp * v))
    e = _run(pp, 1, 1, m)  # dp 1: 16 B a parameter of the rank's stage
    per_block = SHAPE.block_activations(1, SEQ, 1, sp=False, ac=None)
    working = SHAPE.recomputed_block(1, SEQ, 1, sp=False, ac=None) + SHAPE.residual_gradients(1, SEQ, 1, sp=False)
    loss = SHAPE.other_activations(1, SEQ, 1, sp=False) + SHAPE.loss_activations(1, SEQ, 1)
    ranks = [(16 * (n * 12 * HIDDEN**2 + (VOCAB * HIDDEN if r in (0, pp - 1) else 0)),
              (pp - r) * n * per_block + working + (loss if r == pp - 1 else 0)) for r, n in enumerate(e.stages)]
    states, acts = max(ranks, key=sum)  # rank r holds pp - r micro-batches in flight
    assert (e.memory["activations"], e.peak) == (acts, states + acts)
    assert e.stages[0] < e.stages[1]  # the cut gives the rank holding the most fewer blocks


@pytest.mark.parametrize("dp", [1, 2])
def test_a_rank_holds_its_stages_parameters_not_the_models(dp):
    """The peak rank holds its blocks (and the embedding on the first, the head on the last):
    fp32 weights and AdamW's states over dp; under dp > 1 their gathered bf16 copies and
    unsharded fp32 gradients, kept by torch's PipelineStage until the last backward."""
    e = _run(4, 1, dp, 8)
    assert sum(e.stages) == LAYERS and len(e.stages) == 4
    ends = [1, 0, 0, 1]  # the embedding on rank 0, the head on rank 3: VOCAB x HIDDEN each
    mine = [n * 12 * HIDDEN**2 + end * VOCAB * HIDDEN for n, end in zip(e.stages, ends)]
    sharded = [n * -(-12 * HIDDEN // dp) * HIDDEN + end * -(-VOCAB // dp) * HIDDEN for n, end in zip(e.stages, ends)]
    r = mine.index(e.memory["grads"] // 4)  # the peak rank: fp32 gradients of its own parameters
    held = sharded[r] if dp > 1 else mine[r]
    assert e.memory["params"] == 4 * held and e.memory["optimizer"] == 8 * held
    assert e.memory["fsdp_buffers"] == (2 * mine[r] if dp > 1 else 0)
    whole = _run(1, 1, dp, 8)
    assert e.memory["params"] < whole.memory["params"] / 3


def test_the_cut_is_the_best_contiguous_one():
    """The cut minimizes the largest stage's larger share of FLOPs and bytes: no other split of
    the blocks into the stages (a middle stage holding one at least) does better."""
    block, first, last, held = (1.0, 2.0, 0.5), (0.0, 3.0), (1.5, 1.0), (3.0, 2.0, 1.0)

    def worst(counts):
        total_t = 10 * block[0] + first[0] + last[0]
        total_b = (block[1] + block[2] * sum(held) / 3) * 10 + first[1] + last[1]
        ends = [first, (0, 0), last]
        return max(max((ends[k][0] + n * block[0]) / total_t, (ends[k][1] + n * (block[1] + block[2] * held[k])) / total_b)
                   for k, n in enumerate(counts))

    got = stage_blocks(10, 3, 1, block, first, last, held)
    best = min(worst(c) for c in itertools.product(range(11), repeat=3) if sum(c) == 10 and c[1] >= 1)
    assert sum(got) == 10 and got[1] >= 1 and worst(got) == pytest.approx(best)


def test_schedules_run_with_torchs_micro_batch_rules():
    assert not schedule_runs("1F1B", 8, 1, 4, 126)  # torch's 1F1B: at least one micro-batch per stage
    assert schedule_runs("Interleaved1F1B", 8, 2, 64, 126) and not schedule_runs("Interleaved1F1B", 8, 2, 17, 126)
    assert not schedule_runs("Interleaved1F1B", 64, 2, 64, 126)  # 128 stages for 126 blocks
