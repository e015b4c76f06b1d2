"""Sharded parameters: whole-tensor computations on a rank's shard give the single device's answer.

A tensor-parallel rank holds a slice of every sharded parameter. Code outside the graph that
treats ``pm.parameters()`` as whole tensors (``torch.nn.utils.clip_grad_norm_``, a norm of the
parameters, ``torch.amp.GradScaler``'s found-inf check) would silently compute a per-rank answer.
:class:`ShardedParameter` makes those computations exact (NOTE: [sharded parameters]).

NOTE: [sharded parameters]
Every parameter whose placement is a ``Shard`` (any: one segment, fused Q|K|V segments, uneven
front-loaded units, NOTE: [uneven shards]) is a :class:`ShardedParameter`: an ``nn.Parameter``
over the plain local tensor (same storage, same shape: the rank's slice), whose
``__torch_function__`` knows that the elements of the full parameter are split over the
tensor-parallel group, each element on exactly one rank (a grouped shard's kv heads live on
every rank that reads them: its reductions count the rows this rank owns, NOTE: [grouped shards]
in fxtp/core/placement.py). Its ``.grad`` and what pointwise and
shape ops make of it (``p.grad * c``, ``p.detach().float()``, ``torch.zeros_like(p)``, ``p.T``)
are :class:`ShardedTensor` s with the same knowledge. On them:

* pointwise ops, views, casts and the ``_foreach_`` ops optimizers use (SGD, AdamW, weight
  decay, EMA's ``lerp_``, ``clip_grad_value_``'s clamp) run on the shard: exact (NOTE: [foreach types] in fxtp/core/torch_globals.py).
* reductions over all elements (``torch.linalg.vector_norm``, ``norm``, ``_foreach_norm``,
  ``sum``, ``mean``, ``max``/``amax``, ``min``/``amin``, ``count_nonzero``) reduce the shard and
  then all_reduce over the group: every rank gets the single device's value. They are
  collectives: every rank of the group must make the same calls (as with DTensor).
* GradScaler's ``_amp_foreach_non_finite_check_and_unscale_`` all_reduces the found-inf flag
  (max) over the group, so every rank steps or skips together (Megatron-LM does the same; under
  FSDP2, NOTE: [found-inf over dp x tp] in fxtp/runtime/amp.py).
* matrix transforms (``@``, ``mm``, ``torch.linalg.*``, ``svd``: Muon's Newton-Schulz, Shampoo),
  reductions along a dim, and ops on a subset or an order of the elements (indexing, ``split``,
  ``sort``, ``cumsum``, ``cat`` with replicated tensors) raise :class:`FxtpRuntimeError`: on a
  shard they would be silently wrong.
* anything else (metadata, ``copy_``, ``new_zeros``) runs on the shard and returns plain tensors;
  so do pieces of a ``ShardedParameter`` itself (``p[0]``, ``p.chunk(2)``: FSDP2's
  ``fully_shard`` chunks the parameters it replaces), not of its gradient.

Replicated parameters stay plain ``nn.Parameter`` s: their copies (and gradients) are identical on
every rank, so any computation on them is the single device's already. The rank graph runs on
plain tensors (:func:`plain_inputs`), and ``bool`` reductions (``all``/``any``) stay local, so an
assertion on one rank's shard cannot hang the others. Why not DTensor parameters, and this
type's limits under FSDP2: docs/internals.md, "Sharded parameters".
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.distributed_c10d import _resolve_process_group  # NOTE: [group by name]: private, wrapped here only

from fxtp.core.errors import FxtpRuntimeError
from fxtp.core.placement import Shard, owned_part
from fxtp.core.torch_globals import join_foreach_types

__all__ = ["ShardLayout", "ShardedTensor", "ShardedParameter", "plain", "local_tensor", "layout_of", "like", "plain_inputs", "plain_views", "resolve_group"]

_TENSOR_GRAD = torch._C.TensorBase.grad


@dataclass(frozen=True)
class ShardLayout:
    """Where a sharded tensor's elements live.

    Attributes:
        fqn: the parameter's FQN in the original model (for messages).
        placement: its tensor-parallel ``Shard``.
        group_name: the tensor-parallel group's name (NOTE: [group by name] in fxtp/runtime/layout.py).
        world_size: the group's size.
    """

    fqn: str
    placement: Shard
    group_name: str
    world_size: int

    def group(self) -> dist.ProcessGroup:
        return resolve_group(self.group_name)


def resolve_group(name: str) -> dist.ProcessGroup:
    """The ``ProcessGroup`` named ``name`` (NOTE: [group by name] in fxtp/runtime/layout.py)."""
    return _resolve_process_group(name)


@contextlib.contextmanager
def plain() -> Iterator[None]:
    """Sharded tensors as plain tensors inside (the rank graph, fxtp's bookkeeping; ``torch.compile`` traces it):
    ``torch._C.DisableTorchFunctionSubclass``, which ``Tensor.__torch_function__`` runs ops under; private: here only."""
    with torch._C.DisableTorchFunctionSubclass():
        yield


def layout_of(t: Any) -> Optional[ShardLayout]:
    """The layout of a sharded tensor, ``None`` for anything else."""
    return t.__dict__.get("_fxtp_layout") if isinstance(t, ShardedTensor) else None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor (this rank's shard; an alias, no copy); any other tensor as is.
    Like ``DTensor.to_local()``: to compare with ``shard_tensor(full, ...)``, or compute per rank."""
    if not isinstance(t, ShardedTensor):
        return t
    with plain():
        return t.as_subclass(torch.Tensor)


@torch.compiler.disable
def plain_inputs(inputs: list[Any]) -> list[Any]:
    """The rank graph's inputs with sharded parameters as plain aliases (autograd reaches the
    parameters through them), eagerly (while Dynamo traces, :func:`plain_views`); a DTensor parameter
    (NOTE: [DTensor parameters for FSDP2] in fxtp/runtime/dtensor_params.py) as its ``to_local()``; detached
    under ``no_grad`` (an alias there requires grad with no grad_fn: CommDebugMode's module hooks raise)."""
    grad = torch.is_grad_enabled()
    return [(local_tensor(t) if grad else local_tensor(t).detach()) if isinstance(t, ShardedTensor)
            else (t.to_local() if grad else t.to_local().detach()) if isinstance(t, DTensor) else t for t in inputs]


def plain_views(inputs: list[Any]) -> list[Any]:
    """:func:`plain_inputs` that Dynamo traces: a sharded tensor becomes a plain view of itself
    (``view_as`` with ``__torch_function__`` off; Dynamo cannot trace ``as_subclass`` on it), a
    DTensor its ``to_local()``. For a block's state read inside a compiled rank graph (NOTE:
    [blocks under torch.compile] in fxtp/runtime/blocks.py); autograd reaches the parameters
    through the views."""
    with plain():
        return [t.view_as(t) if isinstance(t, ShardedTensor) else t.to_local() if isinstance(t, DTensor) else t
                for t in inputs]


def plain_graph_inputs(inputs: list[Any]) -> list[Any]:
    """:func:`plain_views` while Dynamo traces, else :func:`plain_inputs`."""
    return plain_views(inputs) if torch.compiler.is_compiling() else plain_inputs(inputs)


def _wrap(t: Any, layout: ShardLayout) -> Any:
    if isinstance(t, (list, tuple)):
        return type(t)(_wrap(x, layout) for x in t)
    if type(t) is torch.Tensor:
        with plain():
            t = t.as_subclass(ShardedTensor)
    if isinstance(t, ShardedTensor) and "_fxtp_layout" not in t.__dict__:
        t.__dict__["_fxtp_layout"] = layout
    return t


def _flat(args: Any) -> Iterator[Any]:
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def _first_layout(args: Sequence[Any], kwargs: dict) -> Optional[ShardLayout]:
    return next((l for l in map(layout_of, _flat([*args, *kwargs.values()])) if l is not None), None)


# --- what each op does to a shard ----------------------------------------------------------------

_REDUCE, _AMP, _KEEP, _DENY, _OTHER = "reduce", "amp", "keep", "deny", "other"

# Full reductions fxtp computes over the group (`all`/`any` stay local: see the NOTE).
_REDUCTIONS = {"linalg_vector_norm", "norm", "_foreach_norm", "sum", "nansum", "mean", "nanmean", "amax", "amin",
               "max", "min", "count_nonzero", "_foreach_max"}
# Views and casts keep every element where it was: the result is the same shard of something.
_SHAPE = {"view", "view_as", "reshape", "reshape_as", "flatten", "ravel", "t", "t_", "transpose", "transpose_",
          "permute", "squeeze", "squeeze_", "unsqueeze", "unsqueeze_", "contiguous", "detach", "detach_", "clone",
          "to", "type", "float", "half", "bfloat16", "double", "requires_grad_", "zero_", "fill_", "zeros_like",
          "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "T", "mT", "H", "mH", "data",
          "cat", "concat", "concatenate", "stack", "hstack", "vstack"}
# On a shard these are silently wrong: they transform matrices, reduce along a dim, or read a
# subset or an order of the elements.
_DENIED = {"matmul", "__matmul__", "__rmatmul__", "__imatmul__", "mm", "bmm", "mv", "dot", "vdot", "inner", "outer",
           "ger", "addmm", "addmm_", "addmv", "addr", "addbmm", "baddbmm", "einsum", "tensordot", "kron",
           "chain_matmul", "svd", "svd_lowrank", "pca_lowrank", "qr", "lu", "eig", "cholesky", "inverse", "pinverse",
           "det", "logdet", "slogdet", "trace", "diag", "diagonal", "diag_embed", "triu", "tril", "triu_", "tril_",
           "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "sort", "argsort", "msort", "topk", "kthvalue",
           "median", "nanmedian", "quantile", "nanquantile", "mode", "argmax", "argmin", "std", "var", "std_mean",
           "var_mean", "logsumexp", "softmax", "log_softmax", "prod", "cov", "corrcoef", "cross", "flip", "fliplr",
           "flipud", "roll", "rot90", "matrix_power", "matrix_exp", "histc", "unique", "renorm", "__getitem__",
           "index_select", "masked_select", "gather", "take", "take_along_dim", "split", "chunk", "unbind",
           "tensor_split", "narrow", "expand", "expand_as", "repeat", "tile", "nonzero", "dist", "cdist"}
# Taking pieces of a parameter itself (not of its gradient or what is computed from it) gives
# plain pieces of the shard: FSDP2's fully_shard chunks the parameters it replaces.
_SLICES = {"__getitem__", "split", "chunk", "unbind", "tensor_split", "narrow", "index_select"}
_DUNDER = {"truediv": "div", "rtruediv": "div", "itruediv": "div_", "floordiv": "floor_divide", "radd": "add",
           "rsub": "rsub", "rmul": "mul", "rpow": "pow", "iadd": "add_", "isub": "sub_", "imul": "mul_",
           "ipow": "pow_", "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not",
           "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne", "neg": "neg", "abs": "abs",
           "pow": "pow", "add": "add", "sub": "sub", "mul": "mul", "div": "div", "mod": "remainder"}
_KINDS: dict[str, str] = {}  # by name: a property's __get__ is a new object at every read


def _name(func: Callable) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property (p.T, p.grad): the descriptor's name
        return getattr(getattr(func, "__self__", None), "__name__", name)
    if name.startswith("__") and name.endswith("__") and name[2:-2] in _DUNDER:
        return _DUNDER[name[2:-2]]
    return name


def _is_pointwise(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None or not hasattr(packet, "overloads"):
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def _kind(func: Callable) -> str:
    name = _name(func)
    if name not in _KINDS:
        if name in _REDUCTIONS:
            kind = _REDUCE
        elif name == "_amp_foreach_non_finite_check_and_unscale_":
            kind = _AMP
        elif name in _DENIED or name.startswith("linalg_") or name.startswith("_linalg"):
            kind = _DENY
        elif name in _SHAPE or _is_pointwise(name) or (name.startswith("_foreach_") and _is_pointwise(name[9:])):
            kind = _KEEP
        else:
            kind = _OTHER
        _KINDS[name] = kind
    return _KINDS[name]


def _refuse(func: Callable, layout: ShardLayout, why: str) -> FxtpRuntimeError:
    return FxtpRuntimeError(
        f"{_name(func)} on a tensor made from parameter {layout.fqn!r} (this rank's {layout.placement} shard over "
        f"{layout.world_size} ranks, or its gradient): {why}, so on the shard it would silently differ from the single "
        "device's answer (NOTE: [sharded parameters]). fxtp computes norms, sums, max/min and GradScaler's found-inf "
        "exactly over the group. fix: for a whole-matrix optimizer (Muon, Shampoo) keep the parameter replicated "
        f"(fxtp.compile(..., plan={{{layout.fqn!r}: 'replicate'}})) or leave sharded matrices out of that update; "
        "to compute on the shard on purpose, use fxtp.runtime.sharded.local_tensor(t); for the full tensor, "
        "pm.full_state_dict()"
    )


# --- exact reductions ------------------------------------------------------------------------------


def _arg(args: Sequence[Any], kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _norm_order(func_name: str, args: Sequence[Any], kwargs: dict) -> tuple[float, Any]:
    """``(ord, dim)`` of a norm call; raises on a matrix norm."""
    if func_name == "linalg_vector_norm":
        return float(_arg(args, kwargs, 1, "ord", 2)), _arg(args, kwargs, 2, "dim", None)
    p = _arg(args, kwargs, 1, "p", "fro")
    if p in ("fro", None):
        p = 2
    if isinstance(p, str):
        return math.nan, p  # 'nuc': a matrix norm
    return float(p), _arg(args, kwargs, 2, "dim", None)


def _contribution(local: torch.Tensor, order: float) -> tuple[torch.Tensor, Any]:
    """``(value, op)``: what each rank contributes to a norm of ``order`` and how it combines."""
    local = local.to(torch.promote_types(local.dtype, torch.float32))
    if order == math.inf:
        return local, dist.ReduceOp.MAX
    if order == -math.inf:
        return local, dist.ReduceOp.MIN
    return (local if order == 0 else local.pow(order)), dist.ReduceOp.SUM


def _finish(total: torch.Tensor, order: float) -> torch.Tensor:
    return total if order in (0, math.inf, -math.inf) else total.pow(1.0 / order)


def _all_reduce(values: list[torch.Tensor], op: Any, layout: ShardLayout) -> list[torch.Tensor]:
    """One all_reduce of several scalars of one dtype (stacked; bf16/fp16 travel as float32,
    which every backend reduces), returned in their dtype."""
    if not values:
        return []
    dtype = values[0].dtype
    wire = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    stacked = torch.stack([v.reshape(()).to(wire) for v in values])
    dist.all_reduce(stacked, op=op, group=layout.group())
    return [v.to(dtype) for v in stacked.unbind()]


def _owned(t: torch.Tensor) -> torch.Tensor:
    """The elements of a sharded ``t`` this rank counts in a whole-tensor reduction: all of its
    shard, or of a grouped shard the rows it owns (NOTE: [grouped shards]); call under ``plain``."""
    layout = layout_of(t) if isinstance(t, ShardedTensor) else None
    if layout is None or not layout.placement.overlaps:
        return t
    return owned_part(t, layout.placement, dist.get_rank(layout.group()), layout.world_size)


def _norms(func: Callable, tensors: Sequence[torch.Tensor], order: float, dtype: Any) -> list[torch.Tensor]:
    """Exact norms of ``tensors`` (sharded ones over the group, in one all_reduce)."""
    with plain():
        local = [torch.linalg.vector_norm(_owned(t), order, dtype=dtype) for t in tensors]
    sharded = [i for i, t in enumerate(tensors) if layout_of(t) is not None]
    if not sharded:
        return local
    layout = layout_of(tensors[sharded[0]])
    with plain():
        parts = [_contribution(local[i], order) for i in sharded]
        totals = _all_reduce([v for v, _ in parts], parts[0][1], layout)
        for i, total in zip(sharded, totals):
            local[i] = _finish(total, order).to(local[i].dtype)
    return local


def _reduce(func: Callable, args: Sequence[Any], kwargs: dict) -> Any:
    name, layout = _name(func), _first_layout(args, kwargs)
    assert layout is not None
    if name in ("_foreach_norm", "_foreach_max"):
        tensors = list(args[0])
        if name == "_foreach_max":
            return [_reduce(torch.amax, (t,), {}) if layout_of(t) else t.amax() for t in tensors]
        return _norms(func, tensors, float(_arg(args, kwargs, 1, "ord", 2)), kwargs.get("dtype"))
    x = args[0]
    if name in ("linalg_vector_norm", "norm"):
        order, dim = _norm_order(name, args, kwargs)
        if math.isnan(order):
            raise _refuse(func, layout, "a matrix norm mixes the shard's rows and columns")
        if dim not in (None, ()):
            raise _refuse(func, layout, f"a norm along dim {dim} may reduce over the sharded dim")
        (value,) = _norms(func, [x], order, kwargs.get("dtype"))
        return value.reshape([1] * x.dim()) if _arg(args, kwargs, 3, "keepdim", False) else value
    extra = [a for a in args[1:] if not isinstance(a, torch.dtype)]
    if name in ("max", "min") and extra and isinstance(extra[0], torch.Tensor):
        with plain():  # torch.max(a, b): pointwise
            return _wrap(func(*args, **kwargs), layout)
    if extra or kwargs.get("dim") not in (None, ()) and "dim" in kwargs:
        raise _refuse(func, layout, "a reduction along a dim may reduce over the sharded dim")
    with plain():
        if name in ("sum", "nansum", "count_nonzero", "mean", "nanmean"):
            x = _owned(x)
            args = (x, *args[1:])
        if name in ("sum", "nansum", "count_nonzero"):
            (total,) = _all_reduce([func(*args, **kwargs)], dist.ReduceOp.SUM, layout)
            return total
        if name in ("mean", "nanmean"):
            kept = x.isnan().logical_not().sum() if name == "nanmean" else torch.tensor(x.numel(), device=x.device)
            local = torch.nansum(x, dtype=torch.float64) if name == "nanmean" else x.sum(dtype=torch.float64)
            total, count = _all_reduce([local, kept.to(torch.float64)], dist.ReduceOp.SUM, layout)
            return (total / count).to(kwargs.get("dtype") or x.dtype)
        op = dist.ReduceOp.MAX if name in ("max", "amax") else dist.ReduceOp.MIN
        (value,) = _all_reduce([func(*args, **kwargs)], op, layout)
        return value


def _compiled_kernel(kwargs: dict) -> bool:
    """A call writing into a plain ``out=``, as inductor's extern kernels make them.

    NOTE: [compiled kernels on shards]: under ``torch.compile`` a sharded parameter reaches
    inductor's code as a graph input, and its extern kernels (``extern_kernels.mm(primals_3, x,
    out=buf0)``, forward or on a saved input in backward) call ops refused on a shard. They are the
    rank graph's own, local by construction: they run on the shard. (A user's whole-matrix update
    written with ``out=`` is not caught.)"""
    return isinstance(kwargs.get("out"), torch.Tensor) and not isinstance(kwargs["out"], ShardedTensor)


class ShardedTensor(torch.Tensor):
    """A rank's shard of a tensor whose elements are split over a tensor-parallel group: a plain
    tensor whose whole-tensor computations are exact or refused (NOTE: [sharded parameters])."""

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Sequence[Any] = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        kind = _kind(func)
        layout = _first_layout(args, kwargs)
        if layout is None:  # e.g. a property read on a tensor made by torch internals
            with plain():
                return func(*args, **kwargs)
        if kind == _REDUCE:
            return _reduce(func, args, kwargs)
        if kind == _DENY and _compiled_kernel(kwargs):  # NOTE: [compiled kernels on shards]
            with plain():
                return func(*args, **kwargs)
        if kind == _DENY and not (_name(func) in _SLICES and isinstance(args[0], ShardedParameter)):
            raise _refuse(func, layout, "it transforms the matrix, reads a subset or an order of its elements, or "
                          "reduces along a dim")
        if _name(func) in ("cat", "concat", "concatenate", "stack", "hstack", "vstack"):
            if any(isinstance(t, torch.Tensor) and layout_of(t) is None for t in _flat(args)):
                raise _refuse(func, layout, "it joins shards with tensors every rank holds in full (a norm of the "
                              "result would count those on every rank)")
        with plain():
            out = func(*args, **kwargs)
            if kind == _AMP:
                found_inf = _arg(args, kwargs, 1, "found_inf", None)
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=layout.group())
                return out
        return _wrap(out, layout) if kind == _KEEP else out

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        layout = layout_of(self)
        with plain():
            text = torch.Tensor.__repr__(self.as_subclass(torch.Tensor))
        return f"Sharded({text}, {layout.placement if layout else '?'} of {layout.fqn if layout else '?'})"


class ShardedParameter(ShardedTensor, nn.Parameter):
    """An ``nn.Parameter`` over this rank's shard (``local``) of a sharded parameter; its
    ``.grad`` is a :class:`ShardedTensor` (NOTE: [sharded parameters]).

    Args:
        data: the local shard.
        requires_grad: as ``nn.Parameter``.
        layout: where the full parameter's elements live.
    """

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True, layout: Optional[ShardLayout] = None) -> "ShardedParameter":
        self = nn.Parameter.__new__(cls, local_tensor(data), requires_grad)
        self.__dict__["_fxtp_layout"] = layout
        return self

    @property  # type: ignore[override]
    def grad(self) -> Optional[torch.Tensor]:
        g = _TENSOR_GRAD.__get__(self)
        return None if g is None or isinstance(g, ShardedTensor) else _wrap(g, self.__dict__["_fxtp_layout"])

    @grad.setter
    def grad(self, value: Optional[torch.Tensor]) -> None:
        _TENSOR_GRAD.__set__(self, local_tensor(value) if value is not None else None)

    def __deepcopy__(self, memo: dict) -> "ShardedParameter":
        if id(self) not in memo:
            with plain():
                data = self.data.clone(memory_format=torch.preserve_format)
            memo[id(self)] = ShardedParameter(data, self.requires_grad, self.__dict__["_fxtp_layout"])
        return memo[id(self)]

    def __reduce_ex__(self, protocol: Any) -> Any:
        with plain():
            data = self.data.as_subclass(torch.Tensor)
        return (ShardedParameter, (data, self.requires_grad, self.__dict__["_fxtp_layout"]))

    def __repr__(self) -> str:
        return "ShardedParameter containing:\n" + ShardedTensor.__repr__(self)


def like(current: torch.Tensor, value: nn.Parameter) -> nn.Parameter:
    """``value`` (a new parameter replacing ``current``, e.g. materialized from ``meta``) with
    ``current``'s layout."""
    layout = layout_of(current)
    return value if layout is None else ShardedParameter(value.detach(), value.requires_grad, layout)


join_foreach_types(ShardedTensor, ShardedParameter)  # torch's _foreach_ paths take them (NOTE: [foreach types])
