"""``fxtp.plan``'s solve time against the layer count (issue 25: "the bench records solve time
against layer count"): Llama-3.1-70B's shapes at 8 ... 126 layers on the meta device, 64 x
H100-80GB, global batch 64 x 8192 tokens. Two blocks are analyzed whatever the depth (NOTE:
[repeated blocks]), so the time should not grow with it; building the model on meta (not part
of ``solve_s``) does.

``--passes`` also times fxtp's passes on the full-depth graph (``fxtp.analyze``'s work after the
capture: normalize, the plan at tp 8, the report), CPU seconds (``time.process_time``: the
machine is shared) from one capture per depth, and the capture's wall seconds (torch.export's).

    python tools/bench_plan.py --json docs/bench_plan.json --passes

``--published`` prints the planner's predicted/measured step time for the published runs in
tools/published_runs.py (issue 34), as the markdown table docs/plan_command.md shows, with the
median and worst |log ratio|, and times a plan's close-call search on the big configs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import fxtp
from fxtp.cli.examples import LLAMA31, llama_config

LAYERS = (8, 16, 32, 80, 126)
PASSES_LAYERS = (8, 16, 32, 80)


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


def passes(layers: tuple[int, ...]) -> list[dict]:
    """CPU seconds of the passes at full depth against the layer count (one capture each)."""
    from fxtp.api import _capture
    from fxtp.explain.report import build_report
    from fxtp.planning import normalized, plan_program

    rows = []
    ids = torch.zeros(1, 128, dtype=torch.long, device="meta")
    for n in layers:
        start = time.perf_counter()
        captured = _capture(_model(n), (ids,), {"use_cache": False}, "auto", dynamic_shapes=None)
        capture_s = time.perf_counter() - start
        start = time.process_time()
        fqns, written = normalized(captured.program)
        sharding = plan_program(captured.program, fqns, written, 8, {})
        build_report(captured.program, sharding, captured.frontend, captured.attempts, 0)
        cpu = time.process_time() - start
        rows.append({"layers": n, "nodes": len(captured.program.graph.nodes), "capture_s": capture_s, "passes_cpu_s": cpu,
                     "rounds": sharding.rounds})
        print(f"{n:4d} layers: {rows[-1]['nodes']} nodes, passes {cpu:.2f} s CPU, capture {capture_s:.1f} s", flush=True)
    return rows


def published(path: str | None) -> None:
    """The published runs' predicted/measured table, its median and worst |log ratio|."""
    import published_runs

    t = published_runs.table()
    print(published_runs.markdown(t))
    if path:
        with open(path) as f:
            data = json.load(f)
        data["published"] = {"rows": t.rows, "median_abs_log_ratio": t.median, "worst_abs_log_ratio": t.worst,
                             "not_expressed": list(published_runs.NOT_EXPRESSED), "date": time.strftime("%Y-%m-%d")}
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="write the rows to FILE")
    parser.add_argument("--repeats", type=int, default=3, help="plans per depth (the median is reported)")
    parser.add_argument("--passes", action="store_true", help="also time the passes at full depth (minutes: one capture each)")
    parser.add_argument("--published", action="store_true", help="only the published runs' table (tools/published_runs.py)")
    args = parser.parse_args()
    if args.published:
        return published(args.json)
    fxtp.plan(_model(2 + 1), 8, device_memory=80 * 2**30, batch=8, seq=8192)  # warm-up: imports, first capture
    rows = run(LAYERS, args.repeats)
    out: dict = {"rows": rows}
    if args.passes:
        out["passes"] = passes(PASSES_LAYERS)
    if args.json:  # the file's other sections (--passes, --published from an earlier run) are kept
        meta = {"torch": torch.__version__, "machine": platform.machine(), "date": time.strftime("%Y-%m-%d")}
        try:
            with open(args.json) as f:
                kept = json.load(f)
        except FileNotFoundError:
            kept = {}
        with open(args.json, "w") as f:
            json.dump({**kept, "meta": meta, **out}, f, indent=2)


if __name__ == "__main__":
    main()
