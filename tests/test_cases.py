"""Every case of ../shared/cases/README.md, on real gloo process groups at world sizes 2 and 4.

Each case is checked against the single-device model (outputs, every gradient, SGD steps) and
for its right plan: sharded correctly, or rejected with the stated code and reason.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _helpers import compare_training
from cases import build_case

import fxtp


def _train(name: str, **kwargs):
    model, inputs = build_case(name)
    return compare_training(model, inputs, **kwargs)


def _layers(result) -> dict[str, dict]:
    return {row["name"]: row for row in result["report"]["layers"]}


def _styles(result) -> dict[str, tuple[str, str | None]]:
    return {name: (row["style"], row["code"]) for name, row in _layers(result).items()}


MEGATRON_ATTENTION = {"q": ("colwise", None), "k": ("colwise", None), "v": ("colwise", None), "o": ("rowwise", None)}


def test_case01_head_count_literal_in_view(pool):
    (r, *_) = pool.run(_train, "1-head-literal")
    assert _styles(r) == MEGATRON_ATTENTION
    assert r["forward"] == {"all_reduce": 1}
    assert f"[2, 8, {8 // pool.world_size}, 64]" in r["code"]


def _front_loaded(units: int, ws: int) -> list[int]:
    """Units per rank of an uneven shard (NOTE: [uneven shards]): the first ``units % ws`` ranks get one more."""
    return [units // ws + (r < units % ws) for r in range(ws)]


def _report_bytes_are_the_local_tensors(results) -> None:
    """Each rank's report counts its own parameter bytes (fp32, no tied weights here)."""
    for r in results:
        local = sum(4 * math.prod(shape) for shape in r["local_shapes"].values())
        assert r["report"]["param_bytes"]["per_rank"] == local


def test_case02_uneven_features_exact(pool):
    """5 features at ws 2 and 4: colwise 3/2 and 2/1/1/1 rows, rowwise the same columns; the
    outputs, gradients and SGD steps equal the single device (compare_training)."""
    results = pool.run(_train, "2-uneven")
    r = results[0]
    assert _styles(r) == {"0": ("colwise", None), "2": ("rowwise", None)}
    assert r["forward"] == {"all_reduce": 1}
    for n, rank_result in zip(_front_loaded(5, pool.world_size), results):
        shapes = rank_result["local_shapes"]
        assert shapes["0.weight"] == (n, 5) and shapes["0.bias"] == (n,)
        assert shapes["2.weight"] == (5, n) and shapes["2.bias"] == (5,)
    assert _layers(r)["0"]["local_weight_shape"] == [_front_loaded(5, pool.world_size)[0], 5]  # rank 0's
    _report_bytes_are_the_local_tensors(results)
    # A plan that wants the second layer whole gathers the unequal pieces (padded all_gather).
    (g, *_) = pool.run(_train, "2-uneven", plan={"0": "colwise", "2": "replicate"})
    assert _styles(g)["0"] == ("colwise", None) and g["forward"] == {"all_gather": 1}


def test_case03_heads_not_divisible_split_as_whole_heads(pool):
    """6 heads of 16 at ws 4: 2/2/1/1 whole heads per rank (o's input columns matching); at ws 2
    3 heads each, an even shard as before."""
    results = pool.run(_train, "3-heads-96")
    r = results[0]
    assert _styles(r) == MEGATRON_ATTENTION
    assert r["forward"] == {"all_reduce": 1}
    for heads, rank_result in zip(_front_loaded(6, pool.world_size), results):
        shapes = rank_result["local_shapes"]
        for name in "qkv":
            assert shapes[f"{name}.weight"] == (16 * heads, 96)
        assert shapes["o.weight"] == (96, 16 * heads)
    _report_bytes_are_the_local_tensors(results)
    if pool.world_size == 4:  # the view literal is each rank's own head count
        assert ", 2, 16]" in results[0]["code"] and ", 1, 16]" in results[3]["code"]


def test_case04_grouped_query_attention(pool):
    """ws 2: one kv head per rank, its 4 q heads with it. ws 4: 2 kv heads, 4 ranks: each rank
    holds the kv head its 2 q heads read (NOTE: [grouped shards]), ranks 0, 1 kv head 0."""
    results = pool.run(_train, "4-gqa")
    assert _styles(results[0]) == MEGATRON_ATTENTION
    assert results[0]["forward"] == {"all_reduce": 1}
    for r in results:
        assert r["local_shapes"]["k.weight"] == r["local_shapes"]["v.weight"] == (8, 64)
    if pool.world_size == 4:  # x needs no gradient: one all_reduce sums k/v's over their holders
        assert results[0]["backward"] == {"all_reduce": 1}


