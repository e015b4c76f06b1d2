"""``fxtp.planner.close_call.swapped`` (issue 34, items 2 and 4): a run that measured two layouts in
the other order than the prediction's says, for each pair, how far apart they were priced and
whether that was within the model's measured error (a close call) or not (a miss); and where
each row ran against the prices its calibrations gave it (the host's own spread). No ranks: the
figures are ``fxtp.planner.measure`` runs' (hidden-128 Llama, 8 x 64 tokens, 4 gloo ranks,
2026-12-07) and random ones.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from fxtp.planner.close_call import MEASURED_ERROR, swapped
from fxtp.planner.costs import Choice
from fxtp.planner.measurement import Measurement

_ERROR = f"the model's measured error ({math.exp(MEASURED_ERROR) - 1:.0%})"


def test_a_run_in_the_predicted_order_says_nothing():
    assert swapped({1: 118.81, 2: 139.07, 4: 134.46}, {1: 117.25, 2: 124.69, 4: 123.62}) == ()


def test_layouts_priced_within_the_error_and_run_the_other_way_are_a_close_call():
    # tp 4 and tp 2 priced 1.7% apart; tp 2 ran 7.8% faster
    assert swapped({1: 141.71, 2: 158.04, 4: 155.40}, {1: 124.63, 2: 145.37, 4: 156.68}) == (
        f"tp 2 was priced 1.7% slower than tp 4 and ran 7.8% faster: within {_ERROR}, a close call",)
    # tp 4 priced fastest by 15%; it ran behind tp 1 (and 0.05% ahead of tp 2, whose order is kept)
    assert swapped({1: 150.49, 2: 150.48, 4: 130.77}, {1: 134.91, 2: 151.36, 4: 151.28}) == (
        f"tp 1 was priced 15.1% slower than tp 4 and ran 12.1% faster: within {_ERROR}, a close call",
        f"tp 1 was priced 0.0% slower than tp 2 and ran 12.2% faster: within {_ERROR}, a close call")


def test_layouts_priced_farther_apart_and_run_the_other_way_are_a_miss():
    assert swapped({(1, 8): 1.0, (2, 4): 1.5}, {(1, 8): 2.0, (2, 4): 1.0}) == (
        f"pp 2 x tp 4 was priced 50.0% slower than pp 1 x tp 8 and ran 100.0% faster: beyond {_ERROR}, a miss",)


seconds = st.floats(min_value=1e-3, max_value=10.0, allow_nan=False)


@given(st.lists(st.tuples(seconds, seconds), min_size=2, max_size=6, unique_by=(lambda r: r[0], lambda r: r[1])))
def test_one_sentence_per_inverted_pair_and_none_for_the_same_order(rows):
    predicted = {tp: p for tp, (p, _) in enumerate(rows, 1)}
    measured = {tp: m for tp, (_, m) in enumerate(rows, 1)}
    inversions = sum((predicted[a] < predicted[b]) != (measured[a] < measured[b]) for a in predicted for b in predicted if a < b)
    lines = swapped(predicted, measured)
    assert len(lines) == inversions
    assert (lines == ()) == (sorted(predicted, key=predicted.get) == sorted(measured, key=measured.get))
    for line in lines:
        gap = math.log1p(float(line.split(" was priced ")[1].split("%")[0]) / 100)
        if abs(gap - MEASURED_ERROR) > 1e-3:  # beyond the sentence's rounding (0.1%)
            assert line.endswith("a close call") == (gap < MEASURED_ERROR), line


def test_each_row_is_said_against_its_calibrations_prices():
    """Three calibrations' prices of each row (ms), and where its median step fell: inside their
    range, or how far above the highest or under the lowest."""
    rows = [(SimpleNamespace(choice=Choice(tp, 4 // tp, False, None, 2 * tp, 1), step={"total": p / 1e3}), {"total": ran / 1e3})
            for tp, p, ran in ((1, 137.7, 157.8), (2, 148.7, 190.6), (4, 170.1, 150.0))]
    prices = ((0.1302, 0.1377, 0.1601), (0.1400, 0.1487, 0.1588), (0.1654, 0.1701, 0.1710))
    m = Measurement(None, None, None, None, tuple(rows), 9, 0.0, 0.0, calibrations=3, prices=prices)
    assert m._spread() == ["the 3 calibrations priced a step at: tp 1 x dp 4 130.20 ms to 160.10 ms (ran 157.80 ms: inside); "
                           "tp 2 x dp 2 140.00 ms to 158.80 ms (ran 190.60 ms: 20% above the highest); "
                           "tp 4 x dp 1 165.40 ms to 171.00 ms (ran 150.00 ms: 9% under the lowest)"]
    assert Measurement(None, None, None, None, tuple(rows), 9, 0.0, 0.0)._spread() == []  # one calibration, or a Hardware given
