"""``fxtp.parallelize`` (issue 32, item 3): one call applies a plan, as torchtitan's
``parallelize_llama`` does, on real gloo ranks (4: dp 2 x tp 2).

* A tiny Hugging Face Llama under ``fxtp.plan``'s plan for 4 devices, pinned to sequence
  parallelism, ``activation_checkpointing="blocks"`` and 2 micro-batches of 2: the blocks and the
  root are FSDP2 units, the blocks are checkpointed; the losses of every micro-batch, every
  gradient, the clipped norm and 3 AdamW steps equal the single device's on the global batch.
* The 2-block MLP of tests/test_fsdp_blocks.py: a 1-D ``("dp",)`` mesh (tp 1, FSDP2 only) and a
  1-D ``("tp",)`` mesh (no FSDP2) train as the single device; with ``mp_policy`` (bf16) the
  graph runs in bf16; ``compile_blocks`` (``aot_eager``) on dp 2 x tp 2 is exact; a mesh the
  plan does not fit, a mesh without the dims, the mesh's own options given again,
  ``compile_blocks`` without blocks and a bf16 policy on a static compile are one-line
  ``FxtpConfigError`` s.

The user's own ``fully_shard`` calls on a ``ParallelModule``: tests/test_fsdp_blocks.py.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from _helpers import without_collective_log
from test_fsdp_blocks import X, _Net

import fxtp
from fxtp.core.placement import shard_tensor
from fxtp.core.strategy import TensorParallelStrategy

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 8, 16


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def planned():
    """``fxtp.plan`` for 4 devices as 2 nodes of 2 on 1 Gb/s Ethernet (tp 2 x dp 2, as
    tests/test_plan_apply.py; ``pp=1``: unpinned, the search pipelines across the slow link), pinned to sequence parallelism, block checkpointing and 2
    micro-batches of 2: what the planner may choose, fixed so the test sees each."""
    from fxtp.planner import HARDWARE

    ethernet = dataclasses.replace(HARDWARE["h100"], inter_node_bw=125e6)
    plan = fxtp.plan(_llama(), 4, device_memory=2**30, batch=BATCH, seq=SEQ, devices_per_node=2, hardware=ethernet, pp=1)
    assert (plan.tp, plan.dp) == (2, 2), plan
    choice = dataclasses.replace(plan.chosen.choice, sequence_parallel=True, activation_checkpointing="blocks",
                                 micro_batch=2, accumulation=2)
    return dataclasses.replace(plan, chosen=dataclasses.replace(plan.chosen, choice=choice))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A gradient or parameter gathered over dp (FSDP2's shards): this tp rank's shard."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_like_one_device(pm, ref, tp: int, tp_rank: int, what: str) -> None:
    for fqn, p in pm.named_parameters():
        placement = pm.placements[fqn]
        torch.testing.assert_close(_local(p.grad), shard_tensor(ref.get_parameter(fqn).grad, placement, tp_rank, tp),
                                   msg=lambda m: f"{what}: gradient of {fqn}: {m}")


def _run_plan(plan) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from fxtp.core.recompute import Recompute
    from fxtp.parallelizing import block_names

    mesh = init_device_mesh("cpu", (plan.dp, plan.tp), mesh_dim_names=("dp", "tp"))
    tp_rank = mesh["tp"].get_local_rank()
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))  # the global batch
    micro = ids.chunk(plan.dp)[mesh["dp"].get_local_rank()].split(plan.micro_batch)
    assert len(micro) == plan.accumulation_steps
    ref = _llama()
    model = copy.deepcopy(ref)
    pm = fxtp.parallelize(model, mesh, (micro[0],), strategy=plan, example_kwargs={"labels": micro[0]}, dynamic=False)
    torch.testing.assert_close(model.state_dict(), ref.state_dict(), rtol=0, atol=0)  # the model untouched
    blocks = block_names(pm)
    units = {fqn: isinstance(pm.get_submodule(fqn), FSDPModule) for fqn in blocks}
    train = pm.mode_graph("train")
    checkpointed = [isinstance(train.blocks[fqn].module, Recompute) for fqn in blocks]
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (pm, ref))
    losses = []
    for step in range(3):
        for part in micro:
            loss = pm(part, labels=part).loss
            (loss / len(micro)).backward()
            with torch.no_grad():
                losses.append((loss.item(), ref(part, labels=part).loss.item()))
        ref_opt.zero_grad()
        for part in ids.split(plan.micro_batch):  # every dp rank's micro-batches, summed as the ranks do
            (ref(part, labels=part).loss / (plan.dp * plan.accumulation_steps)).backward()
        _check_like_one_device(pm, ref, plan.tp, tp_rank, f"step {step}")
        torch.testing.assert_close(pm.clip_grad_norm_(1.0), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
        for o in (opt, ref_opt):
            o.step()
        opt.zero_grad()
        for fqn, p in pm.named_parameters():
            want = shard_tensor(ref.get_parameter(fqn).detach(), pm.placements[fqn], tp_rank, plan.tp)
            # AdamW divides by the gradient's RMS: float32 rounding in a near-zero gradient entry
            # moved one weight by 1.1e-5 (of lr 1e-2) at step 0
            torch.testing.assert_close(_local(p.detach()), want, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {fqn}: {m}")
    return {"blocks": blocks, "units": units, "root": isinstance(pm, FSDPModule), "checkpointed": checkpointed,
            "regions": len(pm.report.recompute), "losses": losses}


def test_parallelize_applies_the_plan_and_trains_like_one_device(rank_pools, planned):
    """The plan's dp 2 x tp 2 mesh, sequence parallelism, block checkpointing and micro-batches
    in one call: each block and the root an FSDP2 unit, each block recomputed in backward, the
    user's model untouched; 3 AdamW steps with clipping and 2 accumulated micro-batches equal the
    single device on the global batch (asserted on the ranks: gradients, norms, parameters)."""
    for rank in rank_pools(4).run(_run_plan, planned):
        assert rank["blocks"] == ["model.layers.0", "model.layers.1"], rank
        assert all(rank["units"].values()) and rank["root"], rank
        assert rank["checkpointed"] == [True, True] and rank["regions"] == 2, rank
        for got, want in rank["losses"]:
            assert got == pytest.approx(want, rel=1e-5), rank["losses"]


def _step(pm, ref, whole: torch.Tensor, dp: int, dp_rank: int, tp: int, tp_rank: int, what: str) -> None:
    """One forward and backward of ``pm`` on its dp rank's part of ``whole`` against ``ref`` on
    ``whole`` (FSDP2 averages the gradients over dp: the mean over ``whole``)."""
    ref.zero_grad()
    out, want = pm(whole.chunk(dp)[dp_rank]), ref(whole)
    torch.testing.assert_close(out, want.chunk(dp)[dp_rank], msg=lambda m: f"{what}: {m}")
    (out**2).mean().backward()
    (want**2).mean().backward()
    _check_like_one_device(pm, ref, tp, tp_rank, what)


def _run_meshes(plan) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    # what fxtp.plan(..., pp=2) chooses here: pp 2 x tp 2 x dp 1 under 1F1B
    pipelined = dataclasses.replace(plan, chosen=dataclasses.replace(
        plan.chosen, choice=dataclasses.replace(plan.chosen.choice, pp=2, dp=1, schedule="1F1B")))

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    torch.manual_seed(0)
    ref = _Net()
    x = X.chunk(2)[dp_rank]
    out = {}
    # a 1-D mesh of dp: tp 1, FSDP2 per block and root; a 1-D mesh of tp: no FSDP2
    dp_only = fxtp.parallelize(copy.deepcopy(ref), mesh["dp"], (x,), dynamic=False)
    out["dp_only"] = [isinstance(m, FSDPModule) for m in (dp_only, dp_only.layers[0], dp_only.layers[1])]
    _step(dp_only, ref, X, 2, dp_rank, 1, 0, "dp only")
    tp_only = fxtp.parallelize(copy.deepcopy(ref), mesh["tp"], (X,), dynamic=False, strategy=TensorParallelStrategy(2))
    out["tp_only"] = [isinstance(m, FSDPModule) for m in (tp_only, tp_only.layers[0])]
    _step(tp_only, ref, X, 1, 0, 2, tp_rank, "tp only")
    # FSDP2's mixed precision on every unit: the graph runs in bf16, within bf16's error of the model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    low = fxtp.parallelize(copy.deepcopy(ref), mesh, (x,), mp_policy=policy)  # a graph per dtype: dynamic
    with torch.no_grad():
        got = low(x)
        out["bf16"] = (got.dtype, (got.float() - ref(X).chunk(2)[dp_rank]).abs().max().item())
    # torch.compile per block (aot_eager: no C++ build), then FSDP2, on dp 2 x tp 2
    with without_collective_log():  # Dynamo compiles nothing under the pool's dispatch mode
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        compiled = fxtp.parallelize(copy.deepcopy(ref), mesh, (x,), dynamic=False, compile_blocks={"backend": "aot_eager"})
        _step(compiled, ref, X, 2, dp_rank, 2, tp_rank, "compile_blocks")
        out["compiled"] = (dict(counters["stats"]), sum(counters["graph_break"].values()))
    errors = {}
    for label, call in {
        "plan": lambda: fxtp.parallelize(ref, mesh["tp"], (x,), strategy=plan),
        "tp": lambda: fxtp.parallelize(ref, mesh, (x,), strategy=TensorParallelStrategy(4)),
        "names": lambda: fxtp.parallelize(ref, init_device_mesh("cpu", (4,), mesh_dim_names=("world",)), (x,)),
        "group": lambda: fxtp.parallelize(ref, mesh, (x,), group=mesh["tp"]),
        "compile": lambda: fxtp.parallelize(ref, mesh, (x,), compile_blocks="yes"),
        "mesh": lambda: fxtp.parallelize(ref, 4, (x,)),
        "pipelined": lambda: fxtp.parallelize(ref, mesh["tp"], (x,), strategy=pipelined),
        "static_bf16": lambda: fxtp.parallelize(ref, mesh, (x,), mp_policy=policy, dynamic=False),
        "no_blocks": lambda: fxtp.parallelize(torch.nn.Linear(16, 16), mesh["tp"], (x,), compile_blocks=True),
    }.items():
        with pytest.raises(fxtp.FxtpConfigError) as caught:
            call()
        errors[label] = str(caught.value)
    out["errors"] = errors
    return out


def test_parallelize_on_one_d_meshes_with_compile_and_bad_meshes(rank_pools, planned):
    """A 1-D ``("dp",)`` mesh is FSDP2 alone (every block and the root units), a 1-D ``("tp",)``
    mesh tensor parallelism alone (no unit), ``compile_blocks`` compiles each block once without a
    break; each equals the single device (asserted on the ranks). A mesh that is not the plan's,
    one without the dims, options the mesh gives and a bad ``compile_blocks`` are one-line
    ``FxtpConfigError`` s with a fix."""
    for rank in rank_pools(4).run(_run_meshes, planned):
        assert rank["dp_only"] == [True, True, True] and rank["tp_only"] == [False, False], rank
        assert rank["bf16"][0] == torch.bfloat16 and rank["bf16"][1] < 5e-2, rank["bf16"]
        stats, breaks = rank["compiled"]
        assert stats["unique_graphs"] == 2 and breaks == 0, rank["compiled"]
        errors = rank["errors"]
        assert all("\n" not in message and "fix:" in message for message in errors.values()), errors
        assert "the mesh is dp 1 x tp 2 but the plan is dp 2 x tp 2" in errors["plan"], errors
        assert "the mesh is dp 2 x tp 2 but the plan is tp 4" in errors["tp"], errors
        assert "got ('world',)" in errors["names"] and "takes group from the mesh" in errors["group"], errors
        assert "compile_blocks must be" in errors["compile"] and "got int" in errors["mesh"], errors
        assert "no repeated blocks" in errors["no_blocks"], errors
        assert "fix: drop dynamic=False" in errors["static_bf16"], errors
        assert "the plan is pipelined (pp 2 x tp 2 x dp 1, 1F1B)" in errors["pipelined"] and "fxtp.pipeline(" in errors["pipelined"], errors
