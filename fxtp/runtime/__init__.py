"""Runtime: the rank's ``ParallelModule`` (``module``), parameter and checkpoint layouts
(``layout``, ``checkpoint``) and KV-cache generation (``generation``)."""
