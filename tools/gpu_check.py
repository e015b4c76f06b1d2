"""The prepared GPU check: run once on a machine with a GPU, paste the figures into the README.

    python tools/gpu_check.py [--out DIR]          # on a GPU machine
    python tools/gpu_check.py --device cpu --tiny  # a dry run of the logic on CPU

1. ``examples/train.py`` under torchrun at N=1 (NCCL on a GPU), eager and ``--compile``: the
   loss per step and the step times it prints.
2. A Llama-shaped model (Llama-2-7B widths: hidden 4096, 32 heads, intermediate 11008, vocab
   32000; ``--layers`` blocks, bf16) compiled by fxtp for world_size 8 as rank 0 under a fake
   process group (collectives are no-ops, so this times one rank's compute and measures its
   memory): forward+backward step time and peak memory, eager and ``torch.compile``'d.

3. The CUDA paths of fxtp's own per-rank ops, as rank 0 of world_size 2 under the fake process
   group: a vocab-parallel embedding and cross entropy (bf16), SDPA dropout on sharded heads in
   train mode, a tiny Mixtral's experts (``grouped_mm``, bf16): each runs forward and backward;
   and, in a child process, an out-of-range token id trips the device-side assert (the single
   device's CUDA behaviour) instead of returning zeros.

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
    from fxtp.cli.examples import llama_config

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


_BAD_ID_CHILD = """
import torch, torch.distributed as dist, torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore
import fxtp
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64)).cuda()
ids = torch.randint(0, 64, (2, 8), device="cuda")
pm = fxtp.compile(model, 2, (ids,))
pm(ids.fill_(64))
torch.cuda.synchronize()
print("NO ERROR")
"""


def cuda_paths(args: argparse.Namespace) -> dict[str, Any]:
    """Section 3 of the module docstring: fxtp's per-rank ops on the device, no numerics (the
    fake process group's collectives do nothing)."""
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fxtp
    from fxtp.cli.examples import mixtral

    device = torch.device(args.device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    results: dict[str, Any] = {}

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.up, self.down, self.head = nn.Embedding(64, 16), nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 64)

        def forward(self, ids, labels):
            h = self.emb(ids)
            h = h + self.down(F.gelu(self.up(h)))
            return F.cross_entropy(self.head(h).float().flatten(0, 1), labels.flatten())

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

        def forward(self, x):
            q, k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
            return self.o(F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True).transpose(1, 2).flatten(2))

    ids = torch.randint(0, 64, (2, 8), device=device)
    x = torch.randn(2, 8, 32, device=device)
    mx, (mx_ids,) = mixtral()
    checks = {
        "vocab_parallel_lm_bf16": (LM().to(device, torch.bfloat16), (ids, ids)),
        "sdpa_dropout_train": (Attn().to(device).train(), (x,)),
        "mixtral_experts_bf16": (mx.to(device, torch.bfloat16), (mx_ids.to(device),)),
    }
    for name, (model, inputs) in checks.items():
        try:
            pm = fxtp.compile(model, 2, inputs)
            out = pm(*inputs)
            out = out.logits if hasattr(out, "logits") else out
            out.float().square().mean().backward()
            grads = [p.grad for p in pm.parameters() if p.requires_grad]
            results[name] = {"ok": all(g is not None and bool(torch.isfinite(g).all()) for g in grads),
                             "params_with_grad": sum(g is not None for g in grads),
                             "notes": sorted({n["code"] for n in pm.report.to_dict()["notes"]})}
        except Exception as exc:  # noqa: BLE001 - recorded, the other checks still run
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    dist.destroy_process_group()
    if device.type == "cuda":
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-c", _BAD_ID_CHILD], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        text = proc.stdout + proc.stderr
        results["out_of_range_id_cuda"] = {
            "ok": proc.returncode != 0 and "NO ERROR" not in text and "assert" in text.lower(),
            "rc": proc.returncode, "tail": text[-600:],
        }
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
    report["cuda_paths"] = cuda_paths(args)
    report["llama_per_rank"] = llama_per_rank(args)
    text = json.dumps(report, indent=1)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
