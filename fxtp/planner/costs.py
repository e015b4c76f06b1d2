"""Predicted peak memory and step time of one parallel configuration.

NOTE: [mixed precision]
The convention priced (training): FSDP2 ``fully_shard`` over the ``dp`` ranks of each
tensor-parallel group, with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)`` and fp32 sharded parameters, as torchtitan trains Llama-3
(torchtitan ``parallelize_llama``, ``mixed_precision_param = "bfloat16"``,
``mixed_precision_reduce = "float32"``). Per parameter element, sharded over ``dp x tp``: 4 B
fp32 parameter, 4 B fp32 gradient, and the optimizer's state (AdamW/Adam: ``exp_avg`` and
``exp_avg_sq``, 8 B fp32; SGD without momentum, torch's default: none). Activations are bf16
(NOTE: [activation bytes] in fxtp/planner/model.py). ``Workload`` prices another run:
``activation_bytes=4`` and ``gather_bytes=4`` for an fp32 model without a policy (what a CPU run
on gloo is). Not counted: the CUDA context, NCCL's buffers, the allocator's fragmentation,
temporaries inside one op; the search keeps a reserve for them out of ``device_memory``
(NOTE: [runtime reserve] in fxtp/planner/hardware.py); the peak is NOTE: [peak of a step].
Inference (``training=False``): bf16 parameters sharded over ``tp`` only (each of the ``dp``
groups is a replica), the KV cache of its sequences, and one block's activations plus the
logits.

NOTE: [peak of a step]
A training step's peak is the most of three moments (:func:`step_moments`), each the
parameters and the optimizer's states plus what the moment holds. The runtime is FSDP2's
``fully_shard`` on each block, then on the root (the embedding, the final norm and the head:
``fxtp``'s ``ParallelModule`` keeps them in the root unit), ``reshard_after_forward=True``:

- the loss: every block's saved activations, the final norm's, and the loss's working set
  (``TransformerShape.loss_activations``); the root unit gathered (``gather_bytes``).
- a block's backward, at the block where it holds the most (the last, the one before it, or
  the first: what is held is linear in the block's index between them): the saved activations
  of it and the blocks before it, what its recomputation rebuilds
  (``TransformerShape.recomputed_block``), the gradients of its output and input; the root
  unit gathered with the head's and final norm's unsharded gradients (the root reduces at the
  end of backward); the block gathered, the one before it prefetched (FSDP2's backward
  prefetch; the first block has none) and its unsharded gradients, ``3 x gather_bytes`` an
  element (2 at the first block); the sharded
  gradients of the blocks already done, 4 B an element over ``dp``; and, after the first
  block, the last reduce_scatter's fp32 input, which FSDP2 keeps until the next unit's
  (``reduce_scatter_states`` in ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``).
- the optimizer's step: the sharded gradients, 4 B an element (AdamW's states exist from the
  first step: in steady state they are held through every moment).
- under gradient accumulation, every micro-batch after the first runs beside the gradients
  the earlier ones left (FSDP2: the sharded gradients, 4 B an element over ``dp``; without it,
  accumulated in place), so the loss's and a backward's moments hold them all: the last
  micro-batch's moments are the step's.

``Estimate.memory`` is the peak moment's bytes by what holds them, so its terms sum to the
peak: ``grads`` are those held then (at a backward's peak, the head's and the blocks' already
reduced), not all of them. Without FSDP2 (``dp`` 1) nothing is gathered and the gradients
accumulate in place. Measured against a run on 4 gloo ranks (tests/test_plan_memory.py,
``tools/bench_plan_memory.py``): the peak within 5%, the backward's within 7%; the loss's
moment is under-predicted (gloo's buffers for the output's gathered logits, the final norm's
temporaries), and with checkpointed blocks their forward's temporaries (never the peak).

NOTE: [cost model]
Step time = compute + tensor-parallel communication + the FSDP communication compute does
not hide.

- compute: model FLOPs (NOTE: [FLOPs]) over all devices at the achieved share of the dense
  BF16 peak, by hardware and GEMM size (:func:`compute_efficiency`): the hardware's ``mfu``
  (sourced in NOTE: [hardware table] in fxtp/planner/hardware.py) times the wave
  quantization of the block's GEMMs on a rank (NOTE: [GEMM efficiency]), averaged over them by
  FLOPs: q/k/v and the MLP's up (and gate) projections ``(b s, h) @ (h, n / tp)``, the output
  and down projections ``(b s, n / tp) @ (n / tp, h)``. The same share for their backward
  GEMMs, the attention and the head. Plus the host's seconds for the ops it dispatches besides
  them, the optimizer's tensors and FSDP2's own work (NOTE: [host time] in
  fxtp/planner/host.py: added on a CPU, the larger of the two on a GPU; zero unless calibrated).
  A calibrated ``Hardware`` (NOTE: [calibration] in fxtp/planner/calibration.py) gives the rate
  measured at each ``tp``'s GEMMs instead (``Hardware.achieved_flops``; a degree it did not
  measure is priced as above), and on CPU ranks prices FSDP2's collectives as exposed
  (``overlap_fsdp=False``: no streams to overlap on).
- tensor parallelism: per block and micro-batch, in all_reduces of ``(b, s, h)`` bf16: 2
  forward and 2 backward (Megatron's floor, Shoeybi et al. 2019, section 3), 1 more under
  sequence parallelism (the backward's 2 all_gathers of saved shards, NOTE: [regathered
  activations]), 2 more when a recomputed forward runs them again (``"blocks"``, and
  ``"selective"``, which recomputes collectives: NOTE: [recomputed regions]); under
  sequence parallelism each is an all_gather + reduce_scatter pair moving the same bytes
  (Korthikanti et al. 2022, section 4.2.2), two collectives' latency. Each is timed as one
  NCCL ring collective, latency plus bytes over bus bandwidth (NOTE: [collective time] in
  fxtp/planner/comm.py), over NVLink inside a node. Outside the blocks, what the collectives
  fxtp's plan of the analyzed graph inserts there send (e.g. a vocab-sharded embedding's
  forward all_reduce, the gather of a colwise head's logits and its backward all_reduce; a
  replicated one has none), scaled from the example's tokens to the micro-batch's
  (``ParamShapes.outside_sent``; priced from the plan without sequence parallelism; with it,
  the head's saved input is gathered again in backward, and each rank's gradients of the
  replicated norm weights are partial sums, an all_reduce of them per backward in the
  activations' dtype), timed as one all_reduce of those bytes and each further collective's
  latency (``ParamShapes.outside_collectives``); the loss, a vocab-parallel cross entropy
  under a vocab-sharded head, all_reduces each token's max logit, target logit and sum of
  exponentials (3 all_reduces of ``(b, s)`` fp32 in forward: Megatron-LM's
  ``_VocabParallelCrossEntropy``, as fxtp's runtime runs it); and per block and backward, the weight-gradient all_reduce of grouped kv shards
  when the kv heads do not divide ``tp`` (``ParamShapes.block_weight_sent``, NOTE: [grouped
  shards] in fxtp/core/placement.py). Not overlapped by default: Megatron's tensor-parallel
  collectives sit between dependent matmuls (Narayanan et al. 2021, section 3.3). With
  ``tp_overlap`` (NOTE: [tp overlap]) and sequence parallelism, a block's collectives are
  hidden behind its projection matmuls up to their time.
- FSDP2: per micro-batch (gradient accumulation does not skip its reduce_scatter by default)
  an all_gather of each unit's bf16 parameters in forward and again in backward
  (``reshard_after_forward=True``) and a reduce_scatter of its fp32 gradients, each a ring
  collective over the ``dp`` group (NOTE: [collective time]: over the network once the group
  spans nodes, one NIC per member on a node); what compute does not hide is computed per
  unit (NOTE: [fsdp overlap] in fxtp/planner/comm.py).
- waits: on CPU ranks that share cores, each group's collectives also wait for its slowest
  peer, more the more compute since the group's last collective (NOTE: [collective wait] in
  fxtp/planner/comm.py, measured by the calibration): in ``tp_comm`` and ``fsdp_exposed``,
  and apart as ``tp_wait`` and ``fsdp_wait``.
NOTE: [tp overlap]
Two runtimes hide sequence parallelism's all_gather/reduce_scatter pairs behind the matmuls
that consume or produce them, by splitting each into chunks and pipelining chunk ``i``'s
communication with chunk ``i-1``'s matmul: torch's async TP (micro-pipeline TP,
``torch._inductor.config._micro_pipeline_tp``; torchtitan's
``parallelism.enable_async_tensor_parallel``) and Megatron-LM's ``--tp-comm-overlap``
(Transformer Engine's userbuffers; Megatron-LM README, "Communication optimizations"; Wang et
al. 2023, "Overlap Communication with Dependent Computation via Decomposition in Large Deep
Learning Models"). ``Workload.tp_overlap`` names which (``TP_OVERLAP``): the pricing is the
same, per block and micro-batch ``max(0, tp_s - matmul_s)`` is exposed, ``matmul_s`` the
block's projection matmuls forward and backward (``6 x block_params / tp`` FLOPs a token) at
the achieved rate. Without sequence parallelism nothing is hidden (both need it). Default:
``None``, every collective exposed. Not modelled: the matmuls slowed by sharing SMs with the
communication kernels (torchtitan measured async TP at 1.09-1.10 x vanilla TP's throughput in
bf16 on H100, benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md: a bound to check the
option against, docs/plan_command.md "Published runs").

Not modelled: NVLink shared by tensor-parallel and FSDP
collectives inside a node, NCCL's tree and NVLS algorithms. Pipeline parallelism is priced in
fxtp/planner/pipeline_costs.py (NOTE: [pipeline costs]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fxtp.planner.comm import Group, Unit, collective_wait, fsdp_exposed, ring_latency, ring_time
from fxtp.planner.hardware import Hardware, gemm_efficiency
from fxtp.planner.host import host_seconds, with_host
from fxtp.planner.model import TransformerShape
from fxtp.planner.params import ParamShapes

__all__ = ["Choice", "Estimate", "OPTIMIZER_BYTES", "TP_OVERLAP", "TpComm", "Workload", "compute_efficiency", "estimate", "rate_per_device",
           "step_moments", "tp_comm"]

# Bytes of optimizer state per parameter element, fp32 (NOTE: [mixed precision])
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 0}
_MASTER, _GRAD, _COMPUTE = 4, 4, 2
# the runtimes that overlap tensor-parallel collectives with matmuls (NOTE: [tp overlap])
TP_OVERLAP = {
    "async-tp": "torch async TP (micro-pipeline TP; torchtitan enable_async_tensor_parallel)",
    "megatron": "Megatron-LM --tp-comm-overlap (Transformer Engine userbuffers)",
}


@dataclass(frozen=True)
class Choice:
    """One configuration: the mesh, sequence parallelism, checkpointing, micro-batches."""

    tp: int
    dp: int
    sequence_parallel: bool
    activation_checkpointing: Optional[str]
    micro_batch: int  # sequences per micro-batch on a dp rank
    accumulation: int  # micro-batches per optimizer step (the pipeline's micro-batches when pp > 1)
    pp: int = 1  # pipeline ranks (NOTE: [pipeline costs] in fxtp/planner/pipeline_costs.py)
    schedule: Optional[str] = None  # torch's schedule name when pp > 1: "1F1B", "Interleaved1F1B"
    stages_per_rank: int = 1  # pipeline stages a pp rank holds (2 for Interleaved1F1B)


@dataclass(frozen=True)
class Estimate:
    """A :class:`Choice`'s predicted figures: bytes per device, seconds per step."""

    choice: Choice
    memory: dict[str, int]
    step: dict[str, float]
    comm_bytes: dict[str, int]  # sent per device per step, by kind
    rate: float = 0.0  # FLOP/s per device the compute is priced at (NOTE: [cost model])
    stages: tuple[int, ...] = ()  # blocks per pipeline stage, in stage order (pp > 1)

    @property
    def peak(self) -> int:
        return self.memory["total"]


