"""One training step at pp 2 x tp 2 (``fxtp.pipeline``) against tp 4 (``fxtp.compile``), same run.

    python tools/bench_pipeline.py [--json docs/bench_pipeline.json]

The model: the Llama of ``tests/test_pipeline.py`` (6 blocks, hidden 64, 4 heads, 2 kv heads,
vocab 128, tied embeddings), a global batch of 8 x 16 tokens, the mean cross entropy; 4 gloo ranks
spawned once, each layout built in turn on them. A step is forward, loss and backward of the
global batch (the pipelines in 4 micro-batches, under 1F1B and Interleaved1F1B with 2 stages a
rank) and ``zero_grad``; the figure is the median over 5 steps after 2 warm-up ones of the
slowest rank's wall time (a barrier before each step). CPU and gloo: a tiny model's step is
dominated by per-op and per-message overheads, not by FLOPs; the figures compare layouts on
this machine only.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_STEPS, _WARMUP = 5, 2


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _time(step: Callable[[], None]) -> float:
    """The median over ``_STEPS`` of the slowest rank's seconds a step."""
    times = []
    for i in range(_WARMUP + _STEPS):
        dist.barrier()
        start = time.perf_counter()
        step()
        took = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if i >= _WARMUP:
            times.append(float(took))
    return statistics.median(times)


def measure() -> dict[str, Any]:
    """``{layout: {"step_s": seconds, ...}}`` on 4 initialized gloo ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    import fxtp

    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(2))
    model = _model()
    out: dict[str, Any] = {}
    pm = fxtp.compile(copy.deepcopy(model), 4, (ids,), dynamic=False)

    def tp_step() -> None:
        _loss(pm(ids).logits, target).backward()
        pm.zero_grad()

    out["tp4"] = {"step_s": _time(tp_step)}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    for schedule in ("1F1B", "Interleaved1F1B"):
        pipe = fxtp.pipeline(copy.deepcopy(model), mesh, (ids,), n_microbatches=4, loss_fn=_loss, schedule=schedule,
                             dynamic=False)

        def pp_step() -> None:
            pipe.step(ids, target=target)
            for stage in pipe.stages:
                stage.zero_grad()

        out[f"pp2_tp2_{schedule}"] = {"step_s": _time(pp_step), "bubble": pipe.report.bubble,
                                      "sent_bytes_per_step": pipe.report.sent_bytes_per_step,
                                      "stages": [list(r.blocks) for r in pipe.report.stages]}
    return out


def bench() -> dict[str, Any]:
    """:func:`measure` on 4 spawned gloo ranks."""
    from fxtp.planner.calibration import spawn_ranks

    return spawn_ranks(measure, 4, 300)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    result = bench()
    for layout, row in result.items():
        print(f"{layout:24s} {row['step_s'] * 1e3:8.1f} ms a step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
