"""``fxtp.planner.close_call.swapped`` (issue 34, items 2 and 4): a run that measured two layouts in
the other order than the prediction's says, for each pair, how far apart they were priced and
whether that was within the model's measured error (a close call) or not (a miss). No ranks: the
figures are three ``fxtp.planner.measure`` runs' (hidden-128 Llama, 8 x 64 tokens, 4 gloo ranks,
2026-12-07) and random ones.
"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from fxtp.planner.close_call import MEASURED_ERROR, swapped

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

