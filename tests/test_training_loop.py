"""Training loops as users write them, on real gloo ranks (world sizes 2 and 4), against the
single-device model (NOTE: [sharded parameters] in fxtp/runtime/sharded.py).

torch's own utilities are called on ``pm.parameters()`` as on the model: clipping inside SGD and
AdamW loops, ``clip_grad_value_``, ``get_total_norm``, parameter norms, weight decay, an EMA,
``torch.amp.GradScaler`` with an overflow in one rank's shard, a Muon-like optimizer, bf16
autocast, bf16 parameters with fp32 master weights, gradient accumulation, and FSDP2 x TP
clipping.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.utils._python_dispatch import TorchDispatchMode

import fxtp
from fxtp.core.placement import Shard, local_ranges, shard_tensor
from fxtp.runtime.clipping import FsdpClippingWarning
from fxtp.runtime.sharded import ShardedParameter, local_tensor


class Block(nn.Module):
    """Fused Q|K|V (segments), a LayerNorm (replicated) and an MLP whose hidden width 30 is
    uneven at world size 4 (front-loaded units)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        # no in_proj bias: the key bias's gradient is zero up to rounding (softmax ignores a shift),
        # which Adam would scale up to lr-sized steps of noise on either side
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True, bias=False)
        self.fc1, self.fc2 = nn.Linear(16, 30), nn.Linear(30, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(torch.relu(self.fc1(x)))


def _block(seed: int = 0) -> Block:
    torch.manual_seed(seed)
    return Block()


X = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out.float() ** 2).mean()


class C10dCounter(TorchDispatchMode):
    """Counts the c10d collectives (``dist.all_reduce`` and friends) dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.calls.append(func._opname)
        return func(*args, **(kwargs or {}))


def _assert_params_match(pm: fxtp.ParallelModule, ref: nn.Module, what: str, **tol) -> None:
    """Every rank's tensors are its slices of the single device's: replicated ones equal the
    full tensors on every rank (so they cannot drift apart)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    for fqn, p in pm.named_parameters():
        expected = shard_tensor(ref.get_parameter(fqn).detach(), pm.placements[fqn], rank, ws)
        torch.testing.assert_close(local_tensor(p).detach(), expected, **tol, msg=lambda m, fqn=fqn: f"{what} {fqn}: {m}")


def _clipped_loop(optimizer: str, clip: str):
    """3 steps of ``optimizer`` with gradient clipping ``clip`` ("torch": torch.nn.utils, "pm":
    pm.clip_grad_norm_; "torch on CUDA's defaults": torch's, its foreach kernels' devices patched
    to include the CPU, where the optimizer then takes its ``_foreach_`` path over the sharded
    parameters, NOTE: [foreach types] in fxtp/core/torch_globals.py) by a max_norm that clips every step; the norms and
    the parameters after each step against the single device."""
    patches = contextlib.ExitStack()
    if clip == "torch on CUDA's defaults":
        for where in ("torch.optim.optimizer", "torch.utils._foreach_utils"):
            patches.enter_context(mock.patch(f"{where}._get_foreach_kernels_supported_devices", lambda: ["cpu", "cuda"]))
    with patches:
        return _clipped_steps(optimizer, clip)


def _clipped_steps(optimizer: str, clip: str):
    ref, ws = _block(), dist.get_world_size()
    pm = fxtp.compile(copy.deepcopy(ref), ws, (X,), dynamic=False)
    sharded = {fqn for fqn, p in pm.named_parameters() if isinstance(p, ShardedParameter)}
    assert {"attn.in_proj_weight", "fc1.weight"} <= sharded and "norm.weight" not in sharded
    if ws == 4:
        assert not pm.placements["fc1.weight"].divisible(ws)  # the uneven case
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)}[optimizer]
    opt, ref_opt = make(pm.parameters()), make(ref.parameters())
    foreach = _default_to_fused_or_foreach(list(pm.parameters()), differentiable=False)[1]
    assert foreach == (clip == "torch on CUDA's defaults"), foreach
    norms, collectives = [], []
    for step in range(3):
        _loss(pm(X)).backward()
        _loss(ref(X)).backward()
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        with C10dCounter() as counter:
            if clip == "pm":
                got = pm.clip_grad_norm_(0.05)
            else:
                got = torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.05)
        collectives.append(len(counter.calls))
        assert float(expected) > 0.05  # it clips
        torch.testing.assert_close(got, expected, msg=lambda m, step=step: f"step {step} norm: {m}")
        norms.append(float(got))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        _assert_params_match(pm, ref, f"{optimizer} step {step}")
    return norms, collectives, len(sharded)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("clip", ["torch", "pm", "torch on CUDA's defaults"])
