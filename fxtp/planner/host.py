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
kernels. A calibration on CPU ranks (NOTE: [calibration] in fxtp/planner/calibration.py)
measures every figure (:func:`host_costs`), on all the local ranks at once: ranks sharing a
host's cores contend as they will in the run; with the model's weights it scales the op and
the optimizer figures to the model's own step (:func:`host_on_the_model`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fxtp.local_ranks import per_call, per_call_each
from fxtp.planner.hardware import HostCosts

__all__ = ["HostCosts", "OpCounts", "TrainingStep", "count_ops", "host_costs", "host_on_the_model", "host_seconds",
           "priced_ops", "step_ops", "with_host"]

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


def host_costs(latency: dict[tuple[str, int], float], repeats: int = 5) -> HostCosts:
    """The host's figures on CPU ranks (NOTE: [host time]), each the
    slowest rank's median of ``repeats``, all ranks measuring at once:

    - ops: a chain of ``aten.mul`` on a tensor that needs grad (each op dispatched and recorded
      by autograd as a graph's op is), forward and backward, at 64 and 65536 elements: the
      small one gives the seconds per op, the difference the seconds per byte written;
    - optimizer: ``torch.optim.AdamW`` (its per-tensor loop on CPU) with ``zero_grad``, on 64
      tensors of 16 elements (per tensor) and on one of 2**18 (per element); on 64 DTensor
      shards over all the ranks, as FSDP2's parameters are, and on 64 of fxtp's
      ``ShardedParameter`` s, as a tensor-parallel rank's at dp 1 (per tensor);
    - FSDP2: ``fully_shard`` on 4 units of ``nn.Linear(8, 8)`` layers and a root, forward and
      backward, against the same module unsharded; the difference, less the collectives'
      calibrated latencies (``latency``: ``(kind, ranks) -> s``), over its collectives (an
      all_gather in forward and in backward and a reduce_scatter per unit, 2 for the root), at
      1 and 8 layers a unit: per collective and per parameter tensor.
    """
    per_op, per_op_back = {}, {}
    for numel in (64, 1 << 16):
        per_op[numel], per_op_back[numel] = _op_seconds(numel, 200, repeats)
    small, large = 64 * 4, (1 << 16) * 4  # bytes an op writes
    op_byte = max(0.0, (per_op[1 << 16] - per_op[64]) / (large - small))
    op_back_byte = max(0.0, (per_op_back[1 << 16] - per_op_back[64]) / (large - small))
    tensor = _optimizer_seconds([16] * 64, repeats) / 64
    element = max(0.0, (_optimizer_seconds([1 << 18], repeats) - tensor) / (1 << 18))
    dtensor = _optimizer_seconds([16 * dist.get_world_size()] * 64, repeats, kind="dtensor") / 64
    sharded = _optimizer_seconds([16] * 64, repeats, kind="sharded") / 64
    ranks = dist.get_world_size()
    gather, scatter = latency.get(("all_gather", ranks), 0.0), latency.get(("reduce_scatter", ranks), 0.0)
    waits = 4 * (2 * gather + scatter) + gather + scatter  # 4 units' 3 collectives, the root's 2
    per_collective = {layers: max(0.0, (_fsdp_seconds(layers, repeats) - waits) / 14) for layers in (1, 8)}
    fsdp_tensor = max(0.0, (per_collective[8] - per_collective[1]) / 7)
    return HostCosts(op=max(0.0, per_op[64] - small * op_byte), op_backward=max(0.0, per_op_back[64] - small * op_back_byte),
                     op_byte=op_byte, op_backward_byte=op_back_byte, optimizer_tensor=tensor, optimizer_dtensor=dtensor,
                     optimizer_element=element, optimizer_sharded=sharded,
                     fsdp_unit=max(0.0, per_collective[1] - fsdp_tensor), fsdp_tensor=fsdp_tensor, asynchronous=False)


def _op_seconds(numel: int, n: int, repeats: int) -> tuple[float, float]:
    """Seconds of one ``aten.mul`` in a chain of ``n`` on ``numel`` floats, forward and backward
    (the chain's forward and backward less its forward)."""
    x = torch.randn(numel, requires_grad=True)

    def forward() -> torch.Tensor:
        y = x
        for _ in range(n):
            y = torch.ops.aten.mul.Tensor(y, 1.0001)
        return y

    def both() -> None:
        y = forward()
        y.backward(torch.ones_like(y))
        x.grad = None

    once, twice = per_call_each([forward, both], repeats)  # taking turns: a burst of other load on one of each
    return once / n, max(0.0, twice - once) / n


