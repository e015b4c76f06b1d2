"""Capture: a model as one ATen-level FX graph (``frontends``) and its inputs' dynamic dims (``shapes``)."""

from fxtp.capture.frontends import FRONTENDS, Captured, auto_dynamic_shapes, capture, diagnose_inputs, written_state

__all__ = ["FRONTENDS", "Captured", "auto_dynamic_shapes", "capture", "diagnose_inputs", "written_state"]
