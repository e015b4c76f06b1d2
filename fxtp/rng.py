"""Random numbers across tensor-parallel ranks: dropout in train mode.

NOTE: [dropout across ranks]
fxtp's rule: every rank of a tensor-parallel group draws the *same* random numbers, in the same
order, as the single-device model would.

* Generators: ``fxtp.compile`` copies the tensor-parallel rank 0's default CPU generator (and the
  current CUDA device's, when CUDA is initialized) to the other ranks of the group
  (:func:`sync_generators`; a broadcast, only when the graph draws random numbers). From then on
  the ranks stay in step as long as they make the same random calls, which the same program
  does. A replicated value therefore gets the identical mask on every rank, with no manual seeding.
* Replicated values: the graph's own ``aten.dropout`` / ``aten.native_dropout``, unchanged.
* Sharded values: :func:`sharded_dropout` draws the mask of the *full* value from the shared
  generator and keeps this rank's slice (``fxtp.placement.local_ranges``): one global mask,
  each rank its slice. It consumes exactly what the single-device dropout consumes, so the
  generators stay in step (also under uneven shards) and, with the same seed, the outputs equal
  the single-device model's in train mode (bitwise on CPU). The cost is drawing the full mask
  (its size, transiently, on every rank); Megatron-LM's alternative, per-rank streams, draws only
  the local mask but cannot match the single-device model.

The report's ``dropout-on-shard`` note names every dropout on a sharded value and this choice.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fxtp.placement import Shard, local_ranges

__all__ = ["draws_random", "sharded_dropout", "sharded_native_dropout", "sync_generators"]

_aten = torch.ops.aten


def draws_random(graph: torch.fx.Graph) -> bool:
    """Whether ``graph`` calls an op tagged ``nondeterministic_seeded`` (dropout, rand, ...)."""
    return any(
        n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in n.target.tags
        and not (n.target in (_aten.dropout.default, _aten.native_dropout.default) and n.args[2] is False)
        for n in graph.nodes
    )


def sync_generators(group: "dist.ProcessGroup") -> None:
    """Set every rank's default generator(s) to those of rank 0 of ``group`` (a collective).

    The CPU generator always; the current CUDA device's too when CUDA is initialized.
    """
    states: list[Optional[torch.Tensor]] = [torch.get_rng_state(), None]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states[1] = torch.cuda.get_rng_state()
    dist.broadcast_object_list(states, group=group, group_src=0)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])


def _global_mask(x: torch.Tensor, p: float, dim: int, segments: tuple[int, ...], rank: int, world_size: int) -> torch.Tensor:
    """This rank's slice of the boolean keep-mask of the full value (``x`` is the local shard)."""
    shape = list(x.shape)
    shard = Shard(dim, tuple(segments))
    shape[dim] = shard.size
    # The single-device draw: native_dropout's mask depends only on the generator, not the values.
    _, mask = _aten.native_dropout.default(torch.empty(shape, dtype=x.dtype, device=x.device), p, True)
    pieces = [mask.narrow(dim, start, length) for start, length in local_ranges(shard, rank, world_size)]
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]


def sharded_dropout(
    x: torch.Tensor, p: float, dim: int, segments: tuple[int, ...], rank: int, world_size: int
) -> torch.Tensor:
    """``aten.dropout(full, p, train=True)`` restricted to this rank's shard ``x`` (same shape
    and dtype as ``x``): this rank's slice of one global mask (NOTE: [dropout across ranks])."""
    mask = _global_mask(x, p, dim, segments, rank, world_size)
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return x * mask * scale


def sharded_native_dropout(
    x: torch.Tensor, p: float, dim: int, segments: tuple[int, ...], rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.native_dropout(full, p, True)`` restricted to the shard ``x``: ``(output, bool mask)``."""
    mask = _global_mask(x, p, dim, segments, rank, world_size)
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return x * mask * scale, mask
