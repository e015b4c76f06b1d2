"""fxtp's collectives on real gloo ranks (world sizes 2 and 4): the gather of a shard, even and
uneven (NOTE: [uneven shards]), forward and backward, against the full tensor."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fxtp.core.collectives import gather_from_tp
from fxtp.core.placement import Shard, shard_tensor

SHARDS = {
    "even": Shard(1, (8,)),
    "uneven-rows": Shard(1, (11,)),  # 6/5, 3/3/3/2
    "uneven-heads": Shard(1, (96,), unit=16),  # 3/3 heads, 2/2/1/1 heads
    "uneven-fused": Shard(1, (80, 48), unit=16),  # two segments of 5 and 3 heads
}


def _gather(name: str):
    shard = SHARDS[name]
    ws, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full, grad = torch.randn(3, shard.size, 2), torch.randn(3, shard.size, 2)  # the same on every rank
    local = shard_tensor(full, shard, rank, ws).requires_grad_()
    out = gather_from_tp(local, shard.dim, shard.segments, rank, ws, dist.group.WORLD.group_name, shard.unit)
    out.backward(grad)
    torch.testing.assert_close(out, full, rtol=0, atol=0)
    torch.testing.assert_close(local.grad, shard_tensor(grad, shard, rank, ws), rtol=0, atol=0)
    return tuple(local.shape)


@pytest.mark.parametrize("name", list(SHARDS))
def test_gather_of_unequal_pieces(pool, name):
    shapes = pool.run(_gather, name)
    shard = SHARDS[name]
    assert shapes == [(3, shard.local_size(pool.world_size, r), 2) for r in range(pool.world_size)]
    assert sum(s[1] for s in shapes) == shard.size
