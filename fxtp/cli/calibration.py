"""``fxtp plan --calibrate`` and ``--measure``: the plan with figures measured on the local ranks
(NOTE: [calibration] in fxtp/planner/calibration.py), and its predictions against a run
(NOTE: [predicted against measured] in fxtp/planner/measurement.py)."""

from __future__ import annotations

import argparse
import json
from typing import Any


__all__ = ["add_measuring_arguments", "check_measuring", "calibrated", "run_measure"]


def add_measuring_arguments(plan: argparse.ArgumentParser) -> None:
    """``fxtp plan``'s ``--calibrate`` and ``--measure``."""
    plan.add_argument("--calibrate", action="store_true",
                      help="measure --devices local ranks (GPUs, else gloo CPU ranks) at the model's GEMMs and collectives "
                      "and plan with those figures instead of --hardware's (docs/plan_command.md)")
    plan.add_argument("--measure", action="store_true", help="calibrate, run each tp's best row on the local ranks, "
                      "print predicted against measured by term, and plan again with the measured figures")


def check_measuring(args: argparse.Namespace) -> None:
    """``--device-memory`` unless measured; ``--batch`` and ``--seq`` of a training step when measuring.

    Raises:
        UsageError: a missing or contradicting argument (the CLI exits 2).
    """
    from fxtp.cli.inspection import UsageError  # imports torch: not while the parser is built (fxtp --help)

    measuring = "--measure" if args.measure else "--calibrate" if args.calibrate else None
    if args.device_memory is None and not measuring:
        raise UsageError("the following arguments are required: --device-memory (or --calibrate, which measures it)")
    if measuring and args.inference:
        raise UsageError(f"{measuring} times a training step: drop --inference (a forward is planned from --hardware's figures)")
    missing = [flag for flag, value in (("--batch", args.batch), ("--seq", args.seq)) if value is None]
    if measuring and missing:
        raise UsageError(f"{measuring} times a training step of --batch x --seq tokens: give {' and '.join(missing)} "
                         f"(e.g. --batch 8 --seq 128)")


def calibrated(args: argparse.Namespace, loaded: Any, progress: Any) -> Any:
    """The ``Hardware`` of ``--devices`` local ranks at the model's shapes."""
    from fxtp.planner.calibration import calibrate

    progress.stage(f"calibrate {args.devices} local ranks")
    return calibrate(loaded.model, args.devices, batch=args.batch, seq=args.seq)


def run_measure(args: argparse.Namespace, loaded: Any, progress: Any) -> int:
    """Calibrate, plan, run each tp's best row on ``--devices`` local ranks and print the plan and
    the predicted-against-measured table (or both as JSON); returns the exit status."""
    import torch

    from fxtp.planner.measurement import measure

    model = loaded.model
    if loaded.on_meta:  # a config.json: the same model with random weights, on the CPU
        with torch.device("cpu"):
            model = type(model)(model.config)
    progress.stage(f"calibrate and run on {args.devices} local ranks")
    result = measure(model, args.devices, batch=args.batch, seq=args.seq, device_memory=args.device_memory,
                     optimizer=args.optimizer)
    progress.done()
    if args.format == "json":
        print(json.dumps({"plan": result.plan.to_dict(), "measure": result.to_dict()}, indent=2))
    else:
        print(f"{result.plan}\n\n{result}")
    return 0
