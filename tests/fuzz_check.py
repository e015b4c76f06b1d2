"""The differential property, run on every gloo rank: fxtp against the single-device model.

:func:`differential` compiles a :class:`fuzz_models.Spec` over the default process group and
returns an :class:`Outcome` instead of raising, so one rank's mismatch never leaves the others
waiting in a collective: every rank runs the same collectives (forward, backward, ``steps`` SGD
steps) and only then are the values compared. :func:`check_outcomes` (in the test process)
turns the per-rank outcomes into one assertion.

The property (issue 10, item 5): ``fxtp.compile`` either (a) equals the single-device model
(outputs, every gradient as shard against slice, outputs after each SGD step), every replicated
layer of the report has a code, and the report's collective counts equal the ones a run
measures; or (b) raises an ``FxtpError``. Anything else (a raw torch exception, a silent
difference) is a failure.
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from _helpers import CollectiveCounter, loss_of
from fuzz_models import Spec, build
from torch import nn

import fxtp
from fxtp.core.placement import Shard, shard_tensor
from fxtp.runtime.sharded import local_tensor

__all__ = ["Outcome", "differential", "check_outcomes"]

_NOISE = 10.0
_CHAOTIC = 1e-3
_PHASES = tuple((phase, kind) for phase in ("forward", "backward") for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"))


@dataclass
class Outcome:
    """One rank's result. ``status``: ``"ok"`` (ran and compared), ``"rejected"`` (an
    ``FxtpError``; ``where`` says at compile or at run) or ``"raw-error"`` (any other exception).
    ``problems``: ``(kind, what, max_abs_error)`` for each violated clause, kinds ``"mismatch"``,
    ``"no-code"``, ``"report-count"``, ``"mutated"``. A mismatch's error is fxtp's distance to the
    float64 model; ``ref_err`` in its text is the float32 model's own distance to it."""

    status: str
    where: str = ""
    error: str = ""
    problems: list[tuple[str, str, float]] = field(default_factory=list)
    plan: dict[str, str] = field(default_factory=dict)
    uneven: bool = False  # some parameter sharded unevenly (NOTE: [uneven shards])


def _max_err(a: Any, b: Any) -> float:
    """The largest absolute difference of ``a`` and ``b`` (same structure of tensors; ``inf``
    for a structure or shape mismatch)."""
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    if len(la) != len(lb):
        return float("inf")
    worst = 0.0
    for x, y in zip(la, lb):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or x.shape != y.shape:
            return float("inf")
        if x.numel():
            worst = max(worst, (x.double() - y.double()).abs().nan_to_num(float("inf")).max().item())
    return worst


def _mismatch(got: Any, want: Any, want64: Any) -> Optional[tuple[float, float]]:
    """``None`` if fxtp's ``got`` equals the float32 model's ``want`` (``assert_close``'s float32
    tolerances), or differs from it no more than float32 rounding explains: its error against
    the float64 model ``want64`` is within ``_NOISE`` times the float32 model's own (summation
    order differs across ranks, and SGD steps amplify it), or the float32 model itself has lost
    the float64 one (error above ``_CHAOTIC`` of the values' scale: a diverging training run, no
    verdict). Else ``(fxtp's error, the float32 model's error)``, both against float64."""
    try:
        torch.testing.assert_close(got, want)
        return None
    except AssertionError:
        pass
    err, ref_err = _max_err(got, want64), _max_err(want, want64)
    tensors = [t for t in pytree.tree_leaves(want64) if isinstance(t, torch.Tensor) and t.numel()]
    scale = max((t.abs().max().item() for t in tensors), default=0.0)
    if err <= _NOISE * ref_err or ref_err > _CHAOTIC * (1.0 + scale):
        return None
    return err, ref_err


def _grads(pm: fxtp.ParallelModule, refs: tuple[torch.nn.Module, ...], rank: int, ws: int) -> list[tuple[str, tuple]]:
    """``(fqn, (shard's grad, matching slice of each reference's grad))`` for every parameter
    (a missing grad counts as zeros)."""
    out = []
    for fqn, p in pm.named_parameters():
        ref_grads = [ref.get_parameter(fqn).grad for ref in refs]
        expected = [None if g is None else shard_tensor(g, pm.placements[fqn], rank, ws) for g in ref_grads]
        grad = None if p.grad is None else local_tensor(p.grad)
        like = next((t for t in (grad, *expected) if t is not None), None)
        if like is not None:
            out.append((fqn, tuple(torch.zeros_like(like) if t is None else t.detach().clone() for t in (grad, *expected))))
    return out


def _forward(module: torch.nn.Module, inputs: tuple, seed: int) -> Any:
    """``module(*inputs)`` from generator seed ``seed``: fxtp and the references draw the same
    dropout masks (one device's mask, sliced where fxtp holds a shard)."""
    torch.manual_seed(seed)
    return module(*inputs)


def _step(modules: tuple[torch.nn.Module, ...], inputs: tuple[tuple, ...], seed: int) -> tuple:
    """Forward every module on its inputs and backward ``loss_of`` of each; return the outputs."""
    outs = tuple(_forward(m, x, seed) for m, x in zip(modules, inputs))
    for out in outs:
        loss_of(out).backward()
    return outs


