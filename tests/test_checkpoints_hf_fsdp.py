"""Hugging Face checkpoints and FSDP2 on real gloo ranks.

* A Hugging Face model built with its parameters on ``meta`` (buffers real, accelerate's
  ``init_empty_weights`` convention) is compiled, loaded from a ``save_pretrained`` checkpoint
  directory (several ``.safetensors`` files and ``model.safetensors.index.json``), reading only
  this rank's slices, and equals the model that was saved.
* ``fully_shard(pm, mesh=mesh["dp"])`` on a 2x2 (dp, tp) mesh trains like the single-device
  model; ``full_state_dict()`` and DCP save and load work on it.
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _helpers import graph_code
from torch import nn

import fxtp
from fxtp.cli import examples

HF_MODELS = ["llama", "gpt2", "bert"]


@contextlib.contextmanager
def params_on_meta():
    """Parameters created inside go to ``meta``, buffers stay real: what accelerate's
    ``init_empty_weights()`` does (it patches ``register_parameter`` the same way). A parameter
    already on meta is kept, so tied weights stay tied."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _hidden(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _meta_load(name: str, path: str):
    ref, inputs = getattr(examples, name)()
    with params_on_meta():
        model, _ = getattr(examples, name)()
    pm = fxtp.compile(model, dist.get_world_size(), tuple(t.to("meta") for t in inputs), dynamic=False)
    assert all(p.is_meta for p in pm.parameters())
    assert "device(type='meta')" not in graph_code(pm)  # normalize: no device literal survives
    stats = pm.load_safetensors(path)
    torch.testing.assert_close(_hidden(pm(*inputs)), _hidden(ref(*inputs)))
    return stats


@pytest.mark.parametrize("name", HF_MODELS)
def test_meta_hf_model_loads_its_slices_from_a_checkpoint_directory(rank_pools, tmp_path, name):
    ref, _ = getattr(examples, name)()
    ref.save_pretrained(tmp_path, max_shard_size="100KB")  # several files and the index
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(files) > 1 and "model.safetensors.index.json" in os.listdir(tmp_path)
    pool = rank_pools(2)
    stats = pool.run(_meta_load, name, str(tmp_path))
    for s in stats:
        assert s.sharded_bytes_read * pool.world_size == s.sharded_bytes_full > 0  # exactly 1/ws of the sharded bytes
        assert s.bytes_read < s.file_bytes and 1 <= s.files <= len(files)
    print(f"{name}: {len(files)} files, {stats[0].file_bytes} bytes; each rank read {[s.bytes_read for s in stats]}")


def test_normalize_replaces_device_literals_in_every_position():
    """A positional device (``aten.to.device``) and a keyword one (``arange(device=)``) both
    become the run-time device of the first parameter."""
    from torch.fx import Graph

    from passes.normalize import normalize

    graph = Graph()
    weight = graph.placeholder("p_weight")
    weight.meta["val"] = torch.empty(2, device="meta")
    moved = graph.call_function(torch.ops.aten.to.device, (weight, torch.device("meta"), torch.float32))
    arange = graph.call_function(torch.ops.aten.arange.default, (2,), {"device": torch.device("cpu")})
    graph.output((moved, arange))
    normalize(graph)
    device = next(n for n in graph.nodes if n.target is getattr)
    assert device.args == (weight, "device")
    assert moved.args == (weight, device, torch.float32) and arange.kwargs == {"device": device}


def test_buffers_on_meta_are_one_error_at_load(tmp_path):
    """Everything built on meta: the rotary buffers no checkpoint holds are named in one error."""
    from transformers import LlamaForCausalLM

    ref, inputs = examples.llama()
    ref.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = LlamaForCausalLM(examples.llama_config())
    pm = fxtp.compile(model, 1, tuple(t.to("meta") for t in inputs), dynamic=False)
    for load in (lambda: pm.load_safetensors(tmp_path), lambda: pm.load_full_state_dict(ref.state_dict())):
        with pytest.raises(fxtp.FxtpInputError) as info:
            load()
        message = str(info.value)
        assert message.startswith("['model.rotary_emb.inv_freq', 'model.rotary_emb.original_inv_freq'] are on the meta")
        assert "init_empty_weights()" in message
    with pytest.raises(fxtp.FxtpInputError, match="no safetensors checkpoint at"):
        pm.load_safetensors(tmp_path / "missing")


def _fsdp_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))


def _fsdp_tp(root: str):
    """fxtp on mesh["tp"], fully_shard on mesh["dp"]: 3 AdamW steps on the global batch vs the
    single-device model, then full_state_dict and a DCP round trip."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    model, ref = _fsdp_model(), _fsdp_model()
    batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    local = batch.chunk(2)[dp_rank]
    pm = fully_shard(fxtp.compile(model, 2, (local,), group=mesh["tp"], dynamic=False), mesh=mesh["dp"])
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
    for step in range(3):
        out = pm(local)
        (out**2).mean().backward()  # FSDP2 averages the gradients over dp: the global mean's
        ref_out = ref(batch)
        (ref_out**2).mean().backward()
        torch.testing.assert_close(out, ref_out.chunk(2)[dp_rank], msg=lambda m, step=step: f"step {step}: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = pm.full_state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full[key], value, msg=lambda m, key=key: f"full_state_dict {key}: {m}")
    dcp.save(pm.state_dict(), checkpoint_id=root)

    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    pm2 = fully_shard(fxtp.compile(other, 2, (local,), group=mesh["tp"], dynamic=False), mesh=mesh["dp"])
    sd = pm2.state_dict()
    dcp.load(sd, checkpoint_id=root)
    pm2.load_state_dict(sd)
    loaded = pm2.full_state_dict()
    return all(torch.equal(loaded[k], v) for k, v in full.items()), type(sd["0.weight"]).__name__


def test_fsdp2_over_tp_trains_like_one_device_and_checkpoints(rank_pools, tmp_path):
    for same, kind in rank_pools(4).run(_fsdp_tp, str(tmp_path)):
        assert same and kind == "LocalChunks"
