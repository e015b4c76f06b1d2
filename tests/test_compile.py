"""``torch.compile`` on a ``ParallelModule``, on real gloo ranks, against the single device.

* The whole module, ``fullgraph=True``: plain tensor parallelism, sequence parallelism and both
  checkpointing policies on a tiny Hugging Face Llama (2 blocks) at world size 2, sequence
  parallelism at 4: one graph and no break (``torch._dynamo.explain``), one graph over a 3-step
  AdamW loop (a counting backend), outputs and every gradient at each step equal one device's.
* Per block, as torchtitan's ``apply_compile`` does it (``register_module(i, torch.compile(block,
  fullgraph=True))``): at world size 2 with tensor parallelism (4 Llama blocks, plain and
  ``activation_checkpointing="blocks"``), and at dp 2 x tp 2 with FSDP2's ``fully_shard`` per
  block and on the root: losses, every gradient, the clipped norm and 3 AdamW steps equal one
  device's. Identical blocks compile once (NOTE: [identical blocks compile once] in
  fxtp/runtime/blocks.py): 4 Llama blocks make 2 graphs, as 2 blocks do.

The compiled calls run outside the pool's ``CollectiveLog`` (``without_collective_log``).
The backend is ``aot_eager`` (no C++ builds): what is tested is Dynamo's capture. Inductor's
code calls its extern kernels on a compiled graph's ``ShardedParameter`` inputs directly (NOTE:
[compiled kernels on shards] in fxtp/runtime/sharded.py): tests/test_training.py compiles a
model with sharded weights and biases under inductor, ``fullgraph=True``, forward and backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _helpers import loss_of, without_collective_log

import fxtp
from fxtp.core.placement import shard_tensor
from fxtp.runtime.blocks import model_fqn
from fxtp.runtime.sharded import local_tensor

MODES = {"tp": {}, "sp": {"sequence_parallel": True}, "selective": {"activation_checkpointing": "selective"},
         "blocks": {"activation_checkpointing": "blocks"}}


def _counting(graphs: list[int]):
    """A backend that counts the graphs Dynamo hands it (``aot_eager`` underneath)."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return aot_eager(gm, example_inputs)

    return backend


def _check_grads(pm, ref, rank: int, ws: int, what: str) -> None:
    for name, p in pm.named_parameters():
        fqn = model_fqn(name)
        want = shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], rank, ws)
        torch.testing.assert_close(local_tensor(p.grad), want, msg=lambda m: f"{what}, gradient of {fqn}: {m}")


def _fullgraph(mode: str) -> dict:
    with without_collective_log():
        import torch._dynamo
        from fxtp.cli import examples

        ws, rank = dist.get_world_size(), dist.get_rank()
        model, (ids,) = examples.llama(num_hidden_layers=2)
        ref = copy.deepcopy(model)
        pm = fxtp.compile(model, ws, (ids,), dynamic=False, **MODES[mode])
        torch._dynamo.reset()
        explained = torch._dynamo.explain(pm)(ids)
        torch._dynamo.reset()
        graphs: list[int] = []
        compiled = torch.compile(pm, backend=_counting(graphs), fullgraph=True)
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pm, ref))
        for step in range(3):
            out, ref_out = compiled(ids), ref(ids)
            torch.testing.assert_close(out.logits, ref_out.logits, msg=lambda m: f"{mode} step {step}: {m}")
            loss_of(out).backward()
            loss_of(ref_out).backward()
            _check_grads(pm, ref, rank, ws, f"{mode} step {step}")
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        return {"explain": (explained.graph_count, explained.graph_break_count), "graphs": len(graphs),
                "reasons": [str(r.reason).splitlines()[0] for r in explained.break_reasons]}


@pytest.mark.parametrize("ws, modes", [(2, tuple(MODES)), (4, ("sp",))], ids=["ws2", "ws4"])
def test_torch_compile_fullgraph_in_every_mode(rank_pools, ws, modes):
    """``torch.compile(pm, fullgraph=True)``: one graph and no break, one graph over 3 AdamW steps,
    exact. Before: ``ParallelModule.forward`` made the parameters plain with a
    ``torch.compiler.disable``d function, so ``fullgraph=True`` raised; it now takes
    ``sharded.plain_views`` while Dynamo traces (``sharded.plain_graph_inputs``)."""
    pool = rank_pools(ws)
    for mode in modes:
        for r in pool.run(_fullgraph, mode):
            assert r["explain"] == (1, 0), (mode, r["reasons"])
            assert r["graphs"] == 1, (mode, r["graphs"])


def _apply_compile(pm, backend) -> None:
    """torchtitan's ``apply_compile`` (``torchtitan/models/llama3/infra/parallelize.py``)."""
    layers = pm.get_submodule("model.layers") if hasattr(pm, "model") else pm.get_submodule("layers")
    for name, block in list(layers.named_children()):
        layers.register_module(name, torch.compile(block, backend=backend, fullgraph=True))


