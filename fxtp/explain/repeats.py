"""Repeated blocks shown once in the report's layer table (``fxtp inspect`` without
``--all-layers``): a 32-block model's table is one block's rows and a count, not 32 copies.

A row belongs to the block its layer name's first numeric component closes (``model.layers.3``
for ``model.layers.3.mlp.up_proj``). Consecutive blocks of one list whose rows are equal once
each names its own block as ``#`` (the layer names, and the block's names inside the
communication and reason cells) are a run; a run of two or more keeps its first block's rows
and ends with one line, ``x32 identical blocks: model.layers.0-31``.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

__all__ = ["collapse_blocks", "block_of"]

_BLOCK = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def block_of(name: str) -> Optional[tuple[str, int]]:
    """``(list FQN, index)`` of the repeated block holding layer ``name``, or None."""
    match = _BLOCK.match(name)
    return (match.group(1), int(match.group(2))) if match else None


def _generic(row: Sequence[str], block: tuple[str, int]) -> tuple[str, ...]:
    """``row`` with its own block's name written ``prefix.#``, to compare with another block's."""
    own = re.compile(re.escape(block[0]) + r"\." + str(block[1]) + r"(?=\.|\b|$)")
    return tuple(own.sub(block[0] + ".#", str(cell)) for cell in row)


def collapse_blocks(rows: Sequence[Sequence[str]], names: Sequence[str]) -> list[tuple[Optional[str], Sequence[str]]]:
    """The table's rows with each run of identical consecutive blocks kept once.

    Args:
        rows: the layer table's rows, in order.
        names: each row's layer name (``rows[i]``'s), e.g. ``model.layers.0.mlp.up_proj``.

    Returns:
        ``(None, row)`` for a row shown, and ``(line, ())`` after a run's first block, where
        ``line`` is ``x{count} identical blocks: {list}.{first}-{last}``.
    """
    groups: list[tuple[Optional[tuple[str, int]], list[Sequence[str]]]] = []
    for row, name in zip(rows, names):
        block = block_of(name)
        if groups and block is not None and groups[-1][0] == block:
            groups[-1][1].append(row)
        else:
            groups.append((block, [row]))
    out: list[tuple[Optional[str], Sequence[str]]] = []
    i = 0
    while i < len(groups):
        block, first = groups[i]
        j = i + 1
        if block is not None:
            shape = [_generic(r, block) for r in first]
            while j < len(groups):
                other, other_rows = groups[j]
                if other is None or other[0] != block[0] or other[1] != block[1] + (j - i):
                    break
                if [_generic(r, other) for r in other_rows] != shape:
                    break
                j += 1
        out += [(None, row) for row in first]
        if j - i > 1:
            out.append((f"x{j - i} identical blocks: {block[0]}.{block[1]}-{block[1] + j - i - 1}", ()))
        i = j
    return out
