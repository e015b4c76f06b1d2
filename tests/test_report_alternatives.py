"""The report's alternatives per layer (issue 25, item 4; NOTE: [layer alternatives] in
fxtp/explain/alternatives.py): each linear layer's styles with their predicted collective
bytes and parameter bytes per rank, in ``Report.to_dict()`` and ``--verbose``. One analysis
(no ranks) of a tiny MLP at ws 2: a colwise/rowwise pair and a replicated head."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from cases import build_case
from expert_choice import EXPERT_CHOICE  # noqa: F401 - registers the expert-choice cases

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
    layers, chosen, _ = _chosen_and_stats(report)
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
    # every parameter is a layer's: the chosen alternatives hold the rank's bytes (a property of the per-parameter bytes)
    assert sum(c["param_bytes_per_rank"] for c in chosen.values()) == report.param_bytes_per_rank == report.param_bytes_by_rank[0]
    assert report.to_dict()["param_bytes"]["per_rank"] == report.param_bytes_per_rank
    text = report.to_text(verbose=True)
    assert "  up: replicate: 0 B, 4.2 KiB; *colwise (paired): 512 B, 2.1 KiB" in text, text
    assert "alternatives per layer" not in str(report)  # the table stays as it was (the goldens)


class _Embedded(nn.Module):
    """A token table feeding a colwise/rowwise pair."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.up, self.down = nn.Embedding(128, 16), nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.emb(ids))))


class _FullBytes(TorchDispatchMode):
    """The functional collectives dispatched while active, in call order, as ``(kind, bytes)``
    in the report's convention: the full tensor's bytes (an all_reduce's input, an all_gather's
    output)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional" and func._opname in ("all_reduce", "all_gather_into_tensor"):
            full = out if func._opname == "all_gather_into_tensor" else args[0]
            self.seen.append((func._opname, full.numel() * full.element_size()))
        return out


_EMBEDDING_PLANS = ({}, {"emb": "colwise"}, {"emb": "replicate"})


def _embedding_runs() -> list[dict]:
    """On each rank, per plan: the report's alternatives, the collectives one forward and one
    backward dispatch, and the rank's local parameter bytes."""
    import torch.distributed as dist

    from fxtp.runtime.sharded import local_tensor

    out = []
    for plan in _EMBEDDING_PLANS:
        torch.manual_seed(0)
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
        pm = fxtp.compile(_Embedded(), dist.get_world_size(), (ids,), dynamic=False, plan=plan)
        with _FullBytes() as forward:
            y = pm(ids)
        with _FullBytes() as backward:
            y.pow(2).mean().backward()
        local = {name: local_tensor(p).numel() * p.element_size() for name, p in pm.named_parameters()}
        out.append({"styles": pm.report.plan, "alternatives": pm.report.alternatives, "forward": forward.seen,
                    "backward": backward.seen, "local": local})
    return out


def test_embedding_alternatives_against_a_run(rank_pools):
    """At ws 2 on real gloo ranks, an embedding vocab-parallel (the default), by columns and
    replicated (``plan=``): its chosen alternative's forward bytes are the run's collective
    after the lookup (counted by a ``TorchDispatchMode`` over the functional collectives, not
    fxtp's report), its parameter bytes the rank's local table; the chosen alternatives of the
    three layers sum to the run's bytes per phase; a replicated table holds the whole table."""
    runs = rank_pools(2).run(_embedding_runs)
    for rank in runs:
        for plan, run in zip(_EMBEDDING_PLANS, rank):
            chosen = {name: next(a for a in alts if a["chosen"]) for name, alts in run["alternatives"].items()}
            assert set(chosen) == {"emb", "up", "down"}, run
            for phase in ("forward", "backward"):
                assert sum(c[f"{phase}_bytes"] for c in chosen.values()) == sum(b for _, b in run[phase]), (plan, phase, run)
            emb = chosen["emb"]
            assert emb["param_bytes_per_rank"] == run["local"]["emb.weight"], (plan, run)
            expected = {"": "rowwise (vocab-parallel)", "colwise": "colwise", "replicate": "replicate"}[plan.get("emb", "")]
            assert emb["style"].startswith(expected), (plan, emb)
            if emb["forward_bytes"]:  # the first collective of the forward follows the lookup
                assert run["forward"][0][1] == emb["forward_bytes"] == 2 * 8 * 16 * 4, (plan, run)
            by_style = {a["style"]: a for a in run["alternatives"]["emb"]}
            assert by_style["replicate"]["param_bytes_per_rank"] == 128 * 16 * 4
            assert by_style["rowwise (vocab-parallel)"]["param_bytes_per_rank"] == by_style["colwise (by columns)"]["param_bytes_per_rank"] == 128 * 16 * 2


