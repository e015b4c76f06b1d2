"""The loop fuzzer's property (issue 35, item 7), run on every gloo rank: a user's training loop
on a ``ParallelModule`` against the same loop on the single-device model.

A :class:`Loop` is a tiny Hugging Face causal LM (Llama, or GPT-2), its compile (example tokens
and batch, ``sequence_parallel``, ``dynamic``) and a sequence of the operations a training loop
makes: forwards at varied sizes (token counts below the world size and ones it does not divide
included) with or without ``labels=`` (some or all of them ``ignore_index``), under grad,
``no_grad`` or ``inference_mode``, backward into accumulated gradients; ``train()``/``eval()``
switches; an optimizer step (after ``pm.clip_grad_norm_`` or torch's ``clip_grad_norm_`` on
``pm.parameters()``, or none); ``pm.load_full_state_dict`` of new weights; ``pm.full_state_dict()``.

:func:`run_loop` returns a :class:`LoopOutcome` instead of raising, so a mismatch on one rank
never leaves the others waiting: every rank runs every operation, and only then are the values
compared. :func:`check_loop` (in the test process) asserts over every rank's outcome: each group's
ranks issued the same collectives, kind, group and shapes (NOTE: [same collectives on every rank]
in tests/_helpers.py); every rank refused the same calls, each with an ``FxtpError``; every other
call's loss, logits, gradients, clipped norm and full state equal the single device's.
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.distributed as dist
from _helpers import CollectiveLog, collective_divergence, fxtp_bug, loss_of

import fxtp
from fxtp.core.placement import shard_tensor
from fxtp.runtime.sharded import local_tensor

__all__ = ["Call", "Mode", "Step", "Load", "Save", "Loop", "LoopOutcome", "run_loop", "check_loop"]

_TOL = {"rtol": 1e-4, "atol": 1e-5, "equal_nan": True}
_VOCAB = 96


@dataclass(frozen=True)
class Call:
    """A forward on ``(batch, tokens)`` ids, and a backward of its loss under ``grad="grad"``
    (accumulated into the gradients). ``labels``: ``"none"`` (the logits' ``loss_of``),
    ``"ids"`` (``labels=ids``), ``"some"`` (every other label ``-100``), ``"all"`` (all ``-100``:
    a NaN loss whose backward adds zeros)."""

    tokens: int
    batch: int = 1
    labels: str = "ids"
    grad: str = "grad"  # "grad" | "no_grad" | "inference_mode"


@dataclass(frozen=True)
class Mode:
    """``pm.train(train)`` and the same on the single device."""

    train: bool


@dataclass(frozen=True)
class Step:
    """Optionally clip (``clip``: ``"pm"``: ``pm.clip_grad_norm_``, ``"torch"``:
    ``torch.nn.utils.clip_grad_norm_(pm.parameters())``), then ``opt.step()`` and ``zero_grad()``;
    the gradients are compared first."""

    clip: str = "none"


@dataclass(frozen=True)
class Load:
    """``pm.load_full_state_dict`` of the model's initial weights, plus (``seed`` not 0) seeded noise."""

    seed: int = 0


@dataclass(frozen=True)
class Save:
    """``pm.full_state_dict()`` (a collective) against the single device's state dict."""


Op = Union[Call, Mode, Step, Load, Save]


@dataclass(frozen=True)
class Loop:
    """A model, its compile and the loop run on it. ``family``: ``"llama"`` (``layers`` HF Llama
    layers of hidden 32, 4 heads, ``kv_heads`` of them for keys and values) or ``"gpt2"``."""

    ops: tuple[Op, ...]
    family: str = "llama"
    layers: int = 1
    kv_heads: int = 4
    hidden: int = 32
    tokens: int = 8
    batch: int = 1
    sequence_parallel: bool = False
    dynamic: bool = True
    labels: bool = True  # compiled with labels= (its calls pass labels), else without (calls pass none)
    dropout: bool = False
    seed: int = 0


@dataclass
class LoopOutcome:
    """One rank's result: ``events`` (per op: ``"ok"``, ``"refused <error class>"`` or the raw
    error's last line), ``problems`` (mismatches), ``error`` (a raw traceback, or a compile's
    refusal), the collectives it issued (``CollectiveLog.calls``)."""

    events: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    error: str = ""
    compiled: bool = True
    collectives: list = field(default_factory=list)


def build(loop: Loop) -> torch.nn.Module:
    """The loop's tiny model, from its seed (every rank builds the same one)."""
    import transformers

    torch.manual_seed(loop.seed)
    drop = 0.1 if loop.dropout else 0.0
    if loop.family == "gpt2":
        config = transformers.GPT2Config(vocab_size=_VOCAB, n_embd=loop.hidden, n_layer=loop.layers, n_head=4,
                                         n_positions=32, resid_pdrop=drop, embd_pdrop=drop, attn_pdrop=drop, use_cache=False)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=_VOCAB, hidden_size=loop.hidden, intermediate_size=2 * loop.hidden,
                                      num_hidden_layers=loop.layers, num_attention_heads=4, num_key_value_heads=loop.kv_heads,
                                      max_position_embeddings=32, attention_dropout=drop, use_cache=False)
    return transformers.LlamaForCausalLM(config)


def _ids(loop: Loop, i: int, batch: int, tokens: int) -> torch.Tensor:
    return torch.randint(0, _VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(1000 * loop.seed + i))


def _labels(ids: torch.Tensor, how: str) -> Optional[torch.Tensor]:
    if how == "none":
        return None
    labels = ids.clone()
    if how == "some":
        labels[:, ::2] = -100
    elif how == "all":
        labels[:] = -100
    return labels


