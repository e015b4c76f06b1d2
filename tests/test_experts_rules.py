"""Rules for MoE expert layers (``passes/rules/experts.py``) and deferred reductions
(``passes/moe/reductions.py``), in process through tiny captured graphs (no process group).

Numerics against the single device on real gloo ranks: ``tests/test_moe.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxtp.api import _analyze
from fxtp.arguments import CompileOptions
from fxtp.core.placement import Partial, Shard

aten = torch.ops.aten
E, H, I, S = 4, 16, 8, 12  # experts, hidden, intermediate, (token, expert) pairs


class _Experts(nn.Module):
    """Hugging Face's grouped_mm experts, reduced to the matmuls: gate_up (E, 2I, H), down (E, H, I);
    bf16, which ``aten._grouped_mm`` requires on CPU."""

    def __init__(self, inter: int = I) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * inter, H, dtype=torch.bfloat16))
        self.down_proj = nn.Parameter(torch.randn(E, H, inter, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor, offs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate, up = F.grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)
        return (y * weights.unsqueeze(-1)).view(S // 2, 2, H).sum(dim=1)  # combine top-2


def _plan(model: nn.Module, *inputs, ws: int = 2):
    torch.manual_seed(0)
    captured, plan, report = _analyze(model, inputs, {}, CompileOptions(ws, capture="export"))
    nodes = {n.name: n for n in captured.program.graph.nodes}
    return plan, {row.name: row for row in report.layers}, nodes


def _expert_inputs():
    offs = torch.tensor([3, 6, 9, 12], dtype=torch.int32)
    return torch.randn(S, H, dtype=torch.bfloat16), offs, torch.rand(S, dtype=torch.bfloat16)


def test_grouped_mm_experts_colwise_then_rowwise():
    plan, layers, nodes = _plan(_Experts(), *_expert_inputs())
    gate_up, down = layers["gate_up_proj"], layers["down_proj"]
    assert (gate_up.op, gate_up.style, gate_up.weight_shape, gate_up.local_weight_shape) == ("_grouped_mm", "colwise", (E, 2 * I, H), (E, I, H))
    assert (down.style, down.local_weight_shape) == ("rowwise", (E, H, I // 2))
    # [gate_r | up_r] of every expert: the chunk into gate and up stays local.
    assert plan.params == {"p_gate_up_proj": Shard(1, (I, I)), "p_down_proj": Shard(2, (I,))}
    # One all_reduce, after the combine: the routing weights' product, the view and the top-2 sum are linear.
    (reduced,) = plan.reduces
    assert nodes[reduced].target is aten.sum.dim_IntList and plan.reduces[reduced] is None
    down_node = next(n for n in nodes.values() if n.target is aten._grouped_mm.default and isinstance(plan.placements[n.name], Partial))
    (mul,) = down_node.users
    assert isinstance(plan.placements[mul.name], Partial)
    # The routing weights meet a partial value: they enter through f (their gradient is summed).
    weights = next(a for a in mul.all_input_nodes if a is not down_node)
    assert plan.edges[(mul.name, weights.name)].kind == "enter"


def test_grouped_mm_intermediate_not_divisible():
    """I = 40 at world_size 3: no layout of [gate | up] divides, every expert stays whole."""
    plan, layers, _ = _plan(_Experts(inter=40), *_expert_inputs(), ws=3)
    assert layers["gate_up_proj"].style == "replicate" and layers["gate_up_proj"].code == "not-divisible"
    assert layers["down_proj"].style == "replicate"
    assert not plan.params and not plan.reduces


class _BatchedExperts(nn.Module):
    """Hugging Face's batched_mm experts, reduced to the matmuls: each pair's matrices gathered by
    its expert id, then ``bmm``; ``transposed``: gpt-oss's (E, H, 2I) and (E, I, H) weights on the
    right of the ``bmm``."""

    def __init__(self, transposed: bool = False) -> None:
        super().__init__()
        self.transposed = transposed
        shapes = ((E, H, 2 * I), (E, I, H)) if transposed else ((E, 2 * I, H), (E, H, I))
        self.gate_up_proj, self.down_proj = (nn.Parameter(torch.randn(*shape)) for shape in shapes)

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x.unsqueeze(1), w).squeeze(1) if self.transposed else torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate, up = self._linear(x, self.gate_up_proj[ids]).chunk(2, dim=-1)
        y = self._linear(F.silu(gate) * up, self.down_proj[ids])
        return (y * weights.unsqueeze(-1)).view(S // 2, 2, H).sum(dim=1)


def test_batched_mm_experts_are_the_same_layers():
    """A ``bmm`` of gathered experts (NOTE: [gathered experts]) plans as the grouped matmul does:
    gate_up colwise in segments (I, I), down rowwise, one all_reduce after the combine; on both
    operand orders."""
    ids = torch.arange(S) % E
    for transposed, params in ((False, {"p_gate_up_proj": Shard(1, (I, I)), "p_down_proj": Shard(2, (I,))}),
                               (True, {"p_gate_up_proj": Shard(2, (I, I)), "p_down_proj": Shard(1, (I,))})):
        plan, layers, nodes = _plan(_BatchedExperts(transposed), torch.randn(S, H), ids, torch.rand(S))
        gate_up, down = layers["gate_up_proj"], layers["down_proj"]
        assert (gate_up.op, gate_up.style, down.style) == ("bmm", "colwise", "rowwise"), transposed
        assert gate_up.weight_shape == tuple(nodes["p_gate_up_proj"].meta["val"].shape)  # the parameter, not the gathered rows
        assert plan.params == params, transposed
        (reduced,) = plan.reduces
        assert nodes[reduced].target is aten.sum.dim_IntList, transposed
    plan, layers, _ = _plan(_BatchedExperts(), torch.randn(S, H), ids, torch.rand(S), ws=3)  # I = 8 at ws 3
    assert {layers[w].style for w in ("gate_up_proj", "down_proj")} == {"replicate"} and not plan.params


class _Mlp(nn.Module):
    """A bias-free MLP whose output ``how`` uses: the reduction moves only past linear single uses."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.up, self.down, self.how = nn.Linear(H, 64, bias=False), nn.Linear(64, H, bias=False), how

    def forward(self, x):
        y = self.down(F.gelu(self.up(x)))
        if self.how == "scaled":
            return y.view(-1) * 2.0
        if self.how == "residual":
            return y + x  # sum_r y_r + x != sum_r (y_r + x)
        if self.how == "squared":
            return y * y
        return y.view(-1), y.sum()  # two uses: reduced where it is


def _reduced(how: str):
    """(targets of the nodes all_reduced, placements by node name, nodes)."""
    plan, _, nodes = _plan(_Mlp(how), torch.randn(4, H))
    return [nodes[name].target for name in plan.reduces], plan.placements, nodes


def test_reduction_moves_past_linear_single_uses():
    targets, placements, nodes = _reduced("scaled")
    assert targets == [aten.mul.Tensor]
    view = next(n for n in nodes.values() if n.target is aten.view.default)
    assert isinstance(placements[view.name], Partial)  # a partial sum between the layer and the reduction


def test_reduction_stays_before_nonlinear_or_shared_uses():
    for how in ("residual", "squared", "two-uses"):
        targets, placements, nodes = _reduced(how)
        assert targets == [aten.linear.default], how
        assert not [n for n, p in placements.items() if isinstance(p, Partial) and nodes[n].target is not aten.linear.default], how
