"""``ParallelModule``: the per-rank module ``fxtp.compile`` returns.

It owns this rank's parameters (local shards of sharded ones, copies of replicated ones) under
the original model's FQNs, and runs the rewritten graph with them. Inputs and outputs keep the
original model's structure (``torch.export``'s pytree specs).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import GraphModule
from torch.fx.immutable_collections import immutable_dict, immutable_list

from fxtp.core import activations, collectives, rng
from fxtp.runtime import checkpoint, clipping, fsdp, generation, layout, sharded
from fxtp.runtime.blocks import Template, bind_blocks, new_module
from fxtp.runtime.variants import ModeGraph, SizeGraphs, held, static_refusal
from fxtp.capture.frontends import written_state
from fxtp.core.errors import FxtpInputError, FxtpRuntimeError, raised_by_an_op
from fxtp.core.placement import REPLICATE, Placement, Shard, shard_tensor
from fxtp.explain.report import Report, parameter_placements
from fxtp.capture.shapes import check_inputs
from passes.plan import ShardingPlan

__all__ = ["ParallelModule", "ModeGraph"]


def _describe(spec: pytree.TreeSpec) -> str:
    """``2 positional input(s) and keywords ['scale']`` for an ``(args, kwargs)`` spec."""
    args, kwargs = spec.child(0), spec.child(1)
    return f"{args.num_children} positional input(s) and keywords {sorted(kwargs.context or [])}"

def _plain_containers(value: Any) -> Any:
    """``dict``/``list`` for torch.fx's immutable ones: a ``symbolic_trace`` capture records the
    traced module's ``immutable_dict`` outputs in the output spec; users get what their model
    returns."""
    if isinstance(value, immutable_dict):
        return {k: _plain_containers(v) for k, v in value.items()}
    if isinstance(value, immutable_list):
        return [_plain_containers(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain_containers(v) for v in value)
    if type(value) is dict:
        return {k: _plain_containers(v) for k, v in value.items()}
    if type(value) is list:
        return [_plain_containers(v) for v in value]
    return value


_RESERVED = ("graph_module", "report", "plan", "_fxtp_constants", "mode", "written_state")


class ParallelModule(nn.Module):
    """One rank's part of a tensor-parallel model.

    Attributes:
        graph_module: the rank's ``torch.fx.GraphModule`` (plain tensors and collectives; its
            placeholders are the parameters, buffers and constants, then the flat user inputs).
        report: why each layer got its style (:class:`fxtp.Report`).
        plan: ``{layer: style}``, valid as ``fxtp.compile(..., plan=)``.
        placements: ``{parameter FQN: Placement}``; a ``Shard`` parameter holds this rank's
            slice (``fxtp.core.placement.shard_tensor`` of the full one) as a
            ``fxtp.runtime.sharded.ShardedParameter``, on which whole-tensor computations
            (``torch.nn.utils.clip_grad_norm_``, norms, GradScaler's found-inf) are exact over
            the group (NOTE: [sharded parameters]); :meth:`clip_grad_norm_` clips in one all_reduce.

    Checkpoints (``fxtp.runtime.checkpoint``): :meth:`full_state_dict`, :meth:`load_full_state_dict`,
    :meth:`load_safetensors`. ``state_dict()`` values carry their global layout for
    ``torch.distributed.checkpoint`` and ``load_state_dict`` checks it (``fxtp.runtime.layout``, NOTE:
    [checkpoint layouts]); :meth:`register_optimizer` does the same for an optimizer's state.
    """

    def __init__(
        self,
        program: ExportedProgram,
        graph_module: GraphModule,
        sharding: ShardingPlan,
        report: Report,
        *,
        rank: int,
        world_size: int,
        group_name: Optional[str],
        graphs: Optional[Mapping[str, tuple[ExportedProgram, GraphModule]]] = None,
        mode: str = "train",
        templates: Optional[Mapping[str, Template]] = None,
    ) -> None:
        super().__init__()
        self._templates = dict(templates or {})  # fqn -> the model's class there (NOTE: [blocks of a ParallelModule])
        self._running: Optional[ModeGraph] = None  # the graph a call runs now, for its blocks
        self.graph_module = graph_module
        self.report = report
        self.plan = report.plan
        self._rank, self._world_size, self._group_name = rank, world_size, group_name
        self.placements: dict[str, Placement] = {}
        self._state_placements = dict(sharding.params)  # placeholder -> Shard, NOTE: [sharded state]
        self._kv_heads = dict(sharding.kv_heads)  # placeholder -> KvHeads (passes/kv_heads.py)
        self.written_state: set[str] = set()  # buffers and constants the graphs write in place (a KV cache)
        self._generation = None  # set by fxtp.compile for a Hugging Face causal LM (fxtp.runtime.generation)
        self._size_graphs: Optional[SizeGraphs] = None  # set by fxtp.compile (NOTE: [size-1 graphs], [autocast graphs])
        # (module, mode) -> that mode's ModeGraph, captured on the first switch to it; set by fxtp.compile (NOTE: [modes])
        self._mode_graphs: Optional[Callable[["ParallelModule", str], ModeGraph]] = None
        self._fsdp_warned = False
        self._call_defaults: dict[str, Any] = {}  # keywords a call gets unless it gives them (NOTE: [Hugging Face call defaults])
        self._fxtp_constants = nn.Module()
        self._constant_targets: dict[str, str] = {}  # fxtp's name of a constant -> the model's
        self._shared: dict[tuple[int, str], nn.Parameter] = {}  # tied parameters stay one Parameter
        for fqn in self._templates:  # the model's module tree in its order, modules without state included
            if fqn.split(".")[0] not in _RESERVED:
                self._module_at(fqn)
        # NOTE: [modes] in fxtp/api.py: one graph per mode (``graphs``: mode -> (program, rank
        # graph), a graph shared by modes given once); ``mode`` is the compiled one, bound first.
        graphs = dict(graphs or {mode: (program, graph_module)})
        self._mode = mode
        self._graphs: dict[str, ModeGraph] = {}
        built: dict[int, ModeGraph] = {}
        for key in sorted(graphs, key=lambda m: m != mode):
            prog, gm = graphs[key]
            if id(gm) not in built:
                placements = parameter_placements(prog, sharding) if prog is program else None  # tied FQNs share one
                inputs, blocks = bind_blocks(self, gm, self._bind(prog, placements))
                built[id(gm)] = ModeGraph.of(prog, gm, inputs, blocks)
            self._graphs[key] = built[id(gm)]
        # the module holds its Parameters now: kept here, each would outlive FSDP2's fully_shard, which
        # replaces it with its shard (every rank would keep its whole tp-local copy of every parameter)
        self._shared.clear()
        self.register_state_dict_post_hook(layout.state_dict_hook)  # NOTE: [checkpoint layouts]
        self.register_load_state_dict_pre_hook(layout.load_state_dict_hook)

    def _bind(self, program: ExportedProgram, placements: Optional[Mapping[str, Placement]] = None, *,
              share_constants: bool = False) -> list[tuple[str, str]]:
        """Register ``program``'s parameters, buffers and constants (those not registered yet;
        parameters only with ``placements``); return ``(kind, key)`` per graph placeholder.
        ``share_constants``: a constant of a model attribute already registered is that one (a
        graph captured from the model's meta copy, NOTE: [size-1 graphs] in fxtp/runtime/variants.py)."""
        inputs: list[tuple[str, str]] = []
        known = {target: key for key, target in self._constant_targets.items()} if share_constants else {}
        written = written_state(program)
        from_meta = share_constants and self._holds_values()  # once, not per buffer
        for spec in program.graph_signature.input_specs:
            if spec.kind == InputKind.PARAMETER:
                if placements is not None:
                    full = program.state_dict[spec.target]
                    placement = placements[spec.target]
                    key = (id(full), str(placement))
                    if key not in self._shared:
                        local = shard_tensor(full, placement, self._rank, self._world_size)
                        self._shared[key] = self._parameter(spec.target, local, placement, full.requires_grad)
                    self._register(spec.target, self._shared[key])
                    self.placements[spec.target] = placement
                elif spec.target not in self.placements:
                    raise FxtpInputError(f"parameter {spec.target} is used in one mode's graph only; fxtp cannot shard it")
                inputs.append(("param", spec.target))
            elif spec.kind == InputKind.BUFFER:
                if not self._has(spec.target):
                    source = program.state_dict if spec.persistent else program.constants
                    value = self._local_state(spec.arg.name, held(source[spec.target], spec.target, from_meta))
                    self._register(spec.target, value, persistent=bool(spec.persistent))
                if spec.arg.name in written:
                    self.written_state.add(spec.target)
                inputs.append(("buffer", spec.target))
            elif spec.kind == InputKind.CONSTANT_TENSOR and spec.target in known:
                inputs.append(("buffer", known[spec.target]))
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                key = f"c{len(self._fxtp_constants._buffers)}"
                value = held(program.constants[spec.target], spec.target, from_meta)
                self._fxtp_constants.register_buffer(key, self._local_state(spec.arg.name, value), persistent=False)
                self._constant_targets[f"_fxtp_constants.{key}"] = spec.target
                if spec.arg.name in written:
                    self.written_state.add(f"_fxtp_constants.{key}")
                inputs.append(("buffer", f"_fxtp_constants.{key}"))
            elif spec.kind == InputKind.USER_INPUT:
                inputs.append(("user", ""))
            else:
                raise FxtpInputError(f"fxtp does not support graph inputs of kind {spec.kind.name} ({spec.arg.name})")
        return inputs

    def _parameter(self, fqn: str, local: torch.Tensor, placement: Placement, requires_grad: bool) -> nn.Parameter:
        """A ``ShardedParameter`` for a sharded one in a process group (NOTE: [sharded parameters]),
        else a plain ``nn.Parameter``."""
        if isinstance(placement, Shard) and self._world_size > 1 and self._group_name is not None:
            layout = sharded.ShardLayout(fqn, placement, self._group_name, self._world_size)
            return sharded.ShardedParameter(local, requires_grad, layout)
        return nn.Parameter(local, requires_grad=requires_grad)

    def _local_state(self, placeholder: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's copy of a buffer or constant: its shard where the plan stores it sharded
        (a KV cache written in place, NOTE: [sharded state] in passes/rules/variants.py), or the
        kv heads this rank's query heads need (NOTE: [kv heads kept by the ranks that need them])."""
        if placeholder in self._kv_heads:
            return self._kv_heads[placeholder].local(full, self._rank, self._world_size)
        placement = self._state_placements.get(placeholder, REPLICATE)
        return shard_tensor(full, placement, self._rank, self._world_size)

    def _holds_values(self) -> bool:
        return not all(p.is_meta for p in self.parameters())

    def _has(self, fqn: str) -> bool:
        try:
            self.get_buffer(fqn)
        except AttributeError:
            return False
        return True

    @property
    def mode(self) -> str:
        """The graph calls run now: ``"train"``, ``"eval"``, or ``"mixed"`` (a model compiled
        with some modules in each mode, until the first ``train()``/``eval()``)."""
        return self._mode

    def train(self, mode: bool = True) -> "ParallelModule":
        """Switch to the train-mode (``mode=True``) or eval-mode graph, as ``model.train(mode)``
        switches every module of the model (NOTE: [modes] in fxtp/api.py)."""
        super().train(mode)
        self._mode = "train" if mode else "eval"
        if self._mode not in self._graphs and self._mode_graphs is not None:
            self._graphs[self._mode] = self._mode_graphs(self, self._mode)  # the first switch to it: captured now
        return self

    def mode_graph(self, mode: str) -> ModeGraph:
        """The graph of ``mode`` (NOTE: [modes] in fxtp/api.py)."""
        return self._graphs[mode]

    def bind_graph(self, program: ExportedProgram, gm: GraphModule) -> ModeGraph:
        """``gm`` (the rank graph of ``program``, captured from the model's ``meta`` copy) made a ``ModeGraph`` on
        this module's parameters, buffers and constants; ``FxtpInputError`` if it uses a parameter the compiled one does not."""
        inputs, blocks = bind_blocks(self, gm, self._bind(program, None, share_constants=True))
        return ModeGraph.of(program, gm, inputs, blocks)

    def _register(self, fqn: str, value: torch.Tensor, persistent: bool = True) -> None:
        *path, leaf = fqn.split(".")
        if path and path[0] in _RESERVED or not path and leaf in _RESERVED:
            raise FxtpInputError(f"parameter or buffer {fqn!r} clashes with a ParallelModule attribute; rename it")
        owner = self._module_at(".".join(path))
        if isinstance(value, nn.Parameter):
            owner.register_parameter(leaf, value)
        else:
            owner.register_buffer(leaf, value, persistent=persistent)

    def _module_at(self, fqn: str) -> nn.Module:
        """The submodule at ``fqn``, made (with the model's classes, NOTE: [blocks of a ParallelModule])
        where missing."""
        owner: nn.Module = self
        parts = fqn.split(".") if fqn else []
        for i, part in enumerate(parts):
            if part not in owner._modules:
                owner.add_module(part, new_module(".".join(parts[: i + 1]), self._templates))
            owner = owner._modules[part]  # type: ignore[assignment]
        return owner

    def _flatten(self, graph: "ModeGraph", args: tuple, kwargs: dict) -> list[Any]:
        if self._call_defaults:  # NOTE: [Hugging Face call defaults] in fxtp/capture/hf_defaults.py
            for key, value in self._call_defaults.items():
                if kwargs.get(key, value) != value:
                    raise FxtpInputError(
                        f"{key}={kwargs[key]!r}: the module was captured with {key}={value!r} ({self.report.left_out[0]}). "
                        f"fix: drop {key}=, or use pm.generate for cached decoding"
                    )
            kwargs = self._call_defaults | kwargs
        if graph.in_spec.num_children == 2 and kwargs:
            order = graph.in_spec.child(1).context or []
            if set(order) == set(kwargs):
                kwargs = {k: kwargs[k] for k in order}
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != graph.in_spec:
            raise FxtpInputError(
                f"inputs do not match the call the module was compiled for: {_describe(graph.in_spec)} expected, "
                f"got {_describe(spec)}; call it like the example inputs"
            )
        return flat

    def _graph_for(self, graph: "ModeGraph", flat: list[Any]) -> "ModeGraph":
        """``graph`` if it takes ``flat``'s sizes and no autocast is on, else the graph captured for
        sizes 0 and 1, parameter dtypes or the autocast state (NOTE: [size-1 graphs] in fxtp/runtime/variants.py)."""
        if self._size_graphs is not None:
            return self._size_graphs.select(self.report, self._mode, graph, flat, self.bind_graph, self)
        try:
            check_inputs(flat, graph.specs)
        except FxtpInputError as exc:
            raise static_refusal(exc, flat, graph.specs)
        return graph

    def _input_slots(self, graph: "ModeGraph") -> list[tuple[Optional[nn.Module], str]]:
        """Per graph placeholder, the submodule and attribute holding its tensor (``None`` for a
        user input). The owners are resolved once: a ``get_parameter`` per input per call costs
        a measurable share of a tiny model's step; the attribute is read at call time, so a
        replaced parameter (a meta model being loaded) is seen."""
        if graph.slots is None:
            slots = []
            for kind, key in graph.inputs:
                if kind == "user":
                    slots.append((None, ""))
                else:
                    path, _, leaf = key.rpartition(".")
                    slots.append((self.get_submodule(path), leaf))
            graph.slots = slots
        return graph.slots

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Same signature and output structure as the original model; full outputs on every rank.
        Runs the graph of the current mode (:attr:`mode`).

        Raises:
            FxtpRuntimeError: ``world_size > 1`` and no process group was initialized when
                ``fxtp.compile`` ran.
            FxtpInputError: inputs whose structure differs from the example inputs, or a tensor
                of another rank or dtype, or a size outside what the capture allows
                (``fxtp.capture.shapes.check_inputs``); an index out of range (token id, position), as
                the single-device model would raise ``IndexError`` (an operator's; one raised by Python code,
                a hook's, propagates as it is).
        """
        if self._world_size > 1 and self._group_name is None:
            raise FxtpRuntimeError(
                f"this module is rank {self._rank} of a world_size {self._world_size} tensor-parallel model, but no "
                "process group was initialized when fxtp.compile ran, so it can only be inspected. fix: call "
                "torch.distributed.init_process_group(...) (or pass group=) before fxtp.compile, on every rank"
            )
        units = fsdp.gathered_units(self)  # NOTE: [FSDP2 units inside a ParallelModule] in fxtp/runtime/fsdp.py
        graph = self._graphs[self._mode]
        flat = self._flatten(graph, args, kwargs)
        graph = self._graph_for(graph, flat)
        user = iter(flat)
        inputs = [getattr(owner, leaf) if owner is not None else next(user) for owner, leaf in self._input_slots(graph)]
        if graph.draws_random and self._world_size > 1 and not torch.compiler.is_compiling():
            self._check_generators(inputs)
        try:
            self._running = graph  # its blocks run their bodies of it (NOTE: [blocks of a ParallelModule])
            with activations.saved_tensors(regather=graph.regathers), fsdp.resharded_without_grad(units):
                # no module hooks on it (NOTE: [block bodies run without module hooks] in fxtp/runtime/blocks.py)
                outputs = graph.gm.forward(*sharded.plain_graph_inputs(inputs))
            collectives.release()  # NOTE: [gloo frees] in fxtp/core/collectives.py
        except IndexError as exc:  # a lookup the single device would refuse too (ids, positions)
            if not raised_by_an_op(exc):  # an IndexError of Python code (fxtp's, a hook's) is no input error
                raise
            raise FxtpInputError(
                f"rank {self._rank}: an index in the inputs is out of range: {str(exc).splitlines()[0]}. fix: keep "
                "token ids below the vocabulary size and sequence lengths within the position table (a dynamic "
                "dim's range in the report is what the capture allows, not what the model's tables hold)"
            ) from exc
        except RuntimeError as exc:
            raise FxtpRuntimeError(
                f"rank {self._rank}: the parallel graph failed: {str(exc).splitlines()[0]}. fix: check that the inputs "
                "fit the model (the dtypes and devices it expects: the graph is traced, not checked, for them) and that "
                "inputs, parameters and process group are on one device type (gloo: cpu, nccl: cuda); if they are, "
                "please report this"
            ) from exc
        finally:
            self._running = None
        user_outputs = []
        for (kind, target), value in zip(graph.outputs, outputs):
            if kind == OutputKind.BUFFER_MUTATION:
                with torch.no_grad():
                    self.get_buffer(target).copy_(value)
            else:
                user_outputs.append(value)
        return _plain_containers(pytree.tree_unflatten(user_outputs, graph.out_spec))

    def _check_generators(self, inputs: list[Any]) -> None:
        device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
        if not rng.generators_in_step(layout.tp_group(self), device):
            raise FxtpRuntimeError(
                f"rank {self._rank}: the tensor-parallel ranks' random generators are out of step before a call that "
                "draws random numbers (dropout): each rank would draw another mask for values that must be identical "
                "on every rank, a silently wrong result. fxtp.compile put them in step; something seeded or drew on "
                "some ranks only since. fix: seed every rank of the group alike (torch.manual_seed(seed), not seed + "
                "rank), or call fxtp.core.rng.sync_generators(group) after reseeding"
            )

    # --- generation (fxtp.runtime.generation) -----------------------------------------------------------

    def generate(self, input_ids: torch.Tensor, *, max_new_tokens: int = 20, **kwargs: Any) -> torch.Tensor:
        """Greedy or sampled decoding with a KV cache sharded by kv heads, as Hugging Face's
        ``model.generate`` (NOTE: [generation] in fxtp/runtime/generation.py). A collective: every rank of
        the group calls it with the same arguments.

        Args:
            input_ids: (batch, length) int64 prompts.
            max_new_tokens: tokens to add, >= 1.
            do_sample, temperature, top_k, top_p: as ``model.generate`` (defaults from the
                model's ``generation_config``); the token is drawn on rank 0 and broadcast.
            eos_token_id, pad_token_id: stop and pad as ``model.generate`` does.
            attention_mask: ``None``, or (batch, length) 0/1 with prompts of different lengths
                padded on the left, as Hugging Face's tokenizers give them (NOTE: [padded
                prompts]); right padding raises ``FxtpInputError``.
            num_beams: 1 (or ``None`` with a ``generation_config`` of 1); beam search raises.
            max_cache_len: the static cache's length (default: the needed length rounded up
                to 256, capped at the model's positions); one decoder is compiled per
                (batch, max_cache_len) and kept.

        Returns:
            (batch, length + new) int64: the prompts and the new tokens, as ``model.generate``.

        Raises:
            FxtpInputError: a model that is not a Hugging Face causal LM, bad prompts, or more
                positions than the model has.
        """
        return generation.generate(self, input_ids, max_new_tokens=max_new_tokens, **kwargs)

    # --- checkpoints (fxtp.runtime.checkpoint) ---------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state dict (same keys, full tensors), gathered from the shards.

        A collective: every rank of the tensor-parallel group calls it and gets the full dict.
        See :func:`fxtp.runtime.checkpoint.full_state_dict`.
        """
        return checkpoint.full_state_dict(self)

    def load_full_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True, device: Union[str, torch.device, None] = None
    ) -> None:
        """Slice a full state dict of the original model into this rank's tensors (no communication).

        Raises ``FxtpInputError`` on missing/unexpected keys or wrong shapes. See
        :func:`fxtp.runtime.checkpoint.load_full_state_dict`.
        """
        checkpoint.load_full_state_dict(self, state_dict, strict=strict, device=device)

    def load_safetensors(
        self,
        path: Union[str, os.PathLike],
        *,
        device: Union[str, torch.device, None] = None,
        extra: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> checkpoint.LoadStats:
        """Read only this rank's slices from a full-model ``.safetensors`` file (materializes a
        model compiled on ``meta``); returns the bytes read. See :func:`fxtp.runtime.checkpoint.load_safetensors`.
        """
        return checkpoint.load_safetensors(self, path, device=device, extra=extra)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`` with the single device's norm,
        in one all_reduce (also under FSDP2 on a data-parallel mesh: the norm over both dims). A
        collective. See :func:`fxtp.runtime.clipping.clip_grad_norm_`."""
        return clipping.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.state_dict()`` (and so ``get_optimizer_state_dict``) carry the layouts
        of this module's parameters, and its ``load_state_dict`` take them back, so
        ``torch.distributed.checkpoint`` reshards the optimizer state too. Call it once per
        optimizer of ``self.parameters()``. See :func:`fxtp.runtime.layout.register_optimizer`.
        """
        layout.register_optimizer(self, optimizer)
