"""Layers: the matmul-like nodes the planner gives a style, and what the planner decides about
them that is not an op rule. Each module reads and updates the planner's ``PlannerState``
(``passes/propagate.py``); none edits a graph.

* ``policies``: the layers' names (``plan=`` keys), the planning policies (small and
  renormalized tables, the user's ``plan=``, output heads) and the report row each layer
  becomes (``layer_decision``).
* ``columns``: tables sharded by columns where their consumers take the output sharded
  (``try_columns``, NOTE: [column-sharded embedding]).
* ``layouts``: which segments and split unit a layer's output takes when a rule refuses its
  shard (``refine_layout``, ``refine_uneven``, ``next_segments``).
* ``blocks``: a step for a layer of a repeated block is taken for the same layer of the
  identical blocks after it (``RepeatedBlocks``, ``mirror_blocks``, NOTE: [repeated blocks
  decided alike]).
"""

from passes.layers.blocks import RepeatedBlocks, mirror_blocks, snapshot
from passes.layers.columns import ColumnTrial, try_columns
from passes.layers.layouts import MAX_SEGMENTS, layer_segments, next_segments, refine_layout, refine_uneven
from passes.layers.policies import (
    VOCAB_ROWS_PER_COLUMN,
    apply_overrides,
    check_forced,
    is_output_head,
    keep_renormed_tables,
    keep_small_embeddings,
    layer_decision,
    layer_names,
    rowwise_feeds,
    weight_numel,
    weight_of,
    weight_placeholder,
)

__all__ = [
    "ColumnTrial",
    "MAX_SEGMENTS",
    "RepeatedBlocks",
    "VOCAB_ROWS_PER_COLUMN",
    "apply_overrides",
    "check_forced",
    "is_output_head",
    "keep_renormed_tables",
    "keep_small_embeddings",
    "layer_decision",
    "layer_names",
    "layer_segments",
    "mirror_blocks",
    "next_segments",
    "refine_layout",
    "refine_uneven",
    "rowwise_feeds",
    "snapshot",
    "try_columns",
    "weight_numel",
    "weight_of",
    "weight_placeholder",
]
