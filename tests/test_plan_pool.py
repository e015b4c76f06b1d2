"""``fxtp.planner.hardware.pooled`` (issue 34, item 2): calibrations of the same ranks make one
Hardware, the calibration whose price of the same rows (else whose timing of the model's own
programs) is the median, its figures kept together (NOTE: [predicted against measured], 2 in fxtp/planner/measurement.py): a
calibration's figures are coupled (FSDP2's dp entries are its in-model seconds less the host
work its own host figures price), and a median per figure broke those sums. No ranks: constructed
calibrations, and random ones priced by the cost model.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxtp.planner import Hardware
from fxtp.planner.costs import Choice, Workload, estimate
from fxtp.planner.hardware import CalibrationRun, HostCosts
from fxtp.planner.hardware import pooled

BATCH, SEQ = 8, 64


def _calibrated(f: float, memory: int = 2**30, load: float = 1.0, rate2: float = 8e9, in_model: bool = False,
                model_s: float = 0.0) -> Hardware:
    return Hardware("calibrated", 1e10, memory, 1e9, 1e9, mfu=1.0, achieved_flops=((1, 1e10 * f), (2, rate2 * f)),
                    collectives=(("all_reduce", 2, 1e-4 * f, 1e9 / f), ("all_gather", 2, 2e-4 * f, 2e9 / f))
                    + ((("tp:all_reduce", 2, 3e-4 * f, 1e9 / f),) if in_model else ()),
                    host=HostCosts(op=1e-5 * f, op_backward=1e-5, fsdp_unit=1e-3, asynchronous=False),
                    calibration=CalibrationRun(20.0 * f, load, 2, 4, model_s), collective_wait=((2, 2e-3 * f, 0.1 * f),),
                    doubts=("a round's own doubt",))


def test_the_median_calibration_is_kept_whole():
    # none timed the model (model_s 0): the median wall time, f = 2; the second round's tp 2 GEMMs
    # at a tenth are that round's doubt, not the pooled Hardware's
    rounds = [_calibrated(1.0, 3 * 2**30, 9.0), _calibrated(3.0, 2**30, 5.0, rate2=8e8), _calibrated(2.0, 2 * 2**30, 4.0)]
    hw = pooled(rounds)
    for field in ("achieved_flops", "collectives", "host", "collective_wait"):  # each differs between the rounds
        assert getattr(hw, field) == getattr(rounds[2], field), field
    assert hw.achieved_flops == ((1, 2e10), (2, 1.6e10)) and hw.host.op == 2e-5
    assert hw.memory_bytes == 2**30 and hw.calibration == CalibrationRun(60.0, 9.0, 2, 4)  # the least, the longest, the highest
    assert hw.doubts == ("the load average was 9.0 on 2 cores (4 of it the ranks' own at most)",)  # once, the highest


def test_calibrations_are_ranked_by_the_models_own_programs():
    # the median model_s (3.0) is the f = 1 round's, whose wall time is the shortest
    hw = pooled([_calibrated(1.0, model_s=3.0), _calibrated(3.0, model_s=1.0), _calibrated(2.0, model_s=9.0)])
    assert hw.host.op == 1e-5 and hw.calibration.model_s == 3.0 and hw.calibration.seconds == 60.0
    # of two, the lower; its in-model tp entries (NOTE: [collectives in the model]) with it
    two = pooled([_calibrated(3.0, in_model=True, model_s=2.0), _calibrated(1.0, model_s=1.0)])
    assert two.host.op == 1e-5 and not two.has_role("tp")
    two = pooled([_calibrated(3.0, in_model=True, model_s=1.0), _calibrated(1.0, model_s=2.0)])
    assert two.collective("all_reduce", 2, "tp") == (pytest.approx(9e-4), pytest.approx(1e9 / 3))
    # a Hardware that does not say how it ran ranks after those that do; the highest load is kept
    given = dataclasses.replace(_calibrated(5.0), calibration=None)
    hw = pooled([given, _calibrated(1.0, load=9.0, model_s=2.0), given])
    assert hw.host.op == 1e-5 and hw.calibration.load == 9.0 and hw.doubts[-1].startswith("the load average was 9.0")
    with pytest.raises(ValueError, match="at least one calibration and a price for each"):
        pooled([])
    with pytest.raises(ValueError, match="a price for each"):
        pooled([hw, hw], [1.0])
    # ranked by their prices of the same work where given: the median price, whatever model_s says;
    # of two, the higher (one that measured an op as free prices every row under the other, 2026-12-07)
    rounds = [_calibrated(1.0, model_s=3.0), _calibrated(3.0, model_s=1.0), _calibrated(2.0, model_s=9.0)]
    assert pooled(rounds, [5.0, 1.0, 3.0]).host.op == 2e-5 and pooled(rounds, [3.0, 3.0, 1.0]).host.op == 1e-5
    assert pooled(rounds[:2], [2.0, 1.0]).host.op == 1e-5 and pooled(rounds[:2]).host.op == pytest.approx(3e-5)  # model_s: the lower


def test_measure_asks_for_a_calibration_before_any_rank_starts():
    import torch

    from fxtp.core.errors import FxtpConfigError
    from fxtp.planner.measurement import measure

    with pytest.raises(FxtpConfigError, match=r"calibrations=0.*fix: calibrations=1 or more"):
        measure(torch.nn.Linear(2, 2), 4, batch=BATCH, seq=SEQ, calibrations=0)  # checked before the model is read


@functools.lru_cache(maxsize=None)
def _priced_model():
    import torch
    import transformers

    from fxtp.planner.model import TransformerShape
    from fxtp.planner.params import parameter_shapes, repeated_blocks

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=SEQ, use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    shape = TransformerShape.of(model, repeated_blocks(model).fqn)
    return shape, parameter_shapes(model, (1, 2, 4), (torch.zeros(1, SEQ, dtype=torch.long),), {})


factor = st.floats(min_value=0.5, max_value=2.0)


def _cpu_calibration(rates: float, op: float, fsdp_host: float, tp: float, dp: float, model_s: float = 0.0) -> Hardware:
    """A CPU calibration whose figures moved apart, as a host's drift moves them (each in [0.5, 2])."""
    return Hardware("calibrated", 1e10, 2**30, 1e9, 1e9, devices_per_node=4, mfu=1.0, overlap_fsdp=False, compute_bytes=4,
                    achieved_flops=((1, 1e10 * rates), (2, 9e9 * rates), (4, 8e9 * rates)),
                    collectives=tuple((role + kind, n, lat * f, 1e9 / f) for role, lat, f in (("", 1e-4, 1.0), ("tp:", 3e-4, tp), ("dp:", 2e-4, dp))
                                      for kind in ("all_reduce", "all_gather", "reduce_scatter") for n in (2, 4)),
                    host=HostCosts(op=2e-5 * op, op_backward=2e-5 * op, optimizer_tensor=1e-4, fsdp_unit=1e-4 * fsdp_host,
                                   fsdp_tensor=1e-5 * fsdp_host, asynchronous=False),
                    calibration=CalibrationRun(30.0, 1.0, 2, 4, model_s))