@pytest.mark.parametrize("name", ["4-gqa-interleave", "19-gqa-enable-gqa"])
def test_case19_grouped_query_attention_repeat_interleave_or_enable_gqa(pool, name):
    (r, *_) = pool.run(_train, name)
    assert _styles(r) == MEGATRON_ATTENTION
    if pool.world_size == 2:  # 2 kv heads divide 2: k/v colwise, one kv head per rank
        assert r["backward"] == {}  # x needs no gradient: no f sends anything
    else:  # 2 kv heads, 4 ranks: each rank holds the kv head its 2 q heads read (NOTE: [grouped shards])
        assert r["local_shapes"]["k.weight"] == (8, 64)
        assert r["backward"] == {"all_reduce": 1}  # k/v's gradients summed over their holders
    assert r["forward"] == {"all_reduce": 1}
    if name == "19-gqa-enable-gqa" and pool.world_size == 4:
        assert "grouped_query_attention_local_kv" in r["code"]


@pytest.mark.parametrize("name", ["5a-fused-chunk", "5b-fused-unbind"])
def test_case05_fused_qkv(pool, name):
    (r, *_) = pool.run(_train, name)
    assert _styles(r) == {"qkv": ("colwise", None), "o": ("rowwise", None)}
    assert _layers(r)["qkv"]["local_weight_shape"] == [192 // pool.world_size, 64]
    if name == "5a-fused-chunk":  # each rank holds [Q_r | K_r | V_r]
        assert "[64, 64, 64]" in _layers(r)["qkv"]["reason"]
    assert r["forward"] == {"all_reduce": 1}


def test_case06_rowwise_bias_added_once(pool):
    (r, *_) = pool.run(_train, "6-rowwise-bias")  # gradients of the bias are compared too
    assert _styles(r) == {"0": ("colwise", None), "2": ("rowwise", None)}
    # the bias in the reduced value's dtype (autocast's, as one device's linear casts it), added once after the all_reduce
    assert "type_as_default = torch.ops.aten.type_as.default(p_2_bias, reduce_from_tp)" in r["code"]
    assert "add_tensor = torch.ops.aten.add.Tensor(reduce_from_tp, type_as_default)" in r["code"]


def _tied_one_weight():
    model, inputs = build_case("7-tied")
    pm = fxtp.compile(model, dist.get_world_size(), inputs, dynamic=False)
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    pm(*inputs).square().mean().backward()
    opt.step()
    return pm.get_parameter("emb.weight") is pm.get_parameter("head.weight")


def test_case07_tied_embedding_and_head(pool):
    (r, *_) = pool.run(_train, "7-tied")
    layers = _layers(r)  # NOTE: [tied uses]: one shard of the table for both uses, fc feeds the head whole
    assert _styles(r) == {"emb": ("rowwise", None), "fc": ("replicate", "tied"), "head": ("colwise", None)}
    assert "its consumer head takes its input replicated" in layers["fc"]["reason"]
    assert r["forward"] == {"all_reduce": 1, "all_gather": 1} and r["backward"] == {"all_reduce": 1}
    assert all(pool.run(_tied_one_weight))


def test_case08_vocab_not_divisible_tracks_loss_for_20_steps(pool):
    """11 classes at ws 2 and 4: a colwise head of 6/5 and 3/3/3/2 rows into the vocab-parallel
    cross entropy (no logits gather); the loss tracks the single device for 20 SGD steps."""
    results = pool.run(_train, "8-vocab-11", steps=20)  # the output is the loss itself
    r = results[0]
    assert _styles(r) == {"head": ("colwise", None)}
    assert r["forward"] == {"all_reduce": 3}
    for n, rank_result in zip(_front_loaded(11, pool.world_size), results):
        assert rank_result["local_shapes"]["head.weight"] == (n, 16)
        assert rank_result["local_shapes"]["head.bias"] == (n,)
    _report_bytes_are_the_local_tensors(results)


def test_case09_norms(pool):
    """A and C normalize up's sharded features straight into down: a distributed norm would make
    down rowwise on top of the norm's all_reduce, so up stays replicated and down is colwise
    (NOTE: [norm into a layer]); B normalizes per head: local, no collective."""
    (a, *_) = pool.run(_train, "9a-layernorm")
    assert _styles(a)["up"] == ("replicate", "reduces-sharded-dim")
    assert "NOTE: [norm into a layer]" in _layers(a)["up"]["reason"]
    (b, *_) = pool.run(_train, "9b-per-head-rmsnorm")
    assert _styles(b) == {"up": ("colwise", None), "down": ("rowwise", None)}
    assert b["forward"] == {"all_reduce": 1}  # the per-head norm stays local
    (c, *_) = pool.run(_train, "9c-rmsnorm-then-heads")
    assert _styles(c)["up"] == ("replicate", "reduces-sharded-dim")


def _dropout_train_mode():
    torch.manual_seed(0)
    model, inputs = build_case("10-dropout-eval")
    model.train()
    pm = fxtp.compile(model, dist.get_world_size(), inputs, dynamic=False)
    torch.manual_seed(1234)  # the same seed on every rank
    out = pm(*inputs)
    gathered = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, out)
    return all(torch.equal(g, out) for g in gathered), [n["code"] for n in pm.report.to_dict()["notes"]]


