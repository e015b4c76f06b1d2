"""A ``ParallelModule``'s graphs: one per mode (:class:`ModeGraph`), and those for the input sizes
torch.export specializes, captured on first use.

NOTE: [size-1 graphs]
torch.export specializes sizes 0 and 1 (Ansel et al. 2024, "0/1 specialization"): a dim the
example has at size 2 or more becomes a symbol whose range starts at 2, and a dim the example
has at 0 or 1 becomes that constant. The model's Python may also branch on a size being 1
(Hugging Face's attention takes ``is_causal`` from ``query.shape[2] > 1`` and guards on
``batch != 1``), so a graph traced at size 2 is not, in general, the model at size 1: running it
there would be right only by luck. torch's ``backed_size_oblivious`` capture does not help: it
keeps such a branch's guard and still refuses 1 for these models.

So a call whose sizes differ from what the compiled graph takes only in a 0 or 1 (a batch or
sequence of 1 where the range starts at 2, or a size of 2 or more where the example fixed 1)
gets a graph of its own, captured at that call from a copy of the model with its parameters
and buffers on the ``meta`` device (taken at compile: no weights, and the user's model is not
held or touched) and inputs on ``meta`` shaped like the call, with every other dim dynamic as
at compile. It is planned, checked to shard every parameter as the compiled graph does (one
set of shards), rewritten for the rank, bound to the module's own parameters and buffers, kept
per (mode, which dims are 0, 1 or more) and noted in ``report.shape_notes``. Every rank of the
group captures the same graph at the same call (the ranks get the same shapes); no collective
runs meanwhile. Later calls of that kind cost one more ``check_inputs``.

NOTE: [low-precision graphs]
A dtype is traced into the graph too (a norm's ``to(float32)`` upcast and its cast back to the
input's dtype), so a call on a module whose floating parameters now come in another dtype than
at compile (and so may its floating inputs) gets a graph of its own the same way: captured from
the meta copy with those parameters cast to their dtype now and inputs of the call's dtypes,
kept per (mode, size class, input dtypes, parameter dtypes). An input of another dtype on the
compiled parameters is refused as before. That is FSDP2's mixed precision:
``fully_shard(pm, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))`` keeps the
float32 shards (the optimizer's master weights) and runs the forward on bf16 parameters and
inputs. Buffers keep their dtype, as FSDP2 leaves them.

The autocast state a call runs under is traced into the graph the same way (NOTE: [autocast
graphs] in fxtp/core/autocast.py): compile captures with autocast off, and a call under an
autocast state (device type, dtype) gets a graph captured under that state, kept per (mode, size
class, input dtypes, parameter dtypes, autocast state). torch.autocast casts by device type and
``meta`` has none, so that capture runs on a copy of the meta copy whose parameters, buffers and
inputs are fake tensors on the call's device (:func:`fake_copy`: no memory, no weights). Every
rank picks its graph from its own autocast state and inputs, no collective, so ranks that run
the same loop pick the same graph; the one set of shards is checked as for the others.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx import GraphModule

from fxtp.capture.shapes import InputSpec, check_inputs, input_specs
from fxtp.core import collectives, rng
from fxtp.core.autocast import AutocastState, autocast_as, autocast_state
from fxtp.core.errors import FxtpError, FxtpInputError
from fxtp.runtime.blocks import BlockBody

__all__ = ["ModeGraph", "SizeGraphs", "fake_copy", "meta_copy", "differs_in_zero_one", "held", "in_mode", "mode_of", "static_refusal"]


@dataclass(eq=False)
class ModeGraph:
    """One mode's rank graph and how to call it (NOTE: [modes] in fxtp/api.py). Holds no
    reference to the captured program (whose state dict is the user's full weights)."""

    gm: GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    outputs: list[tuple[OutputKind, Optional[str]]]
    specs: tuple[InputSpec, ...]  # the user inputs it runs on (fxtp.capture.shapes)
    inputs: list[tuple[str, str]]  # (kind, key) per placeholder
    slots: Optional[list[tuple[Optional[nn.Module], str]]] = None
    draws_random: bool = False  # checks the generators before each call (NOTE: [dropout across ranks])
    regathers: bool = False  # saves gathered token shards as shards (NOTE: [regathered activations])
    blocks: dict[str, BlockBody] = dataclasses.field(default_factory=dict)  # NOTE: [blocks of a ParallelModule]
    kinds: dict[int, BlockBody] = dataclasses.field(default_factory=dict)  # NOTE: [identical blocks compile once]

    @classmethod
    def of(cls, program: ExportedProgram, gm: GraphModule, inputs: list[tuple[str, str]],
           blocks: Optional[dict[str, BlockBody]] = None) -> "ModeGraph":
        """``inputs``: ``(kind, key)`` per root placeholder; ``blocks``: the bodies of its blocks."""
        outputs = [(spec.kind, spec.target) for spec in program.graph_signature.output_specs]
        blocks = blocks or {}
        graphs = [gm, *(b.module for b in blocks.values() if isinstance(b.module, GraphModule))]
        return cls(gm, program.call_spec.in_spec, program.call_spec.out_spec, outputs, input_specs(program), inputs,
                   draws_random=rng.draws_random(program.graph),
                   regathers=any(n.target is collectives.gather_from_sp for g in graphs for n in g.graph.nodes),
                   blocks=blocks, kinds={b.kind: b for b in blocks.values() if b.kind is not None})

# fxtp.api's pipeline for one more graph: (meta model, args, kwargs, mode) -> (program, rank graph, its Report)
Build = Callable[[nn.Module, tuple, dict, str], tuple[ExportedProgram, GraphModule, Any]]


def mode_of(model: nn.Module) -> str:
    """``"train"``, ``"eval"``, or ``"mixed"`` (NOTE: [modes] in fxtp/api.py)."""
    flags = {m.training for m in model.modules()}
    return "mixed" if len(flags) > 1 else ("train" if flags.pop() else "eval")


@contextlib.contextmanager
def in_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Every module's ``training`` flag set for the block, then restored one by one."""
    saved = [(m, m.training) for m in model.modules()]
    try:
        for m, _ in saved:
            m.training = training
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def meta_copy(model: nn.Module) -> Optional[nn.Module]:
    """A deep copy of ``model`` whose parameters and buffers are on ``meta`` (ties kept, nothing
    copied but the structure and small non-tensor state), or ``None`` where the model cannot be
    deep-copied."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        meta = tensor.detach().to("meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - a model that refuses deepcopy just gets no size-1 graphs
        return None


def fake_copy(model: nn.Module, device: torch.device) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """A deep copy of the meta copy ``model`` whose parameters and buffers are fake tensors on
    ``device`` (shapes, dtypes and device only: no memory), and what makes an input's fake twin
    in the same fake mode: torch.autocast casts by device type, and ``meta`` has none (NOTE:
    [low-precision graphs])."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # torch.export's own fake tensors
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    memo: dict[int, Any] = {}
    with mode:
        for t in itertools.chain(model.parameters(), model.buffers()):
            fake = torch.empty(t.shape, dtype=t.dtype, device=device)
            memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
    copied = copy.deepcopy(model, memo)

    def twin(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty(t.shape, dtype=t.dtype, device=device)

    return copied, twin


def _is_fake(value: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return value.is_meta or isinstance(value, FakeTensor)


def held(value: torch.Tensor, target: str, from_meta_copy: bool) -> torch.Tensor:
    """``value``, a buffer or constant of a graph captured after compile; ``from_meta_copy``:
    from the model's meta copy (or its fake copy), by a module whose weights are real.

    Raises:
        FxtpInputError: ``value`` is then a ``meta`` (or fake) tensor the compiled graph never
            used, so fxtp holds no real value for it.
    """
    if from_meta_copy and _is_fake(value):
        raise FxtpInputError(
            f"{target} is used only by a graph captured after compile (another mode, sizes 0 and 1, or autocast), from the "
            "model's meta copy, so fxtp has no value for it. fix: compile the model in that mode, or at those sizes"
        )
    return value


def differs_in_zero_one(flat: list[Any], specs: tuple[InputSpec, ...]) -> bool:
    """Whether ``flat`` misses ``specs`` in a size torch.export specializes (NOTE: [size-1
    graphs]): some tensor has a 0 or 1 in a dynamic dim whose range starts above it, or another
    size in a dim the example fixed at 0 or 1, or another floating dtype (NOTE: [low-precision
    graphs]), and nothing else misses (ranks, the other dtypes and static sizes, and ranges'
    upper ends agree)."""
    found = False
    for value, spec in zip(flat, specs):
        if not spec.is_tensor:
            continue
        if not isinstance(value, torch.Tensor) or value.dim() != len(spec.dims):
            return False
        if value.dtype != spec.dtype:  # NOTE: [low-precision graphs]
            if not (value.dtype.is_floating_point and spec.dtype is not None and spec.dtype.is_floating_point):
                return False
            found = True
        for size, dim in zip(value.shape, spec.dims):
            if dim.dynamic and size < dim.lo and size in (0, 1) or not dim.dynamic and dim.size in (0, 1) and size != dim.size:
                found = True
            elif not dim.dynamic and size != dim.size or dim.dynamic and dim.hi is not None and size > dim.hi:
                return False  # another misfit: check_inputs says which
    return found


def static_refusal(refused: FxtpInputError, flat: list[Any], specs: tuple[InputSpec, ...]) -> FxtpInputError:
    """``refused``, the input check's error on a static compile (``dynamic=False``: no graphs
    for sizes 0 and 1 or other dtypes are made), with the fix where another graph would take the
    call: a size 0 or 1, or parameters in another dtype (FSDP2's ``MixedPrecisionPolicy``)."""
    if not differs_in_zero_one(flat, specs):
        return refused
    return FxtpInputError(f"{refused}; a static compile (dynamic=False) keeps its one graph: compile with dynamic=True "
                          "(the default) for sizes 0 or 1, or for parameters FSDP2's MixedPrecisionPolicy casts")


def _cast_parameters(module: nn.Module, model: nn.Module) -> dict[str, torch.dtype]:
    """``{fqn: dtype}`` of ``module``'s floating parameters whose dtype now is not the one of
    ``model``'s (the meta copy's, as compiled): FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``
    hands the forward parameters cast to that dtype (NOTE: [low-precision graphs])."""
    from fxtp.runtime.fsdp import forward_dtypes  # a block's FSDP2 unit casts when the block runs

    compiled = dict(model.named_parameters())
    return {fqn: dtype for fqn, dtype in forward_dtypes(module).items()
            if fqn in compiled and dtype != compiled[fqn].dtype and dtype.is_floating_point}


def _size_class(flat: list[Any]) -> tuple:
    """Per tensor input, each dim as 0, 1 or 2 (meaning 2 or more): the key of a graph."""
    return tuple(tuple(min(int(s), 2) for s in v.shape) if isinstance(v, torch.Tensor) else None for v in flat)


def _describe(flat: list[Any], specs: tuple[InputSpec, ...]) -> str:
    """``input 'ids' dim 0 at 1, dim 1 at 2 or more``: the dims whose size class is new."""
    parts = []
    for value, spec in zip(flat, specs):
        if not spec.is_tensor:
            continue
        dims = [
            f"dim {d} at {size if size < 2 else '2 or more'}"
            for d, (size, dim) in enumerate(zip(value.shape, spec.dims))
            if (dim.dynamic and size < dim.lo) or (not dim.dynamic and dim.size in (0, 1) and size != dim.size)
        ]
        if dims:
            parts.append(f"input {spec.name!r} {', '.join(dims)}")
    return "; ".join(parts)


@dataclass(eq=False)
class SizeGraphs:
    """The module's graphs for sizes 0 and 1, other parameter dtypes and autocast states (NOTE:
    [size-1 graphs], [low-precision graphs]): the model's ``meta`` copy, the pipeline that makes
    one more graph, and the graphs (or the error) made so far. ``dynamic``: the compile's (a
    static one gets graphs for autocast states only); ``devices``: the device types of the
    model's tensors and the example inputs, whose autocast state a call reads."""

    model: nn.Module
    build: Build
    dynamic: bool = True
    devices: frozenset[str] = frozenset({"cpu"})
    graphs: dict[tuple, Union[Any, FxtpError]] = field(default_factory=dict)  # (mode, size class, ...) -> ModeGraph

    def select(self, report: Any, mode: str, compiled: Any, flat: list[Any], bind: Callable[[ExportedProgram, GraphModule], Any],
               module: nn.Module) -> Any:
        """The graph for the call ``flat``: ``compiled`` (a ``ModeGraph``) where it takes its
        sizes and dtypes and no autocast is on, else the one :meth:`graph_for` gives.

        Raises:
            FxtpInputError: the input check's, where no other graph takes the call.
        """
        state = autocast_state(self.devices | {v.device.type for v in flat if isinstance(v, torch.Tensor)})
        try:
            check_inputs(flat, compiled.specs)
        except FxtpInputError as exc:
            if not self.dynamic:
                raise static_refusal(exc, flat, compiled.specs) from None
            if not differs_in_zero_one(flat, compiled.specs):
                raise
            return self.graph_for(report, mode, compiled, flat, exc, bind, module, state)
        return compiled if not state else self.graph_for(report, mode, compiled, flat, None, bind, module, state)

    def graph_for(self, report: Any, mode: str, compiled: Any, flat: list[Any], refused: Optional[FxtpInputError],
                  bind: Callable[[ExportedProgram, GraphModule], Any], module: nn.Module, state: AutocastState = ()) -> Any:
        """The graph for a call ``check_inputs`` refused with ``refused`` on the ``compiled``
        graph (a ``ModeGraph``), or took (``refused=None``) under the autocast ``state``: one
        kept for its size class, input dtypes, the dtypes of ``module``'s parameters now and
        ``state``, else one captured now under ``state``, made a ``ModeGraph`` by ``bind`` and
        noted in ``report``.

        Raises:
            FxtpInputError: ``refused``, with why no graph could be captured for these sizes;
                or what the new graph's own ``check_inputs`` says.
        """
        dtypes = _cast_parameters(module, self.model)
        if not dtypes and any(isinstance(v, torch.Tensor) and v.dtype != spec.dtype for v, spec in zip(flat, compiled.specs)):
            raise refused  # another input dtype on the compiled parameters: the caller's mistake
        key = (mode, _size_class(flat), tuple(v.dtype if isinstance(v, torch.Tensor) else None for v in flat),
               tuple(sorted(dtypes.items())), state)
        if key not in self.graphs:
            self.graphs[key] = self._capture(report, mode, compiled, flat, dtypes, state, bind)
        graph = self.graphs[key]
        if isinstance(graph, FxtpError):
            if refused is None:
                raise FxtpInputError(
                    f"under torch.autocast({_autocast_text(state)}) the module runs a graph captured under it (the model's "
                    f"Python may cast by dtype), and fxtp could not capture one: {graph}. fix: call the module outside "
                    "autocast (cast the model and inputs to that dtype instead)"
                ) from graph
            raise FxtpInputError(f"{refused}; fxtp could not capture a graph for these sizes: {graph}") from graph
        check_inputs(flat, graph.specs)
        return graph

    def _capture(self, report: Any, mode: str, compiled: Any, flat: list[Any], dtypes: dict[str, torch.dtype],
                 state: AutocastState, bind: Callable[[ExportedProgram, GraphModule], Any]) -> Any:
        """The ``ModeGraph`` for the call ``flat`` with parameters in ``dtypes`` under ``state``,
        captured now, or the ``FxtpError`` that refused it."""
        model = self.model
        if dtypes:  # NOTE: [low-precision graphs]
            model = copy.deepcopy(model)
            for fqn, dtype in dtypes.items():
                model.get_parameter(fqn).data = model.get_parameter(fqn).data.to(dtype)
        twin: Callable[[torch.Tensor], torch.Tensor] = lambda v: torch.empty(v.shape, dtype=v.dtype, device="meta")
        if state:  # autocast casts by device type: a fake copy on the call's device (NOTE: [low-precision graphs])
            model, twin = fake_copy(model, next((v.device for v in flat if isinstance(v, torch.Tensor)), torch.device("cpu")))
        args, kwargs = pytree.tree_unflatten([twin(v) if isinstance(v, torch.Tensor) else v for v in flat], compiled.in_spec)
        try:
            # the call's saved-tensor hooks (fxtp's regathering, offloading) are not the capture's: the innermost pair wins
            with autocast_as(state, self.devices), torch.autograd.graph.saved_tensors_hooks(_same, _same):
                program, gm, own = self.build(model, args, kwargs, mode)
        except FxtpError as exc:
            return exc
        what = [_describe(flat, compiled.specs)] + [f"parameters in {d}" for d in sorted({str(d) for d in dtypes.values()})]
        what += [f"under torch.autocast({_autocast_text(state)})"] if state else []
        which = f"{'; '.join(w for w in what if w)} ({mode} mode)"
        report.shape_notes += (
            f"{which}: a graph of its own, captured at the first such call and kept (torch.export specializes sizes 0 "
            "and 1; a dtype and an autocast state are traced into the graph)",
        )
        report.variants[which] = own
        return bind(program, gm)

    def __deepcopy__(self, memo: dict) -> "SizeGraphs":  # the copy's graphs bind the copy's tensors: made again
        return SizeGraphs(copy.deepcopy(self.model, memo), self.build, self.dynamic, self.devices)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _autocast_text(state: AutocastState) -> str:
    """``"cpu", dtype=torch.bfloat16`` for each device type of ``state``."""
    return "; ".join(f"{device!r}, dtype={dtype}" for device, dtype in state)
