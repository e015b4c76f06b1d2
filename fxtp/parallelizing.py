"""``fxtp.parallelize``: one call applies a whole plan on a ``dp x tp`` mesh, as torchtitan's
``parallelize_llama`` does (``torchtitan/models/llama3/infra/parallelize.py``).

The steps, each a short function below, in torchtitan's order:

1. tensor parallelism on ``mesh["tp"]``, with the plan's sequence parallelism and activation
   checkpointing: ``fxtp.compile(model, tp, ..., strategy=plan, group=mesh["tp"])``;
2. ``torch.compile`` per block, in place (``block.compile(fullgraph=True)``: torchtitan's
   ``apply_compile``; the FQNs, and so the checkpoints, stay the model's), when asked;
3. FSDP2 on ``mesh["dp"]``: ``fully_shard`` on each block, then on the root (torchtitan's
   ``apply_fsdp``; NOTE: [FSDP2 units inside a ParallelModule] in fxtp/runtime/fsdp.py), skipped
   when dp is 1.

The result is the ``ParallelModule`` that those calls by hand make; nothing here is needed to
train it, so a user who calls ``fully_shard`` themselves gets the same module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

from torch import nn

from fxtp.api import compile as _tp_compile
from fxtp.core.errors import FxtpConfigError
from fxtp.runtime.blocks import is_block
from fxtp.runtime.module import ParallelModule

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["parallelize", "block_names"]

_DIMS = ("dp", "tp")
_MESH_FIX = "fix: init_device_mesh(device_type, (dp, tp), mesh_dim_names=('dp', 'tp'))"
_OWN = ("world_size", "group", "rank")  # compile's options that parallelize takes from the mesh


def parallelize(
    model: nn.Module,
    mesh: "DeviceMesh",
    example_inputs: Optional[tuple[Any, ...]] = None,
    *,
    strategy: Any = None,
    example_kwargs: Optional[dict[str, Any]] = None,
    mp_policy: Any = None,
    reshard_after_forward: bool = True,
    compile_blocks: Union[bool, Mapping[str, Any]] = False,
    **compile_options: Any,
) -> ParallelModule:
    """This rank's ``ParallelModule`` of ``model`` on ``mesh``: tensor parallelism over
    ``mesh["tp"]``, FSDP2 units per block and on the root over ``mesh["dp"]``, the activation
    checkpointing, and ``torch.compile`` per block if asked.

    The plan's ``micro_batch`` and ``accumulation_steps`` are for your training loop: each dp
    rank takes its ``1/dp`` of the global batch (``mesh["dp"].get_local_rank()``) and runs
    ``plan.accumulation_steps`` forward/backward passes on micro-batches of ``plan.micro_batch``
    sequences per optimizer step, dividing each loss by ``accumulation_steps`` (FSDP2 averages
    the gradients over dp); docs/plan_command.md shows the loop.

    Args:
        model: any ``nn.Module``; never mutated (``fxtp.compile`` copies its parameters).
        mesh: a ``DeviceMesh`` whose dims are named ``"dp"`` and ``"tp"``
            (``init_device_mesh(device_type, (plan.dp, plan.tp), mesh_dim_names=("dp", "tp"))``),
            or a 1-D mesh named ``("tp",)`` (no FSDP2) or ``("dp",)`` (tp 1, FSDP2 only).
        example_inputs: positional inputs of one dp rank's micro-batch, for the capture
            (``fxtp.compile``'s), e.g. ``(ids,)`` of shape ``(plan.micro_batch, seq)``.
        strategy: a ``fxtp.ParallelPlan`` (``fxtp.plan``) or its ``tensor_parallel``: its tp and
            dp must be the mesh's; its sequence parallelism, activation checkpointing and layer
            styles are applied (``fxtp.compile``'s ``strategy=``). ``None``: ``fxtp.compile``'s
            own choices and ``compile_options``.
        example_kwargs: keyword inputs, likewise.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` for every unit, e.g.
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
            (what ``fxtp.plan`` prices; not with ``dynamic=False``); ``None``: the parameters'
            dtypes. At dp 1 there is no unit, and no policy applies.
        reshard_after_forward: FSDP2's option for every unit: ``True`` (default) frees a unit's
            gathered parameters after its forward and gathers them again in its backward.
        compile_blocks: ``True``: ``block.compile(fullgraph=True)`` on each block before FSDP2;
            a mapping: more of ``torch.compile``'s keywords (``{"backend": "aot_eager"}``).
        **compile_options: the rest of ``fxtp.compile``'s keywords (``dynamic``, ``capture``,
            ``plan``, ``sequence_parallel``, ``activation_checkpointing``, ...), not
            ``world_size``, ``group`` or ``rank`` (the mesh's).

    Returns:
        A :class:`ParallelModule` whose blocks (:func:`block_names`; none in a model without an
        ``nn.ModuleList`` of blocks) and itself are FSDP2 units
        (``torch.distributed.fsdp.FSDPModule``) when dp > 1. Outputs are each dp rank's
        micro-batch's, full on every tp rank; ``pm.parameters()`` are this rank's shards.

    Raises:
        FxtpConfigError: a mesh without dims named ``"dp"``/``"tp"``, a mesh whose sizes are not
            the strategy's ``dp x tp``, a pipelined plan (``plan.pp > 1``: ``fxtp.pipeline`` runs it), ``world_size``/``group``/``rank`` given, a bad
            ``compile_blocks`` or one for a model without blocks, an ``mp_policy`` with a
            ``param_dtype`` and ``dynamic=False``; and what ``fxtp.compile`` raises.

    Example::

        plan = fxtp.plan(model, 4, device_memory=80 * 2**30, batch=8, seq=4096)
        mesh = init_device_mesh("cuda", (plan.dp, plan.tp), mesh_dim_names=("dp", "tp"))
        pm = fxtp.parallelize(model, mesh, (ids,), strategy=plan)
    """
    dp_mesh, tp_mesh = _sub_meshes(mesh, strategy)
    given = [name for name in _OWN if name in compile_options]
    if given:
        drop = ", ".join(f"{name}=" for name in given)
        raise FxtpConfigError(f"parallelize takes {', '.join(given)} from the mesh; fix: drop {drop}")
    if getattr(mp_policy, "param_dtype", None) is not None and compile_options.get("dynamic") is False:
        raise FxtpConfigError("mp_policy casts the parameters to its param_dtype, and a static compile (dynamic=False) keeps "
                              "its one graph, in the parameters' dtype (NOTE: [low-precision graphs] in "
                              "fxtp/runtime/variants.py); fix: drop dynamic=False")
    torch_compile = _compile_blocks_options(compile_blocks)
    tp = 1 if tp_mesh is None else tp_mesh.size()
    pm = _tp_compile(model, tp, example_inputs, example_kwargs=example_kwargs, group=tp_mesh, strategy=strategy,
                     **compile_options)
    if torch_compile is not None:
        _apply_compile(pm, torch_compile)
    if dp_mesh is not None and dp_mesh.size() > 1:
        _apply_fsdp(pm, dp_mesh, mp_policy, reshard_after_forward)
    return pm


def block_names(pm: nn.Module) -> list[str]:
    """The FQNs of ``pm``'s blocks, in order (NOTE: [blocks of a ParallelModule] in
    fxtp/runtime/blocks.py): the model's repeated blocks, ``["model.layers.0", ...]``."""
    return [fqn for fqn, module in pm.named_modules() if is_block(module)]


def _sub_meshes(mesh: Any, strategy: Any) -> tuple[Optional["DeviceMesh"], Optional["DeviceMesh"]]:
    """``(mesh["dp"] or None, mesh["tp"] or None)``, checked against ``strategy``'s ``dp x tp``."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise FxtpConfigError(f"mesh must be a torch DeviceMesh with dims named 'dp' and 'tp', got {type(mesh).__name__}; "
                              f"{_MESH_FIX}")
    names = tuple(mesh.mesh_dim_names or ())
    if len(names) != mesh.ndim or not set(names) <= set(_DIMS) or len(set(names)) != len(names):
        raise FxtpConfigError(f"mesh dims must be named 'dp' and/or 'tp', got {names or 'no names'} for a {mesh.ndim}-D "
                              f"mesh; {_MESH_FIX}")
    dp_mesh, tp_mesh = (mesh[name] if name in names else None for name in _DIMS)
    dp, tp = (1 if m is None else m.size() for m in (dp_mesh, tp_mesh))
    if getattr(strategy, "pp", 1) > 1:
        raise FxtpConfigError(f"the plan is pipelined (pp {strategy.pp} x tp {strategy.tp} x dp {strategy.dp}, {strategy.schedule}); "
                              "parallelize applies dp x tp only. fix: fxtp.pipeline(model, mesh, (ids,), "
                              "n_microbatches=plan.n_microbatches, schedule=plan.schedule, ...) on a ('pp', 'dp', 'tp') mesh "
                              "(docs/pipeline.md), or fxtp.plan(..., pp=1)")
    want_tp, want_dp = getattr(strategy, "tp", None), getattr(strategy, "dp", None)
    if (want_tp is not None and want_tp != tp) or (want_dp is not None and want_dp != dp):
        plan = f"dp {want_dp} x tp {want_tp}" if want_dp is not None else f"tp {want_tp}"
        raise FxtpConfigError(f"the mesh is dp {dp} x tp {tp} but the plan is {plan}; "
                              "fix: init_device_mesh(device_type, (plan.dp, plan.tp), mesh_dim_names=('dp', 'tp'))")
    return dp_mesh, tp_mesh


def _compile_blocks_options(compile_blocks: Any) -> Optional[dict[str, Any]]:
    """``torch.compile``'s keywords for each block, or ``None`` for no compile."""
    if compile_blocks is False:
        return None
    if compile_blocks is True:
        return {"fullgraph": True}
    if isinstance(compile_blocks, Mapping):
        return {"fullgraph": True, **compile_blocks}
    raise FxtpConfigError(f"compile_blocks must be True, False or a dict of torch.compile's keywords, got {compile_blocks!r}; "
                          "fix: compile_blocks={'backend': 'inductor'}")


def _apply_compile(pm: nn.Module, options: dict[str, Any]) -> None:
    """torchtitan's ``apply_compile``, in place: each block's calls go through ``torch.compile``
    and the block stays at its FQN (``nn.Module.compile``), an FSDP2 unit as any block."""
    blocks = block_names(pm)
    if not blocks:
        raise FxtpConfigError("compile_blocks: this model has no repeated blocks (no nn.ModuleList of blocks) to compile "
                              "one by one; fix: drop compile_blocks and call torch.compile(pm)")
    for fqn in blocks:
        pm.get_submodule(fqn).compile(**options)


def _apply_fsdp(pm: nn.Module, dp_mesh: "DeviceMesh", mp_policy: Any, reshard_after_forward: bool) -> None:
    """torchtitan's ``apply_fsdp``: ``fully_shard`` on each block, then on ``pm`` (which then
    holds the embedding, the final norm and the head: gathered for the root graph)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for fqn in block_names(pm):
        fully_shard(pm.get_submodule(fqn), **options)
    fully_shard(pm, **options)
