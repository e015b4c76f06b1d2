"""Capture frontends: turn an ``nn.Module`` into one ATen-level graph.

Every frontend hands the passes the same form, a ``torch.export.ExportedProgram`` (training
IR: ATen ops such as ``aten.linear.default``, parameters and buffers as placeholders, shapes in
``node.meta["val"]``, module FQNs in ``node.meta["nn_module_stack"]``):

* ``"fx"``: ``torch.fx.symbolic_trace``, then ``torch.export`` of the traced module to lower it
  to ATen. Fails on data-dependent Python control flow.
* ``"export"``: ``torch.export.export(strict=False)``, tracing with fake tensors.
* ``"dynamo"``: TorchDynamo, torch.compile's bytecode frontend, through
  ``torch.export.export(strict=True)``.
* ``"auto"``: the three in that order; the report says which one was used and why the
  others failed.

Dynamic shapes (NOTE: [dynamic shapes]): by default every dim of every tensor input is
``Dim.AUTO``, so export keeps each dim the model allows dynamic (a symbol with a range, e.g.
batch and sequence) and specializes the others (a ``Linear``'s ``in_features``); the graph's
shape arguments are then ``sym_size`` nodes, not ints. ``dynamic_shapes=`` passes torch.export's
own spec through; ``dynamic=False`` specializes every dim to the example. Where export refuses
a dynamic spec, capture falls back (torch.export's suggested fixes for a user spec, then static
shapes) and says so in ``Captured.notes``, never fails for it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import io
import logging
import re
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim, ShapesCollection
from torch.export.graph_signature import InputKind
from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

from fxtp.capture.hf_experts import check_experts_implementation
from fxtp.capture.in_place import InPlaceProxy
from fxtp.capture.index_lists import cpu_index_lists
from fxtp.capture.isolation import capture_copy, independent_inputs
from fxtp.capture.regions import recording_checkpoints
from fxtp.core.autocast import autocast_state
from fxtp.core.errors import FxtpCaptureError, FxtpInputError

__all__ = ["Captured", "capture", "auto_dynamic_shapes", "written_state", "FRONTENDS"]

FRONTENDS = ("fx", "export", "dynamo")


@dataclass(frozen=True)
class Captured:
    """The captured program, the frontend that produced it, and the failed attempts before it."""

    program: torch.export.ExportedProgram
    frontend: str
    attempts: tuple[tuple[str, str], ...]  # (frontend, one-line reason it failed)
    notes: tuple[str, ...] = ()  # how the dynamic shapes spec was adjusted, if it was
    # torch.utils.checkpoint regions: tag -> the selective region's context_fn (NOTE: [checkpoint regions at capture])
    context_fns: dict[int, Callable[[], Any]] = dataclasses.field(default_factory=dict)


def auto_dynamic_shapes(args: tuple, kwargs: dict) -> ShapesCollection:
    """``Dim.AUTO`` on every dim of every tensor input: export decides which stay dynamic."""
    shapes = ShapesCollection()
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            shapes[leaf] = {d: Dim.AUTO for d in range(leaf.dim())}
    return shapes


def _export_with(make: Callable[[], nn.Module], args: tuple, kwargs: dict, shapes: Any, strict: bool) -> tuple[torch.export.ExportedProgram, list[str]]:
    """``torch.export.export`` with ``shapes``; where export refuses them, torch.export's
    suggested fixes, then static shapes, each with a note (NOTE: [dynamic shapes]). Each
    attempt exports a fresh ``make()``: what one attempt wrote to its module is not the next
    one's (NOTE: [capture on a copy] in fxtp/capture/isolation.py)."""
    notes: list[str] = []
    if shapes is not None and not isinstance(shapes, ShapesCollection):
        try:
            return torch.export.export(make(), args, kwargs, strict=strict, dynamic_shapes=shapes), notes
        except torch._dynamo.exc.UserError as exc:  # a constraint violation: torch suggests fixes
            if "Suggested fixes" not in str(exc):
                raise
            shapes = refine_dynamic_shapes_from_suggested_fixes(exc.msg, shapes)
            fixes = str(exc).split("Suggested fixes:", 1)[1].strip().split("\n\n", 1)[0]
            notes.append(f"dynamic_shapes adjusted by torch.export's suggested fixes: {' '.join(fixes.split())}")
    if shapes is not None:
        try:
            return torch.export.export(make(), args, kwargs, strict=strict, dynamic_shapes=shapes), notes
        except Exception as exc:  # noqa: BLE001 - a dynamic capture that fails falls back to static shapes
            notes.append(f"dynamic capture failed ({_one_line(exc)}); every input dim specialized to the example")
    return torch.export.export(make(), args, kwargs, strict=strict), notes


