"""A ``ParallelModule`` under ``torch.autocast`` behaves as the model under the same autocast
(issue 35; NOTE: [autocast graphs] in fxtp/core/autocast.py): the model's Python that reads a
dtype (Hugging Face's experts' ``.to(hidden.dtype)``, a ``.float()`` upcast, a branch on
``x.dtype``) takes the single device's path, because a call under an autocast state runs a
graph captured under it. On real gloo ranks at world sizes 2 and 4, against the single device
under bf16 autocast: output and loss dtypes and values, every gradient, an SGD step; then a call
without autocast is exact again (the compiled graph). Tiny models, static shapes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from fuzz_moe import Moe, MoeBlock
from torch import nn

import fxtp
from fxtp.cli import examples

pytest.importorskip("transformers")

_BF16 = dict(rtol=2e-2, atol=2e-2)  # bf16's rounding of the matmuls, as test_norms_losses' autocast tests


class CastBack(nn.Module):
    """Dtype-dependent Python of each kind: a branch on a dtype, a ``.float()`` upcast and a
    cast back with ``.to(h.dtype)``: each a no-op (or the other side) at a float32 capture."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if h.dtype != torch.float32:  # under autocast only
            h = h * 2
        y = self.down(F.gelu(h.float()))
        return (x + y).to(h.dtype)


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.silu(self.fc(x)))


def _tiny(name: str) -> tuple[nn.Module, tuple, dict]:
    """The model, its positional inputs and keyword inputs (labels: its loss)."""
    gen = torch.Generator().manual_seed(1)
    if name == "qwen2_moe":
        model, (ids,) = examples.qwen2_moe(num_hidden_layers=1, hidden_size=32, intermediate_size=32,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=32)
        ids = ids[:, :8]
        return model.train(), (ids,), {"labels": ids}
    torch.manual_seed(0)
    if name.startswith("fuzz_moe"):  # Mixtral's block, or Qwen2-MoE's (a gated shared expert)
        # a linear first: the block's input is bf16 under autocast, as after an MLP (the fuzzer's autocast-mlp-then-moe)
        model = nn.Sequential(nn.Linear(16, 16), MoeBlock(16, Moe(ffn=16, shared=name.endswith("shared"), residual=False)))
        return model.train(), (torch.randn(2, 5, 16, generator=gen),), {}
    return {"dense": Dense, "cast_back": CastBack}[name]().train(), (torch.randn(2, 5, 16, generator=gen),), {}


def _parts(out) -> dict[str, torch.Tensor]:
    """The tensors of an output: a Hugging Face ``ModelOutput``'s logits and loss, else itself."""
    return {"logits": out.logits, "loss": out.loss} if hasattr(out, "logits") else {"output": out}


def _loss(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own loss, else the output's mean square (a float32 scalar)."""
    return parts["loss"] if "loss" in parts else parts["output"].float().pow(2).mean()


def _autocast_runs(names: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """Per model, the dtypes of pm's outputs under bf16 autocast, each checked against the
    single device's (dtype, value, gradients; two SGD steps), and once without autocast (exact)."""
    import torch.distributed as dist
    from test_norms_losses import _grads_match

    ws, dtypes = dist.get_world_size(), {}
    for name in names:
        ref, args, kwargs = _tiny(name)
        pm = fxtp.compile(copy.deepcopy(ref), ws, args, example_kwargs=kwargs, dynamic=False)
        for step in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got, want = _parts(pm(*args, **kwargs)), _parts(ref(*args, **kwargs))
            for key, value in want.items():
                assert got[key].dtype == value.dtype, f"{name} {key}: {got[key].dtype}, the single device's {value.dtype}"
                torch.testing.assert_close(got[key], value, **_BF16, msg=lambda m, key=key: f"{name} step {step} {key}: {m}")
            dtypes[name] = {key: str(value.dtype).replace("torch.", "") for key, value in got.items()}
            _loss(got).backward()
            _loss(want).backward()
            _grads_match(pm, ref, f"{name} step {step}", **_BF16)
            with torch.no_grad():  # no autocast: the compiled graph, exact (before the steps part the weights)
                got, want = _parts(pm(*args, **kwargs)), _parts(ref(*args, **kwargs))
            for key, value in want.items() if step == 0 else ():
                torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{name} fp32 {key}: {m}")
            for module in (pm, ref):
                with torch.no_grad():
                    for p in module.parameters():
                        p -= 0.05 * p.grad
                        p.grad = None
        assert sum("torch.autocast('cpu', dtype=torch.bfloat16)" in note for note in pm.report.shape_notes) == 1, name
    return dtypes


@pytest.mark.parametrize("ws", [2, 4], ids=lambda ws: f"ws{ws}")
def test_autocast_gives_the_single_devices_dtypes_values_and_gradients(ws, rank_pools):
    # the whole Hugging Face Qwen2-MoE at ws 2 (its capture is most of the time), its block and Mixtral's at both
    names = ("qwen2_moe",) * (ws == 2) + ("fuzz_moe", "fuzz_moe_shared", "dense", "cast_back")
    (dtypes, *_) = rank_pools(ws).run(_autocast_runs, names)
    want = {"fuzz_moe": {"output": "bfloat16"}, "fuzz_moe_shared": {"output": "bfloat16"}, "dense": {"output": "float32"},
            "cast_back": {"output": "bfloat16"}}
    if ws == 2:
        want["qwen2_moe"] = {"logits": "bfloat16", "loss": "float32"}  # the lm_head's linear; cross entropy in fp32
    assert dtypes == want
