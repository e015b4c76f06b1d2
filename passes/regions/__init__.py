"""Regions of the rank graph outlined into submodules.

* ``checkpointing``: the regions recomputed in backward (``checkpoint_regions``,
  ``recompute_regions``, NOTE: [recomputed regions]) and the outlining both use
  (``outline_span``, ``splice``).
* ``blocks``: each repeated block of the model as a body the root graph calls at its FQN
  (``outline_blocks``, NOTE: [rank program by block]).
"""
