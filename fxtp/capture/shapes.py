"""Input shapes of a captured program: which dims are dynamic, their ranges, and the check of
runtime inputs against them.

``torch.export`` gives every dynamic input dim a symbol (``s0``) with a range
(``program.range_constraints``); dims the model fixes (a ``Linear``'s ``in_features``) and dims
the example had at size 0 or 1 are plain ints (export's 0/1 specialization: a dynamic dim's
range starts at 2 unless an explicit ``Dim(min=1)`` says otherwise). Dims sharing a symbol must
be equal at run time (the batch of ``input_ids`` and ``attention_mask``).

:func:`input_specs` reads this once per captured program; :func:`check_inputs` checks every
call against it (rank, dtype, static sizes, ranges, equal dims), raising ``FxtpInputError``
that names the input, the dim and the range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import sympy
import torch
from torch.export import Dim, ExportedProgram, ShapesCollection
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils._sympy.numbers import int_oo

from fxtp.core.errors import FxtpInputError

__all__ = ["DimSpec", "InputSpec", "input_specs", "check_inputs", "describe_dims", "describe_inputs", "specialized_shapes"]


@dataclass(frozen=True)
class DimSpec:
    """One dim of a tensor input: ``size`` when static; else its ``symbol`` (``"s0"``, or an
    expression of symbols for a derived dim), its range ``[lo, hi]`` (``hi`` None: unbounded)
    and the example's size."""

    size: Optional[int] = None
    symbol: Optional[str] = None
    lo: int = 0
    hi: Optional[int] = None
    example: int = 0

    @property
    def dynamic(self) -> bool:
        return self.size is None

    def range_text(self) -> str:
        return f"[{self.lo}, {'inf' if self.hi is None else self.hi}]"


@dataclass(frozen=True)
class InputSpec:
    """One flat user input: a tensor (``dtype`` and ``dims``) or a constant ``value``."""

    name: str
    dtype: Optional[torch.dtype] = None
    dims: tuple[DimSpec, ...] = ()
    value: Any = None

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None


def input_specs(program: ExportedProgram) -> tuple[InputSpec, ...]:
    """The user inputs of ``program``, in flat order (``program.call_spec.in_spec``)."""
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    ranges = {str(sym): vr for sym, vr in program.range_constraints.items()}
    specs = []
    for spec in program.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        val = nodes[spec.arg.name].meta.get("val") if spec.arg.name in nodes else None
        if not isinstance(val, torch.Tensor):
            specs.append(InputSpec(spec.arg.name, value=getattr(spec.arg, "value", val)))
            continue
        dims = []
        for size in val.shape:
            if not isinstance(size, torch.SymInt):
                dims.append(DimSpec(size=int(size), example=int(size)))
                continue
            expr = size.node.expr
            if isinstance(expr, sympy.Integer):
                dims.append(DimSpec(size=int(expr), example=int(expr)))
                continue
            vr = ranges.get(str(expr))
            lo = int(vr.lower) if vr is not None else 0
            hi = None if vr is None or vr.upper in (int_oo, sympy.oo) else int(vr.upper)
            dims.append(DimSpec(symbol=str(expr), lo=lo, hi=hi, example=optimization_hint(size)))
        specs.append(InputSpec(spec.arg.name, dtype=val.dtype, dims=tuple(dims)))
    return tuple(specs)


def check_inputs(flat: list[Any], specs: tuple[InputSpec, ...]) -> None:
    """Check flat user inputs against ``specs`` (see the module docstring).

    Raises:
        FxtpInputError: naming the input, the dim, the size it got and the range it allows.
    """
    bound: dict[str, tuple[int, str]] = {}  # symbol -> (size, "input 'x' dim 0") first seen
    dynamic = any(d.dynamic for spec in specs for d in spec.dims)
    for value, spec in zip(flat, specs):
        if not spec.is_tensor:
            if isinstance(value, torch.Tensor) or value != spec.value:
                raise FxtpInputError(
                    f"input {spec.name!r} is {value!r} but the module was compiled with {spec.value!r}: a non-tensor "
                    "input is a constant of the graph. fix: pass the same value, or compile again with this one"
                )
            continue
        if not isinstance(value, torch.Tensor):
            raise FxtpInputError(f"input {spec.name!r} must be a tensor ({spec.dtype}), got {type(value).__name__}")
        if value.dim() != len(spec.dims) or value.dtype != spec.dtype:
            raise FxtpInputError(
                f"input {spec.name!r} is {tuple(value.shape)} {value.dtype} but the module runs on {len(spec.dims)}-D "
                f"{spec.dtype} inputs ({describe_dims(spec)}). fix: pass a tensor of that rank and dtype"
            )
        for d, (size, dim) in enumerate(zip(value.shape, spec.dims)):
            where = f"input {spec.name!r} dim {d}"
            if not dim.dynamic:
                if size != dim.size:
                    raise FxtpInputError(
                        f"{where} is {size} but the module was compiled with it static at {dim.size} "
                        f"({describe_dims(spec)}). fix: pass size {dim.size}{_static_why(dynamic)}"
                    )
                continue
            if size < dim.lo or (dim.hi is not None and size > dim.hi):
                low = " (torch.export treats sizes 0 and 1 as special: for size 1 pass dynamic_shapes with Dim(..., min=1))" if size < 2 <= dim.lo else ""
                raise FxtpInputError(
                    f"{where} is {size}, outside the range {dim.range_text()} the module runs on "
                    f"({describe_dims(spec)}){low}"
                )
            if dim.symbol in bound and bound[dim.symbol][0] != size:
                raise FxtpInputError(
                    f"{where} is {size} but must equal {bound[dim.symbol][1]} ({bound[dim.symbol][0]}): the model uses "
                    "them together. fix: pass inputs whose sizes agree"
                )
            bound.setdefault(dim.symbol, (size, where))


