"""The prepared GPU check: run once on a machine with a GPU, paste the figures into the README.

    python tools/gpu_check.py [--out DIR]          # on a GPU machine
    python tools/gpu_check.py --device cpu --tiny  # a dry run of the logic on CPU

1. ``examples/train.py`` under torchrun at N=1 (NCCL on a GPU), eager and ``--compile``: the
   loss per step and the step times it prints.
2. A Llama-shaped model (Llama-2-7B widths: hidden 4096, 32 heads, intermediate 11008, vocab
   32000; ``--layers`` blocks, bf16) compiled by fxtp for world_size 8 as rank 0 under a fake
   process group (collectives are no-ops, so this times one rank's compute and measures its
   memory): forward+backward step time and peak memory, eager and ``torch.compile``'d.

Writes ``gpu_check.json`` (and prints it) into ``--out`` (default ``$OUT`` or ``.``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=2, help="Llama blocks in the per-rank graph check")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=5, help="timed steps after 2 warm-up steps")
    parser.add_argument("--tiny", action="store_true", help="tiny widths (a CPU dry run)")
    parser.add_argument("--skip-torchrun", action="store_true")
    return parser


def torchrun_example(compile_: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           os.path.join(ROOT, "examples", "train.py"), "--steps", "5", *(["--compile"] if compile_ else [])]
    start = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("step ", "backend "))]
    return {"compile": compile_, "rc": proc.returncode, "wall_s": round(time.perf_counter() - start, 1),
            "lines": lines, "stderr_tail": proc.stderr[-2000:] if proc.returncode else ""}


def llama_per_rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaForCausalLM

    import fxtp
    from fxtp.examples import llama_config

    ws = 8
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ws)
    tiny = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1024}
    full = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}
    widths = tiny if args.tiny else full
    seq = 64 if args.tiny else args.seq
    cfg = llama_config(num_hidden_layers=args.layers, max_position_embeddings=seq, **widths)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=device)
    start = time.perf_counter()
    pm = fxtp.compile(model, ws, (ids,))
    compile_s = time.perf_counter() - start
    del model
    results = []
    for mode in ("eager", "torch.compile"):
        fn = torch.compile(pm) if mode == "torch.compile" else pm
        times = []
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for i in range(2 + args.iters):
            t0 = time.perf_counter()
            out = fn(ids)
            logits = out.logits if hasattr(out, "logits") else out
            logits.float().square().mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
            pm.zero_grad(set_to_none=True)
        results.append({
            "mode": mode, "world_size": ws, "rank": 0, "layers": args.layers, "seq": seq, "dtype": str(dtype),
            "fxtp_compile_s": round(compile_s, 1),
            "step_ms_median": round(sorted(times)[len(times) // 2] * 1e3, 2),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if device.type == "cuda" else None,
            "local_param_gib": round(sum(p.numel() * p.element_size() for p in pm.parameters()) / 2**30, 3),
            "collectives_per_forward": pm.report.to_dict()["collectives"][0],
        })
    dist.destroy_process_group()
    return results


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = get_args_parser().parse_args(argv)
    sys.path.insert(0, ROOT)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    if not args.skip_torchrun:
        report["torchrun"] = [torchrun_example(False), torchrun_example(True)]
    report["llama_per_rank"] = llama_per_rank(args)
    text = json.dumps(report, indent=1)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
