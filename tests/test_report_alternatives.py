"""The report's alternatives per layer (issue 25, item 4; NOTE: [layer alternatives] in
fxtp/explain/alternatives.py): each linear layer's styles with their predicted collective
bytes and parameter bytes per rank, in ``Report.to_dict()`` and ``--verbose``. One analysis
(no ranks) of a tiny MLP at ws 2: a colwise/rowwise pair and a replicated head."""

from __future__ import annotations

import torch
from torch import nn

import fxtp


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.head = nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(x))))


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_alternatives_price_the_chosen_style_as_the_report_does():
    """The chosen alternative's bytes are the report's own collectives for that layer (the pair's
    forward all_reduce is ``down``'s, its backward one ``up``'s); a replicated alternative sends
    nothing and holds the whole parameters; a sharded one holds the report's local shard."""
    model = _Mlp()
    x = torch.randn(2, 4, 16, requires_grad=True)
    report = fxtp.analyze(model, 2, (x,), dynamic=False)
    layers = {row["name"]: row for row in report.to_dict()["layers"]}
    chosen = {}
    for name, row in layers.items():
        picked = [a for a in row["alternatives"] if a["chosen"]]
        assert len(picked) == 1, row
        chosen[name] = picked[0]
    assert {n: c["style"] for n, c in chosen.items()} == {"up": "colwise (paired)", "down": "rowwise (paired)",
                                                          "head": "replicate"}
    stats = {(c["phase"], c["kind"]): c["bytes"] for c in report.to_dict()["collectives"]}
    assert chosen["up"]["forward_bytes"] == 0 and chosen["up"]["backward_bytes"] == stats["backward", "all_reduce"] == 4 * 2 * 4 * 16
    assert chosen["down"]["backward_bytes"] == 0 and chosen["down"]["forward_bytes"] == stats["forward", "all_reduce"]
    assert sum(c["forward_bytes"] + c["backward_bytes"] for c in chosen.values()) == sum(stats.values())
    for name in ("up", "down", "head"):
        module = model.get_submodule(name)
        replicate = next(a for a in layers[name]["alternatives"] if a["style"] == "replicate")
        assert (replicate["forward_bytes"], replicate["backward_bytes"]) == (0, 0)
        assert replicate["param_bytes_per_rank"] == _bytes(*module.parameters())
    assert chosen["up"]["param_bytes_per_rank"] == _bytes(model.up.weight, model.up.bias) // 2  # rows of W and b
    assert chosen["down"]["param_bytes_per_rank"] == _bytes(model.down.weight) // 2 + _bytes(model.down.bias)
    text = report.to_text(verbose=True)
    assert "  up: replicate: 0 B, 4.2 KiB; *colwise (paired): 512 B, 2.1 KiB" in text, text
    assert "alternatives per layer" not in str(report)  # the table stays as it was (the goldens)