def _forward(module: torch.nn.Module, ids: torch.Tensor, labels: Optional[torch.Tensor], seed: int, grad: str):
    """``module(ids, labels=labels)`` from generator seed ``seed`` (fxtp draws its slice of the
    single device's dropout masks), under the grad mode; returns ``(loss or None, logits)``."""
    torch.manual_seed(seed)
    context = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[grad]
    with context():
        out = module(ids) if labels is None else module(ids, labels=labels)
    return out.loss, out.logits


def _close(got, want, what: str, problems: list[str]) -> None:
    try:
        torch.testing.assert_close(got, want, **_TOL)
    except AssertionError as e:
        problems.append(f"{what}: {str(e).splitlines()[0]} {' '.join(str(e).split())[-160:]}")


def _compare_grads(pm, ref, where: str, problems: list[str]) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    for fqn, p in pm.named_parameters():
        g = ref.get_parameter(fqn).grad
        if p.grad is None and g is None:
            continue
        want = shard_tensor(g, pm.placements[fqn], rank, ws) if g is not None else torch.zeros_like(local_tensor(p))
        got = local_tensor(p.grad) if p.grad is not None else torch.zeros_like(want)
        _close(got, want, f"{where}: gradient of {fqn}", problems)


def _run(loop: Loop, out: LoopOutcome) -> None:
    ws = dist.get_world_size()
    model = build(loop)
    ref = copy.deepcopy(model)
    example = _ids(loop, 0, loop.batch, loop.tokens)
    try:
        pm = fxtp.compile(model, ws, (example,), example_kwargs={"labels": example.clone()} if loop.labels else None,
                          sequence_parallel=loop.sequence_parallel, dynamic=loop.dynamic)
    except fxtp.FxtpError as e:
        out.compiled, out.error = False, f"{type(e).__name__}: {e}"
        return
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for i, op in enumerate(loop.ops, start=1):
        where = f"op {i} {op!r}"
        try:
            _apply(op, i, loop, pm, ref, (opt, ref_opt), where, out.problems)
            out.events.append("ok")
        except fxtp.FxtpError as e:
            if fxtp_bug(e):
                out.events.append("raw error")
                out.error = f"{where}:\n{traceback.format_exc()}"
                return
            out.events.append(f"refused {type(e).__name__}: {str(e)[:300]}")
        except Exception:  # noqa: BLE001 - the property: any other exception is a finding
            out.events.append("raw error")
            out.error = f"{where}:\n{traceback.format_exc()}"
            return


def _apply(op: Op, i: int, loop: Loop, pm, ref, opts, where: str, problems: list[str]) -> None:
    """Run ``op`` on fxtp and then (unless fxtp refused it) on the single device."""
    if isinstance(op, Call):
        ids = _ids(loop, i, op.batch, op.tokens)
        labels = _labels(ids, op.labels)
        got = _forward(pm, ids, labels, i, op.grad)  # refused here: the single device does not run it
        want = _forward(ref, ids, labels, i, op.grad)
        _close(got, want, f"{where}: (loss, logits)", problems)
        if op.grad == "grad":
            for loss, logits in (got, want):
                (loss_of(logits) if loss is None else loss).backward()
    elif isinstance(op, Mode):
        pm.train(op.train)
        ref.train(op.train)
    elif isinstance(op, Step):
        _compare_grads(pm, ref, where, problems)
        if op.clip != "none":
            norm = pm.clip_grad_norm_(0.5) if op.clip == "pm" else torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.5)
            _close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5), f"{where}: gradient norm", problems)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    elif isinstance(op, Load):
        g, fresh = torch.Generator().manual_seed(op.seed), build(loop)
        with torch.no_grad():  # per parameter, not per key: tied entries (GPT-2's lm_head) stay one tensor
            for p in fresh.parameters():
                p.add_((0.01 if op.seed else 0.0) * torch.randn(p.shape, generator=g))
        state = fresh.state_dict()
        pm.load_full_state_dict(state)
        ref.load_state_dict(state)
    elif isinstance(op, Save):
        got, want = pm.full_state_dict(), ref.state_dict()
        _close(dict(got), {k: want[k] for k in got}, f"{where}: full state dict", problems)


def run_loop(loop: Loop) -> LoopOutcome:
    """Run ``loop`` on this rank of the default process group, recording its collectives."""
    out = LoopOutcome()
    with CollectiveLog() as log:
        try:
            _run(loop, out)
        except Exception:  # noqa: BLE001 - a raw error at compile
            out.error = traceback.format_exc()
    out.collectives = log.calls
    return out


def check_loop(loop: Loop, outcomes: list[LoopOutcome]) -> str:
    """Assert the loop property over every rank's outcome; return ``"rejected"`` (the compile
    refused), or ``"ok"`` with the number of calls refused."""
    ws = len(outcomes)
    diverged = collective_divergence([o.collectives for o in outcomes])
    if diverged:
        raise AssertionError(f"fxtp's ranks diverged at world_size {ws} for\n    {loop!r}\n{diverged}")
    bad = [(r, o) for r, o in enumerate(outcomes) if o.problems or (o.error and o.compiled)]
    if bad:
        lines = [f"the loop property broke at world_size {ws} for\n    {loop!r}"]
        for rank, o in bad:
            lines += [f"--- rank {rank}: events {o.events}", *(f"    {p}" for p in o.problems[:6]), o.error[-3000:]]
        raise AssertionError("\n".join(lines))
    assert len({(o.compiled, tuple(o.events)) for o in outcomes}) == 1, f"ranks disagree: {[o.events for o in outcomes]}"
    if not outcomes[0].compiled:
        return "rejected"
    return f"ok, {sum(e.startswith('refused') for e in outcomes[0].events)} refused"