def test_clipping_inside_the_optimizer_loop_matches_one_device(pool, optimizer, clip):
    results = pool.run(_clipped_loop, optimizer, clip)
    norms = [n for n, _, _ in results]
    assert all(n == norms[0] for n in norms)  # every rank clips by the same coefficient
    for _, collectives, sharded in results:
        # pm.clip_grad_norm_: one all_reduce; torch's too: its _foreach_norm over the gradients, one
        # all_reduce of the shards' norms (before fxtp's types were listed for torch's foreach path,
        # one norm and one all_reduce per sharded parameter)
        assert collectives == [1] * 3 and sharded > 1


def _whole_tensor_utilities():
    """clip_grad_value_, get_total_norm (2 and inf), a norm of the parameters, sums/means/max of
    gradients, an EMA of the parameters, and matrix transforms refused."""
    ref, ws = _block(), dist.get_world_size()
    pm = fxtp.compile(copy.deepcopy(ref), ws, (X,), dynamic=False)
    _loss(pm(X)).backward()
    _loss(ref(X)).backward()
    grads, ref_grads = [p.grad for p in pm.parameters()], [p.grad for p in ref.parameters()]
    for norm_type in (2.0, 1.0, math.inf, 3.0):
        torch.testing.assert_close(torch.nn.utils.get_total_norm(grads, norm_type),
                                   torch.nn.utils.get_total_norm(ref_grads, norm_type), msg=f"get_total_norm {norm_type}")
    torch.testing.assert_close(torch.nn.utils.get_total_norm(grads, 2.0, foreach=True),
                               torch.nn.utils.get_total_norm(ref_grads, 2.0))
    for fqn, p in pm.named_parameters():
        full = ref.get_parameter(fqn)
        for got, want in ((p.norm(), full.norm()), (torch.linalg.vector_norm(p, 3), torch.linalg.vector_norm(full, 3)),
                          (p.grad.sum(), full.grad.sum()), (p.grad.abs().max(), full.grad.abs().max()),
                          (p.grad.mean(), full.grad.mean()), (p.detach().float().pow(2).sum(), full.detach().pow(2).sum())):
            torch.testing.assert_close(got, want, msg=fqn)
    torch.nn.utils.clip_grad_value_(pm.parameters(), 1e-3)
    torch.nn.utils.clip_grad_value_(ref.parameters(), 1e-3)
    ema, ref_ema = [p.detach().clone() for p in pm.parameters()], [p.detach().clone() for p in ref.parameters()]
    with torch.no_grad():
        for params, opt_of in ((pm, ema), (ref, ref_ema)):
            torch.optim.SGD(params.parameters(), lr=1.0).step()
            torch._foreach_lerp_(opt_of, list(params.parameters()), 0.1)
    _assert_params_match(pm, ref, "after clip_grad_value_")
    for fqn, e, r in zip(dict(pm.named_parameters()), ema, ref_ema):
        torch.testing.assert_close(torch.linalg.vector_norm(e), torch.linalg.vector_norm(r), msg=f"EMA {fqn}")
    g = pm.get_parameter("fc1.weight").grad
    refused = []
    for transform in (lambda: g @ g.T, lambda: torch.linalg.svd(g), lambda: g.sum(dim=0), lambda: g[0],
                      lambda: torch.cat([g.flatten(), pm.get_parameter("norm.weight").grad])):
        with pytest.raises(fxtp.FxtpRuntimeError, match="'fc1.weight'") as info:
            transform()
        refused.append(str(info.value).split(" on ")[0])
    return refused


def test_whole_tensor_utilities_are_exact_or_refused(pool):
    for refused in pool.run(_whole_tensor_utilities):
        assert refused == ["matmul", "linalg_svd", "sum", "__getitem__", "cat"]


