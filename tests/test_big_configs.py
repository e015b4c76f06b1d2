"""Full-size configs on the ``meta`` device: ``fxtp.analyze`` plans them without allocating a
weight (GPT-2 124M, Llama-2-7B and Llama-3-8B shapes at world_size 8)."""

from __future__ import annotations

import pytest
import torch

import fxtp
from fxtp import examples

pytest.importorskip("transformers")


def _analyze(name: str) -> tuple[torch.nn.Module, fxtp.Report]:
    model, inputs = getattr(examples, name)()
    report = fxtp.analyze(model, 8, inputs)
    assert all(p.is_meta for p in model.parameters())  # nothing materialized
    return model, report


def test_llama_7b_at_world_size_8():
    model, report = _analyze("llama_7b")
    d = report.to_dict()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert d["param_bytes"]["total"] == whole
    assert d["param_bytes"]["per_rank"] <= whole / 7  # the bound
    # Sharded bytes: a rank holds 1/8 of them; the rest (norms) is replicated.
    sharded = (whole - d["param_bytes"]["per_rank"]) * 8 / 7
    assert sharded >= 0.95 * whole
    styles = {row["name"]: row["style"] for row in d["layers"]}
    assert styles["model.embed_tokens"] == "rowwise" and styles["lm_head"] == "colwise"
    assert all(styles[f"model.layers.{i}.self_attn.{m}_proj"] == "colwise" for i in range(32) for m in "qkv")
    assert report.count("forward", "all_reduce") == 2 * 32 + 1  # + the vocab-parallel embedding


def test_llama3_8b_at_world_size_8():
    """Issue 13's goal: at most 13% of the parameter bytes per rank (8 kv heads, one per rank)."""
    model, report = _analyze("llama3_8b")
    d = report.to_dict()
    assert d["param_bytes"]["total"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert d["param_bytes"]["per_rank"] <= 0.13 * d["param_bytes"]["total"]
    styles = {row["name"]: row["style"] for row in d["layers"]}
    assert all(styles[f"model.layers.{i}.self_attn.{m}_proj"] == "colwise" for i in range(32) for m in "qkv")


def test_gpt2_124m_at_world_size_8():
    """12 heads and a 50257 vocabulary do not divide by 8: the plan says so for each layer."""
    _, report = _analyze("gpt2_124m")
    rows = {row.name: row for row in report.layers}
    assert rows["transformer.h.0.attn.c_attn"].code == "not-divisible"
    assert "12, 64" in rows["transformer.h.0.attn.c_attn"].reason  # the head count in the view
    assert rows["transformer.h.0.mlp.c_fc"].style == "colwise" and rows["transformer.h.0.mlp.c_proj"].style == "rowwise"
    assert rows["transformer.wte"].code == rows["lm_head"].code == "not-divisible"
    assert report.count("forward", "all_reduce") == 12  # one per MLP
