"""Issue 35, items 1 and 2, without ranks: example inputs that share storage become separate
graph inputs under every frontend (NOTE: [independent example inputs]), and a capture never
writes to the user's model, also when the compile fails (NOTE: [capture on a copy]). On ranks:
tests/test_hf_models.py (labels=ids, cross attention, Phi-3 longrope, dynamic NTK)."""

from __future__ import annotations

import pytest
import torch
from _helpers import assert_model_unchanged, model_state
from models import build
from torch import nn

import fxtp


class _WritesItself(nn.Module):
    """A forward that writes to its module: a buffer ``add_``, a plain tensor attribute
    ``mul_``, a counter, a new attribute and a new buffer (Hugging Face rotaries do the last two)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(8))
        self.scale = torch.ones(8)
        self.calls = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        self.scale.mul_(2)
        self.calls += 1
        self.last = x.detach().sum()
        self.register_buffer("seen", y.detach()[0].clone(), persistent=False)
        return self.lin(x) * self.scale + self.steps + y


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(y)


@pytest.mark.parametrize("frontend", ["fx", "export", "dynamo"])
def test_aliased_example_inputs_are_separate_graph_inputs(frontend):
    """Issue 35, item 1 (NOTE: [independent example inputs]): ``(x, x)``, a view of ``x`` and
    another view of its storage compile to two graph inputs under every frontend."""
    torch.manual_seed(0)
    model = _TwoInputs()
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    wide = torch.randn(2, 16)
    for example in ((x, x), (x, x.view(2, 8)), (wide[:, :8], wide[:, 8:])):
        pm = fxtp.compile(model, 1, example, capture=frontend, dynamic=False)
        assert pm.report.frontend == frontend
        torch.testing.assert_close(pm(x, y), model(x, y))


def test_one_tensor_for_inputs_whose_dims_the_plan_specializes_differently():
    """Self-attention compiled as ``mha(x, x, x)`` (shared case 14): the query's length stays
    dynamic while the plan specializes the key's, so the two uses of ``x`` need different
    ``dynamic_shapes`` entries, which torch keys by tensor; before, a raw ``AssertionError``
    ("Shapes assigned to input do not match"). The inputs are made independent once for every
    capture of a compile."""
    torch.manual_seed(0)
    model = nn.MultiheadAttention(64, 4, batch_first=True)
    x, memory = torch.randn(2, 8, 64), torch.randn(2, 5, 64)
    pm = fxtp.compile(model, 2, (x, x, x))  # no process group: rank 0's graph, for the plan
    assert {layer.name: layer.style for layer in pm.report.layers}["out_proj"] == "rowwise"
    one = fxtp.compile(model, 1, (x, x, x))
    torch.testing.assert_close(one(x, memory, memory)[0], model(x, memory, memory)[0])


def test_compile_writes_nothing_to_the_model_also_when_it_fails():
    """Issue 35, item 2 (NOTE: [capture on a copy]): a forward that writes to its module, under
    every frontend, compiled and refused; the model's every attribute is as it was."""
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    for frontend in ("auto", "fx", "export", "dynamo"):
        model = _WritesItself()
        before = model_state(model)
        try:
            pm = fxtp.compile(model, 2, (x, x + 1), capture=frontend)
        except fxtp.FxtpError as exc:  # fx: symbolic tracing would run the buffer's add_ eagerly
            assert frontend == "fx" and "writes buffer steps in place" in str(exc), exc
        else:
            assert pm.report.frontend != "fx"
        assert_model_unchanged(model, before, f"fxtp.compile (capture={frontend!r})")
    model, inputs = build("nn_transformer")
    before = model_state(model)
    with pytest.raises(fxtp.FxtpError):
        fxtp.compile(model, 2, (inputs[0][..., :5],))  # inputs that do not fit: a failed compile
    assert_model_unchanged(model, before, "a failed fxtp.compile")