def _grad_scaler():
    """fp16-style loss scaling where the only overflow lies in the last rank's rows of
    fc1.weight's gradient: every rank skips that step, halves the scale, then steps twice."""
    ref, ws, rank = _block(), dist.get_world_size(), dist.get_rank()
    pm = fxtp.compile(copy.deepcopy(ref), ws, (X,), dynamic=False)
    placement = pm.placements["fc1.weight"]
    assert isinstance(placement, Shard) and placement.dim == 0
    row, local_row = None, None
    start, length = local_ranges(placement, ws - 1, ws)[0]
    row = start + length - 1  # a row only the last rank holds
    if rank == ws - 1:
        local_row = length - 1
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), lr=0.05), torch.optim.AdamW(ref.parameters(), lr=0.05)
    scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10), torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scales = []
    for step in range(3):
        scaler.scale(_loss(pm(X))).backward()
        ref_scaler.scale(_loss(ref(X))).backward()
        if step == 0:
            with torch.no_grad():
                ref.fc1.weight.grad[row, 0] = math.inf
                if local_row is not None:
                    local_tensor(pm.get_parameter("fc1.weight").grad)[local_row, 0] = math.inf
        scaler.unscale_(opt)
        ref_scaler.unscale_(ref_opt)
        pm.clip_grad_norm_(1.0)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        scaler.step(opt)
        ref_scaler.step(ref_opt)
        scaler.update()
        ref_scaler.update()
        scales.append((scaler.get_scale(), ref_scaler.get_scale()))
        opt.zero_grad()
        ref_opt.zero_grad()
        _assert_params_match(pm, ref, f"GradScaler step {step}")
    return scales


def test_grad_scaler_skips_on_every_rank_when_one_shard_overflows(pool):
    for scales in pool.run(_grad_scaler):
        assert scales == [(512.0, 512.0), (512.0, 512.0), (512.0, 512.0)]


def _newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's orthogonalization (Jordan et al. 2024): quintic Newton-Schulz iterations."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x


class Muon(torch.optim.Optimizer):
    """A minimal Muon-like optimizer: 2-D parameters step along their orthogonalized gradient."""

    def __init__(self, params, lr: float = 0.02) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    update = _newton_schulz(p.grad) if p.dim() == 2 else p.grad
                    p.add_(update, alpha=-group["lr"])


def _muon():
    ref, ws = _block(), dist.get_world_size()
    pm = fxtp.compile(copy.deepcopy(ref), ws, (X,), dynamic=False)
    _loss(pm(X)).backward()
    with pytest.raises(fxtp.FxtpRuntimeError, match="matmul on a tensor made from parameter 'attn.in_proj_weight'") as info:
        Muon(pm.parameters()).step()
    assert "plan={'attn.in_proj_weight': 'replicate'}" in str(info.value)
    # what the message advises: Muon on the replicated matrices, AdamW on the sharded ones
    replicated = fxtp.compile(copy.deepcopy(ref), ws, (X,), dynamic=False, plan={"fc1": "replicate", "fc2": "replicate"})
    muon_ref = copy.deepcopy(ref)
    for module in (replicated, muon_ref):
        module.zero_grad()
        _loss(module(X)).backward()
    Muon([replicated.get_parameter("fc1.weight"), replicated.get_parameter("fc2.weight")]).step()
    Muon([muon_ref.fc1.weight, muon_ref.fc2.weight]).step()
    for fqn in ("fc1.weight", "fc2.weight"):
        torch.testing.assert_close(replicated.get_parameter(fqn).detach(), muon_ref.get_parameter(fqn).detach(), msg=fqn)
    return True


def test_whole_matrix_optimizers_raise_on_shards_and_match_on_replicated_matrices(pool):
    assert all(pool.run(_muon))


