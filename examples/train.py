"""Train a small GPT with fxtp tensor parallelism, one process per rank.

    torchrun --nproc-per-node N examples/train.py [--steps 5]

NCCL on GPUs (one per rank, ``LOCAL_RANK``), gloo on CPU, picked automatically. Every rank
builds the same model and batch from a fixed seed; ``fxtp.compile`` gives each rank its shards;
rank 0 prints the loss per step (``step 1 loss 4.8712``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxtp
from fxtp.cli.examples import GPTConfig, TinyGPT


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--dim", type=int, default=64, help="hidden size (divisible by heads and world size)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--compile", action="store_true", help="wrap the parallel module in torch.compile")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = get_args_parser().parse_args(argv)
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, ws = dist.get_rank(), dist.get_world_size()
    try:
        cfg = GPTConfig(n_layers=args.layers, dim=args.dim, batch=args.batch)
        torch.manual_seed(0)
        model = TinyGPT(cfg).to(device)
        data = torch.randint(0, cfg.vocab_size, (args.steps, cfg.batch, cfg.seq_len + 1),
                             generator=torch.Generator().manual_seed(1)).to(device)
        pm = fxtp.compile(model, ws, (data[0, :, :-1],))
        del model
        if rank == 0:
            print(f"backend {backend}, world_size {ws}, device {device.type}")
            print(pm.report.summary())
        step_fn = torch.compile(pm) if args.compile else pm
        opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
        for step in range(args.steps):
            start = time.perf_counter()
            ids, targets = data[step, :, :-1], data[step, :, 1:]
            logits = step_fn(ids)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0:
                print(f"step {step + 1} loss {loss.item():.4f} ({(time.perf_counter() - start) * 1e3:.1f} ms)", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
