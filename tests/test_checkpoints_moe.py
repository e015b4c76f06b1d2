"""DCP checkpoints of a mixture of experts across its two plans and world sizes, on real gloo
ranks: saved under expert parallelism (whole experts per rank, ``Shard(0)``), loaded under
tensor parallelism inside the experts at another world size, saved again and loaded under
expert parallelism with uneven expert counts (6 experts on 4 ranks: 2/2/1/1, ``LocalChunks``,
NOTE: [checkpoint layouts]); each load gives exactly the model that was saved, with the
original FQNs. Tiny Mixtral, 1 layer, 6 experts (fxtp/cli/examples.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _helpers import loss_of
from torch.distributed.tensor import DTensor

import fxtp
from fxtp.cli import examples

pytest.importorskip("transformers")

EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"


def _model(seed: int):
    model, (ids,) = examples.mixtral(num_hidden_layers=1, num_local_experts=6)
    if seed:  # other weights, so that a load that misses a tensor shows
        torch.manual_seed(seed)
        with torch.no_grad():
            for t in model.state_dict().values():
                if t.is_floating_point():
                    t.copy_(torch.randn_like(t))
    return model, (ids[:, :8],)


def _load_step_save(load: str | None, save: str, expert_parallel: bool) -> dict:
    """Compile (perturbed weights when loading), dcp.load ``load`` if given, record the full
    state dict and the output, take one SGD step and dcp.save to ``save``."""
    model, inputs = _model(7 if load else 0)
    pm = fxtp.compile(model, dist.get_world_size(), inputs, dynamic=False, capture="export", expert_parallel=expert_parallel)
    out = {"layout": type(pm.state_dict()[EXPERTS]).__name__, "style": pm.plan.get(EXPERTS)}
    if isinstance(pm.state_dict()[EXPERTS], DTensor):
        out["layout"] += str(list(pm.state_dict()[EXPERTS].placements))
    if load:
        sd = pm.state_dict()
        dcp.load(sd, checkpoint_id=load)
        pm.load_state_dict(sd)
    out["loaded"], out["output"] = pm.full_state_dict(), pm(*inputs).logits.detach()
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    loss_of(pm(*inputs)).backward()
    opt.step()
    dcp.save(pm.state_dict(), checkpoint_id=save)
    out["saved"] = pm.full_state_dict()
    return out


def test_expert_parallel_checkpoint_loads_under_tensor_parallelism_and_back(rank_pools, tmp_path):
    """EP at ws 2 (3 experts a rank, a ``Shard(0)`` DTensor) -> TP at ws 4 -> EP at ws 4
    (2/2/1/1 experts, ``LocalChunks``): every load is exactly what was saved, and its output
    is the single device's on the loaded weights."""
    first, second = str(tmp_path / "ep2"), str(tmp_path / "tp4")
    ep2 = rank_pools(2).run(_load_step_save, None, first, True)[0]
    tp4 = rank_pools(4).run(_load_step_save, first, second, False)[0]
    ep4 = rank_pools(4).run(_load_step_save, second, str(tmp_path / "ep4"), True)[0]
    assert (ep2["style"], tp4["style"], ep4["style"]) == ("expert", "colwise", "expert")
    assert ep2["layout"] == "DTensor[Shard(dim=0)]" and ep4["layout"] == "LocalChunks", (ep2["layout"], ep4["layout"])
    for saved, loaded in ((ep2, tp4), (tp4, ep4)):
        assert list(loaded["loaded"]) == list(saved["saved"])  # the original FQNs, in order
        for key, value in saved["saved"].items():
            assert torch.equal(loaded["loaded"][key], value), key
        model, inputs = _model(0)
        model.load_state_dict(saved["saved"])
        torch.testing.assert_close(loaded["output"], model(*inputs).logits)