def _traced(model: nn.Module) -> torch.fx.GraphModule:
    """``model`` (a capture copy) through ``torch.fx.symbolic_trace``.

    Raises:
        RuntimeError: ``forward`` wrote a buffer in place while tracing: symbolic tracing ran
            that write eagerly (a buffer is a real tensor to it) and left it out of the graph.
    """
    versions = {name: b._version for name, b in model.named_buffers()}  # torch's in-place write counter
    with recording_checkpoints(symbolic=True):  # NOTE: [checkpoint regions at capture]
        tracer = _StackTracer()
        tracer.record_stack_traces = True  # the model's source lines reach the fixes (NOTE: [actionable fixes])
        graph = tracer.trace(model)
        traced = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    written = [name for name, b in model.named_buffers() if name in versions and b._version != versions[name]]
    if written:
        raise RuntimeError(f"forward writes buffer {written[0]} in place, which symbolic tracing runs eagerly and leaves out of the graph")
    return traced


def _fx(model: nn.Module, args: tuple, kwargs: dict, shapes: Any) -> tuple[torch.export.ExportedProgram, list[str]]:
    unused = [_traced(capture_copy(model))]  # a model fx cannot trace fails here, before any export
    made: list[torch.fx.GraphModule] = []

    def make() -> torch.fx.GraphModule:
        made.append(unused.pop() if unused else _traced(capture_copy(model)))
        return made[-1]

    program, notes = _export_with(make, args, kwargs, shapes, strict=False)
    _traced_module_stacks(program.graph, made[-1].graph)
    return program, notes


class _StackTracer(torch.fx.Tracer):
    """``torch.fx.Tracer`` that records each node's module stack in ``meta["fxtp_module_stack"]``
    (the tracer's own ``nn_module_stack`` is not written under ``preserve_node_meta``, which
    the checkpoint regions need) and augmented assignments as in-place ops."""

    def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = super().create_node(*args, **kwargs)
        if self.module_stack:
            node.meta["fxtp_module_stack"] = dict(self.module_stack)
        return node

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        """``y += x`` stays in place (NOTE: [in-place arithmetic at fx capture])."""
        return InPlaceProxy(node, self)

    def _filter_traceback_frames(self, user_stack_summary: traceback.StackSummary) -> traceback.StackSummary:
        """torch.fx's filter (the hook its ``TracerBase`` offers for overriding), less this
        module's own frames: the recorded stack trace ends at the model's line, not at
        :meth:`create_node` above (NOTE: [actionable fixes] quotes that line)."""
        frames = super()._filter_traceback_frames(user_stack_summary)
        return traceback.StackSummary.from_list([f for f in frames if f.filename != __file__])


def _traced_module_stacks(exported: torch.fx.Graph, traced: torch.fx.Graph) -> None:
    """Give each op of ``exported`` (torch.export of the ``symbolic_trace``d module) the modules
    it ran in. The export sees only the leaf modules the traced code still calls, so an op a
    block's own ``forward`` makes (its residual add) would belong to no block; the trace recorded
    every module (``node.meta["nn_module_stack"]``) and the export each op's traced node
    (``meta["from_node"]``). NOTE: [rank program by block] in passes/regions/blocks.py needs them."""
    stacks = {n.name: n.meta.get("fxtp_module_stack") for n in traced.nodes}
    for node in exported.nodes:
        sources = node.meta.get("from_node") or []
        source = sources[0] if sources else None
        while source is not None and source.from_node:
            source = source.from_node[0]
        recorded = stacks.get(source.name) if source is not None else None
        if not recorded:
            continue
        own = dict(node.meta.get("nn_module_stack") or {})
        paths = {path for path, _ in own.values()}
        root = {k: v for k, v in own.items() if v[0] == ""}
        merged = dict(root)
        for path, cls in recorded.values():
            if path not in paths:
                merged[f"fxtp_traced_{path}"] = (path, f"{cls.__module__}.{cls.__qualname__}")
        merged.update({k: v for k, v in own.items() if v[0] != ""})
        node.meta["nn_module_stack"] = merged


