"""Training features on real gloo ranks (world_size 2): full checkpoints, meta-device models
loaded from safetensors, dropout in train mode, torch.compile, and the torchrun example.

Every check compares against the single-device model.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from _helpers import graph_code, loss_of, without_collective_log
from cases import build_case
from torch import nn

import fxtp
from fxtp.cli.examples import GPTConfig, TinyGPT
from fxtp.core.placement import Shard, shard_tensor
from fxtp.runtime.sharded import local_tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pool(rank_pools):
    return rank_pools(2)


class TiedLM(nn.Module):
    """Tied embedding/head, a persistent buffer, a Megatron MLP, and an unused layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.fc, self.out = nn.Linear(16, 64), nn.Linear(64, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight
        self.unused = nn.Linear(3, 3)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.out(torch.relu(self.fc(h))) * self.scale
        return self.head(h)


def _tied_lm(seed: int) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM()


IDS = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))


def _sgd_steps(module: nn.Module, steps: int) -> None:
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        loss_of(module(IDS)).backward()
        opt.step()


def _checkpoint_round_trip():
    ref = _tied_lm(0)
    pm = fxtp.compile(copy.deepcopy(ref), dist.get_world_size(), (IDS,), dynamic=False)
    assert isinstance(pm.placements["fc.weight"], Shard) and isinstance(pm.placements["out.weight"], Shard)
    _sgd_steps(pm, 3)
    _sgd_steps(ref, 3)
    full = pm.full_state_dict()
    assert list(full) == list(ref.state_dict())  # same FQNs, same order; tied head under both
    fresh = _tied_lm(7)
    fresh.load_state_dict(full)
    torch.testing.assert_close(fresh(IDS), ref(IDS))

    # Loading: a fresh pm (other weights) takes the trained full state dict and matches ref.
    pm2 = fxtp.compile(_tied_lm(7), dist.get_world_size(), (IDS,), dynamic=False)
    pm2.load_full_state_dict(ref.state_dict())
    torch.testing.assert_close(pm2(IDS), ref(IDS))
    local = pm2.get_parameter("fc.weight")
    torch.testing.assert_close(local, shard_tensor(ref.fc.weight, pm2.placements["fc.weight"], dist.get_rank(), 2))

    errors = []
    bad = dict(ref.state_dict())
    del bad["fc.bias"]
    for sd in (bad, {**ref.state_dict(), "fc.weight": torch.zeros(32, 16)}, {**ref.state_dict(), "extra": torch.zeros(1)}):
        try:
            pm2.load_full_state_dict(sd)
        except fxtp.FxtpInputError as e:
            errors.append(str(e))
    pm2.load_full_state_dict({**ref.state_dict(), "extra": torch.zeros(1)}, strict=False)
    return errors


def test_full_checkpoint_after_three_steps(pool):
    """Train 3 SGD steps at world_size 2, gather, load into a single-device model: equal outputs."""
    for errors in pool.run(_checkpoint_round_trip):
        assert len(errors) == 3
        assert "missing keys ['fc.bias']" in errors[0]
        assert "fc.weight has shape (32, 16) but the model's full fc.weight is (64, 16)" in errors[1]
        assert "unexpected keys ['extra']" in errors[2]


CFG = GPTConfig(n_layers=1)