def _chosen_and_stats(report) -> tuple[dict, dict, list]:
    rows = {row["name"]: row for row in report.to_dict()["layers"]}
    chosen = {}
    for name, row in rows.items():
        picked = [a for a in row["alternatives"] if a["chosen"]]
        assert len(picked) == 1, row
        chosen[name] = picked[0]
    return rows, chosen, report.to_dict()["collectives"]


def test_chosen_alternatives_sum_to_the_report():
    """Analyses (no ranks) of the tiny Mixtral and Qwen2-MoE cut to 1 layer at ws 2, tensor and
    expert parallel, and of the tiny Llama at ws 4: the chosen alternatives of all layers sum to
    the report's collectives per phase (which tests/test_moe_figures.py and the numerics tests
    check against runs): q/k/v share one input's all_reduce; Mixtral's rowwise experts reduce
    the block output (deferred), plus the routing weights' gradient; Qwen2-MoE's shared expert
    and routed experts share one all_reduce; Llama's 2 kv heads at ws 4 add their holders'
    weight-gradient all_reduce (NOTE: [grouped shards]). An expert-parallel rank holds half the
    experts."""
    from fxtp.cli import examples

    tokens, hidden = 2 * 16, 64
    cases = [("mixtral", examples.mixtral(num_hidden_layers=1), 2, ep) for ep in (False, True)]
    cases += [("qwen2-moe", examples.qwen2_moe(num_hidden_layers=1), 2, ep) for ep in (False, True)]
    cases.append(("llama", examples.llama(), 4, False))
    for name, (model, inputs), ws, ep in cases:
        report = fxtp.analyze(model, ws, tuple(inputs), dynamic=False, capture="export", expert_parallel=ep)
        rows, chosen, stats = _chosen_and_stats(report)
        for phase in ("forward", "backward"):
            assert sum(c[f"{phase}_bytes"] for c in chosen.values()) == sum(s["bytes"] for s in stats if s["phase"] == phase), (name, ep, phase)
        if name != "mixtral":
            continue
        gate_up, down = (f"model.layers.0.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj"))
        assert chosen["model.layers.0.self_attn.k_proj"]["backward_bytes"] == 0  # q_proj carries their input's all_reduce
        assert chosen["model.embed_tokens"]["style"] == "rowwise (vocab-parallel)"
        alts = {n: {a["style"]: a for a in rows[n]["alternatives"]} for n in (gate_up, down)}
        for n in (gate_up, down):
            assert alts[n]["expert"]["param_bytes_per_rank"] == alts[n]["replicate"]["param_bytes_per_rank"] // 2
        rowwise = alts[down]["rowwise (paired)"]
        assert (rowwise["forward_bytes"], rowwise["backward_bytes"]) == (tokens * hidden * 4, tokens * 2 * 4)
        if ep:
            assert chosen[gate_up]["style"] == chosen[down]["style"] == "expert"
            to_all = sum(s["bytes"] for s in stats if s["phase"] == "forward" and s["kind"] == "all_to_all")
            assert chosen[gate_up]["forward_bytes"] + chosen[down]["forward_bytes"] == to_all + tokens * hidden * 4
            assert f"  {down}: replicate: 0 B, 128.0 KiB;" in report.to_text(verbose=True)
        else:
            assert (chosen[gate_up]["style"], chosen[down]["style"]) == ("colwise (paired)", "rowwise (paired)")


def test_chosen_alternatives_sum_to_the_report_where_reductions_fold():
    """Where partial sums meet before one all_reduce (NOTE: [deferred reduction]): the
    expert-choice MoE (4 experts and a shared one, ``index_add`` into zeros, biases as shares)
    and PEFT's LoRA form (``lora_B(lora_A(x)) * scaling``), at ws 2 and 4: the chosen
    alternatives sum to the report's bytes per phase (the report's counts are checked against
    runs in tests/test_moe.py and tests/test_cases.py)."""
    for name in ("expert-choice-moe", "20c-peft-lora"):
        for ws in (2, 4):
            model, inputs = build_case(name)
            report = fxtp.analyze(model, ws, inputs, dynamic=False)
            _, chosen, stats = _chosen_and_stats(report)
            for phase in ("forward", "backward"):
                total = sum(s["bytes"] for s in stats if s["phase"] == phase)
                assert total and sum(c[f"{phase}_bytes"] for c in chosen.values()) == total, (name, ws, phase)
