"""Checkpoints across world sizes on real gloo ranks: torch.distributed.checkpoint (DCP) saves
``pm.state_dict()`` at one world size and loads it at another, for every layout fxtp makes;
torch's ``get_/set_model_state_dict`` and ``get_/set_optimizer_state_dict`` resume training at
another world size; a state dict that does not fit raises.

Every check compares with the model that was saved (exactly) or the single-device model.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _helpers import loss_of
from cases import build_case
from test_training import IDS, TiedLM
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import fxtp
from fxtp.runtime.layout import LocalChunks


def _tied_lm():
    torch.manual_seed(0)
    return TiedLM(), (IDS,)


# One model per layout: TiedLM has a vocab-parallel embedding tied to its colwise head, a colwise
# and a rowwise linear, a replicated bias, a buffer and an unused layer; the other two have a
# fused Q|K|V projection (several segments per rank, NOTE: [segments]).
MODELS = {
    "tied-lm": _tied_lm,
    "mha": lambda: build_case("14-mha"),
    "fused-qkv": lambda: build_case("5a-fused-chunk"),
    "uneven": lambda: build_case("2-uneven"),  # 5 features: uneven at 2 and 4 (NOTE: [uneven shards])
    "heads-96": lambda: build_case("3-heads-96"),  # 6 heads: 3/3 at 2, 2/2/1/1 whole heads at 4
    "gqa": lambda: build_case("4-gqa"),  # 2 kv heads: one per rank at 2; at 4 each held by 2 ranks (NOTE: [grouped shards])
}


def _perturbed(name: str):
    """The model with other weights, so a load that misses a tensor shows."""
    model, inputs = MODELS[name]()
    torch.manual_seed(7)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn_like(t))
    return model, inputs


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _save(root: str):
    """Compile every model, take one SGD step, dcp.save its state dict; rank 0 returns the full
    state dicts and the types of the state-dict values."""
    fulls, kinds = {}, {}
    for name, build in MODELS.items():
        model, inputs = build()
        pm = fxtp.compile(model, _world_size(), inputs)
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        loss_of(pm(*inputs)).backward()
        opt.step()
        sd = pm.state_dict()
        kinds[name] = {k: type(v).__name__ + (str(list(v.placements)) if isinstance(v, DTensor) else "") for k, v in sd.items()}
        dcp.save(sd, checkpoint_id=os.path.join(root, name))
        fulls[name] = pm.full_state_dict()
    return fulls, kinds


def _load(root: str):
    """Compile every model with other weights, dcp.load the checkpoint into its state dict and
    load that; returns the full state dicts and the outputs."""
    fulls, outs = {}, {}
    for name in MODELS:
        model, inputs = _perturbed(name)
        pm = fxtp.compile(model, _world_size(), inputs)
        sd = pm.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(root, name))
        pm.load_state_dict(sd)
        fulls[name], outs[name] = pm.full_state_dict(), pm(*inputs)
    return fulls, outs


@pytest.mark.parametrize("saved_ws,loaded_ws", [(2, 4), (4, 2), (2, 1), (2, 2)])
def test_dcp_reshards_every_layout(rank_pools, tmp_path, saved_ws, loaded_ws):
    """dcp.save at one world size, dcp.load at another: exactly the saved model, for colwise,
    rowwise, segmented, vocab-parallel and tied parameters (world size 1: this process, no group)."""
    fulls, kinds = rank_pools(saved_ws).run(_save, str(tmp_path))[0]
    assert kinds["mha"]["mha.in_proj_weight"] == "LocalChunks"  # Q|K|V: 3 chunks per rank
    assert kinds["mha"]["mha.out_proj.weight"] == "DTensor[Shard(dim=1)]"
    assert kinds["tied-lm"]["emb.weight"] == kinds["tied-lm"]["head.weight"] == "DTensor[Shard(dim=0)]"
    assert kinds["tied-lm"]["out.bias"] == "DTensor[Replicate()]" and kinds["tied-lm"]["scale"] == "Tensor"
    assert kinds["uneven"]["0.weight"] == kinds["uneven"]["2.weight"] == "LocalChunks"  # DTensor's blocks are torch.chunk's
    assert kinds["heads-96"]["q.weight"] == ("LocalChunks" if saved_ws == 4 else "DTensor[Shard(dim=0)]")
    assert kinds["gqa"]["k.weight"] == ("LocalChunks" if saved_ws == 4 else "DTensor[Shard(dim=0)]")  # a kv head, saved once
    results = [_load(str(tmp_path))] if loaded_ws == 1 else rank_pools(loaded_ws).run(_load, str(tmp_path))
    for loaded, outs in results:
        for name, full in fulls.items():
            assert list(loaded[name]) == list(full)
            for key, value in full.items():
                assert torch.equal(loaded[name][key], value), f"{name} {key}"
            model, inputs = MODELS[name]()
            model.load_state_dict(full)
            torch.testing.assert_close(outs[name], model(*inputs))


def _misfits():
    """Load state dicts that do not fit; returns the error messages, and whether a plain full
    state dict (model.state_dict()) loads right."""
    model, inputs = _tied_lm()
    pm = fxtp.compile(_perturbed("tied-lm")[0], _world_size(), inputs)
    errors = []
    local = {**model.state_dict(), "fc.weight": pm.get_parameter("fc.weight").detach().clone()}  # a local shard
    other = fxtp.compile(copy.deepcopy(model), _world_size(), inputs, plan={"fc": "rowwise"}).state_dict()
    for bad in (local, {**pm.state_dict(), "fc.weight": other["fc.weight"]}):
        try:
            pm.load_state_dict(bad)
        except fxtp.FxtpInputError as e:
            errors.append(str(e))
    pm.load_state_dict(model.state_dict())  # full tensors: each sliced to this rank's shard
    copy.deepcopy(pm)  # the hooks and the group (by name) do not stop a copy
    return errors, (pm(*inputs) - model(*inputs)).abs().max().item()


def test_state_dict_that_does_not_fit_raises(rank_pools):
    for errors, full_error in rank_pools(2).run(_misfits):
        assert len(errors) == 2
        assert errors[0].startswith("fc.weight: the state dict holds a tensor of shape (32, 16)")
        assert errors[1].startswith("fc.weight: the state dict holds a DTensor (64, 16) (Shard(dim=1),)")
        assert full_error < 1e-5


OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
}


def _train(module, opt, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        loss_of(module(IDS)).backward()
        opt.step()


def _train_and_save(root: str) -> None:
    for name, make in OPTIMIZERS.items():
        pm = fxtp.compile(_tied_lm()[0], _world_size(), (IDS,))
        opt = make(pm.parameters())
        pm.register_optimizer(opt)
        _train(pm, opt, 2)
        sd = {"model": get_model_state_dict(pm), "optim": get_optimizer_state_dict(pm, opt)}
        dcp.save(sd, checkpoint_id=os.path.join(root, name))


def _resume(root: str):
    fulls = {}
    for name, make in OPTIMIZERS.items():
        pm = fxtp.compile(_perturbed("tied-lm")[0], _world_size(), (IDS,))
        opt = make(pm.parameters())
        pm.register_optimizer(opt)
        sd = {"model": get_model_state_dict(pm), "optim": get_optimizer_state_dict(pm, opt)}
        dcp.load(sd, checkpoint_id=os.path.join(root, name))
        set_model_state_dict(pm, sd["model"])
        set_optimizer_state_dict(pm, opt, sd["optim"])
        _train(pm, opt, 1)
        fulls[name] = pm.full_state_dict()
    return fulls


@pytest.mark.parametrize("saved_ws,loaded_ws", [(2, 4), (4, 2)])
def test_resume_at_another_world_size_takes_the_same_next_step(rank_pools, tmp_path, saved_ws, loaded_ws):
    """2 steps at one world size, save model and optimizer (get_*_state_dict + DCP), resume at
    another and take step 3: the single-device model after 3 steps (momentum, Adam moments and
    step count carried over)."""
    rank_pools(saved_ws).run(_train_and_save, str(tmp_path))
    for fulls in rank_pools(loaded_ws).run(_resume, str(tmp_path)):
        for name, make in OPTIMIZERS.items():
            ref = _tied_lm()[0]
            _train(ref, make(ref.parameters()), 3)
            for key, value in ref.state_dict().items():
                torch.testing.assert_close(fulls[name][key], value, msg=lambda m, key=key, name=name: f"{name} {key}: {m}")
