"""Placements of a tensor across the ranks of a tensor-parallel group.

The vocabulary is DTensor's (``torch.distributed.tensor``): :class:`Replicate`, :class:`Shard`
and :class:`Partial`. fxtp's :class:`Shard` adds *segments*, which DTensor's does not have.

NOTE: [segments]
A sharded dim of global size ``N`` is a concatenation of segments ``(s_0, ..., s_{k-1})`` with
``sum(s_i) == N``; every segment is split into ``world_size`` contiguous blocks and rank ``r``
holds block ``r`` of every segment, concatenated in order. With one segment this is DTensor's
``Shard(dim)``. Several segments describe a fused projection: ``nn.MultiheadAttention``'s
``in_proj_weight`` (192 rows = Q|K|V) sharded with segments ``(64, 64, 64)`` gives rank ``r``
the rows ``[Q_r | K_r | V_r]``, so a later ``chunk(3)`` or ``unflatten(-1, (3, 64))`` stays
local. Merging a sharded inner dim into an outer one (``(N, E) -> (N*H, hd)``) also produces
equal segments, one per outer index.

NOTE: [uneven shards]
A segment need not divide the world size. Its ``s // unit`` units (``unit`` is 1 for features
and vocabulary rows, ``head_dim`` for attention heads, so a head is never cut) are split
front-loaded, as Megatron-LM's and vLLM's uneven partitions are: rank ``r`` gets
``units // world_size`` units, plus one if ``r < units % world_size``. Linear(5, 5) at world_size
4 holds rows 0:2, 2:3, 3:4, 4:5; 6 heads of 16 at world_size 4 hold 2/2/1/1 heads. Rank 0 holds
the most. An even shard (every segment's units divide the world size) is the equal split above,
whatever its unit. The local size of an uneven shard depends on the rank, so rules write a
``passes.registry.LocalSize`` where an even shard gets a number, and the rewrite fills it in.

NOTE: [grouped shards]
Grouped-query attention reads kv head ``j`` from query heads ``[j * g, (j + 1) * g)`` (``g =
Hq // Hkv``). With the query heads split front-loaded in whole heads, rank ``r``'s heads
``[q0, q0 + n)`` read kv heads ``[q0 // g, ceil((q0 + n) / g))`` only (:func:`kv_unit_range`):
vLLM's kv-head replication when kv heads are fewer than ranks, and the mixed case where a rank's
query heads span two kv groups. A segment with a group ``g > 1`` (``Shard.groups``) holds such
kv units: rank ``r`` holds the units its block of the ``units * g`` query units reads. At 28
query heads, 4 kv heads (``g = 7``) and world_size 8, ranks hold the query heads 4/4/4/4/3/3/3/3
and the kv heads ``[0]``, ``[0, 1]``, ``[1]``, ``[1, 2]``, ``[2]``, ``[2, 3]``, ``[3]``, ``[3]``.
The ranges overlap: a unit lives on every rank that reads it, with the same value. Its first
holder (the rank of query unit ``j * g``) *owns* it (:func:`owned_ranges`): whole-tensor
reductions and gathers count owned units only. In backward each holder has the part of the
gradient its own query heads give, so the gradient of a grouped parameter is summed over the
holders (``fxtp.core.collectives.copy_to_holders``). A grouped shard is never ``divisible``:
only rules that know overlapping units see one (``passes.registry.overlap_ok``).

A fused projection mixes both kinds of segment: Phi-3-medium's ``qkv_proj`` (40 query heads and 10
kv heads of 128) at world_size 8 is ``Shard(d, (5120, 1280, 1280), 128, (1, 4, 4))``, rank ``r``
holding ``[Q_r | K_r | V_r]`` with 5 query heads and the 2 kv heads of K and of V they read;
Falcon-7B's multi-query ``query_key_value`` (71 query heads, one kv head of 64) is
``Shard(d, (4544, 64, 64), 64, (1, 71, 71))``: query heads 9/9/9/9/9/9/9/8 and the kv head on
every rank. The query segment's front-loaded heads are the ones the groups count, so the two
agree rank by rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = ["Replicate", "Shard", "Partial", "Placement", "shard_tensor", "local_ranges", "is_sharded", "REPLICATE",
           "kv_unit_range", "owned_ranges", "owned_part", "holder_layout"]


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the full tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a summand; the full tensor is the sum over ranks (``all_reduce``)."""

    def __str__(self) -> str:
        return "P(sum)"


