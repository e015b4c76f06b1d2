"""fxtp benchmark: step time, collectives, compile time and memory, side by side, in one run.

    python tools/bench.py [--quick] [--json PATH] [--plot PATH]

1. **Step time** (forward + backward + SGD), 2 gloo ranks on this machine: fxtp against torch's
   ``parallelize_module`` with the hand plan, on torch's reference Transformer
   (``torch.testing._internal.distributed._tensor.common_dtensor``); and fxtp at world_size 1
   against the plain model. Same weights, inputs and SGD everywhere; outputs and losses are
   checked to agree before anything is timed (a benchmark of a wrong model is worthless).
   Then fxtp at a shape the compile never saw (half the batch and sequence): the first step
   there (``new_shape_ms``), the steady steps there, and how many times the model was captured
   again (``recaptures``: 0 under dynamic shapes).
2. **Collectives** per forward and backward, by kind and bytes, counted at runtime on the gloo
   ranks, against the Megatron floor (2 all_reduce forward + 2 backward per transformer block).
3. **Compile time**: capture and fxtp's own passes, separately, for Llama-shaped configs on the
   ``meta`` device (``Report.timings``).
4. **Memory**: parameter bytes per rank against the whole model (``fxtp.analyze``).
5. **Activations** (``tools/bench_activations.py``), on the gloo ranks: bytes saved for backward
   per rank (single device, tensor parallel, tensor + sequence parallel) and the peak bytes of
   the loss step with the logits all_gathered against loss parallel.

Timing is per rank with ``torch.set_num_threads(1)`` (one core per rank), median of the timed
steps after warm-up, the implementations alternating step by step so drift hits both alike.
A model whose builder fails (e.g. transformers missing) is reported, not fatal.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fxtp  # noqa: E402
from fxtp.cli import examples  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_activations  # noqa: E402
import bench_fsdp  # noqa: E402
from bench_models import Settings, builtins, dtensor_hand_plan, generation_model, megatron_collectives, reference_transformer  # noqa: E402
from bench_report import goals, plot, tables  # noqa: E402

__all__ = ["Settings", "get_args_parser", "main"]

_KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


# --- models ---------------------------------------------------------------------------------


# --- measuring ------------------------------------------------------------------------------


class _Collectives(TorchDispatchMode):
    """Functional collectives dispatched while active: ``counts[kind]``, ``bytes[kind]`` (of the
    result: the full tensor for all_reduce and all_gather)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = _KINDS.get(func._opname) if func.namespace == "_c10d_functional" else None
        if kind is not None:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.bytes[kind] = self.bytes.get(kind, 0) + out.numel() * out.element_size()
        return out


def _loss(out: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum((t.float() ** 2).mean() for t in leaves)


def _step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, target: torch.Tensor) -> float:
    """One training step: forward, cross-entropy, backward, SGD. Returns its wall time."""
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    out = model(ids)
    loss = F.cross_entropy(out.flatten(0, 1), target.flatten())
    loss.backward()
    opt.step()
    return time.perf_counter() - start


def _time_alternating(impls: dict[str, nn.Module], ids: torch.Tensor, s: Settings, barrier: Callable[[], None]) -> dict[str, list[float]]:
    """Step every implementation ``warmup + steps`` times, alternating the order each round."""
    target = torch.randint(0, s.vocab, ids.shape, generator=torch.Generator().manual_seed(7))
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in impls.items()}
    times: dict[str, list[float]] = {k: [] for k in impls}
    names = list(impls)
    for i in range(s.warmup + s.steps):
        for k in names if i % 2 == 0 else reversed(names):
            barrier()
            t = _step(impls[k], opts[k], ids, target)
            if i >= s.warmup:
                times[k].append(t)
    return times


def _agree(impls: dict[str, nn.Module], ref: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """Max abs difference of each implementation's logits against ``ref``'s; raises if off."""
    expected = ref(ids)
    errors = {}
    for k, m in impls.items():
        out = m(ids)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4, msg=lambda msg: f"{k} does not match the model: {msg}")
        errors[k] = float((out - expected).detach().abs().max())
    return errors