def _static_why(dynamic: bool) -> str:
    """Why a static dim is static, for an error's fix (NOTE: [dynamic shapes] in
    fxtp/capture/frontends.py). In a dynamic capture (some dim kept a symbol) fxtp asks every
    dim to be dynamic, so one left static is the model's: a weight's size (a Linear's input
    features) that no ``dynamic_shapes`` can free; else the caller's own ``dynamic_shapes``
    kept it. In a static capture, ``dynamic=True`` (the default) keeps what the model allows."""
    if dynamic:
        return ("; the model fixes it (e.g. a weight's size, such as a Linear's input features, which no capture can make "
                "dynamic), or the dynamic_shapes= passed at compile left it static")
    return ", or compile with dynamic=True (the default): it keeps every dim the model allows dynamic"


def describe_dims(spec: InputSpec) -> str:
    """``ids: (s0 in [2, inf], s1 in [2, 16])`` or ``x: (s0 in [2, inf], 64)``."""
    parts = [str(d.size) if not d.dynamic else f"{d.symbol} in {d.range_text()}" for d in spec.dims]
    return f"{spec.name}: ({', '.join(parts)})"


def describe_inputs(specs: tuple[InputSpec, ...], *, notes: bool = False) -> list[str]:
    """The report's ``input dims`` lines: ``input dims: ids (s0 in [2, inf], 1); mask (...)``
    (a symbol: dynamic, in its range; a number: static), then, indented, one line per kind of
    static dim saying why it is static, as far as fxtp knows:

    - an example size of 0 or 1 in a dynamic capture (some dim has a symbol): torch.export's
      0/1 specialization (the module docstring); an example of 2 keeps it dynamic;
    - any other static size in a dynamic capture: the model fixes it (its guards: a weight's
      size such as a Linear's input features, which no ``dynamic_shapes`` frees), or the
      caller's ``dynamic_shapes`` or, with ``notes``, one of the shape notes printed below;
    - in a static capture (no dim has a symbol): ``dynamic=False`` or a note below.

    Returns ``[]`` when ``specs`` holds no tensor.
    """
    tensors = [spec for spec in specs if spec.is_tensor]
    if not tensors:
        return []
    dims = [d for spec in tensors for d in spec.dims]
    dynamic = any(d.dynamic for d in dims)
    small = sorted({d.size for d in dims if not d.dynamic and dynamic and d.size in (0, 1)})
    fixed = sorted({d.size for d in dims if not d.dynamic and d.size not in small})
    parts = [f"{spec.name} ({', '.join(str(d.size) if not d.dynamic else f'{d.symbol} in {d.range_text()}' for d in spec.dims)})"
             for spec in tensors]
    lines = ["input dims: " + "; ".join(parts)]
    if small:
        lines.append(f"  {', '.join(map(str, small))}: the example's size (torch.export specializes 0 and 1); "
                     "an example of 2 keeps it dynamic")
    if fixed and dynamic:
        also = ", or the dynamic_shapes= passed" + (" or a note below" if notes else "")
        lines.append(f"  {', '.join(map(str, fixed))}: static (the model fixes it, e.g. a Linear's input features{also})")
    elif fixed:
        why = "dynamic=False" + (" or a note below" if notes else "")
        lines.append(f"  {', '.join(map(str, fixed))}: static ({why}; dynamic=True keeps the dims the model allows dynamic)")
    return lines


def specialized_shapes(flat: list[Any], specs: tuple[InputSpec, ...], symbols: set[str]) -> ShapesCollection:
    """A ``dynamic_shapes`` spec (a ``torch.export.ShapesCollection`` over the example tensors
    ``flat``) that reproduces ``specs`` but makes every dim whose symbol is in ``symbols``
    static at the example's size: one ``Dim`` per remaining symbol, with its range, shared by
    the dims that share it; derived dims are ``Dim.AUTO``."""
    dims: dict[str, Any] = {}
    shapes = ShapesCollection()
    for value, spec in zip(flat, specs):
        if not spec.is_tensor or not isinstance(value, torch.Tensor):
            continue
        entry = {}
        for d, dim in enumerate(spec.dims):
            if not dim.dynamic or dim.symbol in symbols:
                entry[d] = Dim.STATIC
            elif dim.symbol.isidentifier():
                if dim.symbol not in dims:
                    dims[dim.symbol] = Dim(f"d_{dim.symbol}", min=dim.lo, max=dim.hi)
                entry[d] = dims[dim.symbol]
            else:
                entry[d] = Dim.AUTO
        shapes[value] = entry
    return shapes
