"""Helpers shared by the tests: collective counting and single-device comparisons."""

from __future__ import annotations

import collections
import contextlib
import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator, Optional
from unittest import mock

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fxtp
from fxtp.explain.report import megatron_floor  # noqa: F401 - re-exported for the tests
from fxtp.core.placement import shard_tensor
from fxtp.runtime.blocks import rank_graphs
from fxtp.runtime.sharded import local_tensor

__all__ = [
    "CollectiveLog",
    "collective_divergence",
    "without_collective_log",
    "model_state",
    "assert_model_unchanged",
    "CollectiveCounter",
    "Fsdp2Collectives",
    "FunctionalSentBytes",
    "loss_of",
    "compare_training",
    "compare_shapes",
    "no_capture",
    "assert_report_counts",
    "count_graph_collectives",
    "megatron_floor",
    "shell_calls",
]

_KINDS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


class CollectiveCounter(TorchDispatchMode):
    """Counts functional collectives dispatched while active: ``counts[kind]``, and the shapes
    of their input tensors in call order: ``shapes[kind]``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.shapes: collections.defaultdict[str, list[tuple[int, ...]]] = collections.defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            kind = _KINDS.get(func._opname)
            if kind is not None:
                self.counts[kind] += 1
                self.shapes[kind].append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


# NOTE: [same collectives on every rank]
# A rank that issues a collective its peers do not (or another shape of it) hangs a GPU job and,
# on gloo, aborts a later call with a size mismatch far from the cause. CollectiveLog records,
# per rank, every collective dispatched while active: torch.distributed's calls (``c10d`` ops:
# FSDP2, DDP, ``all_gather_object``, fxtp's found-inf and norms) and the functional ones (fxtp's
# graphs, DTensor), as ``(op, group ranks, shapes)``. collective_divergence compares the logs of
# every rank: each group's members must issue the same sequence on it (cross-group order is not
# compared). RankPool checks every task this way, and the fuzzer every example.
_P2P = {"send", "recv_", "recv_any_source_"}
# Rooted ops pass tensor lists on the root only (gather_object, scatter_object_list: DCP's
# planning): the part every rank passes is compared.
_EVERY_RANKS_PART = {"gather_": lambda args: args[1], "scatter_": lambda args: args[0]}


def _group_ranks(func, args, kwargs) -> Optional[tuple[int, ...]]:
    """The ranks of the process group a collective op runs on (``None``: not found)."""
    from torch.distributed.distributed_c10d import _resolve_process_group  # private: the tests' one use

    if func.namespace == "_c10d_functional":
        names = [a.name for a in func._schema.arguments]
        values = dict(zip(names, args)) | dict(kwargs or {})
        name = values.get("group_name") or values.get("tag")
        return tuple(dist.get_process_group_ranks(_resolve_process_group(name))) if isinstance(name, str) else None
    for a in [*args, *(kwargs or {}).values()]:
        if isinstance(a, torch.ScriptObject):
            try:
                return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(a)))
            except RuntimeError:  # a ReduceOp, not the group
                continue
    return None


class CollectiveLog(TorchDispatchMode):
    """Every collective dispatched while active, in order: ``calls`` of ``(op, group ranks,
    shapes of its tensor arguments)`` (NOTE: [same collectives on every rank]). An all_to_all's
    shapes are left out (its split sizes differ by rank on purpose); of a gather or scatter, the
    tensors the root alone passes."""

    def __init__(self, sink: Optional[Any] = None) -> None:
        super().__init__()
        self.calls: list[tuple[str, Optional[tuple[int, ...]], tuple]] = []
        self._sink = sink  # a text file each call is also written to (one repr a line) before it runs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional") and func._opname not in _P2P and func._opname != "wait_tensor":
            part = _EVERY_RANKS_PART[func._opname](args) if func._opname in _EVERY_RANKS_PART else (args, kwargs)
            shapes = () if "all_to_all" in func._opname or "alltoall" in func._opname else tuple(
                tuple(t.shape) for t in pytree.tree_leaves(part) if isinstance(t, torch.Tensor))
            self.calls.append((func._opname, _group_ranks(func, args, kwargs), shapes))
            if self._sink is not None:  # kept if gloo aborts the process inside the call
                self._sink.write(f"{self.calls[-1]!r}\n")
                self._sink.flush()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def without_collective_log() -> Iterator[None]:
    """Inside, no ``TorchDispatchMode`` is active (RankPool's :class:`CollectiveLog` of the task
    leaves off): Dynamo compiles no frame while one is (``torch._dynamo.explain`` counts 0 graphs
    and -1 breaks, ``torch.compile`` runs eagerly), so a test of ``torch.compile(pm)`` runs its
    compiled calls here. Their collectives are not compared across ranks.
    ``_disable_current_modes`` is private: the tests' one use."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def collective_divergence(logs: list[list[tuple]]) -> Optional[str]:
    """``None`` when every group's members issued the same collectives on it (``logs[r]``: rank
    ``r``'s ``CollectiveLog.calls``), else a message naming the group, the position and each
    member's collective there (NOTE: [same collectives on every rank])."""
    groups = sorted({g for log in logs for _, g, _ in log if g is not None})
    for group in groups:
        members = [r for r in group if r < len(logs)]
        seqs = {r: [(op, shapes) for op, g, shapes in logs[r] if g == group] for r in members}
        longest = max(len(s) for s in seqs.values())
        for i in range(longest):
            at = {r: (seqs[r][i] if i < len(seqs[r]) else None) for r in members}
            if len(set(at.values())) > 1:
                lines = [f"ranks issued different collectives on group {list(group)}: collective #{i} on it is"]
                for r, c in at.items():
                    what = f"{c[0]} of {list(c[1])}" if c else f"nothing (rank {r} issued {len(seqs[r])} on it)"
                    lines.append(f"  rank {r}: {what}")
                return "\n".join(lines)
    return None


