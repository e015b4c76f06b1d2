"""The planner prices what runs (issue 32, item 5): predicted peak memory per rank against a
training step measured outside fxtp, on 4 gloo ranks.

A tiny Llama-style model (``tools/bench_plan_memory.py``: hidden 256, 4 blocks, 4 x 128 tokens
a dp rank, fp32, AdamW) is compiled on ``mesh["tp"]`` with each checkpointing policy and
``fully_shard``-ed per block then at the root; one warm-up step, then one measured step
(forward, backward, ``optimizer.step()``) under ``shared/tools/heap.py`` (glibc's heap,
sampled on a thread). The prediction is :func:`fxtp.planner.costs.estimate` of the same
configuration (fp32 gathers and activations, AdamW): the peak and each phase's bytes
(NOTE: [peak of a step] in fxtp/planner/costs.py).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

MESHES = {"dp2xtp2": 2, "dp4xtp1": 1}
POLICIES = (None, "selective", "blocks")


def _measure() -> dict:
    import bench_plan_memory

    return {(tp, ac): bench_plan_memory.measure(tp, ac) for tp in MESHES.values() for ac in POLICIES}


@pytest.fixture(scope="module")
def runs(rank_pools):
    import bench_plan_memory

    measured = rank_pools(4).run(_measure)[0]
    predicted = bench_plan_memory.predict(tuple(MESHES.values()))
    return {(mesh, ac): {"measured": measured[tp, ac], "predicted": predicted[tp, ac]}
            for mesh, tp in MESHES.items() for ac in POLICIES}


@pytest.mark.parametrize("mesh", MESHES)
def test_predicted_peak_is_within_10_percent_of_the_measured(runs, mesh):
    """Per policy, the predicted peak per rank is within 10% of the measured one (the largest
    over the ranks), and so is the backward's peak above the step's entry. The forward's
    (the loss) is not asserted: it is under-predicted, by up to a third with checkpointed
    blocks, where it is never the peak (docs/plan_command.md)."""
    for ac in POLICIES:
        m, p = runs[mesh, ac]["measured"], runs[mesh, ac]["predicted"]
        assert abs(p["total"] / m["peak"] - 1) <= 0.10, (mesh, ac, m, p)
        assert abs(p["block"] / m["backward"] - 1) <= 0.10, (mesh, ac, m, p)


@pytest.mark.parametrize("mesh", MESHES)
def test_each_term_is_what_the_run_holds(runs, mesh):
    """Parameter shards exactly; AdamW's states within 10%; the activations after forward
    within 10% where they are most of the step (no checkpointing, "selective"); with
    checkpointed blocks within 1 MiB of their 3-5 MiB (a residual: the heap holds up to 0.7
    MiB less than the blocks' inputs, the final norm's and the softmax predicted, at tp 2; NOTE:
    [peak of a step]); the gradients after backward at least the predicted shards and at most
    1.5x them (the heap also holds 0.2-0.9 MiB the backward leaves besides them, varying from run
    to run: buffers gloo frees on its own threads; a residual, reported); checkpointing saves
    less than none, blocks least."""
    saved = {}
    for ac in POLICIES:
        m, p = runs[mesh, ac]["measured"], runs[mesh, ac]["predicted"]
        assert m["params"] == p["params"], (mesh, ac)
        assert abs(p["optimizer"] / m["optimizer"] - 1) <= 0.10, (mesh, ac, m["optimizer"], p["optimizer"])
        if ac == "blocks":
            assert abs(p["saved"] - m["activations"]) <= 2**20, (mesh, ac, m["activations"], p["saved"])
        else:
            assert abs(p["saved"] / m["activations"] - 1) <= 0.10, (mesh, ac, m["activations"], p["saved"])
        assert p["grads_after"] <= m["grads"] <= 1.5 * p["grads_after"], (mesh, ac, m["grads"], p["grads_after"])
        saved[ac] = m["activations"]
    assert saved[None] > saved["selective"] > saved["blocks"], saved


def test_the_loss_holds_the_gathered_logits_twice():
    """No ranks: the loss's most at ``tp`` > 1 (NOTE: [activation bytes]) counts gathering the
    output's logits as a heap trace per op showed it on 4 gloo ranks (hidden 64, vocab 256, 32 x
    256 tokens, tp 4: 2 MiB a rank's logits, 8 MiB gathered; the step's peak there): the shard,
    its contiguous copy, the gathered buffer and the output concatenated from it (or gloo's flat
    copy inside the collective: as much); the cross entropy's working set beside the gathered
    logits where that is more (bf16, tp 2)."""
    import transformers

    from fxtp.planner.model import TransformerShape
    from fxtp.planner.params import repeated_blocks

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    shape = TransformerShape.of(model, repeated_blocks(model).fqn)
    MiB = 2**20
    assert shape.loss_activations(32, 256, 4, 4) == 2 * 2 * MiB + 2 * 8 * MiB  # 20 MiB
    n = 32 * 256 * 256 // 2  # bf16 at tp 2: Hugging Face's fp32 copy, x - max and its exp beside the gathered logits
    assert shape.loss_activations(32, 256, 2, 2) == n * (2 + 4 + 8) + 2 * n * 2
    n = 32 * 256 * 256 // 8  # bf16 at tp 8: the gather's moment is the most again
    assert shape.loss_activations(32, 256, 8, 2) == 2 * 2 * n + 2 * 2 * n * 8
    assert shape.loss_activations(32, 256, 1, 4) == 12 * 32 * 256 * 256  # tp 1: backward's softmax, its gradient, the logits'