def _new_shape(pm: nn.Module, dt: nn.Module, s: Settings, barrier: Callable[[], None]) -> dict[str, Any]:
    """fxtp at (batch/2, seq/2), a shape its compile never saw: the first step there and the
    steady ones, counting calls of ``torch.export.export``. Checked against DTensor first at
    (batch/2 + 1, seq/2 + 1), another unseen shape, so the timed first step is the first there."""
    batch, seq = max(2, s.batch // 2), max(2, s.seq // 2)
    check = torch.randint(0, s.vocab, (batch + 1, seq + 1), generator=torch.Generator().manual_seed(8))
    ids = torch.randint(0, s.vocab, (batch, seq), generator=torch.Generator().manual_seed(9))
    real, captures = torch.export.export, []

    def counting(*args: Any, **kwargs: Any) -> Any:
        captures.append(1)
        return real(*args, **kwargs)

    torch.export.export = counting
    try:
        error = _agree({"fxtp": pm}, dt, check)["fxtp"]
        times = _time_alternating({"fxtp": pm}, ids, dataclasses.replace(s, warmup=0), barrier)["fxtp"]
    finally:
        torch.export.export = real
    return {"new_shape": list(ids.shape), "new_shape_ms": 1e3 * times[0], "new_shape_steady_ms": 1e3 * statistics.median(times[1:]),
            "recaptures": len(captures), "new_shape_max_abs_error": error}


def _collectives_of(model: nn.Module, inputs: tuple) -> tuple[dict, dict]:
    with _Collectives() as fwd:
        out = model(*inputs)
    with _Collectives() as bwd:
        _loss(out).backward()
    return {"counts": fwd.counts, "bytes": fwd.bytes}, {"counts": bwd.counts, "bytes": bwd.bytes}


def _rank_collectives(s: Settings, ws: int) -> dict[str, Any]:
    """Runtime collectives of fxtp on every built-in model (and DTensor on the reference)."""
    results: dict[str, Any] = {}
    for name, (build, blocks, input_grad) in builtins(s).items():
        try:
            model, inputs = build()
            pm = fxtp.compile(model, ws, inputs)
            fwd, bwd = _collectives_of(pm, inputs)
        except Exception as exc:  # noqa: BLE001 - a failing model is reported, not fatal
            results[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            continue
        floor = megatron_collectives(name, blocks, input_grad, pm.report.to_dict())
        results[name] = {
            "forward": fwd["counts"], "backward": bwd["counts"],
            "bytes": {"forward": fwd["bytes"], "backward": bwd["bytes"]},
            "floor": floor, "blocks": blocks,
            "floor_ok": fwd["counts"] == floor["forward"] and bwd["counts"] == floor["backward"],
            "report_forward_all_reduce": pm.report.count("forward", "all_reduce"),
            "report_backward_all_reduce": pm.report.count("backward", "all_reduce"),
        }
    from torch.distributed.device_mesh import DeviceMesh

    model, inputs = reference_transformer(s)
    dt = dtensor_hand_plan(model, DeviceMesh("cpu", list(range(ws))))
    fwd, bwd = _collectives_of(dt, inputs)
    results["reference_transformer (dtensor)"] = {
        "forward": fwd["counts"], "backward": bwd["counts"],
        "bytes": {"forward": fwd["bytes"], "backward": bwd["bytes"]}, "floor_ok": None,
    }
    return results


def _generation(generate: Callable[..., torch.Tensor], prompt: torch.Tensor, s: Settings, barrier: Callable[[], None]) -> dict[str, Any]:
    """Prefill ms (a call adding one token) and decode tokens/s (the further tokens of a call
    adding ``new_tokens``), medians after one warm-up call (which compiles fxtp's decoder)."""
    generate(prompt, max_new_tokens=s.new_tokens)
    one, full = [], []
    for _ in range(max(1, s.steps // 4)):
        barrier()
        t = time.perf_counter()
        generate(prompt, max_new_tokens=1)
        one.append(time.perf_counter() - t)
        barrier()
        t = time.perf_counter()
        tokens = generate(prompt, max_new_tokens=s.new_tokens)
        full.append(time.perf_counter() - t)
    prefill, whole = statistics.median(one), statistics.median(full)
    decode = (s.new_tokens - 1) / (whole - prefill) if whole > prefill else None  # None: lost in the noise
    return {"prefill_ms": 1e3 * prefill, "decode_tokens_per_s": decode, "tokens": tokens.tolist()}


def _fxtp_generation(model: nn.Module, prompt: torch.Tensor, s: Settings, ws: int, barrier: Callable[[], None]) -> dict[str, Any]:
    """:func:`_generation` of ``pm.generate`` at ``ws``, and the KV cache bytes this rank holds."""
    from fxtp.runtime import generation

    pm = fxtp.compile(model, ws, (prompt,))
    return _generation(pm.generate, prompt, s, barrier) | {"cache_bytes_per_rank": generation.cache_bytes(pm)}


def _rank_main(rank: int, ws: int, port: int, s: Settings, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=datetime.timedelta(seconds=300))
    try:
        from torch.distributed.device_mesh import DeviceMesh

        model, (ids,) = reference_transformer(s)
        pm = fxtp.compile(model, ws, (ids,))
        dt = dtensor_hand_plan(copy.deepcopy(model), DeviceMesh("cpu", list(range(ws))))
        impls = {"fxtp": pm, "dtensor": dt}
        errors = _agree(impls, model, ids)
        times = _time_alternating(impls, ids, s, dist.barrier)
        # The same steps on the same data: the trained models still agree.
        after = _agree({"fxtp": pm}, dt, ids)
        result = {
            "rank": rank,
            "step_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "max_abs_error": errors | {"fxtp_vs_dtensor_after_training": after["fxtp"]},
            "plan": pm.plan,
            **_new_shape(pm, dt, s, dist.barrier),
        }
        result["generation"] = _fxtp_generation(*generation_model(s), s, ws, dist.barrier)
        result["activations"] = bench_activations.measure(model, ids, s.vocab, ws)
        gathered: list[Any] = [None] * ws
        dist.all_gather_object(gathered, result)
        collectives = _rank_collectives(s, ws)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"ranks": gathered, "collectives": collectives}, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bench_distributed(s: Settings, ws: int = 2) -> dict[str, Any]:
    """Step time (fxtp vs DTensor) and collectives, on ``ws`` gloo ranks spawned once."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.json")
        mp.spawn(_rank_main, args=(ws, _free_port(), s, path), nprocs=ws, join=True)
        with open(path) as f:
            return json.load(f)


def bench_single(s: Settings) -> dict[str, Any]:
    """fxtp at world_size 1 against the plain model, one process, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, (ids,) = reference_transformer(s)
        pm = fxtp.compile(model, 1, (ids,))
        plain = copy.deepcopy(model)
        errors = _agree({"fxtp_ws1": pm}, plain, ids)
        times = _time_alternating({"fxtp_ws1": pm, "plain": plain}, ids, s, lambda: None)
        gen_model, prompt = generation_model(s)
        generation = {
            "single": _generation(lambda p, **kw: gen_model.generate(p, do_sample=False, pad_token_id=0, **kw), prompt, s, lambda: None),
            "fxtp_ws1": _fxtp_generation(gen_model, prompt, s, 1, lambda: None),
        }
        return {"step_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}, "max_abs_error": errors,
                "generation": generation}
    finally:
        torch.set_num_threads(threads)


def bench_compile(s: Settings) -> dict[str, Any]:
    """Capture, passes and rewrite time of ``fxtp.compile`` at world_size 2, Llama shapes on meta
    (medians of ``compile_repeats``)."""
    results: dict[str, Any] = {}
    for layers in s.compile_layers:
        runs = []
        for _ in range(s.compile_repeats):
            model, inputs = examples.llama_7b(layers)
            runs.append(fxtp.compile(model, 2, inputs).report.timings)
        results[str(layers)] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return results


def bench_memory(s: Settings) -> dict[str, Any]:
    """Per-rank parameter bytes over the whole, from ``fxtp.analyze``."""
    builders: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {k: b for k, (b, _, _) in builtins(s).items()}
    if s.full_size:
        builders |= {name: getattr(examples, name) for name in ("gpt2_124m", "llama_7b", "llama3_8b", "mixtral_8x7b", "qwen2_moe_a2_7b")}
    results: dict[str, Any] = {}
    for name, build in builders.items():
        try:
            model, inputs = build()
            row = {}
            for ws in s.world_sizes:
                pb = fxtp.analyze(model, ws, inputs).to_dict()["param_bytes"]
                row[str(ws)] = pb["per_rank"] / pb["total"]
            results[name] = row | {"total_bytes": pb["total"]}
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            results[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    return results


# --- reporting ------------------------------------------------------------------------------


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiniest settings (the CI smoke test)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write pass time against layers as a PNG (needs matplotlib)")
    parser.add_argument("--plot-activations", metavar="PATH", help="write saved activations and loss-step peaks as a PNG")
    parser.add_argument("--steps", type=int, help="timed steps (default 20; --quick: 3)")
    return parser


def _generation_result(single: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """``pm.generate`` at ws 1 and 2 beside Hugging Face's ``generate`` (greedy, one prompt)."""
    runs = single | {"fxtp_ws2": ranks[0]["generation"]}
    slowest = max(ranks, key=lambda r: r["generation"]["prefill_ms"])["generation"]
    rates = [r["generation"]["decode_tokens_per_s"] for r in ranks]
    runs["fxtp_ws2"] = runs["fxtp_ws2"] | {"prefill_ms": slowest["prefill_ms"],
                                           "decode_tokens_per_s": None if None in rates else min(rates)}
    return {
        "prefill_ms": {k: v["prefill_ms"] for k, v in runs.items()},
        "decode_tokens_per_s": {k: v["decode_tokens_per_s"] for k, v in runs.items()},
        "cache_bytes_per_rank": {k: v["cache_bytes_per_rank"] for k, v in runs.items() if "cache_bytes_per_rank" in v},
        "token_identical": all(v["tokens"] == runs["single"]["tokens"] for v in runs.values()),
    }


def run(s: Settings) -> dict[str, Any]:
    """Every measurement; the dict ``--json`` writes."""
    started = time.perf_counter()
    sections: dict[str, float] = {}

    def timed(name: str, fn: Callable[[Settings], Any]) -> Any:
        t = time.perf_counter()
        value = fn(s)
        sections[name] = time.perf_counter() - t
        return value

    dist_result = timed("distributed", bench_distributed)
    single = timed("single", bench_single)
    ranks = dist_result["ranks"]
    step_ms = {k: max(r["step_ms"][k] for r in ranks) for k in ("fxtp", "dtensor")}
    step_ms |= {"single": single["step_ms"]["plain"], "fxtp_ws1": single["step_ms"]["fxtp_ws1"]}
    result: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "backend": "gloo", "threads_per_rank": 1, "date": datetime.date.today().isoformat()},
        "settings": dataclasses.asdict(s),
        "step_ms": step_ms,
        "new_shape_ms": max(r["new_shape_ms"] for r in ranks),
        "new_shape_steady_ms": max(r["new_shape_steady_ms"] for r in ranks),
        "new_shape": ranks[0]["new_shape"],
        "recaptures": sum(r["recaptures"] for r in ranks),
        "ratio_fxtp_dtensor": step_ms["fxtp"] / step_ms["dtensor"],
        "ratio_ws1_overhead": step_ms["fxtp_ws1"] / step_ms["single"],
        "max_abs_error": {"ws2": ranks[0]["max_abs_error"], "ws1": single["max_abs_error"]},
        "ranks": ranks,
        "collectives": dist_result["collectives"],
        "generation": _generation_result(single["generation"], ranks),
        "activations": ranks[0]["activations"] | {"world_size": 2},
        "compile": timed("compile", bench_compile),
        "param_fraction": timed("memory", bench_memory),
        # FSDP2 per block at dp 2 x tp 2 (4 gloo ranks): peak heap MiB per rank, fxtp vs torchtitan's plan by hand
        # (not in --quick: 4 more ranks and inductor's C++ compiles; tests/test_fsdp_blocks.py asserts the bound)
        "fsdp_blocks_peak": timed("fsdp_blocks", lambda _: bench_fsdp.bench()) if s.full_size else None,
        # torch.compile per block (block.compile(fullgraph=True), inductor), world size 1, 2 and 8 blocks: first
        # forward+backward seconds and graphs compiled, fxtp's and the plain model's (identical blocks compile once)
        "compile_per_block": timed("compile_per_block", lambda _: {str(n): bench_fsdp.compile_seconds(n)
                                                                   for n in (2, 8)}) if s.full_size else None,
        "section_s": sections,
    }
    result["goals"] = goals(result)
    result["wall_s"] = time.perf_counter() - started
    return result


def main(argv: Optional[list[str]] = None) -> int:
    args = get_args_parser().parse_args(argv)
    s = Settings.quick() if args.quick else Settings()
    if args.steps is not None:
        s = dataclasses.replace(s, steps=args.steps)
    try:
        result = run(s)
    except Exception:  # noqa: BLE001 - one message, exit 1
        traceback.print_exc()
        return 1
    print(tables(result))
    print(f"\n{result['machine']['cpus']} CPUs, torch {torch.__version__}, gloo, 1 thread per rank; {result['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, sort_keys=False)
            f.write("\n")
    if args.plot and not plot(result["compile"], args.plot):
        print("--plot: matplotlib is not installed (pip install 'fxtp[bench]'); no plot written", file=sys.stderr)
    if args.plot_activations and not bench_activations.plot(result["activations"], 2, args.plot_activations):
        print("--plot-activations: matplotlib is not installed (pip install 'fxtp[bench]'); no plot written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
