"""Numerics on real gloo process groups: fxtp against the single-device model.

The ranks start once per world size (module-scoped pool); each test runs one check in them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _helpers import compare_training, megatron_floor
from models import build

import fxtp


def _train(name: str, **kwargs):
    model, inputs = build(name)
    return compare_training(model, inputs, **kwargs)


def test_linear_single_layer(pool):
    (rank0, *_) = pool.run(_train, "linear100")
    (layer,) = rank0["report"]["layers"]
    # 10 out_features: colwise cannot hold (ws 4 does not divide them; at 2 the output would need
    # a gather), so the input is sliced and the layer is rowwise: NOTE: [rowwise fallback] (case 23).
    assert (layer["style"], layer["code"]) == ("rowwise", None)
    assert layer["local_weight_shape"] == [10, 100 // pool.world_size]
    assert rank0["forward"] == {"all_reduce": 1} and rank0["backward"] == {}


def test_mlp(pool):
    (rank0, *_) = pool.run(_train, "mlp")
    assert rank0["plan"] == {"0": "colwise", "2": "rowwise"}
    assert rank0["forward"] == {"all_reduce": 1}
    # The MLP's input needs no gradient, so f's backward all_reduce never runs.
    assert rank0["backward"] == {}
    assert rank0["report"]["collectives"][2] == {"phase": "backward", "kind": "all_reduce", "count": 0, "bytes": 0}


def test_forced_plans_gather_or_slice(pool):
    """A plan that forces a layer colwise gathers its output (all_gather forward, local slice
    backward); one that forces the first layer rowwise slices its replicated input."""
    (colwise, *_) = pool.run(_train, "mlp", plan={"2": "colwise"})
    assert colwise["plan"] == {"0": "replicate", "2": "colwise"}
    assert colwise["forward"] == {"all_gather": 1}
    (rowwise, *_) = pool.run(_train, "mlp", plan={"0": "rowwise"})
    assert rowwise["plan"] == {"0": "rowwise", "2": "replicate"}
    assert rowwise["forward"] == {"all_reduce": 1}


def test_a_shard_summed_and_sliced_over_its_features_stays_sharded(pool):
    """A colwise shard that meets a reduction and a slice over its features stays sharded: the
    sum is a distributed sum (an all_reduce of the partial sums, NOTE: [distributed norm] in
    ``passes/rules/norm.py``), the slice keeps its shard and is all_gathered at the model output,
    and ``b`` is rowwise on the same shard."""
    (auto, *_) = pool.run(_train, "sum_of_hidden")
    assert auto["plan"] == {"a": "colwise", "b": "rowwise"}
    assert auto["forward"] == {"all_reduce": 2, "all_gather": 1}


def test_reference_transformer_finds_the_hand_plan(pool):
    """torch's Transformer.parallelize plan (no sequence parallel), found by analysis."""
    (rank0, *_) = pool.run(_train, "reference_transformer")
    plan = rank0["plan"]
    for i in range(2):
        prefix = f"layers.{i}."
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"):
            assert plan[prefix + name] == "colwise", name
        for name in ("attention.wo", "feed_forward.w2"):
            assert plan[prefix + name] == "rowwise", name
    # Megatron's floor: 2 all_reduce per block forward, 2 backward; the tied table is one
    # vocab-parallel weight for the lookup (1 all_reduce) and the colwise head (1 all_gather).
    assert plan["tok_embeddings"] == "rowwise" and plan["output"] == "colwise"
    assert rank0["forward"] == {"all_reduce": 5, "all_gather": 1}
    assert rank0["backward"] == {"all_reduce": 5}
    assert (rank0["forward"], rank0["backward"]) == megatron_floor(rank0["report"], 2)


