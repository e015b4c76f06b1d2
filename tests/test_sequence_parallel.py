"""Sequence parallelism (``sequence_parallel=True``, NOTE: [sequence parallelism]) on real gloo
ranks at world sizes 2 and 4: outputs, every gradient and SGD steps against the single device,
the collectives the report announces against the ones a run makes, and the activations a rank
saves for backward against the single device's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _helpers import CollectiveCounter, compare_training, graph_code, loss_of

import fxtp
from fxtp.core import activations
from fxtp.cli import examples
from fxtp.core.errors import FxtpInputError
from fxtp.core.placement import shard_tensor
from fxtp.runtime.sharded import local_tensor


def _reference(seed: int = 0, dim: int = 32, seq: int = 16, batch: int = 2, layers: int = 2, dropout: float = 0.0):
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(seed)
    args = ModelArgs(n_layers=layers, vocab_size=64, max_seq_len=seq, dim=dim, n_heads=4, dropout_p=dropout)
    ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed + 1))
    return Transformer(args), (ids,)


def _train(name: str):
    build = {"transformer": examples.transformer, "llama": examples.llama, "gpt2": examples.gpt2, "bert": examples.bert}[name]
    model, inputs = build(0)
    model.train()
    out = compare_training(model, inputs, sequence_parallel=True, rtol=1e-4, atol=1e-5)
    return out["forward"], out["backward"]


# ws 2 runs every model; ws 4 the two token layouts (a (B, T, H) linear, GPT-2's (B*T, H) Conv1D).
@pytest.mark.parametrize("ws,name", [(2, "transformer"), (2, "llama"), (2, "gpt2"), (2, "bert"), (4, "transformer"), (4, "gpt2")])
def test_training_matches_single_device(rank_pools, ws, name):
    """Outputs, gradients (norm weights summed over the ranks) and 3 SGD steps equal the single
    device's; the forward reduce_scatters where tensor parallelism all_reduces, and the report's
    collectives are the ones the run makes (``compare_training``)."""
    for forward, backward in rank_pools(ws).run(_train, name):
        assert forward.get("reduce_scatter", 0) >= 2 and "all_reduce" not in forward, forward
        assert "reduce_scatter" in backward, backward


def _dynamic_tokens():
    rank, ws = dist.get_rank(), dist.get_world_size()
    model, inputs = _reference(dropout=0.2)  # train-mode dropout on the token shards, too
    model.train()
    ref = copy.deepcopy(model)
    pm = fxtp.compile(model, ws, inputs, sequence_parallel=True)
    for tokens in (8, 16, 4 * ws):
        ids = inputs[0][:, :tokens]
        state = torch.get_rng_state()
        out = pm(ids)
        torch.set_rng_state(state)
        ref_out = ref(ids)
        torch.testing.assert_close(out, ref_out)
        loss_of(out).backward()
        loss_of(ref_out).backward()
        for fqn, p in pm.named_parameters():
            torch.testing.assert_close(local_tensor(p.grad), shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], rank, ws))
    return pm.report.shape_notes, [d.dynamic for d in pm.report.inputs[0].dims]


def test_token_count_stays_dynamic(pool):
    """One compile runs every token count that divides world_size (the token dim is not
    specialized, dropout included): outputs and accumulated gradients equal the single device's."""
    for notes, dynamic in pool.run(_dynamic_tokens):
        assert dynamic == [True, True] and not notes, (dynamic, notes)


def _dropout():
    rank, ws = dist.get_rank(), dist.get_world_size()
    model, inputs = _reference(dropout=0.2)
    model.train()
    ref = copy.deepcopy(model)
    torch.manual_seed(7)
    pm = fxtp.compile(model, ws, inputs, sequence_parallel=True, dynamic=False)
    state = torch.get_rng_state()
    out = pm(*inputs)
    torch.set_rng_state(state)
    ref_out = ref(*inputs)
    torch.testing.assert_close(out, ref_out)
    loss_of(out).backward()
    loss_of(ref_out).backward()
    for fqn, p in pm.named_parameters():
        torch.testing.assert_close(local_tensor(p.grad), shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], rank, ws))
    return graph_code(pm).count("token_random(")


def test_dropout_on_token_shards_draws_the_single_device_mask(pool):
    """Train-mode dropout in the token-sharded regions: each rank draws its tokens' slice of the
    single device's mask (same seed, same outputs and gradients)."""
    assert all(n >= 4 for n in pool.run(_dropout))


def _saved(build, kwargs: dict):
    ws = dist.get_world_size()
    model, inputs = build()
    model.train()
    ref = copy.deepcopy(model)
    with activations.measure() as single:
        ref_out = ref(*inputs)
    loss_of(ref_out).backward()
    figures = {}
    for sp in (False, True):
        pm = fxtp.compile(model, ws, inputs, sequence_parallel=sp, dynamic=False, **kwargs)
        with activations.measure() as saved:
            out = pm(*inputs)
        with CollectiveCounter() as backward:
            loss_of(out).backward()  # regathers its layers' inputs: as many all_gathers as the report says
        assert backward.counts.get("all_gather", 0) == pm.report.count("backward", "all_gather"), backward.counts
        for fqn, p in pm.named_parameters():
            torch.testing.assert_close(local_tensor(p.grad), shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], dist.get_rank(), ws),
                                       rtol=1e-4, atol=1e-5)
        figures[sp] = saved.total / single.total
    return figures