class _SentBytes(TorchDispatchMode):
    """Bytes a rank sends in the ring collectives dispatched while active, and their calls, by
    op name: ``sent[op]``, ``calls[op]``. A subclass says which ops count and what each sends."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def _bytes(self, func, args, out) -> Optional[float]:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sent = self._bytes(func, args, out)
        if sent is not None:
            self.sent[func._opname] += sent
            self.calls[func._opname] += 1
        return out


_RING = {"all_reduce": 2, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}


class FunctionalSentBytes(_SentBytes):
    """torch's functional collectives over the default group of ``t`` ranks: ``2 (t-1)/t`` of an
    all_reduce's tensor, ``(t-1)/t`` of an all_gather's output or a reduce_scatter's input."""

    def _bytes(self, func, args, out) -> Optional[float]:
        if func.namespace != "_c10d_functional" or func._opname not in _RING:
            return None
        t = dist.get_world_size()
        full = out if func._opname == "all_gather_into_tensor" else args[0]
        return _RING[func._opname] * (t - 1) * full.numel() * full.element_size() / t


_FSDP2_OPS = {"_allgather_base_": 0, "_reduce_scatter_base_": 1}  # which argument is the whole tensor


class Fsdp2Collectives(_SentBytes):
    """FSDP2's ring collectives (``c10d._allgather_base_`` from ``dist.all_gather_single``,
    ``c10d._reduce_scatter_base_`` from ``dist.reduce_scatter_single``): ``(n-1)/n`` of an
    all_gather's output (argument 0) or a reduce_scatter's input (argument 1) over its ``n``
    ranks (``n`` read from the shapes), in whole bytes."""

    def _bytes(self, func, args, out) -> Optional[int]:
        if func.namespace != "c10d" or func._opname not in _FSDP2_OPS:
            return None
        whole = args[_FSDP2_OPS[func._opname]]
        n = whole.numel() // args[1 - _FSDP2_OPS[func._opname]].numel()
        return (n - 1) * whole.numel() * whole.element_size() // n


def fxtp_bug(e: BaseException) -> bool:
    """Whether an ``FxtpError`` raised by a run is fxtp's own failure rather than a refusal: the
    rank graph raised on inputs that fit the model (``ParallelModule.forward`` wraps a torch
    ``RuntimeError`` from it, "the parallel graph failed ... please report this"). The fuzzers'
    inputs fit by construction, so this is a finding, not a rejection."""
    return isinstance(e, fxtp.FxtpRuntimeError) and "the parallel graph failed" in str(e)