def _meta_load(path: str):
    with torch.device("meta"):
        model = TinyGPT(CFG)
    ids_meta = torch.zeros(CFG.batch, CFG.seq_len, dtype=torch.long, device="meta")
    pm = fxtp.compile(model, dist.get_world_size(), (ids_meta,), dynamic=False)
    assert all(p.is_meta for p in pm.parameters()), "compile on meta must not allocate weights"
    stats = pm.load_safetensors(path)
    torch.manual_seed(0)
    ref = TinyGPT(CFG)
    ids = torch.randint(0, CFG.vocab_size, (CFG.batch, CFG.seq_len), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(pm(ids), ref(ids))
    _sgd_steps_ids(pm, ref, ids)  # the materialized shards train like the single-device model
    return stats


def _sgd_steps_ids(pm, ref, ids) -> None:
    for module in (pm, ref):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        loss_of(module(ids)).backward()
        opt.step()
    torch.testing.assert_close(pm(ids), ref(ids))


def test_meta_model_reads_only_its_slices_from_safetensors(pool, tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    path = str(tmp_path / "tiny_gpt.safetensors")
    save_file(TinyGPT(CFG).state_dict(), path)
    stats = pool.run(_meta_load, path)
    for s in stats:
        assert s.sharded_bytes_full > 0
        assert s.sharded_bytes_read * pool.world_size == s.sharded_bytes_full  # exactly 1/ws of the sharded bytes
        assert s.bytes_read < s.file_bytes
    print(f"bytes read per rank: {[s.bytes_read for s in stats]} of a {stats[0].file_bytes}-byte file; sharded "
          f"{stats[0].sharded_bytes_read} of {stats[0].sharded_bytes_full}")


def _dropout_train():
    rank, ws = dist.get_rank(), dist.get_world_size()
    model, inputs = build_case("10-dropout-eval")
    model.train()
    ref = copy.deepcopy(model)
    torch.manual_seed(100 + rank)  # different on every rank: fxtp.compile syncs the generators
    pm = fxtp.compile(model, ws, inputs, dynamic=False)
    state = torch.get_rng_state()
    out = pm(*inputs)
    gathered = [torch.empty_like(out) for _ in range(ws)]
    dist.all_gather(gathered, out)
    torch.set_rng_state(state)  # the single-device model draws the same numbers
    ref_out = ref(*inputs)
    torch.testing.assert_close(out, ref_out)
    loss_of(out).backward()
    loss_of(ref_out).backward()
    for fqn, p in pm.named_parameters():
        torch.testing.assert_close(local_tensor(p.grad), shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], rank, ws))
    notes = [n for n in pm.report.to_dict()["notes"] if n["code"] == "dropout-on-shard"]
    return all(torch.equal(g, out) for g in gathered), notes, graph_code(pm)


def test_dropout_train_mode_one_global_mask(pool):
    """Case 10 in train mode, ranks seeded differently: outputs bitwise equal on all ranks, and
    equal to the single-device model with the same generator state (outputs and gradients)."""
    for same, notes, code in pool.run(_dropout_train):
        assert same
        assert len(notes) == 1 and "one global mask" in notes[0]["message"]
        assert code.count("sharded_random(") == 1 and code.count("aten.dropout.default(") == 1


def _compiled():
    with without_collective_log():  # Dynamo compiles nothing under the pool's CollectiveLog
        return _compiled_unlogged()


def _compiled_unlogged():
    import torch._dynamo

    ws = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    x = torch.randn(4, 16)
    ref = copy.deepcopy(model)
    pm = fxtp.compile(model, ws, (x,))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(pm)(x)
    compiled = torch.compile(pm, fullgraph=True)  # inductor: its kernels run on the sharded inputs (NOTE: [compiled kernels on shards])
    out = compiled(x)
    ref_out = ref(x)
    torch.testing.assert_close(out, pm(x))
    torch.testing.assert_close(out, ref_out)
    loss_of(out).backward()
    loss_of(ref_out).backward()
    for fqn, p in pm.named_parameters():
        torch.testing.assert_close(local_tensor(p.grad), shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], dist.get_rank(), ws))
    return explained.graph_count, explained.graph_break_count, [str(r.reason) for r in explained.break_reasons]


def test_torch_compile_matches_eager_without_graph_breaks(pool):
    for graphs, breaks, reasons in pool.run(_compiled):
        assert (graphs, breaks) == (1, 0), reasons


def test_torchrun_example_on_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "train.py"), "--steps", "2"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1", "2"], proc.stdout
    assert all("loss" in line for line in lines)
    assert "backend gloo" in proc.stdout
