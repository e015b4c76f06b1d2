"""Activations saved for backward: sequence parallelism's regathered inputs, and their measure.

NOTE: [regathered activations]
Under sequence parallelism (NOTE: [sequence parallelism] in passes/sequence.py) a colwise
layer's input is all_gathered from the token shards, and the layer saves that whole input for
its weight gradient: kept as is, every layer would hold a whole ``(B, T, H)`` activation again
and sequence parallelism would save little. Megatron-LM's sequence-parallel linear saves its
input shard and all_gathers it again in backward (Korthikanti et al. 2022, section 4.2.2); fxtp
does the same with autograd's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``):
while :func:`saved_tensors` is active, every value ``fxtp.core.collectives.gather_from_sp`` returns is
registered with its shard and a function gathering it; a saved tensor that is (a view of) such a
value is stored as a token holding the shard, and the first unpack in backward gathers the value
once more, shared by all the layers that saved it (q, k and v save one input). Each rank runs
the same graph, so the backward's all_gathers come in the same order on every rank.

Under autocast a layer casts its input first (``linear`` of a float32 value under bf16 autocast
saves a bf16 copy, not the gathered value nor a view of it): ``pack`` recognizes such a copy by
its autograd node (``ToCopyBackward0`` of the gathered value or of a whole-tensor ``view`` of
it; the value's own node where it is a contiguous view of a buffer that has none, as a
gather along the sequence dim at batch 1 is) and saves it as the same token; the unpack gathers the float32 shard once, as for the
other layers that saved the value, and casts it (a cast of a gather is the gather of the cast,
bit for bit). One regather per value whatever the dtypes its layers save: the count
``fxtp/explain/counts.py`` reports. A copy without an autograd node (a value no gradient flows
through) cannot be traced to its gather and is saved as is.

:func:`measure` counts the bytes a forward saves for backward (parameters excluded, a storage
counted once, a regathered value as its shard): the figure ``tools/bench.py`` reports.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

__all__ = ["saved_tensors", "measure", "SavedBytes", "gathered", "count_held"]


@dataclass
class SavedBytes:
    """Bytes saved for backward during a :func:`measure` block (``total``), per kind."""

    total: int = 0
    regathered: int = 0  # of which: shards standing for gathered values (NOTE: [regathered activations])
    _seen: set[int] = field(default_factory=set, repr=False)

    def add(self, t: torch.Tensor, regathered: bool = False) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._seen or key == 0:
            return
        self._seen.add(key)
        self.total += storage.nbytes()
        self.regathered += storage.nbytes() if regathered else 0


_MEASURES: list[SavedBytes] = []
_GATHERED: list[dict[int, "_Entry"]] = []


@dataclass
class _Entry:
    root: Any  # weakref to the gathered value's root tensor
    value: Any  # weakref to the gathered value (a view of its root whose base has no autograd node, at batch 1)
    shard: torch.Tensor
    gather: Callable[[torch.Tensor], torch.Tensor]
    token: Optional["_Regathered"] = None


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def gathered(full: torch.Tensor, shard: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Register ``full`` (``gather(shard)``) for regathering while :func:`saved_tensors` is active."""
    if not _GATHERED or torch.compiler.is_compiling():  # a compiled graph saves its own tensors (NOTE: [hooks under torch.compile])
        return
    root = _root(full)
    table = _GATHERED[-1]
    table[id(root)] = _Entry(weakref.ref(root, lambda _, k=id(root), tb=table: tb.pop(k, None)), weakref.ref(full),
                             shard.detach(), gather)


