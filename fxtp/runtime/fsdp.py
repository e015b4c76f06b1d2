"""FSDP2 units inside a ``ParallelModule``: ``fully_shard`` on its blocks, as torchtitan applies it.

NOTE: [FSDP2 units inside a ParallelModule]
torchtitan wraps each transformer block in FSDP2's ``fully_shard``, then the root
(``torchtitan/models/llama3/infra/parallelize.py``, ``apply_fsdp``). FSDP2 gathers a unit's
parameters in the unit's forward pre-hook, reshards them after its forward
(``reshard_after_forward=True``), gathers them again in a pre-backward hook on its outputs and
reduce-scatters its gradients from an autograd hook on its inputs. A ``ParallelModule``'s blocks
are submodules whose ``forward`` runs their body of the rank graph and reads their own
parameters as attributes at call time (NOTE: [blocks of a ParallelModule] in
fxtp/runtime/blocks.py), so every one of those hooks fires on them as on the model's blocks: a
block is gathered when it runs, freed after, and gathered again in its backward; a rank holds
one block's gathered parameters at a time, as torchtitan's plan does.

A unit that is not a block (a submodule inside a block, ``model.layers.0.mlp``; or one holding
blocks and more, ``model``) is never called: the block's body or the root graph reads its
parameters. So, before the root graph runs, :func:`gathered_units` gathers those units with
FSDP2's public ``FSDPModule.unshard()``; they stay gathered through backward, and the root's
end-of-backward callback, which runs each unit's post-backward when its own hooks did not ("in
case forward inputs did not require gradient", ``_root_post_backward_final_callback`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``), reduce-scatters their gradients and
reshards them. Outside autograd (``no_grad``, ``inference_mode``) they are resharded after the
graph with ``FSDPModule.reshard()`` (:func:`resharded_without_grad`). For them the root must be
``fully_shard``-ed too (torchtitan's order): without it nobody queues that callback and the
gradients would never be reduced, so such a unit below an unwrapped root raises
``FxtpConfigError``. Those units cost what a root unit does: held gathered from the forward to
the end of backward.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from fxtp.core.errors import FxtpConfigError
from fxtp.runtime import amp, clipping
from fxtp.runtime.blocks import is_block, model_fqn

__all__ = ["forward_dtypes", "fsdp_units", "gathered_units", "resharded_without_grad"]


def fsdp_units(pm: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules of ``pm`` (``pm`` itself excluded) that FSDP2's ``fully_shard`` wrapped, by
    FQN. Runs before every graph call: a walk over ``_modules`` finds there are none (11 us for
    the 33 modules of the tiny Llama; ``named_modules`` takes 50), the names only when some are."""
    from torch.distributed.fsdp import FSDPModule

    stack = [c for c in pm._modules.values() if c is not None]
    while stack:
        m = stack.pop()
        if isinstance(m, FSDPModule):
            return [(name, m) for name, m in pm.named_modules() if m is not pm and isinstance(m, FSDPModule)]
        stack.extend(c for c in m._modules.values() if c is not None)
    return []


def gathered_units(pm: nn.Module) -> list[nn.Module]:
    """Before a call of ``pm``'s rank graph (before its parameters are read): its FSDP2 units
    gathered (NOTE: [FSDP2 units inside a ParallelModule]), and the first call under FSDP2 warns
    about torch's clipping (NOTE: [clipping under FSDP2] in fxtp/runtime/clipping.py).

    Returns:
        The units gathered, for :func:`resharded_without_grad`; ``[]`` without units.

    Raises:
        FxtpConfigError: a unit below a ``pm`` that ``fully_shard`` did not wrap.
    """
    if not pm._fsdp_warned:
        pm._fsdp_warned = clipping.warn_under_fsdp(pm)
        if pm._fsdp_warned:  # NOTE: [found-inf over dp x tp] in fxtp/runtime/amp.py
            amp.combine_found_inf_over_tp(pm)
    units = [(name, unit) for name, unit in fsdp_units(pm) if not is_block(unit)]  # blocks gather in their own hooks
    if not units:
        return []
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(pm, FSDPModule):
        name = units[0][0]
        raise FxtpConfigError(
            f"fully_shard was applied to {name!r} of this ParallelModule but not to the ParallelModule itself: "
            f"{name!r} is not a block, so its FSDP2 hooks never fire (the rank graph reads its parameters), and without a root "
            "unit nothing would reduce-scatter its gradients (NOTE: [FSDP2 units inside a ParallelModule] in "
            "fxtp/runtime/fsdp.py). fix: after the blocks, also call fully_shard(pm, mesh=mesh['dp']) on the "
            "ParallelModule, as torchtitan does; or wrap the blocks (pm.get_submodule('<block fqn>')) instead"
        )
    for _, unit in units:
        unit.unshard()  # type: ignore[operator]  # FSDPModule.unshard: all_gather, waited
    return [unit for _, unit in units]


@contextlib.contextmanager
def resharded_without_grad(units: list[nn.Module]) -> Iterator[None]:
    """Around the graph call: outside autograd, the gathered ``units`` resharded after it
    (no backward will come to reshard them)."""
    try:
        yield
    finally:
        if units and not torch.is_grad_enabled():
            for unit in units:
                unit.reshard()  # type: ignore[operator]


def forward_dtypes(pm: nn.Module) -> dict[str, torch.dtype]:
    """``{fqn: dtype}`` of ``pm``'s parameters as the rank graph will read them: a parameter of
    an FSDP2 unit whose ``MixedPrecisionPolicy`` has a ``param_dtype`` is cast to it when the
    unit gathers, which for a block happens after the root graph has started (NOTE: [low-precision
    graphs] in fxtp/runtime/variants.py picks the graph by these dtypes). Reads FSDP2's policy from
    its private state (``_get_fsdp_state()._mp_policy``: ``FSDPModule`` has no public getter), here only."""
    units = fsdp_units(pm)
    from torch.distributed.fsdp import FSDPModule

    if isinstance(pm, FSDPModule):
        units = [("", pm), *units]
    owner: dict[int, torch.dtype] = {}
    for _, unit in sorted(units, key=lambda u: u[0].count(".") if u[0] else -1):  # inner units last: they win
        state = unit._get_fsdp_state()  # type: ignore[operator]
        dtype = getattr(getattr(state, "_mp_policy", None), "param_dtype", None)
        for p in unit.parameters():
            if dtype is not None and p.is_floating_point():
                owner[id(p)] = dtype
            else:
                owner.pop(id(p), None)
    return {model_fqn(fqn): owner.get(id(p), p.dtype) for fqn, p in pm.named_parameters()}
