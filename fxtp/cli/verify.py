"""``fxtp inspect --verify``: run the ranks locally on gloo and compare with the single-device model.

Every rank rebuilds the model from MODEL (seeded, then loaded with the parent's state dict, so a
model defined in a file works too), compiles it, runs forward and backward on the parent's
inputs, and compares its outputs with the single-device model's, and every parameter's gradient
(a shard against the matching slice of the full gradient). A rank that fails reports one line
(its traceback with ``verbose``); ranks that fail alike are reported once.
"""

from __future__ import annotations

import copy
import datetime
import os
import traceback
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils._pytree as pytree

from fxtp.core.errors import FxtpError, FxtpRuntimeError
from fxtp.core.placement import shard_tensor
from fxtp.cli.demo import _free_port
from fxtp.runtime.sharded import local_tensor

__all__ = ["VerifyResult", "verify"]


@dataclass(frozen=True)
class VerifyResult:
    """Max abs errors over all ranks against the single-device model."""

    world_size: int
    output_error: float
    grad_error: float
    params: int  # parameters with a gradient, compared
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.output_error <= self.tolerance and self.grad_error <= self.tolerance

    def __str__(self) -> str:
        verdict = "OK" if self.ok else f"FAIL: over tolerance {self.tolerance:.0e}"
        return (
            f"verify: {self.world_size} rank(s) on gloo against the single-device model\n"
            f"  outputs:   max abs error {self.output_error:.2e}\n"
            f"  gradients: max abs error {self.grad_error:.2e} ({self.params} parameters)\n"
            f"{verdict}"
        )


def _float_leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _loss(out: Any) -> torch.Tensor:
    """A deterministic scalar from any output structure (sum of mean squares)."""
    return sum((t.float() ** 2).mean() for t in _float_leaves(out))


def _max_error(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    return max((float((a.detach().float() - b.detach().float()).abs().max()) for a, b in pairs if a.numel()), default=0.0)


def _compare(model: torch.nn.Module, inputs: tuple, world_size: int, sequence_parallel: bool = False) -> tuple[float, float, int]:
    import fxtp

    rank = dist.get_rank()
    ref = copy.deepcopy(model)
    pm = fxtp.compile(model, world_size, inputs, sequence_parallel=sequence_parallel)
    # The same generator state for both runs: a model with dropout in train mode draws the same
    # masks (fxtp draws the single device's mask and keeps its slice, NOTE: [dropout across ranks]).
    state = torch.random.get_rng_state()
    out = pm(*inputs)
    torch.random.set_rng_state(state)
    expected = ref(*inputs)
    out_err = _max_error(zip(_float_leaves(out), _float_leaves(expected)))
    _loss(out).backward()
    _loss(expected).backward()
    pairs = []
    for fqn, placement in pm.placements.items():
        local, full = pm.get_parameter(fqn).grad, ref.get_parameter(fqn).grad
        local = None if local is None else local_tensor(local)  # the shard itself (NOTE: [sharded parameters])
        if local is not None and full is not None:
            pairs.append((local, shard_tensor(full, placement, rank, world_size)))
        elif (local is None) != (full is None):
            raise FxtpRuntimeError(f"{fqn} has a gradient on one side only (parallel: {local is not None})")
    errors = torch.tensor([out_err, _max_error(pairs)], dtype=torch.float64)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    return float(errors[0]), float(errors[1]), len(pairs)


def _rank_main(
    rank: int, world_size: int, port: int, timeout_s: int, model_text: str, state: dict, inputs: tuple, results: Any,
    sequence_parallel: bool = False,
) -> None:
    from fxtp.cli.inspection import load_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        model = load_model(model_text).model
        model.load_state_dict(state)
        found = _compare(model, inputs, world_size, sequence_parallel)
        if rank == 0:
            results.put(("ok", found))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent as a message
        text = str(exc)
        if not isinstance(exc, FxtpError):  # its first line, and the next when the first announces it
            lines = [line.strip() for line in text.splitlines() if line.strip()] or [""]
            text = f"{type(exc).__name__}: {' '.join(lines[:2]) if lines[0].endswith(':') else lines[0]}"
        results.put(("error", (rank, text, traceback.format_exc())))
    finally:
        dist.destroy_process_group()


def verify(
    model_text: str,
    model: torch.nn.Module,
    inputs: tuple,
    world_size: int,
    *,
    tolerance: float = 1e-4,
    timeout_s: int = 120,
    verbose: bool = False,
    sequence_parallel: bool = False,
) -> VerifyResult:
    """Run ``world_size`` local gloo ranks on MODEL ``model_text`` (``model`` is its single-device
    instance: its state dict is sent to the ranks) and return the max abs errors.

    Raises:
        FxtpRuntimeError: a rank failed: one line per distinct error, naming the ranks
            (``verbose``: each failing rank's traceback too).
    """
    results = mp.get_context("spawn").SimpleQueue()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        mp.spawn(
            _rank_main,
            args=(world_size, _free_port(), timeout_s, model_text, state, inputs, results, sequence_parallel),
            nprocs=world_size,
            join=True,
        )
    except mp.ProcessExitedException as exc:  # killed, or exited without reporting
        raise FxtpRuntimeError(f"verify: a rank died: {exc}") from None
    except mp.ProcessRaisedException as exc:  # raised outside _rank_main's try (the process group)
        last = str(exc).strip().splitlines()[-1]
        raise FxtpRuntimeError(f"verify: a rank failed before it ran: {last}") from None
    answers = []
    while not results.empty():
        answers.append(results.get())
    errors = [found for kind, found in answers if kind == "error"]
    if errors:
        raise FxtpRuntimeError(_failure_message(errors, verbose))
    ((_, (out_err, grad_err, params)),) = answers
    return VerifyResult(world_size, out_err, grad_err, params, tolerance)


def _failure_message(errors: list[tuple[int, str, str]], verbose: bool) -> str:
    """``verify failed on rank(s) 0, 1: <error>``, one line per distinct error (sorted by rank);
    ``verbose`` appends each failing rank's traceback."""
    by_text: dict[str, list[int]] = {}
    for rank, text, _ in sorted(errors):
        by_text.setdefault(text, []).append(rank)
    lines = [f"verify failed on rank(s) {', '.join(map(str, ranks))}: {text}" for text, ranks in by_text.items()]
    if verbose:
        lines += [f"rank {rank}:\n{trace}" for rank, _, trace in sorted(errors)]
    return "\n".join(lines)