@dataclass(frozen=True)
class Workload:
    """What one step runs: the global batch in sequences, their length, training or not."""

    batch: int
    seq: int
    training: bool
    optimizer: str
    devices_per_node: int
    activation_bytes: int = 2  # bf16 (NOTE: [mixed precision]); 4 prices an fp32 model
    # bytes of a parameter element FSDP2 all_gathers: bf16, ``MixedPrecisionPolicy(param_dtype=
    # torch.bfloat16)`` (NOTE: [mixed precision]); 4 prices a run without a policy (fp32 gathers)
    gather_bytes: int = _COMPUTE
    tp_overlap: Optional[str] = None  # a key of TP_OVERLAP: collectives hidden behind matmuls


def compute_efficiency(hw: Hardware, shape: TransformerShape, tokens: int, tp: int) -> float:
    """The share of ``hw.peak_flops`` a rank's matmuls run at on a micro-batch of ``tokens``
    tokens at tensor-parallel degree ``tp``: :func:`~fxtp.planner.hardware.gemm_efficiency`
    of the block's projections, averaged by their FLOPs (their times add up; NOTE: [cost model])."""
    qkv = (shape.heads + 2 * shape.kv_heads) * (shape.hidden // max(1, shape.heads))
    mlp = shape.intermediate * (2 if shape.gated_mlp else 1)
    gemms = ((max(1, qkv // tp), shape.hidden * qkv),  # (output columns on a rank, FLOPs weight)
             (shape.hidden, shape.hidden * shape.hidden),
             (max(1, mlp // tp), shape.hidden * mlp),
             (shape.hidden, shape.hidden * shape.intermediate))
    weight = sum(w for _, w in gemms)
    return weight / sum(w / gemm_efficiency(hw, tokens, n) for n, w in gemms)


@dataclass(frozen=True)
class TpComm:
    """One micro-batch's tensor-parallel collectives on a rank (NOTE: [cost model]): seconds a
    block's cost exposed (``block_s``) and before any overlap (``block_all_s``), seconds outside
    the blocks, the bytes a rank sends for a block and outside, and the collectives a block
    issues and those outside it (NOTE: [collective wait] in fxtp/planner/comm.py counts them)."""

    block_s: float
    block_all_s: float
    outside_s: float
    block_bytes: float
    outside_bytes: float
    block_count: int = 0
    outside_count: int = 0


def rate_per_device(choice: Choice, shape: TransformerShape, hw: Hardware, work: Workload) -> float:
    """FLOP/s a device computes at: the rate calibrated at ``tp``'s GEMMs where one was measured,
    else the peak at the efficiency by hardware and GEMM size (NOTE: [cost model])."""
    measured = dict(hw.achieved_flops).get(choice.tp)
    return measured if measured else hw.peak_flops * compute_efficiency(hw, shape, choice.micro_batch * work.seq, choice.tp)


def tp_comm(choice: Choice, shape: TransformerShape, params: ParamShapes, hw: Hardware, work: Workload,
            rate: float) -> TpComm:
    """A micro-batch's tensor-parallel collectives (NOTE: [cost model], NOTE: [tp overlap]);
    ``rate`` the device's FLOP/s (:func:`rate_per_device`)."""
    tp, b = choice.tp, choice.micro_batch
    sp, ac = choice.sequence_parallel, choice.activation_checkpointing
    per_block = 4 + (1 if sp else 0) + (2 if ac in ("blocks", "selective") else 0) if work.training else 2
    payload = b * work.seq * shape.hidden * work.activation_bytes
    outside = sum(params.outside_sent) if work.training else params.outside_sent[0]  # per payload byte
    if sp and work.training:  # the head input's regather; the norms' partial gradients, all_reduced
        outside += (tp - 1) / tp + 2 * (tp - 1) / tp * shape.norm_params * work.activation_bytes / payload
    weights = params.block_weight_sent if work.training else 0.0  # grouped kv gradients, per block and backward
    tp_group = Group.tp(tp, work.devices_per_node)
    # a block's all_reduce-equivalents of one payload: all_reduces, or under sequence
    # parallelism all_gather/reduce_scatter pairs moving the same bytes (NOTE: [collective time])
    block_s = (2 * per_block * ring_time("all_gather", payload, tp_group, hw) if sp
               else per_block * ring_time("all_reduce", payload, tp_group, hw))
    outside_s = ring_time("all_reduce", outside * payload * tp / (2 * (tp - 1)), tp_group, hw) if tp > 1 and outside else 0.0
    count = sum(params.outside_collectives) if work.training else params.outside_collectives[0]
    outside_count = max(count, 1 if outside else 0) if tp > 1 else 0
    if tp > 1:  # each collective outside the blocks beyond the one priced above costs its latency
        outside_s += max(0, count - (1 if outside else 0)) * ring_latency("all_reduce", tp_group, hw)
    if tp > 1 and work.training:  # the vocab-parallel loss's 3 all_reduces of a float per token
        outside_s += 3 * ring_time("all_reduce", b * work.seq * 4, tp_group, hw)
        outside_count += 3
    if tp > 1 and sp and work.training:  # entering and leaving the sp region, the regather, a norm tensor's each
        outside_count += 3 + shape.norm_params // shape.hidden
    if weights:
        block_s += ring_time("all_reduce", weights * tp / (2 * (tp - 1)), tp_group, hw)
    block_all_s = block_s
    if work.tp_overlap and sp and tp > 1:  # NOTE: [tp overlap]
        matmul_s = 6 * shape.block_params / tp * b * work.seq / rate if work.training else 0.0
        block_s = max(0.0, block_s - matmul_s)
    block_count = (2 * per_block if sp else per_block) + (1 if weights else 0) if tp > 1 else 0
    return TpComm(block_s, block_all_s, outside_s, per_block * 2 * (tp - 1) / tp * payload + weights, outside * payload,
                  block_count, outside_count)


def estimate(choice: Choice, shape: TransformerShape, params: ParamShapes, hw: Hardware, work: Workload) -> Estimate:
    """Predicted memory and time of ``choice`` without pipelining (NOTE: [mixed precision], NOTE:
    [cost model]); a pipelined one (``pp > 1``) is :func:`fxtp.planner.pipeline_costs.estimate_pipeline`'s."""
    tp, dp, ac = choice.tp, choice.dp, choice.activation_checkpointing
    memory = _memory(choice, shape, params, work)
    tokens = work.batch * work.seq
    rate_device = rate_per_device(choice, shape, hw, work)
    rate = tp * dp * rate_device
    if work.training:
        compute = shape.flops_per_token(work.seq, ac) * tokens / rate
        recompute = compute - shape.flops_per_token(work.seq) * tokens / rate
    else:
        compute = (shape.matmul_params * 2 + 4 * shape.layers * shape.hidden * work.seq) * tokens / rate
        recompute = 0.0
    host = _host(choice, shape, params, hw, work) if work.training else {"compute": 0.0, "recompute": 0.0, "optimizer": 0.0,
                                                                         "fsdp": 0.0}
    gemms = compute
    compute, host_recompute = with_host(hw.host, gemms, host)  # NOTE: [host time]
    recompute += host_recompute
    comm = tp_comm(choice, shape, params, hw, work, rate_device)
    # a micro-batch's compute between its collectives: the optimizer's step follows the last (NOTE: [collective wait])
    between = (compute - host["optimizer"]) / choice.accumulation
    tp_wait = choice.accumulation * collective_wait(Group.tp(tp, work.devices_per_node), between,
                                                    shape.layers * comm.block_count + comm.outside_count, hw)
    tp_bytes = round(choice.accumulation * (shape.layers * comm.block_bytes + comm.outside_bytes))
    tp_all_s = choice.accumulation * (shape.layers * comm.block_all_s + comm.outside_s) + tp_wait
    tp_s = choice.accumulation * (shape.layers * comm.block_s + comm.outside_s) + tp_wait
    fsdp_bytes, fsdp_s, fsdp_exposed_s, fsdp_wait = 0, 0.0, 0.0, 0.0
    if work.training and dp > 1:
        # a rank sends (dp-1)/dp of each all_gather's output and reduce_scatter's input, whose
        # dim 0 FSDP2 pads to a multiple of dp: (dp-1) x its padded shard (NOTE: [collective time])
        fsdp_bytes = choice.accumulation * (2 * work.gather_bytes + _GRAD) * (dp - 1) * params.elements(dp)
        units = _fsdp_units(choice, shape, params, hw, work, compute / choice.accumulation)
        fsdp_wait = choice.accumulation * collective_wait(Group.dp(tp, dp, work.devices_per_node), between,
                                                          2 + 3 * (len(units) - 2) if params.n_blocks else 2, hw)
        fsdp_s = choice.accumulation * _fsdp_serial(choice, params, hw, work, units) + host["fsdp"] + fsdp_wait
        fsdp_exposed_s = choice.accumulation * fsdp_exposed(units) + fsdp_wait if hw.overlap_fsdp else fsdp_s
    step = {
        "compute": compute,
        "gemm": gemms,  # of which the GEMMs (FLOPs at the rate); the rest is the host's (NOTE: [host time])
        "recompute": recompute,
        "comm": tp_s + fsdp_exposed_s,
        "tp_comm": tp_s,
        "tp_comm_hidden": tp_all_s - tp_s,
        "fsdp_comm": fsdp_s,
        "fsdp_exposed": fsdp_exposed_s,
        "fsdp_host": host["fsdp"] if work.training and dp > 1 else 0.0,  # of which FSDP2's own host work (NOTE: [host time])
        "tp_wait": tp_wait,  # of which waiting for peers on shared cores (NOTE: [collective wait])
        "fsdp_wait": fsdp_wait,
        "total": compute + tp_s + fsdp_exposed_s,
    }
    return Estimate(choice, memory, step, {"tp": tp_bytes, "fsdp": fsdp_bytes}, rate_device)


def _host(choice: Choice, shape: TransformerShape, params: ParamShapes, hw: Hardware, work: Workload) -> dict[str, float]:
    """A training step's host seconds on a rank (NOTE: [host time] in fxtp/planner/host.py)."""
    tensors = len(params.other) + params.n_blocks * len(params.block) if params.n_blocks else len(params.other)
    units = (len(params.block),) * params.n_blocks + (len(params.other),) if params.n_blocks else (len(params.other),)
    return host_seconds(hw.host, params.ops, layers=shape.layers, tokens=choice.micro_batch * work.seq, tp=choice.tp,
                        dp=choice.dp, checkpointing=choice.activation_checkpointing, micro_batches=choice.accumulation,
                        tensors=tensors, elements=-(-params.elements() // choice.dp), units=units,
                        sharded=params.sharded_tensors() if choice.tp > 1 else 0)


def _fsdp_units(choice: Choice, shape: TransformerShape, params: ParamShapes, hw: Hardware, work: Workload,
                compute: float) -> list[Unit]:
    """FSDP2's units in forward order, one micro-batch's seconds on one device (NOTE: [fsdp overlap]):
    the embedding (no matmul), each block, the final norm with the head; ``compute`` is the
    micro-batch's compute, split by FLOPs (NOTE: [FLOPs]). A model analyzed whole (no
    repeated blocks counted) is one unit."""
    group = Group.dp(choice.tp, choice.dp, work.devices_per_node)

    def unit(elements: int, forward: float, backward: float) -> Unit:
        return Unit(ring_time("all_gather", work.gather_bytes * elements, group, hw),
                    ring_time("reduce_scatter", _GRAD * elements, group, hw), forward, backward)

    if not params.n_blocks:
        return [unit(params.elements(), compute / 3, 2 * compute / 3)]
    first, blocks, last = params.unit_elements()
    kinds = shape.block_kinds()
    if len(kinds) != len(blocks):  # not extrapolated by kind: price each block as the average one
        kinds = ((shape.block_params, shape.layers),)
        blocks = ((sum(e * n for e, n in blocks) // max(1, sum(n for _, n in blocks)), shape.layers),)
    attention = 4 * shape.hidden * work.seq  # a block's attention FLOPs per token, forward (NOTE: [FLOPs])
    head_forward = 2 * shape.matmul_params - 2 * sum(p * n for p, n in kinds)
    ac = choice.activation_checkpointing
    total, costs = 3 * head_forward, []
    for (active, n), (elements, _) in zip(kinds, blocks):  # NOTE: [block kinds] in fxtp/planner/params.py
        block_forward = 2 * active + attention
        redo = block_forward if ac == "blocks" else 0  # "selective" recomputes no matmul (NOTE: [FLOPs])
        total += n * (3 * block_forward + redo)
        costs.append((elements, n, block_forward, redo))
    scale = compute / total if total else 0.0
    units = [unit(first, 0.0, 0.0)]
    for elements, n, block_forward, redo in costs:
        units += [unit(elements, block_forward * scale, (2 * block_forward + redo) * scale)] * n
    return units + [unit(last, head_forward * scale, 2 * head_forward * scale)]


def _fsdp_serial(choice: Choice, params: ParamShapes, hw: Hardware, work: Workload, units: list[Unit]) -> float:
    """One micro-batch's FSDP2 collectives end to end, none hidden: each block unit's all_gather
    in forward and again in backward and its reduce_scatter; the root's (the embedding, the
    final norm and the head, one unit: ``units``' first and last) one all_gather and one
    reduce_scatter, since FSDP2 does not reshard the root after forward (``_lazy_init`` in
    ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``: "the parameters would be freed and
    all-gathered immediately")."""
    if not params.n_blocks:
        return units[0].all_gather + units[0].reduce_scatter
    group = Group.dp(choice.tp, choice.dp, work.devices_per_node)
    first, _, last = params.unit_elements()
    root = (ring_time("all_gather", work.gather_bytes * (first + last), group, hw)
            + ring_time("reduce_scatter", _GRAD * (first + last), group, hw))
    return root + sum(2 * u.all_gather + u.reduce_scatter for u in units[1:-1])


def _memory(choice: Choice, shape: TransformerShape, params: ParamShapes, work: Workload) -> dict[str, int]:
    tp, dp, b, e = choice.tp, choice.dp, choice.micro_batch, work.activation_bytes
    sp = choice.sequence_parallel
    if not work.training:
        kv = shape.kv_cache(b, work.seq, tp, e=e)
        acts = shape.block_activations(b, work.seq, tp, sp=sp, ac=None, e=e) + 4 * b * work.seq * shape.vocab // tp
        out = {"params": _COMPUTE * params.elements(), "grads": 0, "optimizer": 0, "activations": acts, "kv_cache": kv,
               "fsdp_buffers": 0}
    else:
        elements = params.elements(dp)
        out = {"params": _MASTER * elements, "optimizer": OPTIMIZER_BYTES[work.optimizer] * elements, "kv_cache": 0,
               **max(step_moments(choice, shape, params, work).values(), key=lambda m: sum(m.values()))}
    out["total"] = sum(out.values())
    return out


def step_moments(choice: Choice, shape: TransformerShape, params: ParamShapes, work: Workload) -> dict[str, dict[str, int]]:
    """What a training step holds besides the parameters and the optimizer's states at the
    moments one of which is its peak (NOTE: [peak of a step]): the loss, a block's backward
    (the block where it is most), the optimizer's step; each as grads, activations and FSDP2
    buffers, bytes on one device."""
    tp, dp, b, s, e = choice.tp, choice.dp, choice.micro_batch, work.seq, work.activation_bytes
    sp, ac, g = choice.sequence_parallel, choice.activation_checkpointing, work.gather_bytes
    layers = shape.layers
    per_block = shape.block_activations(b, s, tp, sp=sp, ac=ac, e=e)
    if params.n_blocks:
        first, blocks, last = params.unit_elements()
        block = max(elements for elements, _ in blocks)
        block_grads = _GRAD * sum(el * n for el, n in params.unit_elements(dp)[1]) // layers  # a block's shard, on average
    else:  # a model analyzed whole: one unit
        first, block, last, block_grads = 0, 0, params.elements(), 0
    fsdp = dp > 1
    root = g * (first + last) if fsdp else 0  # the root unit, gathered through forward and backward
    head_grads = (g if fsdp else _GRAD) * last  # the head's and final norm's gradients, unsharded until the root's reduce
    # under accumulation, a later micro-batch runs beside the gradients the earlier ones left (FSDP2: sharded)
    kept = _GRAD * params.elements(dp) if choice.accumulation > 1 else 0
    moments = {"loss": {"grads": kept, "fsdp_buffers": root,
                        "activations": layers * per_block + shape.other_activations(b, s, tp, sp=sp, e=e)
                        + shape.loss_activations(b, s, tp, e)}}
    working = shape.recomputed_block(b, s, tp, sp=sp, ac=ac, e=e) + shape.residual_gradients(b, s, tp, sp=sp, e=e)
    best = None
    for i in sorted({layers - 1, max(0, layers - 2), 0}):  # held is linear in i below the last block
        later = layers - 1 - i  # blocks whose backward is done: their sharded gradients, one reduce_scatter input kept
        # the block gathered, the one before it prefetched (the first block has none), its unsharded
        # gradients; FSDP2 keeps the last reduce_scatter's input until the next unit's (``reduce_scatter_states``)
        unit = ((3 if i else 2) * g * block + (_GRAD * block if later else 0)) if fsdp else 0
        done = later * (block_grads if fsdp else _GRAD * block)  # accumulated into ``kept`` when it is held
        held = {"grads": max(kept + (head_grads if fsdp else 0), head_grads + done),
                "activations": (i + 1) * per_block + working, "fsdp_buffers": root + unit}
        if best is None or sum(held.values()) > sum(best.values()):
            best = held
    moments["block"] = best
    moments["step"] = {"grads": _GRAD * params.elements(dp), "activations": 0, "fsdp_buffers": 0}
    return moments