def test_nn_transformer_packed_in_proj(pool):
    (rank0, *_) = pool.run(_train, "nn_transformer")
    layers = {row["name"]: row for row in rank0["report"]["layers"]}
    assert rank0["report"]["capture"]["frontend"] == "export"
    assert [f["frontend"] for f in rank0["report"]["capture"]["failed"]] == ["fx"]
    ws = pool.world_size
    for attn in ("encoder.layers.0.self_attn", "decoder.layers.0.self_attn"):
        packed = layers[f"{attn}.in_proj_weight"]
        assert packed["style"] == "colwise"
        assert packed["local_weight_shape"] == [192 // ws, 64]
        assert "[64, 64, 64]" in packed["reason"]  # head-aligned Q|K|V segments
        assert layers[f"{attn}.out_proj"]["style"] == "rowwise"
    cross = "decoder.layers.0.multihead_attn"
    assert layers[f"{cross}.in_proj_weight[0:64]"]["style"] == "colwise"
    assert layers[f"{cross}.in_proj_weight[64:192]"]["style"] == "colwise"
    # one all_reduce per rowwise layer (3 attention + 2 MLP) and nothing else
    assert rank0["forward"] == {"all_reduce": 5}


def test_tiny_gpt(pool):
    (rank0, *_) = pool.run(_train, "tiny_gpt")
    assert (rank0["forward"], rank0["backward"]) == megatron_floor(rank0["report"], 2)
    assert rank0["forward"] == {"all_reduce": 5, "all_gather": 1}
    assert rank0["plan"]["head"] == "colwise" and rank0["plan"]["tok"] == "rowwise"
    assert rank0["plan"]["pos"] == "replicate"  # small-embedding


def test_rowwise_straight_into_colwise(pool):
    (rank0, *_) = pool.run(_train, "back_to_back")
    assert rank0["plan"] == {"0": "colwise", "2": "rowwise", "3": "colwise", "5": "rowwise"}
    assert rank0["forward"] == {"all_reduce": 2}
    assert rank0["backward"] == {"all_reduce": 2}  # f before "0" (the input wants a gradient) and before "3"


def test_transposed_weights(pool):
    """x @ W.T, matmul with an (in, out) weight, F.linear and addmm: each a Megatron pair."""
    (rank0, *_) = pool.run(_train, "transposed_weights")
    assert rank0["plan"] == {"w1": "colwise", "w2": "rowwise", "w3": "colwise", "w4": "rowwise"}
    layers = {row["name"]: row for row in rank0["report"]["layers"]}
    ws = pool.world_size
    assert layers["w1"]["local_weight_shape"] == [64 // ws, 16]  # stored (out, in): rows
    assert layers["w2"]["local_weight_shape"] == [64 // ws, 16]  # stored (in, out): rows too
    assert layers["w4"]["local_weight_shape"] == [32 // ws, 16]
    assert rank0["forward"] == {"all_reduce": 2}
    assert "torch.ops.aten.mm.default" in rank0["code"]  # the rowwise addmm: bias after the all_reduce


def test_replicated_input_sliced_in_segments(pool):
    (rank0, *_) = pool.run(_train, "cat_plus_input")
    assert rank0["plan"] == {"a": "colwise", "b": "colwise", "down": "rowwise"}
    assert rank0["forward"] == {"all_reduce": 1}
    assert rank0["code"].count("aten.slice.Tensor(") == 2  # [r_a | r_b] of this rank, then cat


@pytest.mark.parametrize("frontend", ["fx", "export", "dynamo"])
def test_each_capture_frontend_trains(pool, frontend):
    (rank0, *_) = pool.run(_train, "tiny_gpt", capture=frontend)
    assert rank0["report"]["capture"] == {"frontend": frontend, "failed": []}
    assert rank0["forward"] == {"all_reduce": 5, "all_gather": 1}


def _world_size_1_inside_a_job():
    model, inputs = build("tiny_gpt")
    pm = fxtp.compile(model, 1, inputs, dynamic=False)
    out, ref = pm(*inputs), model(*inputs)
    return torch.equal(out, ref)


def test_world_size_1_inside_a_larger_job_is_bitwise_equal(pool):
    assert all(pool.run(_world_size_1_inside_a_job))


def _identical_across_ranks():
    model, inputs = build("tiny_gpt")
    pm = fxtp.compile(model, dist.get_world_size(), inputs, dynamic=False)
    out = pm(*inputs)
    gathered = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, out)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def test_outputs_bitwise_equal_across_ranks(pool):
    assert all(pool.run(_identical_across_ranks))


def _on_device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model, inputs = build("mlp")
    return compare_training(model, inputs, group=mesh["tp"])["forward"]


def test_device_mesh_group(pool):
    assert pool.run(_on_device_mesh)[0] == {"all_reduce": 1}


def _on_sub_groups():
    """TP=2 inside a larger job: ranks {0,1} and {2,3} are separate tensor-parallel groups."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group([r, r + 1]) for r in range(0, ws, 2)]
    group = groups[rank // 2]
    model, inputs = build("mlp")
    ref = model(*inputs)
    pm = fxtp.compile(model, 2, inputs, group=group, dynamic=False)
    torch.testing.assert_close(pm(*inputs), ref)
    return pm.report.to_dict()["layers"][0]["local_weight_shape"]


def test_sub_group(pool):
    if pool.world_size != 4:
        pytest.skip("needs 4 ranks for two groups of 2")
    assert pool.run(_on_sub_groups) == [[128, 64]] * 4


def _mismatched_world_size():
    model, inputs = build("mlp")
    try:
        fxtp.compile(model, dist.get_world_size() * 2, inputs)
    except fxtp.FxtpConfigError as e:
        return str(e)
    return "no error"


def test_world_size_must_match_group(pool):
    msg = pool.run(_mismatched_world_size)[0]
    assert f"the process group has {pool.world_size} ranks" in msg


class _SqueezeHeads(torch.nn.Module):
    """(1, T, 32) -> 4 heads of 8 -> ``squeeze()``: at world_size 4 each rank holds 1 head, a dim
    of local size 1 that the rank must not squeeze (only the global batch of 1 goes)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        h = self.up(x).view(1, 3, 4, 8).transpose(1, 2).squeeze()
        return self.down(h.transpose(0, 1).reshape(3, 32))


def _squeeze_heads():
    torch.manual_seed(0)
    return compare_training(_SqueezeHeads(), (torch.randn(1, 3, 8),))


def test_squeeze_keeps_a_sharded_dim_of_local_size_one(pool):
    (rank0, *_) = pool.run(_squeeze_heads)
    assert rank0["plan"] == {"up": "colwise", "down": "rowwise"}
    assert "torch.ops.aten.squeeze.dims(" in rank0["code"]