def _export(model: nn.Module, args: tuple, kwargs: dict, shapes: Any) -> tuple[torch.export.ExportedProgram, list[str]]:
    on_meta = any(p.is_meta for p in model.parameters())
    with cpu_index_lists() if on_meta else contextlib.nullcontext():  # NOTE: [index lists on meta]
        return _export_with(lambda: capture_copy(model), args, kwargs, shapes, strict=False)


def _dynamo(model: nn.Module, args: tuple, kwargs: dict, shapes: Any) -> tuple[torch.export.ExportedProgram, list[str]]:
    return _export_with(lambda: capture_copy(model), args, kwargs, shapes, strict=True)


_FRONTEND_FNS: dict[str, Callable[[nn.Module, tuple, dict, Any], tuple[torch.export.ExportedProgram, list[str]]]] = {
    "fx": _fx,
    "export": _export,
    "dynamo": _dynamo,
}


_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \w+\n\s*(.+)')


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Silence torch's own logging and prints while a frontend runs: a failed attempt is reported
    by fxtp in one line, not by torch's tracebacks and graph dumps."""
    # ``disabled``, not ``setLevel``: each ``setLevel`` clears every logger's cache, and torch
    # has some 300 loggers (a second per capture on a loaded machine, measured with cProfile).
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n == "torch" or n.startswith("torch.")]
    disabled = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    sink = io.StringIO()  # export prints the partial graph of a failed trace
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        for lg, flag in zip(loggers, disabled):
            lg.disabled = flag


def _one_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception, plus the user's source line it points at, if any."""
    text = str(exc).strip()
    first = next((line for line in text.splitlines() if line.strip()), "")
    frames = [m for m in _USER_FRAME.finditer(text) if "/torch/" not in m.group(1)]
    where = ""
    if frames:
        path, line, code = frames[-1].groups()
        where = f" (at {path.rsplit('/', 1)[-1]}:{line}: {code.strip()})"
    return f"{type(exc).__name__}: {first[:240]}{where}"


def capture(model: nn.Module, args: tuple, kwargs: dict, how: str = "auto", *, dynamic_shapes: Any = None) -> Captured:
    """Capture ``model(*args, **kwargs)`` with the frontend(s) ``how`` names.

    ``dynamic_shapes``: torch.export's spec (a dict/tuple by argument, a ``ShapesCollection``,
    e.g. :func:`auto_dynamic_shapes`), or ``None`` for static shapes.

    Raises:
        FxtpInputError: the example inputs do not fit the model (names the module and the
            shape it expected).
        FxtpCaptureError: every frontend tried failed; lists each with its reason. Or, before
            any is tried, Hugging Face experts on the eager loop (NOTE: [eager experts] in
            fxtp/capture/hf_experts.py).
    """
    check_experts_implementation(model)
    args, kwargs, dynamic_shapes = independent_inputs(args, kwargs, dynamic_shapes)  # NOTE: [independent example inputs]
    order = FRONTENDS if how == "auto" else (how,)
    attempts: list[tuple[str, str]] = []
    for name in order:
        try:
            # Grad mode on: fused inference fast paths (nn.TransformerEncoderLayer, nn.MultiheadAttention)
            # only run without grad, and would hide the linears inside one opaque op.
            with torch.enable_grad(), _quiet_torch_logs(), recording_checkpoints() as recorded:
                program, notes = _FRONTEND_FNS[name](model, args, kwargs, dynamic_shapes)
        except Exception as exc:  # noqa: BLE001 - every frontend failure is reported, none is fatal
            attempts.append((name, _one_line(exc)))
            continue
        check_operand_dtypes(program.graph)
        return Captured(program, name, tuple(attempts), tuple(notes), dict(recorded.context_fns))
    mismatch = diagnose_inputs(model, args, kwargs)
    if mismatch is not None:
        raise FxtpInputError(mismatch)
    tried = "\n".join(f"  - {name}: {reason}" for name, reason in attempts)
    hint = "" if how == "auto" else ' (try capture="auto" to fall back to the other frontends)'
    fix = "remove data-dependent control flow from forward (use torch.cond), or file an issue with the model"
    if any("Cache" in reason for _, reason in attempts) and "use_cache" in inspect.signature(model.forward).parameters:
        # Hugging Face models return a KV cache object by default: not a tensor, not capturable.
        fix = "pass example_kwargs={'use_cache': False} (or build the model with config.use_cache=False): a KV cache is not a tensor output"
    raise FxtpCaptureError(f"could not capture {type(model).__name__} into a graph{hint}; frontends tried:\n{tried}\nfix: {fix}")


_MATMULS = frozenset(
    {
        torch.ops.aten.linear.default,
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.matmul.default,
        torch.ops.aten.bmm.default,
    }
)


