"""``fxtp.pipeline``: pipeline stages of fxtp tensor-parallel modules under torch's schedules.

NOTE: [pipeline x tensor parallelism]
A ``("pp", "tp")`` or ``("pp", "dp", "tp")`` ``DeviceMesh``: the model's blocks are cut into
``pp * stages_per_rank`` contiguous stages (NOTE: [pipeline stages] in split.py); each rank
compiles its stages with ``fxtp.compile`` on its ``tp`` sub-mesh, wraps them with FSDP2's
``fully_shard`` per block and per stage over ``dp`` (as torchtitan), and hands them to
``torch.distributed.pipelining.PipelineStage`` over its ``pp`` group (the ranks of the same
``dp``/``tp`` coordinate) and to torch's schedule class of that name. fxtp writes no scheduler.
A stage's output is the full hidden states on every tensor-parallel rank, so each rank sends
its copy to the same ``tp`` rank of the next stage.

* Stages to ranks: stage ``s`` on pipeline rank ``s % pp`` (torchtitan's ``"loop"`` style of
  ``stage_ids_this_rank``), for GPipe, 1F1B, Interleaved1F1B, LoopedBFS and
  InterleavedZeroBubble; ZBVZeroBubble and DualPipeV place two stages a rank in a V (``"v"``
  style: rank ``r`` holds stages ``r`` and ``2 * pp - 1 - r``, so rank 0 holds the first and the
  last), as their schedules require. The zero-bubble schedules split backward into an input and
  a weight pass; the stages are :class:`fxtp.pipelining.stage.FxtpStage` s, whose backward sees
  sharded parameters plain (NOTE: [split backward of sharded parameters] in stage.py).
* The loss: ``loss_fn(logits, target)`` runs on the last stage per micro-batch; the schedule
  scales the gradients by ``1 / n_microbatches`` (``scale_grads=True``), so a mean loss over
  equal micro-batches gives the global batch's mean.
* Tied embeddings (``lm_head.weight is model.embed_tokens.weight``) on different stages: each
  stage holds a copy, and :meth:`Pipeline.step` sums their gradients across the two stages (an
  all_reduce over the first and last stages' ranks of each ``dp``/``tp`` coordinate, or a local
  add when one rank holds both), as Megatron-LM's ``_allreduce_word_embedding_grads``; the
  copies start equal and so stay equal under any optimizer. The norm counts it once.
* Clipping (:meth:`Pipeline.clip_grad_norm_`): every stage's share of the norm
  (``fxtp.runtime.clipping.norm_share``), one all_reduce over the whole mesh.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from fxtp.core.errors import FxtpConfigError
from fxtp.pipelining.report import PipelineReport, StageRow, bubble_fraction
from fxtp.pipelining.split import StageModule, balance, blocks_of, check_divisible, in_flight, unit_costs

__all__ = ["Pipeline", "pipeline"]

# The schedules whose stages sit in a V on the pipeline ranks (``generate_stage_to_rank_mapping(..., style="v")``).
_V_STYLE = ("ZBVZeroBubble", "DualPipeV")
_TIED = ("model.embed_tokens.weight", "lm_head.weight")


class Pipeline:
    """This rank's pipeline stages and torch's schedule over them (from :func:`pipeline`).

    Attributes:
        stages: this rank's stage modules (``ParallelModule``, FSDP2-wrapped when ``dp > 1``), in
            stage order; ``stage_ids`` their stage indices.
        schedule: the ``torch.distributed.pipelining`` schedule.
        report: a :class:`PipelineReport`.
    """

    def __init__(self, stages: list[nn.Module], stage_ids: list[int], schedule: Any, report: PipelineReport,
                 tied: Optional[tuple[Optional[dist.ProcessGroup], int]], pp_group: dist.ProcessGroup) -> None:
        self.stages, self.stage_ids, self.schedule, self.report = stages, stage_ids, schedule, report
        self._pp_group = pp_group
        self._n_stages = len(report.stages)
        self._tied = tied  # (group or None for a local add, last stage id) when the tie spans stages

    def parameters(self) -> Iterator[nn.Parameter]:
        for stage in self.stages:
            yield from stage.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(FQN in the original model, local parameter)``; a tied weight appears under both
        names on the stages holding its copies."""
        for stage in self.stages:
            yield from stage.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        """This rank's stages' state dicts in one, under the model's FQNs; values carry their
        global layout (``ParallelModule.state_dict``), so ``torch.distributed.checkpoint`` saves
        them from every rank and loads them at another pp x tp (a tied weight under both names,
        on the stages holding its copies)."""
        return {k: v for stage in self.stages for k, v in stage.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load each stage's entries of ``state_dict`` (e.g. filled by ``dcp.load`` from
        :meth:`state_dict`), strictly."""
        for stage in self.stages:
            stage.load_state_dict({k: state_dict[k] for k in stage.state_dict()})

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict, original FQNs and shapes, on every rank: each stage's
        ``full_state_dict()`` (collective over tp), then gathered over pp (``all_gather_object``).
        A collective of the whole mesh."""
        mine = {k: v for stage in self.stages for k, v in stage.full_state_dict().items()}
        parts: list[Any] = [None] * dist.get_world_size(self._pp_group)
        dist.all_gather_object(parts, mine, group=self._pp_group)
        return {k: v for part in parts for k, v in part.items()}

    def step(self, x: Optional[torch.Tensor] = None, *, target: Optional[torch.Tensor] = None,
             losses: Optional[list] = None) -> Any:
        """One forward and backward of the global batch ``x`` ``(batch, seq)`` (token ids, read on
        the first stage's ranks) against ``target`` (read on the last stage's), in
        ``n_microbatches`` equal micro-batches; the per-micro-batch losses are appended to
        ``losses`` on the last stage's ranks. Gradients accumulate in the stages' parameters;
        tied embeddings' are summed across their stages. Returns the schedule's output."""
        args = (x,) if 0 in self.stage_ids else ()
        last = self._n_stages - 1 in self.stage_ids
        out = self.schedule.step(*args, target=target if last else None, losses=losses if last else None)
        self._sum_tied_grads()
        return out

    def _sum_tied_grads(self) -> None:
        if self._tied is None:
            return
        group, last = self._tied
        mine = {sid: stage for sid, stage in zip(self.stage_ids, self.stages)}
        grads = [mine[sid].get_parameter(fqn).grad for sid, fqn in ((0, _TIED[0]), (last, _TIED[1])) if sid in mine]
        locals_ = [_local(g) for g in grads if g is not None]
        if group is None:  # one rank holds both copies
            total = locals_[0] + locals_[1]
            for t in locals_:
                t.copy_(total)
        else:
            dist.all_reduce(locals_[0], group=group)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip every stage's gradients by the single device's total norm (over pp, dp and tp;
        a tied weight counted once); returns the norm, equal on every rank. A collective of the
        whole mesh."""
        from fxtp.runtime.clipping import norm_share, scale_by_norm_

        norm_type = float(norm_type)
        shares, grads = [], []
        for sid, stage in zip(self.stage_ids, self.stages):
            skip = frozenset({_TIED[1]}) if self._tied is not None and sid == self._tied[1] else frozenset()
            share, local = norm_share(stage, norm_type, skip=skip)
            shares.append(share)
            grads.extend(local)
        if norm_type == math.inf:
            total = torch.stack(shares).max()
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        else:
            total = torch.stack(shares).sum()
            dist.all_reduce(total)
        return scale_by_norm_(grads, total, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    from fxtp.runtime.sharded import local_tensor

    return t.to_local() if isinstance(t, DTensor) else local_tensor(t)


def pipeline(model: nn.Module, mesh: Any, example_inputs: tuple[torch.Tensor], *, n_microbatches: int,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], schedule: str = "1F1B",
             stages_per_rank: Optional[int] = None, **compile_options: Any) -> Pipeline:
    """Pipeline ``model`` over ``mesh``'s ``pp`` dim, each stage tensor-parallel over ``tp`` and
    FSDP2-sharded over ``dp`` (NOTE: [pipeline x tensor parallelism]).

    torchtitan's ``pipeline_llama`` (``torchtitan/distributed/pipeline_parallel.py``) does the
    same in three steps: ``pipeline_module_split`` (a deep copy of the model per stage with other
    stages' layers deleted), ``parallelize_llama`` on each stage (TP, FSDP2), and
    ``build_pipeline_schedule``; here the cut is balanced by predicted FLOPs and bytes instead
    of counted, a stage shares the model's modules (no copy) and fxtp's capture replaces
    ``parallelize_module``'s hand-written plan.

    Args:
        model: a Hugging Face causal LM (``model.model.layers``); never mutated.
        mesh: a ``DeviceMesh`` over every rank with dims ``("pp", "tp")`` or ``("pp", "dp", "tp")``
            (any order; ``tp`` and ``dp`` optional).
        example_inputs: ``(ids,)``, the global batch's token ids ``(batch, seq)``, int64; its
            first ``batch / n_microbatches`` rows are the stages' example micro-batch.
        n_microbatches: micro-batches a step, dividing ``batch``.
        loss_fn: ``loss_fn(logits (b, s, vocab), target)`` -> a 0-dim tensor, a mean over the
            micro-batch; run on the last stage.
        schedule: a name of ``torch.distributed.pipelining.schedules.get_schedule_class``
            (``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``, ``"LoopedBFS"``, and the zero-bubble
            ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``, ``"DualPipeV"``; the last two need 2
            stages a rank and, DualPipeV, at least as many micro-batches as stages).
        stages_per_rank: 1 for single-stage schedules, default 2 for the others.
        **compile_options: passed to ``fxtp.compile`` for every stage (``dynamic``, ``plan``, ...).

    Returns:
        This rank's :class:`Pipeline`.

    Raises:
        FxtpConfigError: a mesh without ``pp`` or not over every rank, a model that is not a
            decoder LM, a batch that does not split into ``n_microbatches``, more stages than
            units, ``stages_per_rank`` the schedule cannot run, or tied
            embeddings sharded differently on their two stages.
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    from fxtp.pipelining.stage import FxtpStage

    import fxtp

    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names or mesh.size() != dist.get_world_size():
        raise FxtpConfigError(
            f"fxtp.pipeline: the mesh {names} of {mesh.size()} ranks needs a 'pp' dim and must span every rank "
            f"({dist.get_world_size()}); fix: init_device_mesh(device, (pp, tp), mesh_dim_names=('pp', 'tp'))"
        )
    size = {n: mesh[n].size() if n in names else 1 for n in ("pp", "dp", "tp")}
    pp, dp, tp = size["pp"], size["dp"], size["tp"]
    cls = get_schedule_class(schedule)
    name = cls.__name__.removeprefix("Schedule")
    single = issubclass(cls, PipelineScheduleSingle)
    per_rank = stages_per_rank or (1 if single else 2)
    if single and per_rank != 1 or per_rank < 1 or name in _V_STYLE and per_rank != 2:
        raise FxtpConfigError(
            f"fxtp.pipeline: {cls.__name__} cannot run {per_rank} stages a rank; fix: stages_per_rank="
            f"{1 if single else 2}"
        )
    ranks = _stage_ranks(pp, per_rank, v_style=name in _V_STYLE)
    n_stages = len(ranks)
    (ids,) = example_inputs
    batch, seq = ids.shape[:2]
    check_divisible(batch, n_microbatches)
    micro = batch // n_microbatches
    blocks_of(model)
    cut = balance(*unit_costs(model, micro_batch=micro, seq=seq, tp=tp), in_flight(schedule, pp, ranks, n_microbatches))
    pp_rank = mesh["pp"].get_local_rank()
    mine = [s for s in range(n_stages) if ranks[s] == pp_rank]
    weight = model.model.embed_tokens.weight
    hidden = weight.shape[-1]
    stages, pipe_stages = [], []
    for s in mine:
        example = ids[:micro] if s == 0 else torch.zeros(micro, seq, hidden, dtype=weight.dtype, device=weight.device)
        stage = StageModule(model, cut.blocks[s], first=s == 0, last=s == n_stages - 1)
        pm = fxtp.compile(stage, tp, (example,), group=mesh["tp"] if "tp" in names else None, **compile_options)
        if dp > 1:
            _fully_shard(pm, cut.blocks[s], mesh["dp"])
        stages.append(pm)
        pipe_stages.append(FxtpStage(pm, s, n_stages, weight.device, group=mesh["pp"].get_group()))
    sched = cls(pipe_stages[0] if single else pipe_stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    tied = _tie(model, mesh, ranks, stages, mine)
    bubble, source = bubble_fraction(name, pp, n_microbatches, per_rank)
    crossing = sum(ranks[s] != ranks[s + 1] for s in range(n_stages - 1))
    act_bytes = micro * seq * hidden * weight.element_size()
    rows = tuple(StageRow(stage=s, pp_rank=ranks[s], blocks=tuple(cut.blocks[s]), embedding=s == 0, head=s == n_stages - 1,
                          time_share=cut.time[s], memory_share=cut.memory[s]) for s in range(n_stages))
    report = PipelineReport(stages=rows, schedule=cls.__name__, pp=pp, tp=tp, dp=dp, stages_per_rank=per_rank,
                            n_microbatches=n_microbatches, bubble=bubble, bubble_source=source,
                            sent_bytes_per_step=2 * crossing * n_microbatches * act_bytes, micro_batch_bytes=act_bytes)
    return Pipeline(stages, mine, sched, report, tied, mesh["pp"].get_group())


def _stage_ranks(pp: int, per_rank: int, *, v_style: bool) -> list[int]:
    """The pipeline rank of each stage: ``s % pp`` (loop), or back and forth in a V for the V
    schedules (torch's ``generate_stage_to_rank_mapping`` styles ``"loop"`` and ``"v"``)."""
    return [s % pp if not v_style or (s // pp) % 2 == 0 else pp - 1 - s % pp for s in range(pp * per_rank)]


def _fully_shard(pm: nn.Module, blocks: range, dp_mesh: Any) -> None:
    """FSDP2 per block, then the stage (torchtitan's ``apply_fsdp``; NOTE: [FSDP2 units inside a
    ParallelModule] in fxtp/runtime/fsdp.py)."""
    from torch.distributed.fsdp import fully_shard

    for i in blocks:
        fully_shard(pm.get_submodule(f"model.layers.{i}"), mesh=dp_mesh)
    fully_shard(pm, mesh=dp_mesh)


def _tie(model: nn.Module, mesh: Any, ranks: list[int], stages: list[nn.Module],
         mine: list[int]) -> Optional[tuple[Optional[dist.ProcessGroup], int]]:
    """The tied embedding's reduction (NOTE: [pipeline x tensor parallelism]): ``None`` when the
    weights are not tied or one stage holds both; else ``(group, last stage)``, ``group`` None
    where one rank holds both stages. Every rank creates every pair group (``new_group`` is
    collective).

    Raises:
        FxtpConfigError: the two copies are sharded differently over tp (their local gradients
            do not correspond).
    """
    last = len(ranks) - 1
    if model.lm_head.weight is not model.model.embed_tokens.weight or last == 0:
        return None
    by_id = dict(zip(mine, stages))
    held = [str(by_id[sid].placements.get(fqn)) for sid, fqn in ((0, _TIED[0]), (last, _TIED[1])) if sid in by_id]
    if ranks[0] == ranks[last]:
        _same_layout(held)
        return None if 0 not in by_id else (None, last)
    pp_dim = mesh.mesh_dim_names.index("pp")
    grid = mesh.mesh.movedim(pp_dim, 0).reshape(mesh.mesh.shape[pp_dim], -1)
    group = None
    for col in range(grid.shape[1]):
        pair = [int(grid[ranks[0], col]), int(grid[ranks[last], col])]
        made = dist.new_group(pair)
        if dist.get_rank() in pair:
            group = made
    if held:  # this rank holds one copy: compare its layout with the other's
        seen: list[Any] = [None, None]
        dist.all_gather_object(seen, held[0], group=group)
        held = seen
    _same_layout(held)
    return (group, last) if (0 in by_id or last in by_id) else None


def _same_layout(held: list[str]) -> None:
    """Raise unless the tied weight's two copies (their placements, as text) are sharded alike."""
    if len(held) == 2 and held[0] != held[1]:
        raise FxtpConfigError(
            f"fxtp.pipeline: the tied {_TIED[0]} ({held[0]}) and {_TIED[1]} ({held[1]}) are sharded differently "
            "over tp, so their gradients cannot be summed shard by shard; fix: plan={'lm_head': ...} or "
            "plan={'model.embed_tokens': ...} to match, or untie them"
        )
