"""``fxtp.plan``'s solve time against the layer count (issue 25: "the bench records solve time
against layer count"): Llama-3.1-70B's shapes at 8 ... 126 layers on the meta device, 64 x
H100-80GB, global batch 64 x 8192 tokens. Two blocks are analyzed whatever the depth (NOTE:
[repeated blocks]), so the time should not grow with it; building the model on meta (not part
of ``solve_s``) does.

    python tools/bench_plan.py --json docs/bench_plan.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import fxtp
from fxtp.explain.examples import LLAMA31, llama_config

LAYERS = (8, 16, 32, 80, 126)


def _model(layers: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    shapes = {**LLAMA31["70b"], "num_hidden_layers": layers}
    cfg = llama_config(vocab_size=128256, max_position_embeddings=131072, **shapes)
    with torch.device("meta"):
        return LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()


def run(layers: tuple[int, ...], repeats: int) -> list[dict]:
    rows = []
    for n in layers:
        start = time.perf_counter()
        model = _model(n)
        build_s = time.perf_counter() - start
        solves = []
        for _ in range(repeats):
            plan = fxtp.plan(model, 64, device_memory=80 * 2**30, batch=64, seq=8192)
            solves.append(plan.solve_s)
        rows.append({"layers": n, "build_s": build_s, "solve_s": statistics.median(solves), "solves_s": solves,
                     "analyzed_blocks": plan.analyzed_blocks, "mesh": {"tp": plan.tp, "dp": plan.dp}})
        print(f"{n:4d} layers: solve {rows[-1]['solve_s']:.2f} s (build on meta {build_s:.2f} s), tp {plan.tp} x dp {plan.dp}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="write the rows to FILE")
    parser.add_argument("--repeats", type=int, default=3, help="plans per depth (the median is reported)")
    args = parser.parse_args()
    fxtp.plan(_model(2 + 1), 8, device_memory=80 * 2**30, batch=8, seq=8192)  # warm-up: imports, first capture
    rows = run(LAYERS, args.repeats)
    if args.json:
        meta = {"torch": torch.__version__, "machine": platform.machine(), "date": time.strftime("%Y-%m-%d")}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