def loss_of(out: Any) -> torch.Tensor:
    """A deterministic scalar from any output structure (sum of mean squares)."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum((t.float() ** 2).mean() for t in leaves)


def count_graph_collectives(pm: fxtp.ParallelModule) -> collections.Counter[str]:
    """Collective call sites in the emitted graph, by function name."""
    return collections.Counter(
        n.target.__name__ for n in graph_nodes(pm) if n.op == "call_function" and n.target.__module__ == "fxtp.core.collectives"
    )


def graph_nodes(pm: fxtp.ParallelModule) -> list[Any]:
    """The nodes of the rank program: the root graph's and its blocks' bodies' (NOTE: [rank
    program by block] in passes/regions/blocks.py)."""
    return [n for gm in rank_graphs(pm).values() for n in gm.graph.nodes]


def graph_code(pm: fxtp.ParallelModule) -> str:
    """The code of the rank program: the root graph's, then each block body's."""
    return "\n".join(gm.code for gm in rank_graphs(pm).values())


def assert_report_counts(report: "fxtp.Report", forward: Any, backward: Any) -> None:
    """The report's collectives per forward and backward equal the ones a run measured
    (``CollectiveCounter.counts``); report figures must be what runs."""
    for phase, measured in (("forward", forward), ("backward", backward)):
        reported = {kind: report.count(phase, kind) for kind in set(_KINDS.values()) if report.count(phase, kind)}
        assert reported == dict(measured), f"report says {phase} {reported}, the run did {dict(measured)}"


_PLAIN = (int, float, str, bool, type(None))


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """Everything ``fxtp`` must leave as it was on the user's ``model`` (issue 35, item 2):
    per module (``fqn:attribute``), its parameters, buffers and plain tensor attributes as
    ``(type, dtype, shape, clone)`` (no clone of a ``meta`` tensor, which has no values), its
    submodules' names, and its other attributes by value (ints, strings, flags) or by identity."""
    state: dict[str, Any] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        items = [(k, v) for k, v in vars(module).items() if k not in ("_parameters", "_buffers", "_modules")]
        items += [(f"param {k}", v) for k, v in module._parameters.items()]
        items += [(f"buffer {k}", v) for k, v in module._buffers.items()]
        items.append(("submodules", tuple(module._modules)))
        for key, value in items:
            if isinstance(value, torch.Tensor):
                plain = type(value) in (torch.Tensor, torch.nn.Parameter) and not value.is_meta
                value = (type(value).__name__, value.dtype, tuple(value.shape), value.detach().clone() if plain else None)
            elif not (isinstance(value, _PLAIN) or isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
                value = ("object", id(value))
            state[f"{fqn}:{key}"] = value
    return state


def assert_model_unchanged(model: torch.nn.Module, before: dict[str, Any], what: str = "fxtp.compile") -> None:
    """``model``'s :func:`model_state` is ``before``'s, tensors bitwise (NaNs included)."""
    after = model_state(model)
    assert after.keys() == before.keys(), f"{what} changed the model's attributes: added {sorted(after.keys() - before.keys())}, removed {sorted(before.keys() - after.keys())}"
    for key, old in before.items():
        new = after[key]
        if isinstance(old, tuple) and len(old) == 4 and isinstance(old[3], torch.Tensor):
            assert new[:3] == old[:3] and new[3] is not None, f"{what} changed the model's {key}: {old[:3]} -> {new[:3]}"
            same = torch.equal(new[3].reshape(-1).view(torch.uint8), old[3].reshape(-1).view(torch.uint8)) if old[3].numel() else True
            assert same, f"{what} wrote to the model's {key}"
        else:
            assert new == old, f"{what} changed the model's {key}: {old} -> {new}"


def assert_same_layout(out: Any, ref_out: Any) -> None:
    """Every output the single-device model returns contiguous and not a view is so from fxtp too:
    a user's ``logits.view(-1, vocab)`` works on both, and FSDP2 wrapping the module does not warn
    of a returned view (a gathered output used to be a ``movedim`` of the collective's)."""
    for i, (got, want) in enumerate(zip(pytree.tree_leaves(out), pytree.tree_leaves(ref_out))):
        if isinstance(want, torch.Tensor) and want.is_contiguous() and not want._is_view():
            assert got.is_contiguous() and not got._is_view(), (
                f"output {i} {tuple(got.shape)}: contiguous={got.is_contiguous()}, view={got._is_view()}, "
                "where the model's is contiguous and no view")


def compare_training(
    model, inputs, *, steps: int = 3, lr: float = 0.1, rtol: float | None = None, atol: float | None = None,
    dynamic: bool = False, compile_inputs: Optional[tuple] = None, **compile_kwargs
) -> dict[str, Any]:
    """Compile ``model`` over the default process group and check it against ``model`` itself:
    outputs, every gradient (shard against the matching slice), and outputs after ``steps`` SGD
    steps on both. Also checks the user's model was not mutated by compile. Returns the plan, the
    collectives counted in the first forward and backward (and the shapes the forward's
    all_reduces took), the parameters' placements, the report and the rank's graph code.
    ``rtol``/``atol``: tolerances (default: ``assert_close``'s for the dtype). ``dynamic``:
    passed to ``fxtp.compile``; static by default, since only the example's shapes run here and
    a static capture costs a third to a half of a dynamic one (dynamic shapes are checked by
    :func:`compare_shapes` and the tests that call another shape). ``compile_inputs``: the
    example inputs to compile with, when they are not ``inputs`` (aliased examples)."""
    tol = {"rtol": rtol, "atol": atol} if rtol is not None else {}
    ws, rank = dist.get_world_size(), dist.get_rank()
    ref = copy.deepcopy(model)
    before = model_state(model)
    pm = fxtp.compile(model, ws, inputs if compile_inputs is None else compile_inputs, dynamic=dynamic, **compile_kwargs)
    assert_model_unchanged(model, before)

    with CollectiveCounter() as fwd:
        out = pm(*inputs)
    ref_out = ref(*inputs)
    torch.testing.assert_close(out, ref_out, **tol)
    assert_same_layout(out, ref_out)
    with CollectiveCounter() as bwd:
        loss_of(out).backward()
    loss_of(ref_out).backward()
    assert_report_counts(pm.report, fwd.counts, bwd.counts)
    for fqn, p in pm.named_parameters():
        ref_grad = ref.get_parameter(fqn).grad
        if ref_grad is None:
            assert p.grad is None or not local_tensor(p.grad).any(), fqn
            continue
        expected = shard_tensor(ref_grad, pm.placements[fqn], rank, ws)
        torch.testing.assert_close(local_tensor(p.grad), expected, **tol, msg=lambda m: f"gradient of {fqn}: {m}")

    opt = torch.optim.SGD(pm.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(steps):
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        out, ref_out = pm(*inputs), ref(*inputs)
        torch.testing.assert_close(out, ref_out, **tol, msg=lambda m: f"after SGD step {step + 1}: {m}")
        loss_of(out).backward()
        loss_of(ref_out).backward()
    return {
        "plan": pm.plan,
        "forward": dict(fwd.counts),
        "backward": dict(bwd.counts),
        "forward_all_reduce_shapes": list(fwd.shapes["all_reduce"]),
        "placements": {fqn: str(p) for fqn, p in pm.placements.items()},
        "report": pm.report.to_dict(),
        "code": graph_code(pm),
        "out_shapes": [tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)],
        "local_shapes": {fqn: tuple(p.shape) for fqn, p in pm.named_parameters()},
    }


def shell_calls(command: str, cwd: Path) -> list[list[str]]:
    """The argv of each ``fxtp``/``python`` call bash makes for the pasted ``command``: bash
    parses, quotes and expands it (a shell syntax error fails the assert), the calls are
    recorded, not run. ``cwd`` gets a scratch folder ``.calls``."""
    calls = Path(cwd) / ".calls"
    shutil.rmtree(calls, ignore_errors=True)
    calls.mkdir()
    script = (
        'n=0; record() { n=$((n+1)); printf "%s\\0" "$@" > "$CALLS/$n"; }\n'
        'fxtp() { record fxtp "$@"; }\npython() { record python "$@"; }\n' + command + "\n"
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, CALLS=str(calls)), timeout=60, check=False)
    assert done.returncode == 0, f"bash refuses {command!r}: {done.stderr}"
    files = sorted(calls.iterdir(), key=lambda f: int(f.name))
    return [f.read_text().split("\0")[:-1] for f in files]