def test_case10_dropout(pool):
    (r, *_) = pool.run(_train, "10-dropout-eval")  # eval mode: exact against single device
    assert _styles(r) == {"up": ("colwise", None), "down": ("rowwise", None)}
    for same, notes in pool.run(_dropout_train_mode):  # train mode: replicated values bitwise equal
        assert same
        assert "dropout-on-shard" in notes


def test_case11_replicated_input_keeps_its_shape(pool):
    (r, *_) = pool.run(_train, "11-replicated-input")
    assert _styles(r) == {"1": ("colwise", None), "3": ("rowwise", None)}
    assert r["out_shapes"] == [(4, 16, 11)]


def test_case12_shape_branch_falls_back_to_export(pool):
    (r, *_) = pool.run(_train, "12-shape-branch")
    capture = r["report"]["capture"]
    assert capture["frontend"] == "export"
    assert capture["failed"][0]["frontend"] == "fx" and "TraceError" in capture["failed"][0]["reason"]
    assert _styles(r) == {"up": ("colwise", None), "down": ("rowwise", None)}


def _encoder_under_no_grad():
    model, inputs = build_case("13-encoder-fast-path")
    with torch.no_grad():
        pm = fxtp.compile(model, dist.get_world_size(), inputs, dynamic=False)
        torch.testing.assert_close(pm(*inputs), model(*inputs))
    return pm.plan


def test_case13_fast_path_does_not_hide_the_linears(pool):
    (r, *_) = pool.run(_train, "13-encoder-fast-path")
    expected = {
        "self_attn.in_proj_weight": "colwise",
        "self_attn.out_proj": "rowwise",
        "linear1": "colwise",
        "linear2": "rowwise",
    }
    assert r["plan"] == expected
    assert pool.run(_encoder_under_no_grad)[0] == expected


@pytest.mark.parametrize("name,all_reduce", [("14-mha", 1), ("14-mha-weights-unused", 1), ("14-mha-weights-used", 2)])
def test_case14_multihead_attention_packed_in_proj(pool, name, all_reduce):
    (r, *_) = pool.run(_train, name)  # also: the report's counts are the run's (compare_training)
    layers = _layers(r)
    assert layers["mha.in_proj_weight"]["style"] == "colwise"
    assert "[64, 64, 64]" in layers["mha.in_proj_weight"]["reason"]
    assert layers["mha.out_proj"]["style"] == "rowwise"
    assert r["forward"] == {"all_reduce": all_reduce}


# Second set (shared/cases 15-23; 17, 18, 19 and 21 live beside the features that fix them).


@pytest.mark.parametrize("name", ["15-shared-head-linear", "15-per-head-scale", "15-head-norm"])
def test_case15_replicated_parameter_in_a_sharded_region(pool, name):
    """A replicated parameter meets head-sharded values: its gradient is summed over the ranks
    (compare_training checks every gradient against the single device)."""
    (r, *_) = pool.run(_train, name)
    assert {k: v for k, v in _styles(r).items() if k in "qkvo"} == MEGATRON_ATTENTION
    assert r["forward"] == {"all_reduce": 1}
    if name == "15-shared-head-linear":
        assert _layers(r)["shared"]["style"] == "replicate"
        assert r["backward"] == {"all_reduce": 2}  # f on the shared weight and on its bias