def _per_block(layers: int, mode: str, steps: int) -> dict:
    """``apply_compile`` on a ``ParallelModule`` against the same one run eagerly (the same sums in
    the same order: equal at torch's default tolerance at every step) and against one device
    (equal at step 0; after AdamW steps within 1e-3: Adam's ``g / sqrt(v)`` turns the rounding of
    the tensor-parallel sums on near-zero gradients into parameter differences of ~1e-5, measured
    on the eager ``ParallelModule`` too)."""
    with without_collective_log():
        from torch._dynamo.utils import counters
        from fxtp.cli import examples

        ws, rank = dist.get_world_size(), dist.get_rank()
        model, (ids,) = examples.llama(num_hidden_layers=layers)
        ref = copy.deepcopy(model)
        pm = fxtp.compile(model, ws, (ids,), dynamic=False, **MODES[mode])
        eager = fxtp.compile(copy.deepcopy(ref), ws, (ids,), dynamic=False, **MODES[mode])
        torch._dynamo.reset()
        counters.clear()
        graphs: list[int] = []
        _apply_compile(pm, _counting(graphs))
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pm, eager, ref)]
        for step in range(steps):
            tol = {} if step == 0 else {"rtol": 1e-3, "atol": 1e-3}
            out, eager_out, ref_out = pm(ids), eager(ids), ref(ids)
            torch.testing.assert_close(out.logits, eager_out.logits, msg=lambda m: f"{mode} step {step}: {m}")
            torch.testing.assert_close(out.logits, ref_out.logits, **tol, msg=lambda m: f"{mode} step {step}: {m}")
            for o in (out, eager_out, ref_out):
                loss_of(o).backward()
            for name, p in pm.named_parameters():
                fqn = model_fqn(name)
                torch.testing.assert_close(local_tensor(p.grad), local_tensor(eager.get_parameter(fqn).grad),
                                           msg=lambda m: f"{mode} step {step}, gradient of {fqn}: {m}")
                want = shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], rank, ws)
                torch.testing.assert_close(local_tensor(p.grad), want, **tol, msg=lambda m: f"{mode} step {step}, {fqn}: {m}")
            norms = [pm.clip_grad_norm_(0.5), eager.clip_grad_norm_(0.5), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)]
            torch.testing.assert_close(norms[0], norms[1])
            torch.testing.assert_close(norms[0], norms[2], **tol)
            for o in opts:
                o.step()
                o.zero_grad()
        full, want = pm.full_state_dict(), eager.full_state_dict()  # under the model's FQNs, not _orig_mod's
        assert full.keys() == want.keys() == ref.state_dict().keys()
        for key, value in full.items():
            torch.testing.assert_close(value, want[key], msg=lambda m: f"{mode}: {key}: {m}")
        return {"graphs": len(graphs), "breaks": sum(counters["graph_break"].values())}


def test_compile_per_block_is_exact_and_compiles_identical_blocks_once(rank_pools):
    """torchtitan's ``apply_compile``, ``fullgraph=True``, on 4 Llama blocks: exact over 3 AdamW
    steps with ``clip_grad_norm_``, no break, 2 graphs, as on 2 blocks (and under
    ``activation_checkpointing="blocks"``, one step): the first block is one graph, blocks 1-3 share
    one. The first lacks the float32 cast of the blocks' input (the rewrite moved it ahead of the
    embedding's all_reduce, NOTE: [deferred reduction]), so its body is another program."""
    pool = rank_pools(2)
    for layers, mode, steps in ((4, "tp", 3), (2, "tp", 1), (4, "blocks", 1)):
        for r in pool.run(_per_block, layers, mode, steps):
            assert r == {"graphs": 2, "breaks": 0}, (layers, mode, r)


def _per_block_fsdp() -> dict:
    with without_collective_log():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
        from test_fsdp_blocks import X, _Net, _whole

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
        x = X.chunk(2)[dp].clone().requires_grad_()  # block 0's input as block 1's: Dynamo guards requires_grad
        torch.manual_seed(0)
        ref = _Net()
        pm = fxtp.compile(copy.deepcopy(ref), 2, (x,), group=mesh["tp"], dynamic=False)
        torch._dynamo.reset()
        graphs: list[int] = []
        _apply_compile(pm, _counting(graphs))  # then FSDP2, as torchtitan orders them
        for name in ("layers.0", "layers.1"):
            fully_shard(pm.get_submodule(name), mesh=mesh["dp"], reshard_after_forward=True)
        fully_shard(pm, mesh=mesh["dp"], reshard_after_forward=True)
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (pm, ref))
        for step in range(3):
            out = pm(x)
            (out**2).mean().backward()  # FSDP2 averages over dp: the global batch's mean
            (ref(_whole(x, mesh)) ** 2).mean().backward()
            torch.testing.assert_close(out, _whole(x, mesh, ref).chunk(2)[dp], msg=lambda m: f"step {step}: {m}")
            for name, p in pm.named_parameters():
                fqn = model_fqn(name)
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                want = shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], tp, 2)
                torch.testing.assert_close(grad, want, msg=lambda m: f"step {step} gradient of {fqn}: {m}")
            torch.testing.assert_close(pm.clip_grad_norm_(0.5), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        return {"graphs": len(graphs), "resharded": isinstance(pm.get_submodule("layers.1._orig_mod.up").weight, DTensor)}


def test_compile_per_block_under_fsdp2_is_exact(rank_pools):
    """dp 2 x tp 2: ``apply_compile``, then ``fully_shard`` on each block and on the root
    (``reshard_after_forward=True``): outputs, every gradient, the clipped norm and 3 AdamW steps
    equal one device's; the 2 identical blocks are one graph; a block is resharded after the step."""
    for r in rank_pools(4).run(_per_block_fsdp):
        assert r == {"graphs": 1, "resharded": True}, r
