"""Smoke test of ``tools/bench.py --quick``: it runs end to end and writes the documented JSON.

Not a timed test: only that times are positive and the keys are there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_quick_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench.py"), "--quick", "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Step time" in proc.stdout and "Goals" in proc.stdout
    result = json.loads(out.read_text())

    assert set(result["step_ms"]) >= {"fxtp", "dtensor", "single"}
    assert all(ms > 0 for ms in result["step_ms"].values())
    assert result["ratio_fxtp_dtensor"] > 0 and result["ratio_ws1_overhead"] > 0
    assert result["new_shape_ms"] > 0 and result["new_shape_steady_ms"] > 0 and result["recaptures"] == 0

    collectives = result["collectives"]
    assert {"tiny_gpt", "mlp", "reference_transformer"} <= set(collectives)
    for name, c in collectives.items():
        assert "floor_ok" in c or "error" in c, name
    # fxtp's runtime counts agree with its report, and reach the floor where the analysis is done.
    assert collectives["tiny_gpt"]["floor_ok"] is True
    assert collectives["tiny_gpt"]["forward"]["all_reduce"] == collectives["tiny_gpt"]["report_forward_all_reduce"]

    activations = result["activations"]  # measured on the ranks: sequence parallelism saves less than tp alone
    assert 0 < activations["saved_fraction"]["tp_sp"] < activations["saved_fraction"]["tp"] < 1
    assert all(b > 0 for b in activations["logits_peak_bytes"].values()) and activations["head_with_loss"] == "colwise"

    assert result["compile"], "no compile timings"
    for timings in result["compile"].values():
        assert timings["capture_s"] > 0 and timings["passes_s"] > 0

    for name, fractions in result["param_fraction"].items():
        if "error" not in fractions:
            assert 0 < fractions["2"] <= 1, name

    generation = result["generation"]  # pm.generate beside Hugging Face's generate
    assert generation["token_identical"] is True
    assert set(generation["prefill_ms"]) == {"single", "fxtp_ws1", "fxtp_ws2"}
    assert all(ms > 0 for ms in generation["prefill_ms"].values())
    # 4 heads, 2 kv heads: at ws 2 a rank holds one kv head's cache, half of ws 1's (+ 2 length counters)
    cache = generation["cache_bytes_per_rank"]
    assert 0 < cache["fxtp_ws2"] < cache["fxtp_ws1"] and abs(2 * cache["fxtp_ws2"] - cache["fxtp_ws1"]) <= 64