@pytest.mark.parametrize("name", ["16a-scale-grad-by-freq", "16c-padding-idx"])
def test_case16_embedding_options_honoured_in_a_vocab_parallel_lookup(pool, name):
    (r, *_) = pool.run(_train, name)  # id 7 occurs 6 times: its row's gradient is divided by 6
    assert _styles(r)["emb"] == ("rowwise", None)


def test_case16b_max_norm_table_stays_replicated_with_its_reason(pool):
    (r, *_) = pool.run(_train, "16b-max-norm")
    emb = _layers(r)["emb"]
    assert (emb["style"], emb["code"]) == ("replicate", "embedding-max-norm")
    assert "max_norm" in emb["reason"] and "tied" not in emb["reason"]


def test_case20_lora_adapters_at_megatron_floor(pool):
    (r, *_) = pool.run(_train, "20-lora")
    assert _styles(r) == {
        "up.base": ("colwise", None),
        "up.A": ("replicate", "cheaper-replicated"),
        "up.B": ("colwise", None),
        "down.base": ("rowwise", None),
        "down.A": ("rowwise", None),
        "down.B": ("replicate", "cheaper-replicated"),
    }
    assert r["forward"] == {"all_reduce": 2}


def test_case20b_lora_beside_bias_free_layers_reduces_once(pool):
    """PEFT's/torchtitan's LoRA plan beside a rowwise base: A rowwise, B replicated on A's partial
    output, added to the base's partial output, one forward all_reduce for both (NOTE: [deferred
    reduction]); B's weight gradient, a partial sum per rank, is all_reduced in backward.
    compare_training checks outputs, gradients and SGD steps against the single device, and the
    report's collectives against the run's."""
    (r, *_) = pool.run(_train, "20b-lora-no-bias")
    assert _styles(r)["down.A"] == ("rowwise", None) and _styles(r)["down.B"] == ("replicate", "cheaper-replicated")
    assert r["forward"] == {"all_reduce": 1}
    assert r["backward"] == {"all_reduce": 2}  # up.A's output entering colwise up.B; down.B's weight gradient


def test_case20c_peft_lora_scaled_adapters_at_megatron_floor(pool):
    """PEFT's own form, ``base_layer(x) + lora_B(lora_A(x)) * scaling``: the scaling between B's
    all_reduced output and the merge with the colwise base hid the merge from the cheaper-side
    choice (up's A went colwise, B rowwise: 3 forward all_reduce). Now PEFT's Megatron plan:
    beside the colwise base A replicated and B colwise, beside the rowwise base A rowwise and
    B replicated, 2 forward all_reduce (compare_training: numbers and report == run)."""
    (r, *_) = pool.run(_train, "20c-peft-lora")
    assert _styles(r) == {
        "up.base_layer": ("colwise", None),
        "up.lora_A.default": ("replicate", "cheaper-replicated"),
        "up.lora_B.default": ("colwise", None),
        "down.base_layer": ("rowwise", None),
        "down.lora_A.default": ("rowwise", None),
        "down.lora_B.default": ("replicate", "cheaper-replicated"),
    }
    assert r["forward"] == {"all_reduce": 2}
    assert r["backward"] == {"all_reduce": 1}  # up.A's output entering the colwise up.B


def test_case22_report_counts_every_collective(pool):
    (r, *_) = pool.run(_train, "22-latent-kv")  # compare_training asserts report == run
    assert r["forward"] == {"all_reduce": 1} and r["backward"] == {"all_reduce": 1}
    assert _styles(r)["rope"] == ("replicate", "cheaper-replicated")
    assert _styles(r)["kv_b"] == ("colwise", None)


