"""Close calls: when the plan's winner is not a clear win, which assumption decides it and where.

NOTE: [close calls]
A plan is a close call when either

- the best row and the runner-up (the fastest fitting row of another ``tp``) are within the
  model's measured error: ``|log(t_runner_up / t_best)| <= MEASURED_ERROR``, the median
  ``|log(predicted / measured)|`` of the published runs the model was compared with
  (``python tools/bench_plan.py --published``, docs/plan_command.md "Published runs"; the
  test recomputes it from the runs' figures); or
- the winner flips when one assumption moves within its plausible range (``ASSUMPTIONS``): the
  achieved efficiency ``mfu`` from 0.6 to 1.4 times the table's (the published runs reach
  0.29 to 0.75 of peak on H100 and A100: docs/plan_command.md), the network per GPU from a
  quarter (one NIC shared by 4 GPUs, or HDR 200 Gb/s against NDR 400) to twice the table's,
  NVLink from half (the bus bandwidth nccl-tests measure at small sizes) to the datasheet's.
  A calibrated ``Hardware`` (NOTE: [calibration] in fxtp/planner/calibration.py) prices with
  what it measured in their place, the rates (``achieved_flops``) and the collectives
  (``collectives``), which moving ``mfu`` or a bandwidth would not change: those assumptions
  are not moved for it; the first test still applies.

The flip point is found by bisection on the assumption, each step re-pricing the two rows'
degrees (their best sequence parallelism, checkpointing and micro-batch again, under the
moved figure; memory does not depend on it), to 1% of the value. The plan says it as "tp 1
wins while achieved efficiency (mfu) is above 0.41; below, tp 8".

The same threshold reads a run (``fxtp plan --measure``, NOTE: [predicted against measured] in
fxtp/planner/measurement.py): two layouts the run measured in the other order than the
prediction's were either priced within the model's measured error of each other (a close call:
the prediction did not separate them) or farther apart (a miss of the model). :func:`swapped`
says which, for each such pair.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Optional

from fxtp.planner.hardware import Hardware

__all__ = ["MEASURED_ERROR", "ASSUMPTIONS", "close_calls", "swapped"]

# median |log(predicted / measured)| over the published runs (docs/bench_plan.json "published")
MEASURED_ERROR = 0.161
# (what the plan calls it, the Hardware field, the plausible range as factors of the table's
# figure, the field of a calibrated Hardware that measures it instead)
ASSUMPTIONS = (
    ("achieved efficiency (mfu)", "mfu", 0.6, 1.4, "achieved_flops"),
    ("network bandwidth per GPU", "inter_node_bw", 0.25, 2.0, "collectives"),
    ("NVLink bandwidth", "intra_node_bw", 0.5, 1.0, "collectives"),
)

# (hardware, layout) -> the layout's best step seconds, None if none fits; a layout is a tp
# (no pipelining) or a (pp, tp) pair
Price = Callable[[Hardware, Any], Optional[float]]


def _name(layout: Any) -> str:
    return f"pp {layout[0]} x tp {layout[1]}" if isinstance(layout, tuple) else f"tp {layout}"


def _order(layout: Any) -> tuple:
    return layout if isinstance(layout, tuple) else (1, layout)


def _fmt(field: str, value: float) -> str:
    return f"{value:.2f}" if field == "mfu" else f"{value / 1e9:.0f} GB/s"


def _winner(price: Price, hw: Hardware, tps: tuple[Any, ...]) -> Any:
    times = [(t, _order(tp), tp) for tp in tps for t in (price(hw, tp),) if t is not None]
    return min(times, key=lambda x: x[:2])[2] if times else tps[0]


def _flip(price: Price, hw: Hardware, field: str, lo: float, hi: float, tps: tuple[Any, ...]) -> Optional[tuple[float, bool, Any]]:
    """The value of ``field`` in ``[lo, hi]`` (absolute) nearest the table's where another
    degree than ``tps[0]`` starts to win, whether that is above it (True) or below, and that
    degree; None if ``tps[0]`` wins over the whole range."""

    def winner(value: float) -> Any:
        return _winner(price, dataclasses.replace(hw, **{field: value}), tps)

    here, found = getattr(hw, field), None
    for end, above in ((lo, False), (hi, True)):
        if end == here or winner(end) == tps[0]:
            continue
        a, b = here, end  # tps[0] wins at a, another at b
        while abs(b - a) > 0.01 * here:
            mid = (a + b) / 2
            a, b = (a, mid) if winner(mid) != tps[0] else (mid, b)
        value = (a + b) / 2
        if found is None or abs(value - here) / here < abs(found[0] - here) / here:
            found = (value, above, winner(b))
    return found


def close_calls(hw: Hardware, price: Price, best: Any, best_s: float, others: dict[Any, float]) -> tuple[str, ...]:
    """The plan's close-call lines (NOTE: [close calls]); empty for a clear win.

    Args:
        hw: the hardware the plan was priced with.
        price: re-prices a degree's best row under other hardware figures (None: nothing fits).
        best, best_s: the chosen layout (its ``tp``, or ``(pp, tp)`` when pipelined) and its step seconds.
        others: the other layouts that fit, each with its best row's step seconds.
    """
    if not others:
        return ()
    lines = []
    other, other_s = min(others.items(), key=lambda kv: (kv[1], _order(kv[0])))
    gap = math.log(other_s / best_s) if best_s > 0 else math.inf
    if gap <= MEASURED_ERROR:
        lines.append(f"{_name(other)} is {other_s / best_s - 1:.1%} slower than {_name(best)}, within the model's measured error "
                     f"({math.exp(MEASURED_ERROR) - 1:.0%}, the median over published runs): either may be faster")
    tps = (best, *sorted(others, key=_order))
    for name, field, low, high, measured in ASSUMPTIONS:
        if getattr(hw, measured):  # calibrated: priced with the measurement, not this figure
            continue
        here = getattr(hw, field)
        hi = min(1.0, here * high) if field == "mfu" else here * high
        found = _flip(price, hw, field, here * low, hi, tps)
        if found is not None:
            value, above, flipped = found
            side, other_side = ("below", "above") if above else ("above", "below")
            lines.append(f"{_name(best)} wins while {name} is {side} {_fmt(field, value)}; {other_side}, {_name(flipped)} "
                         f"(the hardware table's: {_fmt(field, here)})")
    return tuple(lines)


def swapped(predicted: dict[Any, float], measured: dict[Any, float]) -> tuple[str, ...]:
    """Each pair of layouts measured in the other order than predicted, a sentence each: how far
    apart they were priced and ran, and whether the prices were within the model's measured error
    (a close call) or not (a miss); empty when the order is the predicted one (NOTE: [close calls]).

    Args:
        predicted, measured: step seconds per layout (its ``tp``, or ``(pp, tp)``), the same keys.

    Returns:
        One sentence per pair ``(a, b)`` with ``a`` priced faster (ties: the smaller layout first)
        and measured slower, in that order; a measured tie keeps the order.

    Raises:
        KeyError: a layout of ``predicted`` that ``measured`` lacks.
    """
    lines = []
    for a, b in itertools.combinations(sorted(predicted, key=lambda k: (predicted[k], _order(k))), 2):
        if measured[a] <= measured[b]:  # a priced faster (or as fast) and it ran no slower
            continue
        # measured[a] > measured[b] >= 0; a step priced at 0 s (none of its terms) is infinitely apart
        priced = predicted[b] / predicted[a] if predicted[a] > 0 else math.inf
        ran = measured[a] / measured[b] if measured[b] > 0 else math.inf
        within = math.log(priced) <= MEASURED_ERROR
        lines.append(f"{_name(b)} was priced {priced - 1:.1%} slower than {_name(a)} and ran {ran - 1:.1%} faster: "
                     + ("within" if within else "beyond") + f" the model's measured error ({math.exp(MEASURED_ERROR) - 1:.0%}), "
                     + ("a close call" if within else "a miss"))
    return tuple(lines)