_ROWS = (Choice(1, 4, False, None, 2, 1), Choice(2, 2, False, None, 4, 1), Choice(4, 1, False, None, 8, 1))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(factor, factor, factor, factor, factor, factor), min_size=3, max_size=3), st.booleans())
def test_each_row_is_priced_within_what_the_calibrations_priced_it(rounds, by_price):
    """Fuzzed: three calibrations whose figures moved independently (the GEMM rates, the op
    figures, FSDP2's host work, the tp and the dp groups' entries). Every row, priced with the
    pooled Hardware, costs what one of the calibrations priced it at, term by term, so no less
    than the least of them and no more than the most (a median per figure priced rows below
    every calibration, 2026-12-07: dp 2 x tp 2's FSDP2 at 41.1 ms against 44.2 to 51.9). Ranked
    by their prices of the rows (as ``fxtp.planner.measure`` ranks them), the rows cost the
    median of the three calibrations' sums."""
    shape, params = _priced_model()
    found = [_cpu_calibration(*r) for r in rounds]
    work = Workload(BATCH, SEQ, True, "adamw", 4, activation_bytes=4, gather_bytes=4)
    sums = [sum(estimate(c, shape, params[c.tp], h, work).step["total"] for c in _ROWS) for h in found]
    hw = pooled(found, sums if by_price else None)
    if by_price:
        assert sum(estimate(c, shape, params[c.tp], hw, work).step["total"] for c in _ROWS) == sorted(sums)[1]
    for c in _ROWS:
        own = [estimate(c, shape, params[c.tp], h, work).step for h in found]
        got = estimate(c, shape, params[c.tp], hw, work).step
        terms = ("total", "compute", "tp_comm", "fsdp_exposed")
        assert any(all(s[t] == got[t] for t in terms) for s in own), (c, got, own)
        for t in terms:
            assert min(s[t] for s in own) <= got[t] <= max(s[t] for s in own), (c, t, got[t], [s[t] for s in own])


def test_measure_keeps_the_calibration_whose_prices_are_the_median():
    """``fxtp.planner.measure``'s pooling with the planner itself, no ranks: three calibrations,
    one faster and one slower than the third in every figure; the one timed the model's programs
    the median (``model_s``) is the fast one, the one whose prices are the median the middle one.
    The plan printed prices each row as that one did, and each row's three prices are printed."""
    import torch
    import transformers

    from fxtp.planner.measurement import _rows, pooled_plan
    from fxtp.planner.search import plan

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=SEQ, use_cache=False))
    fast, mid, slow = (_cpu_calibration(*f, model_s=m) for f, m in (((2.0,) + (0.5,) * 4, 2.0), ((1.0,) * 5, 9.0),
                                                                      ((0.5,) + (2.0,) * 4, 1.0)))
    planned = []
    hw, p, prices = pooled_plan([fast, mid, slow], lambda h: planned.append(h) or plan(
        model, 4, device_memory=2**30, batch=BATCH, seq=SEQ, devices_per_node=4, hardware=h, pp=1))
    assert pooled([fast, mid, slow]).host == fast.host  # by model_s alone, the fast one
    assert hw.host == mid.host and len(planned) == 4  # each calibration's plan, then the kept one's
    assert [e.choice.tp for e in _rows(p)] == [1, 2, 4] and len(prices) == 3
    for e, (by_fast, by_mid, by_slow) in zip(_rows(p), prices):
        assert by_fast < by_mid < by_slow and e.step["total"] == pytest.approx(by_mid, rel=1e-12), (e.choice, prices)
    assert pooled_plan([mid], lambda h: plan(model, 4, device_memory=2**30, batch=BATCH, seq=SEQ, devices_per_node=4,
                                             hardware=h, pp=1))[2] == ()  # one calibration: no spread