@dataclass(frozen=True)
class Shard:
    """Rank ``r`` holds block ``r`` of every segment of ``dim`` (see NOTE: [segments]).

    Args:
        dim: the sharded dim, non-negative.
        segments: global sizes of the segments along ``dim``.
        unit: the split granularity (NOTE: [uneven shards]): every segment is split in whole
            units of this size (1: elements; a head_dim: whole heads).
        groups: empty, or one per segment: a segment's group ``g > 1`` holds kv units read by
            query units in groups of ``g`` (NOTE: [grouped shards]); 1 is a plain segment.
    """

    dim: int
    segments: tuple[int, ...]
    unit: int = 1
    groups: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert self.dim >= 0 and len(self.segments) >= 1 and self.unit >= 1, self
        assert all(s % self.unit == 0 for s in self.segments), self
        assert not self.groups or len(self.groups) == len(self.segments) and min(self.groups) >= 1, self
        if self.groups and max(self.groups) == 1:
            object.__setattr__(self, "groups", ())  # one spelling of a plain shard

    @property
    def overlaps(self) -> bool:
        """Some units are held by several ranks (NOTE: [grouped shards])."""
        return bool(self.groups)

    @property
    def size(self) -> int:
        """Global size of the sharded dim."""
        return sum(self.segments)

    def local_size(self, world_size: int, rank: Optional[int] = None) -> int:
        """Size of the sharded dim on rank ``rank``; an uneven shard (NOTE: [uneven shards])
        needs the rank, an even one has the same size everywhere."""
        if rank is None:
            assert self.divisible(world_size), f"{self} is uneven at world_size {world_size}: its local size needs the rank"
            rank = 0
        return sum(length for _, length in local_ranges(self, rank, world_size))

    def divisible(self, world_size: int) -> bool:
        """Every rank holds the same size (every segment's units divide the world size)."""
        return not self.overlaps and all((s // self.unit) % world_size == 0 for s in self.segments)

    def with_dim(self, dim: int) -> "Shard":
        return Shard(dim, self.segments, self.unit, self.groups)

    def __str__(self) -> str:
        unit = f", unit={self.unit}" if self.unit != 1 else ""
        groups = f", groups={list(self.groups)}" if self.groups else ""
        if len(self.segments) == 1:
            return f"S({self.dim}{unit}{groups})"
        return f"S({self.dim}, segments={list(self.segments)}{unit}{groups})"


Placement = Union[Replicate, Shard, Partial]
REPLICATE = Replicate()


def is_sharded(placement: object) -> bool:
    """A ``Shard``, or a tuple of placements (a multi-output node) holding one."""
    if isinstance(placement, tuple):
        return any(isinstance(p, Shard) for p in placement)
    return isinstance(placement, Shard)


def _front_loaded(units: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(first, count)`` of rank ``rank``'s block of ``units`` (NOTE: [uneven shards])."""
    base, extra = divmod(units, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def kv_unit_range(q_start: int, q_count: int, group: int) -> tuple[int, int]:
    """``(start, length)`` of the kv units that query units ``[q_start, q_start + q_count)``
    read, ``group`` query units per kv unit (NOTE: [grouped shards]): at 28 query heads, 4 kv
    heads, world_size 8, rank 1's heads 4..7 give ``(0, 2)``; no query units, no kv units."""
    if q_count == 0:
        return q_start // group, 0
    start = q_start // group
    return start, (q_start + q_count - 1) // group + 1 - start


def _ranges(shard: Shard, rank: int, world_size: int, owned: bool) -> list[tuple[int, int]]:
    ranges = []
    offset = 0
    for i, seg in enumerate(shard.segments):
        group = shard.groups[i] if shard.groups else 1
        q_first, q_count = _front_loaded(seg // shard.unit * group, rank, world_size)
        if group == 1:
            first, count = q_first, q_count
        elif owned:  # the kv units whose first reader, query unit j * g, is on this rank
            first = -(-q_first // group)
            count = max(0, (q_first + q_count - 1) // group + 1 - first) if q_count else 0
        else:
            first, count = kv_unit_range(q_first, q_count, group)
        ranges.append((offset + first * shard.unit, count * shard.unit))
        offset += seg
    return ranges


def local_ranges(shard: Shard, rank: int, world_size: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every global range rank ``rank`` holds along ``shard.dim``, in order
    (one per segment; front-loaded when uneven, NOTE: [uneven shards]; the kv units its query
    units read for a grouped segment, NOTE: [grouped shards])."""
    return _ranges(shard, rank, world_size, owned=False)


def owned_ranges(shard: Shard, rank: int, world_size: int) -> list[tuple[int, int]]:
    """The part of each of :func:`local_ranges` that rank ``rank`` owns: all of it for a plain
    segment; for a grouped one the units this rank is the first holder of (NOTE: [grouped
    shards]). Over the ranks they tile the dim exactly once. Starts are global."""
    return _ranges(shard, rank, world_size, owned=True)


def holder_layout(shard: Shard, rank: int, world_size: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """The rows of a grouped parameter whose gradient its holders sum (NOTE: [grouped shards]):
    per local range of rank ``rank`` ``(start, length)``, ``start`` counted among the grouped
    segments' rows only (``-1`` for a plain segment's range: its rows have one holder), and the
    grouped segments' total size. At Falcon-7B's ``(4544, 64, 64)`` with groups ``(1, 71, 71)``
    rank 0 gets ``((-1, 576), (0, 64), (64, 64)), 128``."""
    groups = shard.groups or (1,) * len(shard.segments)
    ranges, offset, compact = [], 0, 0
    for (start, length), seg, g in zip(local_ranges(shard, rank, world_size), shard.segments, groups):
        ranges.append((compact + start - offset, length) if g > 1 else (-1, length))
        compact += seg if g > 1 else 0
        offset += seg
    return tuple(ranges), compact


def shard_tensor(full: torch.Tensor, placement: Placement, rank: int, world_size: int) -> torch.Tensor:
    """This rank's local piece of ``full`` (a new tensor; ``full`` is never modified).

    Raises:
        ValueError: ``full`` does not have the placement's global size along the sharded dim.
    """
    if not isinstance(placement, Shard):
        return full.detach().clone()
    if full.shape[placement.dim] != placement.size:
        raise ValueError(f"tensor of shape {tuple(full.shape)} does not match {placement}")
    pieces = [full.detach().narrow(placement.dim, start, length) for start, length in local_ranges(placement, rank, world_size)]
    return torch.cat(pieces, dim=placement.dim).clone() if len(pieces) > 1 else pieces[0].clone()


def owned_part(local: torch.Tensor, shard: Shard, rank: int, world_size: int) -> torch.Tensor:
    """The rows of rank ``rank``'s ``local`` tensor (its :func:`local_ranges` along ``shard.dim``,
    concatenated) that it owns (:func:`owned_ranges`): ``local`` itself unless ``shard`` is
    grouped; over the ranks these tile the whole tensor once (NOTE: [grouped shards])."""
    if not shard.overlaps:
        return local
    pieces, pos = [], 0
    for (start, length), (first, count) in zip(local_ranges(shard, rank, world_size), owned_ranges(shard, rank, world_size)):
        pieces.append(local.narrow(shard.dim, pos + first - start, count))
        pos += length
    return torch.cat(pieces, shard.dim) if len(pieces) > 1 else pieces[0]
