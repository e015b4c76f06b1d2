"""docs/moe.md's table of one training step's collectives for the tiny Mixtral, under tensor
and expert parallelism at ws 2, against a run: each rank counts its ``_c10d_functional`` calls
and the bytes it hands in (a ``TorchDispatchMode``, not fxtp's report), and the table is
rendered from those counts: a kind's bytes per rank where every rank hands in the same, else
summed over the ranks (the token blocks' all_to_all and gathers are data-dependent)."""

from __future__ import annotations

import collections
import pathlib

import pytest
import torch
from _helpers import loss_of
from torch.utils._python_dispatch import TorchDispatchMode

import fxtp
from fxtp.cli import examples

pytest.importorskip("transformers")

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "moe.md"
_KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "all_to_all_single": "all_to_all",
          "reduce_scatter_tensor": "reduce_scatter"}
PLANS = {"tensor parallel (default)": {}, "`expert_parallel=True`": {"expert_parallel": True}}


class _Bytes(TorchDispatchMode):
    """``{kind: [count, bytes]}`` of the functional collectives dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.defaultdict[str, list[int]] = collections.defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = _KINDS.get(func._opname) if func.namespace == "_c10d_functional" else None
        if kind is not None:
            self.seen[kind][0] += 1
            self.seen[kind][1] += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


def _step() -> dict:
    """One forward and backward of the tiny Mixtral (2 layers, (2, 16) ids) per plan."""
    import torch.distributed as dist

    out = {}
    for name, options in PLANS.items():
        model, (ids,) = examples.mixtral()
        pm = fxtp.compile(model, dist.get_world_size(), (ids,), dynamic=False, capture="export", **options)
        with _Bytes() as forward:
            logits = pm(ids)
        with _Bytes() as backward:
            loss_of(logits).backward()
        out[name] = {"forward": dict(forward.seen), "backward": dict(backward.seen)}
    return out


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:g} KiB"


def _cell(per_rank: list[dict]) -> str:
    parts = []
    for kind in ("all_reduce", "all_gather", "all_to_all", "reduce_scatter"):
        seen = [r.get(kind, [0, 0]) for r in per_rank]
        if not seen[0][0]:
            continue
        same = all(s == seen[0] for s in seen)
        where = f"{_kib(seen[0][1])} per rank" if same else f"{_kib(sum(s[1] for s in seen))} over the ranks"
        parts.append(f"{seen[0][0]} {kind}, {where}")
    return "; ".join(parts)


def test_docs_table_is_a_run(rank_pools):
    ranks = rank_pools(2).run(_step)
    rows = [f"| {name} | {_cell([r[name]['forward'] for r in ranks])} | {_cell([r[name]['backward'] for r in ranks])} |"
            for name in PLANS]
    text = DOC.read_text()
    for row in rows:
        assert row in text, "docs/moe.md should hold the measured row:\n" + "\n".join(rows)