def check_operand_dtypes(graph: torch.fx.Graph) -> None:
    """Refuse a matmul whose operands have different dtypes (an int64 input into a float
    ``Linear``, fp32 into a bf16 model). Eager PyTorch refuses it too, but tracing with fake
    tensors does not, so the graph would only fail when run, on every rank.

    Raises:
        FxtpInputError: naming the node, its module and the dtypes.
    """
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _MATMULS:
            continue
        vals = [v for v in (a.meta.get("val") for a in node.all_input_nodes) if isinstance(v, torch.Tensor)]
        dtypes = sorted({str(v.dtype).replace("torch.", "") for v in vals})
        if len(dtypes) > 1 and not autocast_state({v.device.type for v in vals}):  # autocast casts them (NOTE: [autocast graphs])
            stack = node.meta.get("nn_module_stack") or {}
            module = list(stack.values())[-1][0] if stack else "(top level)"
            raise FxtpInputError(
                f"{node.format_node()} in module {module!r} multiplies operands of dtypes {', '.join(dtypes)}; "
                "PyTorch refuses this when the model runs. fix: give example inputs of the dtype the model computes in "
                "(e.g. x.float(), or model.to(x.dtype))"
            )


_INPUTS_FIX = "pass example_inputs shaped like the model's real inputs (shape and dtype)"


def diagnose_inputs(model: nn.Module, args: tuple, kwargs: dict, *, given: str = "example inputs",
                    fix: str = _INPUTS_FIX) -> Optional[str]:
    """If ``model`` fails to run eagerly on the inputs, say where and what it expected.

    Runs a copy of the model (the user's model and its buffers are not touched) under
    ``torch.no_grad``; returns ``None`` when the model runs. ``given`` names the inputs and
    ``fix`` says what to pass, in the caller's words (the CLI's are ``--input``; ``given=""``:
    the message starts at the module that refused them).
    """
    probe = copy.deepcopy(model)
    stack: list[tuple[str, nn.Module, tuple]] = []
    failing: list[tuple[str, nn.Module, tuple]] = []

    def pre_hook(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple) -> None:
            stack.append((name, module, inputs))

        return hook

    def post_hook(module: nn.Module, inputs: tuple, output: Any) -> None:
        stack.pop()

    handles = []
    for name, module in probe.named_modules():
        handles.append(module.register_forward_pre_hook(pre_hook(name)))
        handles.append(module.register_forward_hook(post_hook))
    try:
        with torch.no_grad():
            probe(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - turned into a message below
        failing = list(stack)
        error = _one_line(exc)
    else:
        return None
    finally:
        for h in handles:
            h.remove()
    lead = f"{given} do not fit the model: " if given else ""
    if not failing:
        return f"{lead}{type(model).__name__} raised: {error}. fix: {fix}"
    name, module, inputs = failing[-1]
    shapes = ", ".join(str(tuple(t.shape)) for t in inputs if isinstance(t, torch.Tensor))
    where = f"module '{name}' ({module})" if name else f"the model ({type(module).__name__})"
    received = f"received input of shape {shapes}" if shapes else "received no tensor input"
    expected = _expected(module)
    weight = next(module.parameters(recurse=False), None)
    dtypes = {t.dtype for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if weight is not None and dtypes and weight.dtype not in dtypes and "dtype" in error:
        received = f"received input of dtype {', '.join(sorted(str(d) for d in dtypes))}"
        expected = f" but its weight is {weight.dtype}"
    return f"{lead}{where} {received}{expected}: {error}. fix: {fix}"


def _expected(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return f" but expects (..., {module.in_features})"
    if isinstance(module, nn.Embedding):
        return f" but expects integer indices < {module.num_embeddings}"
    if isinstance(module, nn.LayerNorm):
        return f" but expects (..., {', '.join(map(str, module.normalized_shape))})"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return f" but expects {module.in_channels} input channels"
    return ""


def written_state(program: torch.export.ExportedProgram) -> dict[str, str]:
    """``{placeholder: FQN}`` of the buffers and constants the graph writes in place (a static
    KV cache's ``index_copy_``): the planner may store them sharded, like parameters."""
    state = {
        spec.arg.name: spec.target
        for spec in program.graph_signature.input_specs
        if spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    }
    written: dict[str, str] = {}
    for node in program.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for i, arg in enumerate(node.target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node) and value.name in state:
                written[value.name] = state[value.name]
    return written