class _Regathered:
    """A gathered value saved as its shard; gathered again at its first unpack, and cast once
    per dtype a layer saved it in (autocast's copies, NOTE: [regathered activations])."""

    def __init__(self, shard: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.shard, self.gather, self.root = shard, gather, None
        self.casts: dict[tuple[torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    def view(self, size, stride, offset) -> torch.Tensor:
        return self._root().as_strided(size, stride, offset)

    def cast_view(self, dtype: torch.dtype, shape: tuple[int, ...], size, stride, offset) -> torch.Tensor:
        """A view of ``root.view(shape).to(dtype)`` (contiguous, as autocast's copy was)."""
        key = (dtype, shape)
        if key not in self.casts:
            with torch.no_grad():
                self.casts[key] = self._root().view(shape).to(dtype).contiguous()
        return self.casts[key].as_strided(size, stride, offset)

    def _root(self) -> torch.Tensor:
        if self.root is None:
            with torch.no_grad():
                self.root = _root(self.gather(self.shard))
        return self.root


_VIEWS = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0")


def _cast_source(copy: torch.Tensor, table: dict[int, "_Entry"]) -> Optional["_Entry"]:
    """The entry whose gathered value ``copy`` is a dtype cast of (of the whole value, or of a
    whole-tensor view of it), or None (NOTE: [regathered activations], under autocast)."""
    node = copy.grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0" or not copy.is_contiguous() or copy.storage_offset():
        return None
    source = node.next_functions[0][0] if node.next_functions else None
    while source is not None and type(source).__name__ in _VIEWS:
        source = source.next_functions[0][0]
    if source is None:
        return None
    for entry in table.values():
        root, value = entry.root(), entry.value()
        # the autograd node is the root's, or (a gather that is a view of its buffer: a size-1 dim
        # moved, as at batch 1) the value's, laid out as its contiguous root
        node_of = root is not None and (root.grad_fn is source or value is not None and value.grad_fn is source
                                        and value.is_contiguous() and not value.storage_offset())
        if node_of and root.is_contiguous() and root.numel() == copy.numel():
            return entry
    return None


def _is_parameter(t: torch.Tensor) -> bool:
    root = _root(t)
    return isinstance(root, torch.nn.Parameter) or (root.is_leaf and root.requires_grad)


@contextlib.contextmanager
def saved_tensors(regather: bool) -> Iterator[None]:
    """Saved-tensor hooks for one forward: regather (NOTE: [regathered activations]) when
    ``regather``, and count into the active :func:`measure` if any. A no-op block when neither
    applies, or under ``torch.compile`` (its graphs save their own tensors)."""
    if not (regather or _MEASURES) or torch.compiler.is_compiling():
        yield
        return
    table: dict[int, _Entry] = {}
    counter = _MEASURES[-1] if _MEASURES else None

    def pack(t: torch.Tensor) -> Any:
        root = _root(t)
        entry = table.get(id(root)) if regather else None
        cast = None
        if entry is None or entry.root() is not root:
            entry = _cast_source(root, table) if regather and table else None
            if entry is None:
                if counter is not None and not _is_parameter(t):
                    counter.add(t)
                return t
            cast = (root.dtype, tuple(root.shape))
        if entry.token is None:
            entry.token = _Regathered(entry.shard, entry.gather)
        if counter is not None:
            counter.add(entry.shard, regathered=True)
        return entry.token, cast, tuple(t.shape), t.stride(), t.storage_offset()

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        token, cast, size, stride, offset = packed
        return token.view(size, stride, offset) if cast is None else token.cast_view(*cast, size, stride, offset)

    _GATHERED.append(table)
    try:  # NOTE: [hooks under torch.compile]
        with torch.autograd.graph.saved_tensors_hooks(torch.compiler.disable(pack), torch.compiler.disable(unpack)):
            yield
    finally:
        _GATHERED.pop()


# NOTE: [hooks under torch.compile]
# ``torch.compile(pm)`` runs ``ParallelModule.forward`` eagerly (its inputs are made plain tensors
# by a ``torch.compiler.disable``d function, fxtp/runtime/sharded.py ``plain_inputs``) and compiles
# the rank graph. The hooks above are then active while the compiled graph saves its tensors, and
# Dynamo, active for the whole compiled call, would try to compile ``pack`` at each saved tensor:
# one graph and one break each (``storage_offset`` returns an int). They are marked
# ``torch.compiler.disable``: they run as Python, and a tensor the compiled graph saves is not a
# value ``gathered`` registered, so it is kept as is.


def count_held(t: torch.Tensor) -> None:
    """Count ``t``'s bytes into the active :func:`measure`, if any: a tensor kept for backward
    outside autograd's saved tensors (``torch.utils.checkpoint``'s generator state)."""
    if _MEASURES:
        _MEASURES[-1].total += t.untyped_storage().nbytes()


@contextlib.contextmanager
def measure(result: Optional[SavedBytes] = None) -> Iterator[SavedBytes]:
    """Count the bytes saved for backward by the forwards run in the block (a plain model's, or
    a ``ParallelModule``'s with its regathered values as shards)::

        with fxtp.core.activations.measure() as saved:
            loss = model(x).sum()
        print(saved.total)
    """
    result = SavedBytes() if result is None else result
    _MEASURES.append(result)
    try:
        with saved_tensors(regather=False):
            yield result
    finally:
        _MEASURES.pop()
