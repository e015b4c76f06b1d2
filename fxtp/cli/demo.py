"""The main job on a built-in example: a tiny GPT over local gloo ranks.

``fxtp demo [--world-size N]`` starts N processes on 127.0.0.1, compiles the model on each,
checks every rank's output against the single-device model, and prints rank 0's report.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_demo"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world_size: int, port: int, timeout_s: int) -> None:
    import fxtp
    from fxtp.cli.examples import tiny_gpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        model, inputs = tiny_gpt(seed=0)
        expected = model(*inputs)
        pm = fxtp.compile(model, world_size, inputs)
        out = pm(*inputs)
        err = (out - expected).abs().max()
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        torch.testing.assert_close(out, expected)
        if rank == 0:
            print(pm.report)
            print(
                f"\nOK: outputs of all {world_size} ranks match the single-device model "
                f"(max abs error {err.item():.2e}, logits {tuple(out.shape)})"
            )
    finally:
        dist.destroy_process_group()


def run_demo(world_size: int = 2, timeout_s: int = 120) -> None:
    """Run the demo on ``world_size`` local gloo ranks; raises if any rank fails."""
    mp.spawn(_rank_main, args=(world_size, _free_port(), timeout_s), nprocs=world_size, join=True)