@contextlib.contextmanager
def no_capture() -> Iterator[None]:
    """Fail if anything calls ``torch.export.export`` (a recapture) inside the block."""
    with mock.patch("torch.export.export", side_effect=AssertionError("fxtp captured the model again")):
        yield


def compare_shapes(model, example, calls, *, lr: float = 0.1, tol: dict | None = None,
                   then: Callable[[Any, Any], Any] | None = None, **compile_kwargs) -> dict[str, Any]:
    """Compile ``model`` once on ``example`` over the default process group, then for each input
    tuple of ``calls`` (other batch sizes and sequence lengths, in a mixed order): outputs,
    every gradient (shard against slice) and one SGD step, against the single-device model,
    with no recapture. Returns the report, the output shapes and, under ``"then"``, what
    ``then(pm, ref)`` returns, called last (more checks on the same compile)."""
    tol = tol or {}
    ws, rank = dist.get_world_size(), dist.get_rank()
    ref = copy.deepcopy(model)
    pm = fxtp.compile(model, ws, example, **compile_kwargs)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=lr), torch.optim.SGD(ref.parameters(), lr=lr)
    shapes = []
    with no_capture():
        for i, inputs in enumerate(calls):
            out, ref_out = pm(*inputs), ref(*inputs)
            torch.testing.assert_close(out, ref_out, **tol, msg=lambda m: f"call {i} {[tuple(t.shape) for t in inputs]}: {m}")
            loss_of(out).backward()
            loss_of(ref_out).backward()
            for fqn, p in pm.named_parameters():
                ref_grad = ref.get_parameter(fqn).grad
                if ref_grad is not None:
                    expected = shard_tensor(ref_grad, pm.placements[fqn], rank, ws)
                    torch.testing.assert_close(local_tensor(p.grad), expected, **tol, msg=lambda m: f"call {i}, gradient of {fqn}: {m}")
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            shapes.append([tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)])
    return {"report": pm.report.to_dict(), "shapes": shapes, "then": then(pm, ref) if then is not None else None}