def _optimizer_seconds(sizes: list[int], repeats: int, kind: str = "plain") -> float:
    """Seconds of one AdamW step over parameters of ``sizes`` elements, their gradients kept:
    plain ``nn.Parameter`` s, DTensor shards over all the ranks (``"dtensor"``, as FSDP2's), or
    fxtp's ``ShardedParameter`` s of a tensor-parallel shard over all the ranks (``"sharded"``,
    as a tp rank's at dp 1)."""
    params = [nn.Parameter(torch.randn(n)) for n in sizes]
    if kind == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        params = [nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in params]
    elif kind == "sharded":
        from fxtp.core.placement import Shard
        from fxtp.runtime.sharded import ShardedParameter, ShardLayout

        ranks = dist.get_world_size()
        params = [ShardedParameter(p.detach(), True, ShardLayout(f"calibration.{i}", Shard(0, (p.numel() * ranks,)),
                                                                 dist.group.WORLD.group_name, ranks))
                  for i, p in enumerate(params)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    return per_call(opt.step, repeats)  # the gradients kept: zero_grad sets each to None, no op


def _fsdp_seconds(layers: int, repeats: int) -> float:
    """Seconds FSDP2 adds to a forward and backward of 4 units of ``layers`` ``nn.Linear(8, 8)``
    and a root ``nn.Linear(8, 8)``, against the same module without it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(layers)]) for _ in range(4)],
                          nn.Linear(8, 8, bias=False))
    plain = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in list(model)[:4]:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    x = torch.randn(4, 8)

    def step(m: nn.Module) -> Callable[[], None]:
        def once() -> None:
            m(x).sum().backward()
            m.zero_grad(set_to_none=True)
        return once

    sharded, unsharded = per_call_each([step(model), step(plain)], repeats)  # taking turns, as above
    return sharded - unsharded


def step_ops(pm: nn.Module, ids: torch.Tensor, hidden: int) -> OpCounts:
    """:class:`OpCounts` of one training forward and backward of ``pm`` on ``ids`` (a Hugging Face
    model's, its loss on ``labels=ids``), counted as it runs, the whole model as one block
    (``other`` none): GEMMs left out, as :func:`count_ops` counts a captured program."""
    counter = _Counter(hidden)
    with counter:
        loss = pm(ids, labels=ids).loss
        (forward_ops, forward_bytes), counter.into, sharded = counter.into, [0, 0.0], counter.sharded
        loss.backward()
    pm.zero_grad(set_to_none=True)
    forward_bytes = max(forward_bytes, 1.0)
    return OpCounts((int(forward_ops), forward_bytes / ids.numel()), (0, 0.0), counter.into[0] / max(forward_ops, 1),
                    counter.into[1] / forward_bytes, sharded / forward_bytes)


def priced_ops(host: HostCosts, ops: OpCounts, tokens: int, tp: int = 1) -> float:
    """Seconds ``host`` prices ``ops``' forward and backward at ``tokens`` a rank on a tp ``tp``
    rank, as the plan prices a step's ops (:func:`host_seconds`: the same ops at every degree,
    the bytes of the tensors tensor parallelism shards over ``tp``; NOTE: [host time])."""
    return host_seconds(host, ops, layers=1, tokens=tokens, tp=tp, dp=1, checkpointing=None, micro_batches=1, tensors=0,
                        elements=0, units=())["compute"]


class TrainingStep:
    """The model's tp 1 training step on this rank, for :func:`host_on_the_model`: ``fxtp.compile``'s
    program of a copy of ``model`` at ``tokens = (batch, seq)`` (one rank's micro-batch) and AdamW.
    ``step()`` runs its forward and backward, ``step(True)`` its optimizer step too."""

    def __init__(self, model: nn.Module, tokens: tuple[int, int]) -> None:
        import fxtp

        self.ids = torch.randint(0, model.config.vocab_size, tokens, generator=torch.Generator().manual_seed(0))
        self.pm = fxtp.compile(copy.deepcopy(model).train(), 1, (self.ids,), example_kwargs={"labels": self.ids}, dynamic=False)
        self.opt = torch.optim.AdamW(self.pm.parameters(), lr=1e-6)

    def step(self, with_optimizer: bool = False) -> None:
        self.pm(self.ids, labels=self.ids).loss.backward()
        if with_optimizer:
            self.opt.step()
        self.pm.zero_grad(set_to_none=True)


def host_on_the_model(host: HostCosts, program: TrainingStep, ops: OpCounts, gemm_s: float, seconds: float,
                      optimizer_s: float) -> HostCosts:
    """``host`` with its per-op figures scaled by one factor and its optimizer figures by another,
    so that beside its GEMMs' ``gemm_s`` seconds (at the calibrated tp 1 rate) they price what
    the model's own training step takes (``program``, its ``ops`` counted by :func:`step_ops`)
    with every rank running it at once: ``seconds`` its forward and backward, ``optimizer_s`` what its
    optimizer step adds to them (the caller times both, :func:`~fxtp.local_ranks.per_call_each`):

    - ops: its forward and backward. A chain of ``aten.mul`` misses what a model's ops add
      (autograd nodes of several inputs, views, the Python between them; NOTE: [contended
      window] in fxtp/local_ranks.py).
    - optimizer: what AdamW's step over the model's parameters adds to that forward and
      backward, the parameters' tensors and elements priced with ``optimizer_tensor`` and
      ``optimizer_element``. Timed alone on small tensors, a step costs less than after a
      backward, whose activations and gradients have left the caches: a hidden-128 Llama's
      AdamW took 8.9-17 ms in a step on 4 ranks, priced 4.8-7 (2026-12-07). The one factor
      scales the DTensor and ``ShardedParameter`` figures too.
    """
    priced = priced_ops(host, ops, program.ids.numel())
    scale = max(0.0, seconds - gemm_s) / priced if priced else 1.0
    params = [p for p in program.pm.parameters() if p.requires_grad]
    priced_opt = len(params) * host.optimizer_tensor + sum(p.numel() for p in params) * host.optimizer_element
    opt_scale = optimizer_s / priced_opt if priced_opt and optimizer_s else 1.0
    return dataclasses.replace(host, op=host.op * scale, op_backward=host.op_backward * scale,
                               op_byte=host.op_byte * scale, op_backward_byte=host.op_backward_byte * scale,
                               **{f: getattr(host, f) * opt_scale for f in
                                  ("optimizer_tensor", "optimizer_dtensor", "optimizer_sharded", "optimizer_element")})
