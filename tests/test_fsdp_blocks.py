"""FSDP2's ``fully_shard`` on the blocks of a ``ParallelModule``, then on the root, as
torchtitan applies it (NOTE: [FSDP2 units inside a ParallelModule] in fxtp/runtime/fsdp.py):
dp 2 x tp 2 on real gloo ranks.

* A 2-block MLP of hidden 16 with a head, ``reshard_after_forward=True``: a block is gathered
  while it runs and resharded after (seen from a hook on the next block); FSDP2's collectives
  per step (counted on the c10d ops FSDP2 issues, a ``TorchDispatchMode``, not fxtp) are those
  of the same wrapping on the eager model; the losses, every gradient and 3 AdamW steps with
  ``clip_grad_norm_`` equal the single device's, also with gradient accumulation over two
  micro-batches and under ``MixedPrecisionPolicy(bf16, reduce fp32)`` (against the same policy
  on the eager model); a unit that is not a block, without a root unit, is refused by name.
* Peak memory per rank (``shared/tools/heap.py``: glibc's heap, sampled on a thread) of one
  forward and backward of ``tools/bench_fsdp.py``'s model (8 blocks 512 -> 2048 -> 512) is at most
  1.10x the hand-written torchtitan plan's, with sequence parallelism and with
  ``activation_checkpointing="blocks"`` too; so are the bytes the wrapped model holds.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch import nn

import fxtp
from _helpers import Fsdp2Collectives
from fxtp.core.placement import shard_tensor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

X = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers, self.head = nn.ModuleList([_Block(), _Block()]), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _wrap(model: nn.Module, mesh, **kwargs) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for i in range(2):
        fully_shard(model.get_submodule(f"layers.{i}"), mesh=mesh, reshard_after_forward=True, **kwargs)
    return fully_shard(model, mesh=mesh, reshard_after_forward=True, **kwargs)


def _grads(pm, tp_rank: int) -> dict[str, tuple[torch.Tensor, object]]:
    from torch.distributed.tensor import DTensor

    return {fqn: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad, pm.placements[fqn])
            for fqn, p in pm.named_parameters()}


def _run(sequence_parallel: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    micro = [X.chunk(2)[dp], (X * 0.5 - 0.25).chunk(2)[dp]]
    torch.manual_seed(0)
    ref = _Net()

    lone = fxtp.compile(copy.deepcopy(ref), 2, (micro[0],), group=mesh["tp"], dynamic=False)
    from torch.distributed.fsdp import fully_shard

    fully_shard(lone.get_submodule("layers.1.up"), mesh=mesh["dp"])
    with pytest.raises(fxtp.FxtpConfigError, match=r"'layers\.1\.up' of this ParallelModule.*is not a block"):
        lone(micro[0])

    pm = _wrap(fxtp.compile(copy.deepcopy(ref), 2, (micro[0],), group=mesh["tp"], dynamic=False,
                            sequence_parallel=sequence_parallel), mesh["dp"])
    eager = _wrap(copy.deepcopy(ref), mesh["dp"])  # FSDP2 alone on the eager model: its collectives
    seen = []
    pm.get_submodule("layers.1").register_forward_pre_hook(lambda m, a: seen.append(
        (isinstance(pm.get_submodule("layers.0.up").weight, DTensor), isinstance(m.up.weight, DTensor))))
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (pm, ref))
    calls, eager_calls = [], []
    for step in range(3):
        with Fsdp2Collectives() as counted:
            for x in micro:  # gradient accumulation: FSDP2 reduce-scatters each, the shards add
                out = pm(x)
                (out**2).mean().backward()  # FSDP2 averages over dp: the global batch's mean
        with Fsdp2Collectives() as counted_eager:
            for x in micro:
                (eager(x) ** 2).mean().backward()
        calls.append(dict(counted.calls))
        eager_calls.append(dict(counted_eager.calls))
        for x in micro:
            (ref(_whole(x, mesh)) ** 2).mean().backward()
        torch.testing.assert_close(out, _whole(micro[-1], mesh, ref).chunk(2)[dp], msg=lambda m: f"step {step}: {m}")
        for fqn, (grad, placement) in _grads(pm, tp).items():
            want = shard_tensor(ref.get_parameter(fqn).grad, placement, tp, 2)
            torch.testing.assert_close(grad, want, msg=lambda m: f"step {step} gradient of {fqn}: {m}")
        norm, ref_norm = pm.clip_grad_norm_(0.5), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch.testing.assert_close(norm, ref_norm)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        eager.zero_grad()
    with torch.no_grad():
        torch.testing.assert_close(pm(micro[0]), ref(_whole(micro[0], mesh)).chunk(2)[dp])
    resharded = isinstance(pm.get_submodule("layers.1.down").weight, DTensor)  # after a no_grad call
    return {"calls": calls, "eager_calls": eager_calls, "seen": seen, "resharded": resharded}


def _whole(x: torch.Tensor, mesh, model: nn.Module | None = None) -> torch.Tensor:
    """The global batch of ``x`` (each dp rank's half, gathered); ``model``'s output on it."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(parts, x.contiguous(), group=mesh["dp"].get_group())
    whole = torch.cat(parts)
    if model is None:
        return whole
    with torch.no_grad():
        return model(whole)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_fully_shard_per_block_trains_like_one_device(rank_pools, sequence_parallel):
    """Per-block units and the root, ``reshard_after_forward=True``: block 0 is resharded and
    block 1 gathered when block 1 runs (in each forward); FSDP2's collectives per step are the
    eager model's under the same wrapping (a gather per block in forward and again in backward);
    losses, gradients, norms and 3 AdamW steps with clipping and accumulation equal the single
    device's (asserted on the ranks); a ``no_grad`` call leaves the blocks resharded."""
    for rank in rank_pools(4).run(_run, sequence_parallel):
        assert rank["calls"] == rank["eager_calls"], rank
        assert rank["calls"][0]["_allgather_base_"] > 2 * 2, rank  # each block gathered again in its backward
        assert rank["seen"] == [(True, False)] * (3 * 2 + 1), rank
        assert rank["resharded"], rank


def _run_mixed() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    x = X.chunk(2)[dp]
    torch.manual_seed(0)
    ref = _Net()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pm = _wrap(fxtp.compile(copy.deepcopy(ref), 2, (x,), group=mesh["tp"]), mesh["dp"], mp_policy=policy)
    eager = _wrap(copy.deepcopy(ref), mesh["dp"], mp_policy=policy)  # the same policy's reference
    opt, eager_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pm, eager))
    errors = []
    for _ in range(3):
        out, want = pm(x), eager(x)
        assert out.dtype == want.dtype == torch.bfloat16
        errors.append((out.float() - want.float()).abs().max().item())
        (out.float() ** 2).mean().backward()
        (want.float() ** 2).mean().backward()
        for fqn, (grad, placement) in _grads(pm, tp).items():
            full = eager.get_parameter(fqn).grad.full_tensor()
            torch.testing.assert_close(grad, shard_tensor(full, placement, tp, 2), rtol=2e-2, atol=2e-2)
        for o in (opt, eager_opt):
            o.step()
            o.zero_grad()
    return {"errors": errors}


