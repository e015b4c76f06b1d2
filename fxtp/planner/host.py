"""Host time of a training step: the ops it dispatches, beside its GEMMs' FLOPs and its
collectives' bytes.

NOTE: [host time]
A step's GEMMs are priced by their FLOPs and its collectives by their bytes (NOTE: [cost model]
in fxtp/planner/costs.py). Every op the step dispatches also costs the host its dispatch, its
autograd record and, for an elementwise op, the pass over its output; an optimizer step costs
so much per parameter tensor; FSDP2 costs so much per unit and parameter tensor for its hooks,
its copy-in and copy-out (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``).
:class:`HostCosts` holds those figures, :class:`OpCounts` what a model dispatches, and
:func:`host_seconds` prices a configuration's step with them:

- forward, per micro-batch: ``ops x op + bytes x op_byte`` over the ops the model dispatches
  (every block's and those outside the blocks), the GEMMs left out (their rate is calibrated
  with their dispatch in it, NOTE: [calibration] in fxtp/planner/calibration.py); backward
  ``ops x op_backward + bytes x op_backward_byte`` per forward op and byte.
  ``bytes``: what the ops write, on a rank: the share of a block's bytes in tensors whose last
  dim is not the model's hidden size (heads, the MLP's features: what tensor parallelism
  shards) over ``tp``, the rest whole. A block recomputed (``"blocks"``) dispatches its forward
  again in backward; a ``"selective"`` one is priced so too (an upper bound: it recomputes some
  of the ops, each through torch's selective-checkpoint dispatch mode).
- optimizer: ``tensors x optimizer_tensor`` (``optimizer_dtensor`` for FSDP2's sharded
  parameters, DTensors, whose every op goes through DTensor's Python dispatch;
  ``optimizer_sharded`` at dp 1 for the tensor-parallel shards, fxtp's ``ShardedParameter``,
  whose ops go through its ``__torch_function__``: 3.3x a plain tensor's here, 6.3 ms against
  1.9 for a hidden-128 Llama's 21 tensors at tp 4, 2026-12-06) plus ``elements x
  optimizer_element``; torch's AdamW runs its per-tensor loop on CPU tensors (its foreach path is
  for CUDA tensors: ``_default_to_fused_or_foreach`` in ``torch/optim/optimizer.py``).
- FSDP2, per micro-batch: each block unit's forward all_gather, backward all_gather and
  reduce_scatter, the root's all_gather and reduce_scatter, each ``fsdp_unit + tensors x
  fsdp_tensor``: FSDP2's share, priced with its collectives (``fsdp_exposed``); under
  pipelining one all_gather and one reduce_scatter of each unit a step.
- a pipeline rank (fxtp/planner/pipeline_costs.py) is priced for its own stages: their blocks,
  their parameter tensors, and the ops outside the blocks on the last rank (the head's and the
  loss's, most of them).

The counts come from the model itself (:func:`count_ops`): its forward and backward run once on
``meta`` tensors under a dispatch mode that counts each op and what it writes, the forward's by
block (each node's ``nn_module_stack``), the backward's shared out as the forward's.

On a CPU (``asynchronous=False``) the host is the device: host seconds add to the GEMMs'. On a
GPU the host queues kernels ahead of the device and its time shows only where it exceeds the
device's (``asynchronous=True``: compute is the larger of the two). The tables' GPUs do not
price it (every figure 0): PyTorch's CPU-side launch of a CUDA kernel takes 5-20 us (Holistic
Trace Analysis documentation, "CUDA Kernel Launch Statistics"), hidden behind a large model's
kernels. A calibration on CPU ranks measures every figure (``host_costs`` in
fxtp/planner/calibration.py), on all the local ranks at once: ranks sharing a host's cores
contend as they will in the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxtp.planner.hardware import HostCosts

__all__ = ["HostCosts", "OpCounts", "count_ops", "host_seconds", "with_host"]

# priced by FLOPs at the calibrated GEMM rate, which includes their dispatch (NOTE: [host time])
_GEMMS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default"})


@dataclass(frozen=True)
class OpCounts:
    """What one forward of the model dispatches on the example, GEMMs left out (NOTE: [host time]).

    Attributes:
        block, other: ``(ops, bytes per token)`` of one block and of everything outside the blocks.
        backward_ops, backward_bytes: the backward's ops and bytes per forward op and byte.
        sharded_share: the share of the forward's bytes in tensors whose last dim is not the
            hidden size (those tensor parallelism shards, NOTE: [host time]).
    """

    block: tuple[int, float]
    other: tuple[int, float]
    backward_ops: float
    backward_bytes: float
    sharded_share: float = 0.0


class _Counter(TorchDispatchMode):
    """Counts the ops dispatched, and the bytes they write (a view writes none), into ``into``;
    the bytes of outputs whose last dim is not ``hidden`` into ``sharded``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.into: list[float] = [0, 0.0]
        self.hidden, self.sharded = hidden, 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if str(func) not in _GEMMS:
            self.into[0] += 1
            if not func.is_view:
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        self.into[1] += t.numel() * t.element_size()
                        if t.dim() and t.shape[-1] != self.hidden:
                            self.sharded += t.numel() * t.element_size()
        return out