_NO_DECAY = (nn.LayerNorm, nn.RMSNorm, nn.Embedding)


def _type_groups(module: nn.Module, lr: float) -> list[dict]:
    """Parameter groups by module type (``isinstance``, as Hugging Face's
    ``Trainer.get_decay_parameter_names``): norms and embeddings without weight decay at half the
    rate, the rest with decay 0.1; pm's module tree must answer as the model's (NOTE: [blocks of
    a ParallelModule] in fxtp/runtime/blocks.py)."""
    exempt = {id(p) for m in module.modules() if isinstance(m, _NO_DECAY) for p in m.parameters(recurse=False)}
    params = list(module.parameters())
    return [{"params": [p for p in params if id(p) not in exempt], "weight_decay": 0.1},
            {"params": [p for p in params if id(p) in exempt], "weight_decay": 0.0, "lr": lr / 2}]


def differential(spec: Spec, steps: int = 2, lr: float = 0.1) -> Outcome:
    """Run the property for ``spec`` on this rank of the default process group: fxtp against
    the same model in float32 (the reference) and in float64 (the judge of rounding)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    model, inputs = build(spec)
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    inputs64 = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        pm = fxtp.compile(model, ws, inputs, sequence_parallel=spec.sequence_parallel, dynamic=spec.dynamic,
                          expert_parallel=spec.expert_parallel,
                          activation_checkpointing=spec.checkpointing if spec.checkpointing in ("blocks", "selective") else None)
    except fxtp.FxtpError as e:
        return Outcome("rejected", "compile", f"{type(e).__name__}: {e}")
    except Exception:  # noqa: BLE001 - the property: any other exception is a finding
        return Outcome("raw-error", "compile", traceback.format_exc())
    uneven = any(isinstance(p, Shard) and not p.divisible(ws) for p in pm.placements.values())
    outcome = Outcome("ok", plan=dict(pm.plan), uneven=uneven)
    problems = outcome.problems
    problems += [("mutated", k, float("nan")) for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    problems += [("no-code", row.name, float("nan")) for row in pm.report.layers if row.style == "replicate" and row.code is None]
    modules, all_inputs = (pm, ref, ref64), (inputs, inputs, inputs64)
    try:
        pairs: list[tuple[str, tuple]] = []
        with CollectiveCounter() as fwd:
            out = _forward(pm, inputs, 0)
        with CollectiveCounter() as bwd:
            loss_of(out).backward()
        pairs.append(("output", (out, *_step(modules[1:], all_inputs[1:], 0))))
        pairs += [(f"gradient of {fqn}", grads) for fqn, grads in _grads(pm, modules[1:], rank, ws)]
        opts = [torch.optim.SGD(_type_groups(m, lr) if spec.type_groups else m.parameters(), lr=lr) for m in modules]
        for step in range(steps):
            if spec.clip:  # torch's clipping on every module, as a training loop calls it (NOTE: [sharded parameters])
                norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1) for m in modules]
                pairs.append((f"gradient norm before SGD step {step + 1}", tuple(norms)))
            for opt in opts:
                opt.step()
                opt.zero_grad()
            pairs.append((f"output after SGD step {step + 1}", _step(modules, all_inputs, step + 1)))
    except fxtp.FxtpError as e:
        return Outcome("rejected", "run", f"{type(e).__name__}: {e}", problems, outcome.plan)
    except Exception:  # noqa: BLE001
        return Outcome("raw-error", "run", traceback.format_exc(), problems, outcome.plan)
    for what, (got, want, want64) in pairs:
        errs = _mismatch(got, want, want64)
        if errs is not None:
            problems.append(("mismatch", f"{what} (float32 model's own error {errs[1]:.2g})", errs[0]))
    measured = {"forward": fwd.counts, "backward": bwd.counts}
    for phase, kind in _PHASES:
        claimed, ran = pm.report.count(phase, kind), measured[phase][kind]
        if claimed != ran:
            problems.append(("report-count", f"{phase} {kind}: report {claimed}, ran {ran}", float("nan")))
    for phase, counts in measured.items():
        extra = {k: n for k, n in counts.items() if (phase, k) not in _PHASES and n}
        if extra:
            problems.append(("report-count", f"{phase} {extra} ran, not in the report", float("nan")))
    return outcome


def check_outcomes(spec: Spec, outcomes: list[Outcome]) -> str:
    """Assert the property over every rank's outcome; return ``"ok"`` or ``"rejected"``."""
    bad = [(r, o) for r, o in enumerate(outcomes) if o.status == "raw-error" or o.problems]
    if bad:
        lines = [f"fxtp broke the differential property at world_size {len(outcomes)} for\n    {spec!r}"]
        for rank, o in bad:
            lines.append(f"--- rank {rank}: {o.status} {o.where}; plan {o.plan}")
            for kind, what, err in o.problems:
                lines.append(f"    {kind}: {what}" + (f" (max abs error {err:.3g})" if err == err else ""))
            if o.error:
                lines.append(o.error.rstrip()[-3000:])
        raise AssertionError("\n".join(lines))
    statuses = {o.status for o in outcomes}
    assert len(statuses) == 1, f"ranks disagree: {[o.status for o in outcomes]} for {spec!r}"
    return statuses.pop()
