"""The calibration's pricing of the model's own programs, without ranks (NOTE: [collectives in
the model] in fxtp/planner/calibration.py, NOTE: [host time] in fxtp/planner/host.py): the
communication is what a program takes beyond its compute, and that compute is the model's ops
priced as the plan prices a step's. tests/test_plan_measure.py runs the calibration on ranks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")


def _model():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config)


@given(seconds=st.floats(0, 1), compute=st.floats(0, 1), tp_share=st.floats(0, 1), fsdp_share=st.floats(0, 1))
@settings(max_examples=300, deadline=None)
def test_a_programs_communication_is_what_it_takes_beyond_its_compute(seconds, compute, tp_share, fsdp_share):
    """NOTE: [collectives in the model]: the calibration prices each of the model's programs at
    its measured seconds (compute + tp + FSDP2), the two in their profiled proportion."""
    from fxtp.planner.calibration import communication

    tp_s, fsdp_s = communication(seconds, compute, tp_share, fsdp_share)
    assert tp_s >= 0 and fsdp_s >= 0
    if tp_share + fsdp_share > 0 and seconds > compute:
        assert compute + tp_s + fsdp_s == pytest.approx(seconds, rel=1e-9, abs=1e-12)
        assert tp_s * fsdp_share == pytest.approx(fsdp_s * tp_share, rel=1e-9, abs=1e-15)
    else:
        assert tp_s == fsdp_s == 0


def test_the_host_figures_price_the_models_own_step_at_its_seconds():
    """host_on_the_model scales the op and optimizer figures to the plain tp 1 step's measured
    seconds; the calibration prices each degree's program with them as the plan prices a step's
    ops (``priced_ops``: host_seconds, the tensors tp shards cheaper by their bytes), so at tp 1
    the compute is the plain step's seconds and at tp > 1 only the sharded bytes shrink."""
    from fxtp.planner.hardware import HostCosts
    from fxtp.planner.host import TrainingStep, host_on_the_model, priced_ops, step_ops

    program = TrainingStep(_model(), (2, 64))
    chain = HostCosts(op=1e-5, op_byte=1e-10, op_backward=2e-5, op_backward_byte=1e-10, optimizer_tensor=1e-4,
                      optimizer_element=1e-9)
    ops = step_ops(program.pm, program.ids, 128)
    forward, per_token = ops.block
    assert forward > 50 and ops.backward_ops > 1 and per_token > 0 and ops.other == (0, 0.0), ops  # a Llama's step
    assert 0 < ops.sharded_share < 1, ops  # the vocab's logits and the MLP's activations, not the hidden states
    gemm_s, seconds, optimizer_s = 0.01, 0.05, 0.02
    host = host_on_the_model(chain, program, ops, gemm_s, seconds, optimizer_s)
    tokens = program.ids.numel()
    assert gemm_s + priced_ops(host, ops, tokens) == pytest.approx(seconds, rel=1e-9)
    params = [p for p in program.pm.parameters() if p.requires_grad]
    optimizer = len(params) * host.optimizer_tensor + sum(p.numel() for p in params) * host.optimizer_element
    assert optimizer == pytest.approx(optimizer_s, rel=1e-9)
    assert host.op / chain.op == pytest.approx(host.op_backward_byte / chain.op_backward_byte) != 1  # one factor
    fixed = forward * host.op * (1 + ops.backward_ops * host.op_backward / host.op)  # the ops, not their bytes
    for tp in (2, 4):  # the same ops; the bytes tp shards over tp (NOTE: [host time])
        shrink = 1 - ops.sharded_share + ops.sharded_share / tp
        assert priced_ops(host, ops, tokens, tp) - fixed == pytest.approx((priced_ops(host, ops, tokens) - fixed) * shrink)