def count_ops(program: Any, blocks_fqn: Optional[str], hidden: int, inputs: tuple, kwargs: dict) -> Optional[OpCounts]:
    """:class:`OpCounts` of a captured ``program`` (``torch.export``'s, the analysis's) on its
    example ``inputs``, run on ``meta`` (its state swapped for meta copies) node by node, each
    node's ops counted to its block (``nn_module_stack``; NOTE: [repeated blocks] in
    fxtp/planner/params.py: the last block analyzed is the one counted); None where the
    program cannot run on ``meta`` (the host time is then not priced) or has no blocks."""
    from torch.nn.utils.stateless import _reparametrize_module

    if blocks_fqn is None:
        return None
    gm = program.module()
    state = {k: torch.empty_like(v, device="meta").requires_grad_(v.requires_grad)
             for k, v in {**dict(gm.named_parameters()), **dict(gm.named_buffers())}.items()}
    meta = [torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t for t in inputs]
    meta_kwargs = {k: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    tokens = next((t.numel() for t in (*inputs, kwargs.get("input_ids")) if isinstance(t, torch.Tensor)), 0)
    counter, per_block, outside = _Counter(hidden), {}, [0, 0.0]
    head = f"{blocks_fqn}." if blocks_fqn else ""

    class _ByBlock(torch.fx.Interpreter):
        def run_node(self, n: Any) -> Any:
            paths = [path for path, _ in (n.meta.get("nn_module_stack") or {}).values()]
            index = next((p[len(head):].partition(".")[0] for p in paths if p.startswith(head) and p != blocks_fqn), None)
            counter.into = per_block.setdefault(int(index), [0, 0.0]) if index and index.isdigit() else outside
            return super().run_node(n)

    try:
        with _reparametrize_module(gm, state), counter:
            out = _ByBlock(gm).run(*meta, *meta_kwargs.values())
            first = next(t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad)
            forward = [outside[0] + sum(b[0] for b in per_block.values()), outside[1] + sum(b[1] for b in per_block.values())]
            sharded, counter.into = counter.sharded, [0, 0.0]
            backward = counter.into
            first.float().sum().backward()
    except Exception:  # an op without a meta kernel, a state the swap missed: unpriced
        return None
    if not per_block or not tokens or not forward[0]:
        return None
    block = per_block[max(per_block)]
    return OpCounts((int(block[0]), block[1] / tokens), (int(outside[0]), outside[1] / tokens),
                    backward[0] / forward[0], backward[1] / max(forward[1], 1.0), sharded / max(forward[1], 1.0))


def host_seconds(costs: HostCosts, ops: Optional[OpCounts], *, layers: int, tokens: int, tp: int, dp: int,
                 checkpointing: Optional[str], micro_batches: int, tensors: int, elements: int,
                 units: tuple[int, ...], regather: bool = True, sharded: int = 0) -> dict[str, float]:
    """A step's host seconds on one rank (NOTE: [host time]): ``{"compute", "recompute", "optimizer",
    "fsdp"}``, ``"recompute"`` the part of ``"compute"`` the checkpointed blocks' forwards take again.

    Args:
        ops: the model's counts (None: no op priced); ``layers``: blocks in the model.
        tokens: a micro-batch's tokens on a rank; ``tp``, ``dp``: the mesh.
        checkpointing: the blocks' (``None``, ``"blocks"``, ``"selective"``); ``micro_batches`` a step.
        tensors, elements: the parameter tensors and elements a rank's optimizer steps; ``sharded``
            of those tensors are tensor-parallel shards (priced at ``optimizer_sharded`` at dp 1).
        units: FSDP2's units, each one's parameter tensors (the blocks', then the root's); empty at dp 1.
        regather: FSDP2 gathers each block unit again for backward, a micro-batch at a time;
            False: every unit is gathered once and reduced once a step (under pipelining,
            NOTE: [pipeline costs] in fxtp/planner/pipeline_costs.py).
    """
    out = {"compute": 0.0, "recompute": 0.0, "optimizer": 0.0, "fsdp": 0.0}
    if ops is not None:
        scale = tokens * (1 - ops.sharded_share + ops.sharded_share / tp)
        block_ops, block_bytes = ops.block[0], ops.block[1] * scale
        forward_ops = layers * block_ops + ops.other[0]
        forward_bytes = layers * block_bytes + ops.other[1] * scale
        forward = forward_ops * costs.op + forward_bytes * costs.op_byte
        backward = ops.backward_ops * forward_ops * costs.op_backward + ops.backward_bytes * forward_bytes * costs.op_backward_byte
        redo = layers * (block_ops * costs.op + block_bytes * costs.op_byte) if checkpointing else 0.0
        out["compute"] = micro_batches * (forward + backward + redo)
        out["recompute"] = micro_batches * redo  # of which the recomputed forwards'
    if dp > 1:
        per_tensor = tensors * costs.optimizer_dtensor
    else:
        per_tensor = (tensors - sharded) * costs.optimizer_tensor + sharded * (costs.optimizer_sharded or costs.optimizer_tensor)
    out["optimizer"] = per_tensor + elements * costs.optimizer_element
    if dp > 1 and units and not regather:
        out["fsdp"] = sum(2 * (costs.fsdp_unit + n * costs.fsdp_tensor) for n in units)
    elif dp > 1 and units:
        *blocks, root = units
        collectives = [(3, n) for n in blocks] + [(2, root)]  # the root is not resharded after forward
        out["fsdp"] = micro_batches * sum(k * (costs.fsdp_unit + n * costs.fsdp_tensor) for k, n in collectives)
    return out


def with_host(costs: HostCosts, gemms: float, host: dict[str, float]) -> tuple[float, float]:
    """A rank's compute seconds with its ``host`` seconds (:func:`host_seconds`) beside its
    ``gemms``' (NOTE: [host time]): added on a CPU, the larger of the two on a GPU; and the host
    seconds the recomputed forwards add to it (none shown on a GPU, whose host runs ahead)."""
    busy = host["compute"] + host["optimizer"]
    if costs.asynchronous:
        return max(gemms, busy), 0.0
    return gemms + busy, host["recompute"]
