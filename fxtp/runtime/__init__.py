"""Runtime: the rank's ``ParallelModule`` (``module``), parameter and checkpoint layouts
(``layout``, ``checkpoint``) and KV-cache generation (``generation``)."""

from typing import Any

from fxtp.core.torch_globals import unbind_world_defaults

__all__ = ["ParallelModule"]

# the runtime imports torch._dynamo, and with it a torch module whose argument defaults hold the
# default process group when imported after init_process_group (NOTE: [world defaults])
unbind_world_defaults()


def __getattr__(name: str) -> Any:
    # `from fxtp.runtime import ParallelModule` worked when fxtp.runtime was one module; loaded
    # on first use so that importing a sibling (layout, checkpoint) does not load the module.
    if name == "ParallelModule":
        from fxtp.runtime.module import ParallelModule

        return ParallelModule
    raise AttributeError(f"module 'fxtp.runtime' has no attribute {name!r}")