def _low_precision():
    """bf16 autocast; bf16 parameters with fp32 master weights; gradient accumulation over 2
    micro-batches: 3 steps each against the single device, within bf16 tolerance."""
    ws = dist.get_world_size()
    bf16 = {"rtol": 2e-2, "atol": 2e-2}
    # bf16 autocast, clipping, AdamW
    ref = _block()
    pm = fxtp.compile(copy.deepcopy(ref), ws, (X,), dynamic=False)
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
    for step in range(3):
        outs = []
        for module, o in ((pm, opt), (ref, ref_opt)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(module(X))
            _loss(outs[-1]).backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
            o.step()
            o.zero_grad()
        torch.testing.assert_close(outs[0], outs[1], **bf16)
        with torch.no_grad():  # the rank graph ran in bf16: far from its float32 output
            assert (outs[0] - pm(X)).abs().max() > 1e-4
        _assert_params_match(pm, ref, f"autocast step {step}", **bf16)
    # bf16 parameters, fp32 master weights
    ref = _block().to(torch.bfloat16)
    pm = fxtp.compile(copy.deepcopy(ref), ws, (X.bfloat16(),), dynamic=False)
    results = []
    for module in (pm, ref):
        master = [p.detach().float() for p in module.parameters()]
        opt = torch.optim.SGD(master, lr=0.5)  # linear in the gradients (Adam would scale bf16 noise up to lr)
        for _ in range(3):
            _loss(module(X.bfloat16())).backward()
            for m, p in zip(master, module.parameters()):
                m.grad = p.grad.float()
                p.grad = None
            torch.nn.utils.clip_grad_norm_(master, 0.5)
            opt.step()
            with torch.no_grad():
                for m, p in zip(master, module.parameters()):
                    p.copy_(m)
        results.append(dict(zip(dict(module.named_parameters()), master)))
    for fqn, m in results[0].items():
        expected = shard_tensor(results[1][fqn], pm.placements[fqn], dist.get_rank(), ws)
        torch.testing.assert_close(local_tensor(m), expected, **bf16, msg=lambda msg, fqn=fqn: f"master {fqn}: {msg}")
    # gradient accumulation over micro-batches (fp32: exact up to summation order)
    ref = _block()
    pm = fxtp.compile(copy.deepcopy(ref), ws, (X[:2],), dynamic=False)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        for micro in X.chunk(2):
            _loss(pm(micro)).div(2).backward()
        _loss(ref(X)).backward()
        torch.testing.assert_close(pm.clip_grad_norm_(0.1), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        _assert_params_match(pm, ref, f"accumulation step {step}")
    return True


def test_bf16_master_weights_and_accumulation_match_one_device(pool):
    assert all(pool.run(_low_precision))


def _fsdp_tp_clipping():
    """fxtp on mesh["tp"], FSDP2 on mesh["dp"]: pm.clip_grad_norm_ is the global batch's norm
    (over both dims) in one all_reduce; 3 clipped AdamW steps match the single device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    ref = _block()
    local = X.chunk(2)[dp_rank]
    pm = fxtp.compile(copy.deepcopy(ref), 2, (local,), group=mesh["tp"], dynamic=False)
    fully_shard(pm, mesh=mesh["dp"])
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), lr=0.05), torch.optim.AdamW(ref.parameters(), lr=0.05)
    calls, warned = [], []
    for step in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _loss(pm(local)).backward()  # FSDP2 averages over dp: the global batch's mean
        warned.append([str(w.message) for w in caught if issubclass(w.category, FsdpClippingWarning)])
        _loss(ref(X)).backward()
        if step == 0:  # NOTE: [clipping under FSDP2]: torch's norm there is the tp rank's own (hence the warning)
            per_rank = torch.nn.utils.get_total_norm([p.grad for p in pm.parameters()])
            whole = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
            assert float(per_rank.full_tensor() if hasattr(per_rank, "full_tensor") else per_rank) < 0.99 * float(whole)
        with C10dCounter() as counter:
            got = pm.clip_grad_norm_(0.05)
        calls.append(counter.calls)
        torch.testing.assert_close(got, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05), msg=f"step {step}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = pm.full_state_dict()
    # float32 rounding, amplified by AdamW: the clipped norms above equal torch's within 2 ulp every step, but
    # fc1.weight[381]'s gradient (5e-6, then 1e-6) is ~1000x below the median (7e-3), so the summation order of
    # the sharded run (tp partial sums, dp mean) changes its rounding by ~1e-3 relative, which Adam's m/sqrt(v)
    # turns into 1.21e-5 after 3 steps at lr 0.05 (measured); the same run in float64 differs by 1.7e-8 (from
    # pm.clip_grad_norm_'s float32 norm), so no term is missed or duplicated. 3e-5: 2.5x the measured figure.
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1.3e-6, atol=3e-5, msg=lambda m, key=key: f"{key}: {m}")
    return calls, warned


def test_fsdp2_x_tp_clipping_is_the_norm_over_both_dims(rank_pools):
    """dp 2 x tp 2 at ws 4: pm.clip_grad_norm_ is exact; torch's get_total_norm on FSDP2's
    parameters is each tp rank's own, which the first forward warns about, once."""
    for calls, warned in rank_pools(4).run(_fsdp_tp_clipping):
        assert calls == [["allreduce_"]] * 3
        assert [len(w) for w in warned] == [1, 0, 0] and "pm.clip_grad_norm_" in warned[0][0], warned


def test_the_fuzzers_property_holds_with_clipping_in_the_loop(pool):
    """The differential fuzzer's property (test_fuzz.py) on a spec that draws ``clip``: MHA-style
    attention and an MLP whose width 10 is sharded at world size 2 and replicated at 4."""
    from fuzz_check import check_outcomes, differential
    from fuzz_models import Attn, Mlp, Spec

    spec = Spec(hidden=16, blocks=(Attn(heads=4, kv_heads=4), Mlp(ffn=10)), clip=True)
    check_outcomes(spec, pool.run(differential, spec))


def _decay_groups() -> dict:
    """GPT-2's weight-decay groups built by module type (Hugging Face's
    ``Trainer.get_decay_parameter_names``, which excludes ``nn.LayerNorm`` weights by
    ``isinstance``) on ``pm`` and on the model: the same names; 3 AdamW steps with those groups
    equal the single device's (NOTE: [blocks of a ParallelModule] in fxtp/runtime/blocks.py)."""
    from transformers import GPT2LMHeadModel, Trainer

    from fxtp.cli import examples

    ws, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(examples.gpt2_config()).train()
    model.config.use_cache = False
    ids = examples.gpt2()[1][0]
    ref = copy.deepcopy(model)
    pm = fxtp.compile(model, ws, (ids,), example_kwargs={"labels": ids.clone()}, dynamic=False)
    names = Trainer.get_decay_parameter_names(None, pm)
    assert sorted(names) == sorted(Trainer.get_decay_parameter_names(None, ref))
    assert isinstance(pm.get_submodule("transformer.h.0.ln_1"), nn.LayerNorm)
    assert type(pm.get_submodule("transformer.h.0")) is type(ref.transformer.h[0])
    tree = [(fqn, type(m)) for fqn, m in pm.named_modules() if fqn and not fqn.startswith(("graph_module", "_fxtp"))]
    assert tree == [(fqn, type(m)) for fqn, m in ref.named_modules() if fqn]  # dropouts and activations too, in order

    def groups(m: nn.Module) -> list[dict]:
        decay = set(Trainer.get_decay_parameter_names(None, m))
        named = list(m.named_parameters())
        return [{"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]

    # eps=1e-3: a near-zero gradient (GPT-2's attention biases) is not blown up to a full step by its own rounding
    opt, ref_opt = (torch.optim.AdamW(groups(m), lr=1e-2, eps=1e-3) for m in (pm, ref))
    for step in range(3):
        for m, o in ((pm, opt), (ref, ref_opt)):
            m(ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    for fqn, p in pm.named_parameters():
        want = shard_tensor(ref.get_parameter(fqn).detach(), pm.placements[fqn], rank, ws)
        torch.testing.assert_close(local_tensor(p).detach(), want, msg=lambda m: f"{fqn} after 3 AdamW steps: {m}")
    return {"decay": len(names), "all": len(list(pm.named_parameters()))}


def test_weight_decay_groups_by_module_type_match_one_device(pool):
    """pm's module tree answers type checks as the model's (GPT-2's LayerNorms are
    ``nn.LayerNorm``), so the decay groups and 3 AdamW steps equal the single device's."""
    for rank in pool.run(_decay_groups):
        assert 0 < rank["decay"] < rank["all"], rank
