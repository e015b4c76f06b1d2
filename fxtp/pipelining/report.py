"""What a pipeline is: the blocks of each stage, the schedule, its bubble, the bytes between stages.

NOTE: [pipeline bubble]
With ``p`` pipeline ranks, ``m`` micro-batches and forward and backward of equal cost per stage,
the idle fraction of a step (the bubble over the whole step time):

* GPipe and 1F1B: ``(p - 1) / (m + p - 1)`` (Huang et al. 2019, GPipe, section 2.2; Narayanan
  et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", section 2.2.1: bubble time over ideal time ``(p - 1) / m``);
* interleaved 1F1B (and looped BFS) with ``v`` stages per rank: ``(p - 1) / (v * m + p - 1)``
  (Narayanan et al. 2021, section 2.2.2: the bubble shrinks by ``v``);
* the zero-bubble schedules, with the forward (F), input-gradient (B) and weight-gradient (W)
  passes of equal cost (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241):
  ``InterleavedZeroBubble`` is their ZB1P (torch's docstring), whose bubble is a third of 1F1B's,
  ``(p - 1)(T_F + T_B - T_W)`` against ``(p - 1)(T_F + T_B + T_W)`` (section 2.1, ZB-H1): a bubble
  time over ideal time of ``(p - 1) / (3 m)``, so ``(p - 1) / (3 m + p - 1)`` of the step. That
  is the paper's one-stage-a-rank figure; torch interleaves ``v`` stages a rank, which can only
  shorten the warm-up, so it is an upper bound there. ``ZBVZeroBubble`` is their ZB-V (section 6):
  0. A real model's unequal passes leave some bubble, not priced here.
* ``DualPipeV`` (DeepSeek-V3's DualPipe, arXiv 2412.19437, cut to a V): no formula here (``nan``);
  its published bubble, ``(p / 2 - 1)(F&B + B - 3W)``, is DualPipe's, not DualPipeV's.

Bytes between stages: a stage boundary that crosses ranks carries, per micro-batch, the
activation forward and its gradient backward, each ``micro_batch * seq * hidden`` elements, on
every tensor-parallel rank (each holds the full hidden states).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["PipelineReport", "StageRow", "bubble_fraction"]

_SOURCES = {
    "gpipe": "GPipe (Huang et al. 2019); Narayanan et al. 2021 s2.2.1",
    "1f1b": "Narayanan et al. 2021 s2.2.1 (PipeDream-Flush)",
    "interleaved1f1b": "Narayanan et al. 2021 s2.2.2",
    "loopedbfs": "Narayanan et al. 2021 s2.2.2",
    "interleavedzerobubble": "Qi et al. 2024 s2.1, ZB1P: a third of 1F1B's (F = B = W)",
    "zbvzerobubble": "Qi et al. 2024 s6, ZB-V (F = B = W)",
}


def bubble_fraction(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int) -> tuple[float, str]:
    """The predicted idle fraction of a step and its source (NOTE: [pipeline bubble])."""
    name = schedule.lower()
    if name not in _SOURCES:
        return float("nan"), "no formula for this schedule"
    if name == "zbvzerobubble":
        return 0.0, _SOURCES[name]
    if name == "interleavedzerobubble":
        return (pp - 1) / (3 * n_microbatches + pp - 1), _SOURCES[name]
    v = stages_per_rank if name in ("interleaved1f1b", "loopedbfs") else 1
    return (pp - 1) / (v * n_microbatches + pp - 1), _SOURCES[name]


@dataclass(frozen=True)
class StageRow:
    """One stage: its index, pipeline rank, blocks (``model.layers`` indices), whether it holds
    the embedding and the head, and its predicted shares of the FLOPs and bytes."""

    stage: int
    pp_rank: int
    blocks: tuple[int, ...]
    embedding: bool
    head: bool
    time_share: float
    memory_share: float


@dataclass(frozen=True)
class PipelineReport:
    """The pipeline of ``fxtp.pipeline`` (NOTE: [pipeline bubble]).

    Attributes:
        stages: one :class:`StageRow` per stage, in stage order.
        schedule: torch's schedule class name.
        pp, tp, dp: the mesh's sizes; ``stages_per_rank``; ``n_microbatches``.
        bubble: the predicted idle fraction of a step; ``bubble_source`` its formula's source.
        sent_bytes_per_step: bytes one tensor-parallel rank sends between stages in a step,
            summed over the pipeline (forward activations and backward gradients).
        micro_batch_bytes: one activation sent across a boundary, bytes.
    """

    stages: tuple[StageRow, ...]
    schedule: str
    pp: int
    tp: int
    dp: int
    stages_per_rank: int
    n_microbatches: int
    bubble: float
    bubble_source: str
    sent_bytes_per_step: int
    micro_batch_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        from tabulate import tabulate

        rows = [(r.stage, r.pp_rank, _span(r.blocks), "yes" if r.embedding else "", "yes" if r.head else "",
                 f"{r.time_share:.2f}", f"{r.memory_share:.2f}") for r in self.stages]
        table = tabulate(rows, headers=("stage", "pp rank", "blocks", "embedding", "head", "FLOPs share", "bytes share"))
        return (
            f"pipeline: {self.schedule}, pp {self.pp} x dp {self.dp} x tp {self.tp}, {self.stages_per_rank} stage(s) a rank, "
            f"{self.n_microbatches} micro-batches\n{table}\n"
            f"bubble: {self.bubble:.3f} of a step ({self.bubble_source})\n"
            f"sent between stages per step: {self.sent_bytes_per_step} bytes a tensor-parallel rank "
            f"({self.micro_batch_bytes} bytes an activation or gradient)"
        )


def _span(blocks: tuple[int, ...]) -> str:
    return "-" if not blocks else str(blocks[0]) if len(blocks) == 1 else f"{blocks[0]}-{blocks[-1]}"
