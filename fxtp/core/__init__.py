"""The core the passes build on: placements, errors, and what rank graphs call.

``placement`` (Replicate / Shard / Partial and uneven shards), ``errors`` (the ``FxtpError``
hierarchy), ``local_ops``, ``norms``, ``losses`` and ``collectives`` (the ops the rewrite emits
into rank graphs: distributed norms, the vocab-parallel cross entropy, Megatron-LM's f/g
backward), ``rng`` (random ops on shards), ``activations`` (saved-tensor
hooks that keep regathered activations as shards), ``torch_globals`` (what fxtp adjusts of torch's
module-level state: its ``_foreach_`` paths' type lists, argument defaults holding the default
process group). Nothing here imports the passes, the
runtime or the API.
"""
