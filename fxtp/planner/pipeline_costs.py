"""Predicted memory and step time of a pipelined configuration: ``pp`` stages of ``tp x dp``.

NOTE: [pipeline costs]
The runtime priced is ``torch.distributed.pipelining``'s, as ``fxtp.pipeline`` and torchtitan's
``pipeline_llama`` run it: the ``L`` blocks cut into ``S = pp x v`` contiguous stages (``v`` =
``stages_per_rank``), stage ``s`` on pipeline rank ``s % pp``, the embedding on stage 0, the
final norm, the head and the loss on stage ``S - 1``; each stage tensor-parallel over ``tp`` and
FSDP2 over ``dp``. A dp replica's ``batch / dp`` sequences run as ``m`` micro-batches of ``b``.
The mesh is ``("pp", "dp", "tp")``, pp outermost (torchtitan's order).

- The cut (:func:`stage_blocks`): the objective of ``fxtp.pipelining.split.balance`` (the
  largest stage's larger share of the FLOPs and of the bytes), solved for a stack of like
  blocks: a stage's FLOPs are its blocks' and, on the last, the head's; its bytes are its
  parameters' states and the activations of the micro-batches it holds (``in_flight``), the
  embedding's on the first, the head's and the loss's on the last.
- Time: pipeline rank ``r`` is busy ``W_r`` over the ``m`` micro-batches: its blocks' (and the
  head's) compute at the rank's rate (NOTE: [FLOPs]) and its host seconds (NOTE: [host time]
  in fxtp/planner/host.py, priced for its own stages), their tensor-parallel collectives
  (NOTE: [cost model] in costs.py, per block as there; the collectives outside the blocks on
  the first and the last rank), and its receives. The step is ``max_r W_r / (1 - bubble)``
  plus the FSDP2 communication not hidden, ``bubble`` the schedule's idle fraction
  (``fxtp.pipelining.report.bubble_fraction``, NOTE: [pipeline bubble] there: ``(pp - 1) /
  (m + pp - 1)`` for 1F1B, ``(pp - 1) / (v m + pp - 1)`` for Interleaved1F1B; Narayanan et al.
  2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
  sections 2.2.1 and 2.2.2). The formula assumes equal stages: the slowest rank sets the pace.
- Point-to-point: per micro-batch and stage boundary, the activation ``(b, s, hidden)`` in the
  activations' dtype forward and its gradient backward, whole on every tp rank (a stage's
  output is full on each, NOTE: [pipeline x tensor parallelism] in fxtp/pipelining/pipe.py);
  one send each (NOTE: [point-to-point time] in comm.py), over the network once the job spans
  nodes (the outermost dim's neighbours are ``dp x tp`` ranks apart), priced exposed: torch's
  schedules wait on a stage's receive before it computes.
- FSDP2 under pipelining: torch's ``PipelineStage`` turns off the gradient reduction and the
  reshard after backward for all but the last micro-batch (``backward_maybe_with_nosync`` in
  ``torch/distributed/pipelining/stage.py``), and torchtitan does not reshard after forward
  under pp ("to avoid per-microbatch all-gathers", ``get_fsdp_reshard_after_forward_policy`` in
  ``torchtitan/distributed/fsdp.py``): a unit is gathered once a step and reduced once, at the
  last backward. Priced as such (``fsdp_exposed(..., regather=False)``), hidden behind the first
  micro-batch's forward and the last one's backward. ``fxtp.pipeline`` keeps FSDP2's default
  ``reshard_after_forward=True``, whose warmup forwards gather again: not priced.
- Memory of a pipeline rank at the last micro-batch's backward (the most of the rank's
  moments), the ranks' most being the plan's: fp32 parameters and the optimizer's states of its
  stages, sharded over ``dp``; their gathered bf16 copies (``fsdp_buffers``) and unsharded fp32
  gradients, kept until that backward (above; at ``dp`` 1 the gradients only); the
  activations of the micro-batches in flight: under 1F1B rank ``r`` holds ``min(m, pp - r)``
  (Narayanan et al. 2021, section 2.2.1; ``fxtp.pipelining.split.in_flight``), under
  Interleaved1F1B ``min(v m, (v - 1) m_round + 2 (pp - 1 - r) + 1)`` stage-micro-batches, torch's
  warmup plus the one in flight (``_get_warmup_ops`` in
  ``torch/distributed/pipelining/schedules.py``, ``m_round = m / max(1, m // pp)``), on rank 0
  about Korthikanti et al. 2022's ``pp (1 + (pp - 1) / (pp v))`` (section 4.2.3); a block's
  backward working set; on the last rank one micro-batch's final norm and loss. The peak grows
  with the micro-batch ``b`` (a 1F1B rank holds ``min(B, (pp - r) b)`` of its ``B`` sequences):
  the search stops at the first ``b`` that does not fit.

Only training is pipelined. Not modelled: a tied head's copy on the last stage (its
parameters are counted once, with the embedding), the stages' unequal forward/backward
ratios inside the bubble, the zero-bubble schedules (``fxtp.pipeline`` refuses them).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from fxtp.planner.comm import Group, Unit, collective_wait, fsdp_exposed, p2p_time, ring_time
from fxtp.planner.costs import _GRAD, OPTIMIZER_BYTES, Choice, Estimate, Workload, rate_per_device, tp_comm
from fxtp.planner.hardware import Hardware
from fxtp.planner.host import host_seconds, with_host
from fxtp.planner.model import TransformerShape
from fxtp.planner.params import ParamShapes

__all__ = ["SCHEDULES", "estimate_pipeline", "held_micro_batches", "stage_blocks", "schedule_runs"]

# torch's schedules the search prices, with their stages per rank (NOTE: [pipeline costs])
SCHEDULES: tuple[tuple[str, int], ...] = (("1F1B", 1), ("Interleaved1F1B", 2))


def schedule_runs(schedule: str, pp: int, stages_per_rank: int, n_microbatches: int, layers: int) -> bool:
    """Whether torch runs ``schedule`` with these sizes: at least ``pp`` micro-batches (torch's
    1F1B asks at least one per stage), interleaved ones a multiple of their rounds
    (``ScheduleInterleaved1F1B``: ``m % max(1, m // pp) == 0``), at most one stage per block."""
    if n_microbatches < pp or pp * stages_per_rank > layers:
        return False
    return stages_per_rank == 1 or n_microbatches % max(1, n_microbatches // pp) == 0


def held_micro_batches(schedule: str, pp: int, rank: int, n_microbatches: int, stages_per_rank: int) -> int:
    """Stage-micro-batches whose activations pipeline rank ``rank`` holds at most (NOTE: [pipeline costs])."""
    if stages_per_rank == 1:
        from fxtp.pipelining.split import in_flight

        return in_flight(schedule, pp, [rank], n_microbatches)[0]
    per_round = n_microbatches // max(1, n_microbatches // pp)
    warmup = (stages_per_rank - 1) * per_round + 2 * (pp - 1 - rank)
    return min(stages_per_rank * n_microbatches, warmup + 1)


def _ranks(pp: int, v: int) -> list[list[int]]:
    return [[s for s in range(pp * v) if s % pp == r] for r in range(pp)]


@functools.lru_cache(maxsize=4096)  # the close calls price the same rows again under other hardware figures
def stage_blocks(layers: int, pp: int, v: int, block: tuple[float, float, float], first: tuple[float, float],
                 last: tuple[float, float], held: tuple[float, ...]) -> tuple[int, ...]:
    """Blocks per stage, ``pp x v`` stages summing to ``layers``, minimizing the largest
    stage's larger share of the FLOPs and of the bytes (NOTE: [pipeline costs]); a stage
    between the first and the last holds a block at least (no stage is empty).

    Args:
        block: a block's FLOPs a token, its state bytes, its activation bytes per micro-batch held.
        first, last: the embedding's and the head's (the loss's with it) FLOPs and bytes.
        held: micro-batches each stage holds at once.
    """
    n = pp * v
    need = np.array([0] + [1] * (n - 2) + [0])
    held_ = np.asarray(held, dtype=float)
    fixed_t = np.zeros(n)
    fixed_b = np.zeros(n)
    fixed_t[0], fixed_b[0] = first
    fixed_t[-1] += last[0]
    fixed_b[-1] += last[1]
    per = block[1] + block[2] * held_
    flops_total = block[0] * layers + first[0] + last[0] or 1.0
    bytes_total = float((block[1] + block[2] * held_.mean()) * layers + first[1] + last[1]) or 1.0

    def rooms(cap: float) -> np.ndarray:  # the most blocks each stage takes under the cap, -1 for none
        by_time = (cap * flops_total - fixed_t) / block[0] if block[0] else np.full(n, float(layers))
        by_bytes = (cap * bytes_total - fixed_b) / np.where(per > 0, per, 1.0) if (per > 0).all() else np.full(n, float(layers))
        most = np.minimum(by_time, by_bytes)
        return np.where(most >= -1e-9, np.minimum(layers, np.floor(most + 1e-9)), -1).astype(int)

    def holds(cap: float) -> bool:
        r = rooms(cap)
        return bool((r >= need).all() and r.sum() >= layers)

    lo, hi = 0.0, 1.0
    while not holds(hi):
        lo, hi = hi, 2 * hi
    for _ in range(30):  # the least cap whose rooms hold every block
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    counts = rooms(hi)
    for _ in range(int(counts.sum()) - layers):  # give back from the costliest stage that can
        cost = np.maximum((fixed_t + counts * block[0]) / flops_total, (fixed_b + counts * per) / bytes_total)
        k = int(np.argmax(np.where(counts > need, cost, -np.inf)))
        counts[k] -= 1
    return tuple(int(c) for c in counts)


def estimate_pipeline(choice: Choice, shape: TransformerShape, params: ParamShapes, hw: Hardware, work: Workload) -> Estimate:
    """Predicted memory and time of a pipelined ``choice`` (``pp > 1``, training; NOTE: [pipeline costs])."""
    from fxtp.pipelining.report import bubble_fraction

    pp, tp, dp, b, m, v = choice.pp, choice.tp, choice.dp, choice.micro_batch, choice.accumulation, choice.stages_per_rank
    sp, ac, s, e, g = choice.sequence_parallel, choice.activation_checkpointing, work.seq, work.activation_bytes, work.gather_bytes
    layers, n = shape.layers, pp * v
    attention = 4 * shape.hidden * s  # a block's attention FLOPs a token, forward (NOTE: [FLOPs])
    block_params = sum(p * k for p, k in shape.block_kinds()) / layers
    block_fwd = 2 * block_params + attention
    head_fwd = 2 * shape.matmul_params - 2 * block_params * layers
    redo = block_fwd if ac == "blocks" else 0.0
    emb, kinds, head = params.unit_elements(1)
    emb_dp, kinds_dp, head_dp = params.unit_elements(dp)
    block_el = sum(el * k for el, k in kinds) / max(1, layers)
    block_el_dp = sum(el * k for el, k in kinds_dp) / max(1, layers)
    per_el = (4 + OPTIMIZER_BYTES[work.optimizer]) / dp + (g if dp > 1 else 0) + _GRAD  # NOTE: [pipeline costs]
    per_block = shape.block_activations(b, s, tp, sp=sp, ac=ac, e=e)
    loss = shape.other_activations(b, s, tp, sp=sp, e=e) + shape.loss_activations(b, s, tp, e)
    schedule = choice.schedule or "1F1B"
    held = tuple(held_micro_batches(schedule, pp, k % pp, m, v) / v for k in range(n))
    counts = stage_blocks(layers, pp, v, (3 * block_fwd + redo, per_el * block_el, per_block), (0.0, per_el * emb),
                          (3 * head_fwd, per_el * head + loss), held)
    rate = rate_per_device(choice, shape, hw, work)
    comm = tp_comm(choice, shape, params, hw, work, rate)
    tokens = work.batch // dp * s  # a replica's, a step
    payload = b * s * shape.hidden * e
    hop = p2p_time(payload, tp * dp * pp > work.devices_per_node, hw)
    group = Group.dp(tp, dp, work.devices_per_node)
    working = shape.recomputed_block(b, s, tp, sp=sp, ac=ac, e=e) + shape.residual_gradients(b, s, tp, sp=sp, e=e)
    ranks, fsdp_seen = [], {}
    for r, stages in enumerate(_ranks(pp, v)):
        blocks = sum(counts[k] for k in stages)
        first, last = 0 in stages, n - 1 in stages
        flops = blocks * (3 * block_fwd + redo) + (3 * head_fwd if last else 0.0)
        gemms = flops * tokens / (tp * rate)
        host = _rank_host(choice, params, hw, work, blocks, first, last)
        compute, host_recompute = with_host(hw.host, gemms, host)  # NOTE: [host time] in fxtp/planner/host.py
        sends = sum(k < n - 1 for k in stages) + sum(k > 0 for k in stages)  # = its receives
        between = compute - host["optimizer"]  # the compute between its collectives (NOTE: [collective wait])
        tp_wait = m * collective_wait(Group.tp(tp, work.devices_per_node), between / m,
                                      blocks * comm.block_count + (comm.outside_count if first or last else 0), hw)
        tp_s = m * (blocks * comm.block_s + (comm.outside_s if first or last else 0.0)) + tp_wait
        tp_all = m * (blocks * comm.block_all_s + (comm.outside_s if first or last else 0.0)) + tp_wait
        tp_bytes = m * (blocks * comm.block_bytes + (comm.outside_bytes if first or last else 0.0))
        elements = blocks * block_el + (emb if first else 0) + (head if last else 0)
        sharded = blocks * block_el_dp + (emb_dp if first else 0) + (head_dp if last else 0)
        chunks = held_micro_batches(schedule, pp, r, m, v)
        acts = chunks * blocks / v * per_block + working + (loss if last else 0)
        memory = {"params": round(4 * (sharded if dp > 1 else elements)), "grads": round(_GRAD * elements),
                  "optimizer": round(OPTIMIZER_BYTES[work.optimizer] * (sharded if dp > 1 else elements)),
                  "activations": round(acts), "kv_cache": 0, "fsdp_buffers": round(g * elements) if dp > 1 else 0}
        memory["total"] = sum(memory.values())
        fsdp_s = fsdp_hidden_s = wait = 0.0
        if dp > 1 and (blocks, first, last) in fsdp_seen:
            fsdp_s, fsdp_hidden_s, wait = fsdp_seen[(blocks, first, last)]
        elif dp > 1:
            scale = tokens // m / (tp * rate)  # seconds per FLOP a token of one micro-batch
            units = [Unit(ring_time("all_gather", g * emb, group, hw), ring_time("reduce_scatter", _GRAD * emb, group, hw),
                          0.0, 0.0)] if first else []
            one = Unit(ring_time("all_gather", g * block_el, group, hw), ring_time("reduce_scatter", _GRAD * block_el, group, hw),
                       block_fwd * scale, (2 * block_fwd + redo) * scale)
            units += [one] * blocks
            if last:
                units.append(Unit(ring_time("all_gather", g * head, group, hw), ring_time("reduce_scatter", _GRAD * head, group, hw),
                                  head_fwd * scale, 2 * head_fwd * scale))
            wait = collective_wait(group, between, 2 * len(units), hw)  # each unit gathered and reduced once a step
            fsdp_s = sum(u.all_gather + u.reduce_scatter for u in units) + host["fsdp"] + wait
            fsdp_hidden_s = fsdp_exposed(units, regather=False) + wait if hw.overlap_fsdp else fsdp_s
            fsdp_seen[(blocks, first, last)] = fsdp_s, fsdp_hidden_s, wait
        ranks.append({"busy": compute + tp_s + m * sends * hop, "compute": compute, "gemm": gemms,
                      "fsdp_host": host["fsdp"], "tp_wait": tp_wait, "fsdp_wait": wait,
                      "recompute": blocks * redo * tokens / (tp * rate) + host_recompute,
                      "tp": tp_s, "tp_all": tp_all, "p2p": m * sends * hop, "memory": memory, "fsdp": fsdp_s,
                      "fsdp_exposed": fsdp_hidden_s, "bytes": {"tp": round(tp_bytes), "pp": m * sends * payload,
                                                               "fsdp": round((g + _GRAD) * (dp - 1) * sharded)}})
    bubble, _ = bubble_fraction(schedule, pp, m, v)
    slow = max(ranks, key=lambda x: x["busy"])
    idle = slow["busy"] * bubble / (1 - bubble)
    exposed = max(x["fsdp_exposed"] for x in ranks)
    step = {"compute": slow["compute"], "gemm": slow["gemm"], "fsdp_host": max(x["fsdp_host"] for x in ranks),
            "recompute": slow["recompute"], "comm": slow["tp"] + slow["p2p"] + exposed,
            "tp_comm": slow["tp"], "tp_comm_hidden": slow["tp_all"] - slow["tp"], "fsdp_comm": max(x["fsdp"] for x in ranks),
            "fsdp_exposed": exposed, "p2p": slow["p2p"], "bubble": idle, "tp_wait": slow["tp_wait"],
            "fsdp_wait": max(x["fsdp_wait"] for x in ranks), "total": slow["busy"] + idle + exposed}
    peak = max(ranks, key=lambda x: x["memory"]["total"])["memory"]
    sent = {k: max(x["bytes"][k] for x in ranks) for k in ("tp", "fsdp", "pp")}
    return Estimate(choice, peak, step, sent, rate, counts)


def _rank_host(choice: Choice, params: ParamShapes, hw: Hardware, work: Workload, blocks: int, first: bool,
               last: bool) -> dict[str, float]:
    """A pipeline rank's host seconds a step (NOTE: [host time] in fxtp/planner/host.py): its
    ``blocks``' ops over the ``m`` micro-batches, those outside the blocks on the last rank;
    its optimizer over its own parameter tensors (the embedding's on the first, the final
    norm's and the head's on the last); FSDP2 once a unit a step (NOTE: [pipeline costs])."""
    ops = params.ops if last or params.ops is None else dataclasses.replace(params.ops, other=(0, 0.0))
    own = (params.other[:params.before] if first else ()) + (params.other[params.before:] if last else ())
    own_sharded = (params.sharded[0][:params.before] if first else ()) + (params.sharded[0][params.before:] if last else ())
    units = (len(params.block),) * blocks + ((len(own),) if own else ())
    emb, kinds, head = params.unit_elements(1)
    block_el = sum(el * k for el, k in kinds) / max(1, params.n_blocks)
    elements = blocks * block_el + (emb if first else 0) + (head if last else 0)
    return host_seconds(hw.host, ops, layers=blocks, tokens=choice.micro_batch * work.seq, tp=choice.tp, dp=choice.dp,
                        checkpointing=choice.activation_checkpointing, micro_batches=choice.accumulation,
                        tensors=sum(units), elements=-(-round(elements) // choice.dp), units=units, regather=False,
                        sharded=blocks * sum(params.sharded[1]) + sum(own_sharded) if choice.tp > 1 else 0)