def _reference_128():
    return _reference(dim=128, seq=64, batch=4)


def _llama_128():
    return examples.llama(0, hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4,
                          max_position_embeddings=64, vocab_size=256)


@pytest.mark.parametrize("ws,build", [(2, _reference_128), (4, _reference_128), (4, _llama_128)], ids=["ws2-reference", "ws4-reference", "ws4-llama"])
def test_saved_activations_per_rank(rank_pools, ws, build):
    """A rank saves at most 1/ws + 0.05 of the single device's activations for backward with
    sequence parallelism (Korthikanti et al. 2022's 1/t), clearly less than without it; the
    gradients, with the regathered inputs, equal the single device's."""
    for figures in rank_pools(ws).run(_saved, build, {}):
        assert figures[True] <= 1 / ws + 0.05, figures
        assert figures[True] < figures[False] - 0.1, figures


def _saved_under_autocast():
    ws = dist.get_world_size()
    model, inputs = _reference()
    model.train()
    figures = {}
    for sp in (False, True):
        pm = fxtp.compile(model, ws, inputs, sequence_parallel=sp, dynamic=False)
        with torch.autocast("cpu", dtype=torch.bfloat16), activations.measure() as saved:
            out = pm(*inputs)
        with CollectiveCounter() as backward:
            loss_of(out).backward()
        assert backward.counts.get("all_gather", 0) == pm.report.count("backward", "all_gather"), backward.counts
        figures[sp] = (saved.total, saved.regathered)
    return figures


def test_regathers_under_autocast(pool):
    """Under bf16 autocast a colwise layer saves autocast's bf16 copy of its gathered float32
    input; that copy is saved as the shard too and regathered, once per value: the backward's
    all_gathers are the report's, and a rank saves less than without sequence parallelism
    (NOTE: [regathered activations])."""
    for figures in pool.run(_saved_under_autocast):
        assert figures[True][1] > 0 and figures[True][0] < figures[False][0], figures


def _uneven_tokens():
    model, inputs = _reference()
    pm = fxtp.compile(model, dist.get_world_size(), inputs, sequence_parallel=True)
    try:
        pm(inputs[0][:, :15])
    except FxtpInputError as exc:
        return str(exc)
    return "no error"


def test_token_count_that_does_not_divide_is_an_input_error(rank_pools):
    for message in rank_pools(2).run(_uneven_tokens):
        assert "15" in message and "does not divide" in message and "fix: pad" in message, message


def test_analyze_reports_the_sequence_collectives():
    model, inputs = _reference()
    report = fxtp.analyze(model, 2, inputs, sequence_parallel=True, dynamic=False)
    assert report.sequence_parallel and report.to_dict()["sequence_parallel"]
    assert report.count("forward", "reduce_scatter") == 5 and report.count("forward", "all_reduce") == 0
    assert "reduce_scatter fwd" in str(report) and "sequence parallelism:" in str(report)
    tp = fxtp.analyze(model, 2, inputs, dynamic=False)
    assert tp.count("forward", "reduce_scatter") == 0 and not tp.sequence_parallel


def test_sequence_parallel_must_be_a_bool():
    model, inputs = _reference()
    with pytest.raises(fxtp.FxtpConfigError, match="sequence_parallel"):
        fxtp.analyze(model, 2, inputs, sequence_parallel="yes")



def _llama_accumulation_after_a_load():
    """Issue 35 item 7's loop: a tiny HF Llama under sequence parallelism, 3 SGD steps at T=8,
    ``load_full_state_dict``, two accumulated micro-batches at T=8 and T=4 (1 token per rank at
    world size 4), a step, then T=12; against the single device at every call and gradient."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, use_cache=False)
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 128, (1, t), generator=g) for t in (8, 8, 8, 8, 8, 4, 12)]
    pm = fxtp.compile(model, ws, (ids[0],), example_kwargs={"labels": ids[0].clone()}, sequence_parallel=True)
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)

    def call(x):
        loss, ref_loss = pm(x, labels=x).loss, ref(x, labels=x).loss
        torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"T={x.shape[1]}: {m}")
        loss.backward()
        ref_loss.backward()

    def step():
        for fqn, p in pm.named_parameters():
            want = shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], rank, ws)
            torch.testing.assert_close(local_tensor(p.grad), want, msg=lambda m: f"gradient of {fqn}: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()

    for x in ids[:3]:
        call(x)
        step()
    pm.load_full_state_dict(model.state_dict())
    ref.load_state_dict(model.state_dict())
    for x in ids[4:6]:  # accumulated: T=8, then T=4
        call(x)
    step()
    call(ids[6])
    return pm.report.shape_notes


def test_accumulation_after_a_load_at_one_token_per_rank(rank_pools):
    """Every rank issues the same collectives (the pool checks it: NOTE: [same collectives on
    every rank] in tests/_helpers.py) and each call equals the single device's."""
    assert rank_pools(4).run(_llama_accumulation_after_a_load) == [()] * 4