def test_fully_shard_per_block_mixed_precision(rank_pools):
    """``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on every unit: outputs (bf16)
    and gradients equal the same policy on the eager model within bf16's tolerance, over 3 AdamW
    steps."""
    for rank in rank_pools(4).run(_run_mixed):
        assert max(rank["errors"]) < 5e-2, rank


def _run_memory() -> dict:
    import bench_fsdp

    return {label: bench_fsdp.measure(**kw) for label, kw in
            {"tp": {}, "sp": {"sequence_parallel": True}, "ac_blocks": {"checkpointing": True}}.items()}


def test_fully_shard_per_block_peak_memory_near_the_hand_plan(rank_pools):
    """fxtp's blocks under FSDP2 hold at most 1.10x the peak bytes per rank of torchtitan's plan
    written by hand (DTensor ``parallelize_module`` per block, ``fully_shard`` per block and
    root), on 8 blocks of 512 -> 2048 -> 512 (64 MiB of fp32 weights, so a whole-model gather
    would show), at dp 2 x tp 2: plain, with sequence parallelism, and with
    ``activation_checkpointing="blocks"``; and the bytes each rank holds once wrapped (16 MiB of
    shards, measured on the same heap) are at most 1.10x the hand plan's."""
    result = rank_pools(4).run(_run_memory)[0]
    for label, peaks in result.items():
        assert peaks["fxtp"] <= 1.10 * peaks["hand"], (label, {k: v / 2**20 for k, v in peaks.items()})
        # held after wrapping: each rank's quarter of the weights (16 MiB), not also its tp-local half
        # (a ParallelModule that kept its Parameters held 48 MiB: FSDP2's shards plus the old copies)
        assert peaks["fxtp_resident"] <= 1.10 * peaks["hand_resident"], (label, {k: v / 2**20 for k, v in peaks.items()})


def test_compile_per_block_is_exact():
    """torchtitan's ``apply_compile``: ``block.compile(fullgraph=True)`` on each block of a
    ``ParallelModule`` (world size 1, ``aot_eager`` to skip inductor's C++ builds): one graph per
    block and no break, outputs and every gradient equal the model's; a block called alone equals
    the model's block."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _Net()
    pm = fxtp.compile(copy.deepcopy(model), 1, (X,), dynamic=False)
    for i in range(2):
        pm.get_submodule(f"layers.{i}").compile(backend="aot_eager", fullgraph=True)
    out, want = pm(X), model(X)
    torch.testing.assert_close(out, want)
    (out**2).mean().backward()
    (want**2).mean().backward()
    for fqn, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, model.get_parameter(fqn).grad, msg=lambda m: f"gradient of {fqn}: {m}")
    # the blocks share one body (NOTE: [identical blocks compile once]); block 0 is compiled again for its input
    # that needs no grad (Dynamo guards requires_grad)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    hidden = torch.randn(4, 6, 16)
    torch.testing.assert_close(pm.get_submodule("layers.1")(hidden), model.layers[1](hidden))
