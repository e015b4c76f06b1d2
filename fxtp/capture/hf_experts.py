"""Hugging Face experts implementations fxtp can capture, checked before capture.

NOTE: [eager experts]
Hugging Face's routed-experts modules (classes decorated with ``@use_experts_implementation``,
``transformers/integrations/moe.py``: ``MixtralExperts``, ``Qwen2MoeExperts``, ``GptOssExperts``,
...) pick their forward at every call from ``config._experts_implementation``. ``"grouped_mm"``
(the default) and ``"batched_mm"`` are straight-line tensor programs that fxtp shards
(``passes/rules/experts.py``; NOTE: [gathered experts] in ``passes/propagate.py``). ``"eager"``
(also what a standalone experts module without an implementation runs) is the class's own
forward, a Python loop over the experts the routing hit (``for expert_idx in expert_hit``):
its trip count and every slice in it depend on the data, so torch.export, ``symbolic_trace``
and dynamo all fail on it, after tracing the model up to it. fxtp refuses it up front, naming
the module and the line that switches it: ``model.set_experts_implementation("grouped_mm")``
(transformers' public ``PreTrainedModel`` method), or, for a module outside a
``PreTrainedModel``, its ``config._experts_implementation``. ``"batched_mm"`` runs the same
products in any dtype; torch's ``grouped_mm`` takes float32 and bfloat16 weights only.

The experts modules are found by what the decorator sets on each instance, so fxtp does not
import transformers here.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from fxtp.core.errors import FxtpCaptureError

__all__ = ["CAPTURED_IMPLEMENTATIONS", "check_experts_implementation"]

# The implementations fxtp captures and shards; the fix names the first.
CAPTURED_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
_LOOPED = (None, "eager")  # the class's own forward (None: transformers warns, then runs it)


def _is_experts_module(module: nn.Module) -> bool:
    """Does ``module`` carry what ``@use_experts_implementation``'s ``__init__`` sets?"""
    return all(hasattr(module, a) for a in ("_is_expert_parallel", "is_concatenated", "has_gate", "config"))


def _implementation(module: nn.Module) -> Optional[str]:
    return getattr(module.config, "_experts_implementation", "eager" if module.config is not None else "")


def check_experts_implementation(model: nn.Module) -> None:
    """Refuse a model whose Hugging Face experts would run the eager loop (NOTE: [eager experts]).

    Raises:
        FxtpCaptureError: naming the first such experts module (FQN and class), how many
            there are, and the line to run before ``fxtp.compile``/``fxtp.analyze``.
    """
    looped = [(name, m) for name, m in model.named_modules() if _is_experts_module(m) and _implementation(m) in _LOOPED]
    if not looped:
        return
    name, module = looped[0]
    where = f"the experts module {name or type(model).__name__} ({type(module).__name__})"
    more = f" and {len(looped) - 1} more" if len(looped) > 1 else ""
    impl = _implementation(module)
    if callable(getattr(model, "set_experts_implementation", None)):
        line = f'model.set_experts_implementation("{CAPTURED_IMPLEMENTATIONS[0]}")'
    else:
        owner = f'model.get_submodule("{name}")' if name else "model"
        line = f'{owner}.config._experts_implementation = "{CAPTURED_IMPLEMENTATIONS[0]}"'
    raise FxtpCaptureError(
        f"cannot capture {where}{more}: its config._experts_implementation is {impl!r}, which runs a Python loop over "
        "the experts the routing hit (data-dependent: no frontend can trace it). fix: run "
        f"{line} before fxtp.compile (\"{CAPTURED_IMPLEMENTATIONS[1]}\" instead runs the same products in any dtype; "
        "torch's grouped_mm takes float32 and bfloat16 weights only); fxtp shards both (docs/moe.md)"
    )