def test_case23_seed_linear_goes_rowwise_on_its_sliced_input(pool):
    (r, *_) = pool.run(_train, "23-seed-linear")
    (row,) = r["report"]["layers"]
    assert (row["style"], row["local_weight_shape"]) == ("rowwise", [10, 100 // pool.world_size])
    assert r["forward"] == {"all_reduce": 1} and r["out_shapes"] == [(2, 10)]


@pytest.mark.parametrize("name", ["lm-loss", "lm-loss-and-logits", "vocab-12-loss"])
def test_loss_parallel_cross_entropy_on_a_colwise_head(pool, name):
    """cross_entropy on sharded classes is Megatron's vocab-parallel loss: exact loss, gradients
    and SGD steps (ignore_index targets included), 3 forward all_reduce of (N,), no gather."""
    (r, *_) = pool.run(_train, name)
    assert _styles(r)["head"] == ("colwise", None)
    assert "vocab-parallel cross_entropy" in _layers(r)["head"]["reason"]
    if name == "vocab-12-loss":
        assert r["forward"] == {"all_reduce": 3}
    elif name == "lm-loss":  # + the vocab-parallel lookup and the MLP's rowwise layer
        assert r["forward"] == {"all_reduce": 5}
    else:  # the logits are a model output too: gathered once for it
        assert r["forward"] == {"all_reduce": 5, "all_gather": 1}


def test_case18_glu_on_a_fused_projection(pool):
    (r, *_) = pool.run(_train, "18-glu")
    assert _styles(r) == {"w12": ("colwise", None), "w3": ("rowwise", None)}
    layers = _layers(r)
    assert "[128, 128]" in layers["w12"]["reason"]  # each rank holds [w1_r | w2_r]
    assert layers["w12"]["local_weight_shape"] == [256 // pool.world_size, 64]
    assert layers["w3"]["local_weight_shape"] == [64, 128 // pool.world_size]
    assert r["forward"] == {"all_reduce": 1}
    assert r["backward"] == {"all_reduce": 1}  # f after the norm, whose weight needs its gradient
    assert "aten.glu.default" in r["code"]


def test_case21_in_place_activation(pool):
    (r, *_) = pool.run(_train, "21-in-place")  # the gain's gradient is compared too
    assert _styles(r) == {"up": ("colwise", None), "down": ("rowwise", None)}
    for op in ("aten.relu_.default", "aten.mul_.Tensor"):
        assert op in r["code"]  # the in-place ops run on the local shards
    assert r["forward"] == {"all_reduce": 1}


def _out_of_range_inputs():
    """Ids the single device refuses: a token id >= vocab, a negative one, a target >= vocab,
    and a sequence longer than GPT-2's position table. Each raises FxtpInputError on every rank
    (the vocab-parallel lookup and loss only see their own rows; without the check they would
    give zeros: a silently wrong answer)."""
    from fxtp.cli.examples import gpt2

    model, (ids, labels) = build_case("lm-loss")
    pm = fxtp.compile(model, dist.get_world_size(), (ids, labels), dynamic=False)
    messages = []
    for bad_ids, bad_labels in ((ids.clone().fill_(64), labels), (ids.clone().fill_(-1), labels), (ids, labels.clone().fill_(64))):
        try:
            pm(bad_ids, bad_labels)
        except fxtp.FxtpInputError as exc:
            messages.append(str(exc))
        else:
            messages.append("no error")
    ok = pm(ids, labels)  # the group is still in step: a good batch runs and equals the single device
    messages.append(float((ok - model(ids, labels)).detach().abs()))
    gpt, (gids,) = gpt2()
    pg = fxtp.compile(gpt, dist.get_world_size(), (gids,))
    try:
        pg(torch.cat([gids, gids], 1))  # 32 positions, the table holds 16
    except fxtp.FxtpInputError as exc:
        messages.append(str(exc))
    else:
        messages.append("no error")

    def hook(module, args):  # Python code's IndexError (a user's hook here, or fxtp's own) is no input error
        raise IndexError("a hook's own bug")

    handle = pg.get_submodule("transformer.h.0").register_forward_pre_hook(hook)
    try:
        pg(gids)
    except IndexError as exc:
        messages.append(f"{type(exc).__name__}: {exc}")
    handle.remove()
    return messages


def test_out_of_range_ids_raise_as_on_one_device(pool):
    for embedding_high, embedding_negative, target, ok, positions, hooked in pool.run(_out_of_range_inputs):
        assert hooked == "IndexError: a hook's own bug", hooked
        assert "embedding at emb got an id outside [0, 64)" in embedding_high and "first bad id: 64" in embedding_high
        assert "first bad id: -1" in embedding_negative
        assert "cross_entropy" in target and "outside [0, 64)" in target and "first bad id: 64" in target
        assert ok < 1e-5
        assert "index in the inputs is out of range" in positions and "position table" in positions
