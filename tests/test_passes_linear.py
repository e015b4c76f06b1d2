"""The passes are linear in the layer count (issue 25: "make them linear in the layer count"),
checked by counting, not timing: the Python calls fxtp's passes make planning a tiny Llama of
2, 3 and 4 identical blocks, captured on meta. Linear calls ``a + b L`` grow by the same amount
from 3 to 4 blocks as from 2 to 3; a term in ``L^2`` makes the second step larger (``7 c``
against ``5 c``). Any pass looping over the graph once per layer, or comparing every block with
every other, shows there."""

from __future__ import annotations

import sys

import pytest
import torch

from fxtp.api import _capture
from fxtp.explain.report import build_report
from fxtp.planning import normalized, plan_program

transformers = pytest.importorskip("transformers")

_OURS = ("/passes/", "/fxtp/")


def _calls(layers: int) -> tuple[int, int]:
    """(Python calls made by normalize, the plan at tp 4 and the report; graph nodes)."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    captured = _capture(model, (ids,), {"use_cache": False}, "auto", dynamic_shapes=None)
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and any(part in frame.f_code.co_filename for part in _OURS):
            count += 1

    sys.setprofile(profile)
    try:
        fqns, written = normalized(captured.program)
        # kv 2 at tp 4: grouped kv shards, the case that took refinement rounds per block
        sharding = plan_program(captured.program, fqns, written, 4, {}, sequence=True)
        build_report(captured.program, sharding, captured.frontend, captured.attempts, 0)
    finally:
        sys.setprofile(None)
    return count, len(captured.program.graph.nodes)


def test_passes_make_calls_linear_in_the_layer_count():
    (c2, n2), (c3, n3), (c4, n4) = (_calls(n) for n in (2, 3, 4))
    assert n4 - n3 == n3 - n2 > 0  # the graph itself grows by one block's nodes
    assert c4 - c3 <= 1.02 * (c3 - c2), (c2, c3, c4)
    assert c4 - c3 > 0.9 * (c3 - c2)  # and it is counting something that grows with the blocks
