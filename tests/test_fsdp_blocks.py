"""FSDP2's ``fully_shard`` on the blocks of a ``ParallelModule``, then on the root, as
torchtitan applies it (NOTE: [FSDP2 units inside a ParallelModule] in fxtp/runtime/fsdp.py):
dp 2 x tp 2 on real gloo ranks, a 2-block MLP of hidden 16. 3 SGD steps against the single
device; the FSDP2 collectives of a step counted on the c10d ops FSDP2 issues (a
``TorchDispatchMode``, not fxtp); a block without a root unit refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxtp
from _helpers import Fsdp2Collectives

X = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers, self.head = nn.ModuleList([_Block(), _Block()]), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _run() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    local = X.chunk(2)[dp]
    torch.manual_seed(0)
    ref = _Net()
    alone = fxtp.compile(copy.deepcopy(ref), 2, (local,), group=mesh["tp"], dynamic=False)
    fully_shard(alone.get_submodule("layers.1"), mesh=mesh["dp"])
    with pytest.raises(fxtp.FxtpConfigError, match=r"'layers\.1' of this ParallelModule.*fully_shard\(pm, mesh"):
        alone(local)
    pm = fxtp.compile(copy.deepcopy(ref), 2, (local,), group=mesh["tp"], dynamic=False)
    for i in range(2):
        fully_shard(pm.get_submodule(f"layers.{i}"), mesh=mesh["dp"])
    fully_shard(pm, mesh=mesh["dp"])
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    calls, sharded = [], []
    for _ in range(3):
        with Fsdp2Collectives() as counted:
            out = pm(local)
            (out**2).mean().backward()  # FSDP2 averages over dp: the global batch's mean
        calls.append(dict(counted.calls))
        want = ref(X)
        (want**2).mean().backward()
        torch.testing.assert_close(out, want.chunk(2)[dp])
        sharded.append(isinstance(pm.get_submodule("layers.0.up").weight, DTensor))  # resharded after backward
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    with torch.no_grad():
        torch.testing.assert_close(pm(local), ref(X).chunk(2)[dp])
    sharded.append(isinstance(pm.get_submodule("layers.1.down").weight, DTensor))  # resharded after a no_grad call
    return {"calls": calls, "sharded": sharded}


def test_fully_shard_per_block_trains_like_one_device(rank_pools):
    """Per-block units and the root: the outputs of 3 SGD steps and of a ``no_grad`` call equal
    the single device's (asserted on the ranks); per step one all_gather and one reduce_scatter
    per unit (the 2 blocks and the root), the blocks resharded after backward and after the
    ``no_grad`` call; a block without the root unit raises ``FxtpConfigError`` naming it."""
    for rank in rank_pools(4).run(_run):
        assert rank["calls"] == [{"_allgather_base_": 3, "_reduce_scatter_base_": 3}] * 3, rank
        assert rank["sharded"] == [True] * 4, rank
