"""DP x TP on 4 gloo ranks as a 2x2 DeviceMesh ("dp", "tp"): fxtp on mesh["tp"], DDP on mesh["dp"].

Three SGD steps on the global batch must match the single-device model, and fxtp's collectives
must only address the tensor-parallel group of the rank.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import fxtp
from fxtp.core.placement import Shard, shard_tensor
from fxtp.runtime.sharded import local_tensor


@pytest.fixture(scope="module")
def pool(rank_pools):
    return rank_pools(4)


class GroupRecorder(TorchDispatchMode):
    """Records ``(collective, group name)`` of every functional collective dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func._opname != "wait_tensor":
            self.calls.append((func._opname, args[-1]))
        return func(*args, **(kwargs or {}))


def _dp_tp_training():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"]
    dp_rank, tp_rank = dp.get_local_rank(), tp.get_local_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    ref = copy.deepcopy(model)
    batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))  # the global batch
    local = batch.chunk(2)[dp_rank]  # this dp replica's half; both tp peers get the same rows
    pm = fxtp.compile(model, 2, (local,), group=tp)
    assert isinstance(pm.placements["0.weight"], Shard)
    ddp = DDP(pm, process_group=dp.get_group())
    opt, ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    recorder = GroupRecorder()
    for step in range(3):
        with recorder:
            out = ddp(local)
            (out**2).mean().backward()  # DDP averages over dp: the gradient of the global mean
        ref_out = ref(batch)
        (ref_out**2).mean().backward()
        torch.testing.assert_close(out, ref_out.chunk(2)[dp_rank], msg=lambda m, step=step: f"step {step}: {m}")
        for fqn, p in pm.named_parameters():
            expected = shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], tp_rank, 2)
            torch.testing.assert_close(local_tensor(p.grad), expected, msg=lambda m, step=step, fqn=fqn: f"step {step} grad {fqn}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    torch.testing.assert_close(pm(local), ref(batch).chunk(2)[dp_rank])
    full = pm.full_state_dict()  # gathered over tp only
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full[key], value)
    tp_group = tp.get_group()
    return {
        "tp_ranks": dist.get_process_group_ranks(tp_group),
        "calls": recorder.calls,
        "tp_name": tp_group.group_name,
        "dp_name": dp.get_group().group_name,
    }


def test_dp_x_tp_matches_single_device_on_the_global_batch(pool):
    results = pool.run(_dp_tp_training)
    assert [r["tp_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for r in results:
        assert r["calls"], "fxtp issued no collective"
        assert {name for _, name in r["calls"]} == {r["tp_name"]}  # only TP peers, never dp or world
        assert r["tp_name"] != r["dp_name"]
        assert [op for op, _ in r["calls"]] == ["all_reduce"] * 3  # one g per forward, 3 steps


def _accumulation_in_low_precision():
    """Gradient accumulation over 2 micro-batches per dp replica under bf16 autocast, 3 SGD
    steps, against the single device's fp32 steps on the global batch (bf16 tolerance):

    * DDP on mesh["dp"], no gradient sync on the first micro-batch (``ddp.no_sync()``), clipped
      with torch's ``clip_grad_norm_``;
    * FSDP2 on mesh["dp"], no reduce-scatter on the first micro-batch
      (``set_requires_gradient_sync(False)``), clipped with ``pm.clip_grad_norm_``.

    (bf16 parameters with fp32 master weights: ``tests/test_training_loop.py``'s
    ``_low_precision``; FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` is not run:
    it casts the inputs to bf16, which the float32 graph refuses, docs/training.md.)
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from test_training_loop import X, _block, _loss

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"]
    local = X.chunk(2)[dp.get_local_rank()]
    micro = local.chunk(2)
    bf16 = {"rtol": 2e-2, "atol": 2e-2}
    ref = _block()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)  # linear in the gradients (Adam scales bf16 noise up to lr)
    ddp_pm = fxtp.compile(copy.deepcopy(ref), 2, (micro[0],), group=tp)
    ddp = DDP(ddp_pm, process_group=dp.get_group())
    fsdp_pm = fxtp.compile(copy.deepcopy(ref), 2, (micro[0],), group=tp)
    fully_shard(fsdp_pm, mesh=dp)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ddp, fsdp_pm)]
    for step in range(3):
        _loss(ref(X)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        for i, x in enumerate(micro):  # each micro-batch's loss is half of the replica's mean
            with ddp.no_sync() if i == 0 else contextlib.nullcontext(), torch.autocast("cpu", dtype=torch.bfloat16):
                out = ddp(x)
            (_loss(out) / 2).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
        for i, x in enumerate(micro):
            fsdp_pm.set_requires_gradient_sync(i == 1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = fsdp_pm(x)
            (_loss(out) / 2).backward()
        fsdp_pm.clip_grad_norm_(0.5)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for pm, what in ((ddp_pm, "ddp"), (fsdp_pm, "fsdp2")):
            full = pm.full_state_dict()
            for key, value in ref.state_dict().items():
                torch.testing.assert_close(full[key].float(), value, **bf16, msg=lambda m, key=key, what=what: f"{what} step {step} {key}: {m}")
    return True


def test_accumulation_in_bf16_autocast_with_ddp_and_fsdp2_matches_one_device(pool):
    assert all(pool.run(_accumulation_in_low_precision))
