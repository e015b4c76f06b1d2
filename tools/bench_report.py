"""What ``tools/bench.py`` prints: the tables, the goals it checks, the compile-time plot."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

__all__ = ["goals", "plot", "tables"]


def _kinds(counts: dict[str, int], nbytes: dict[str, int]) -> str:
    return ", ".join(f"{n} {k} ({nbytes.get(k, 0) / 1024:.1f} KiB)" for k, n in sorted(counts.items())) or "none"


def _floor_text(floor: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in floor.items()) or "none"


def tables(result: dict[str, Any]) -> str:
    """The printed tables for a result dict (as written by ``--json``)."""
    parts = []
    ms = result["step_ms"]
    rows = [
        ("fxtp, world_size 2", f"{ms['fxtp']:.2f}", "; ".join(f"{r['step_ms']['fxtp']:.2f}" for r in result["ranks"])),
        ("DTensor parallelize_module, world_size 2", f"{ms['dtensor']:.2f}", "; ".join(f"{r['step_ms']['dtensor']:.2f}" for r in result["ranks"])),
        ("fxtp, world_size 1", f"{ms['fxtp_ws1']:.2f}", "-"),
        ("plain model", f"{ms['single']:.2f}", "-"),
    ]
    parts.append("Step time (forward + backward + SGD), median ms\n" + tabulate(rows, headers=("", "ms (slowest rank)", "per rank"), tablefmt="github"))
    parts.append(
        f"fxtp / DTensor: {result['ratio_fxtp_dtensor']:.3f} (goal <= 0.75)   "
        f"fxtp ws1 / plain: {result['ratio_ws1_overhead']:.3f} (goal <= 1.05)"
    )
    parts.append(
        f"New shape {tuple(result['new_shape'])} (compiled at ({result['settings']['batch']}, {result['settings']['seq']})): "
        f"first step {result['new_shape_ms']:.2f} ms, steady {result['new_shape_steady_ms']:.2f} ms, "
        f"recaptures {result['recaptures']}"
    )
    g = result["generation"]
    rate = g["decode_tokens_per_s"]
    rows = [(k, f"{g['prefill_ms'][k]:.2f}", "-" if rate[k] is None else f"{rate[k]:.1f}", g["cache_bytes_per_rank"].get(k, "-"))
            for k in g["prefill_ms"]]
    parts.append(
        f"generate (greedy, prompt (1, {result['settings']['seq']}), +{result['settings']['new_tokens']} tokens; token-identical: "
        f"{'yes' if g['token_identical'] else 'NO'})\n"
        + tabulate(rows, headers=("", "prefill ms", "decode tokens/s", "KV cache bytes per rank"), tablefmt="github")
    )
    rows = []
    for name, c in result["collectives"].items():
        if "error" in c:
            rows.append((name, "error", c["error"][:80], "", ""))
            continue
        floor = c.get("floor")
        rows.append((
            name,
            _kinds(c["forward"], c["bytes"]["forward"]),
            _kinds(c["backward"], c["bytes"]["backward"]),
            f"{_floor_text(floor['forward'])} / {_floor_text(floor['backward'])}" if floor else "-",
            {True: "yes", False: "NO", None: "-"}[c["floor_ok"]],
        ))
    parts.append("Collectives per step at world_size 2 (runtime counts)\n" + tabulate(rows, headers=("model", "forward", "backward", "floor fwd / bwd", "at floor"), tablefmt="github"))
    rows = []
    for layers, t in result["compile"].items():
        frac = t["passes_s"] / t["capture_s"]
        rows.append((layers, f"{t['capture_s']:.2f}", f"{t['passes_s']:.3f}", f"{frac:.1%}", f"{t.get('rewrite_s', float('nan')):.3f}"))
    parts.append("Compile time, Llama shapes on meta, world_size 2 (s)\n" + tabulate(rows, headers=("layers", "capture", "passes", "passes / capture", "rewrite"), tablefmt="github"))
    wss = sorted({ws for m in result["param_fraction"].values() for ws in m if ws.isdigit()}, key=int)
    rows = []
    for name, m in result["param_fraction"].items():
        if "error" in m:
            rows.append((name, m["error"][:60], *[""] * len(wss)))
        else:
            rows.append((name, f"{m['total_bytes'] / 2**20:.1f}", *[f"{m[ws]:.1%}" for ws in wss]))
    parts.append("Parameter bytes per rank / whole model\n" + tabulate(rows, headers=("model", "MiB", *[f"ws {ws}" for ws in wss]), tablefmt="github"))
    a = result["activations"]
    allocated, saved, peaks = a["allocated_bytes"], a["saved_activation_bytes"], a["logits_peak_bytes"]
    names = {"single": "single device", "single_ac": "single device, blocks checkpointed", "tp": "fxtp tensor parallel",
             "tp_sp": "fxtp tensor + sequence parallel", "tp_sp_ac": "fxtp tp + sp + activation_checkpointing='blocks'"}
    base = {"single": "single", "single_ac": "single_ac", "tp": "single", "tp_sp": "single", "tp_sp_ac": "single_ac"}
    rows = [(names[k], allocated[k], f"{allocated[k] / allocated[base[k]]:.3f} of {base[k]}", saved[k], f"{saved[k] / allocated[k]:.3f}")
            for k in names]
    parts.append(f"Activations after the forward, rank 0 of {a['world_size']} (reference Transformer, "
                 f"batch {result['settings']['batch']}, seq {result['settings']['seq']})\n"
                 + tabulate(rows, headers=("", "allocator bytes", "fraction", "fxtp counter", "counter / allocator"),
                            tablefmt="github"))
    parts.append(f"Loss step peak, rank 0 (fp32 logits {a['logits_bytes']} bytes): logits all_gathered {peaks['gathered']} bytes, "
                 f"loss parallel {peaks['loss_parallel']} bytes (head {a['head_with_loss']})")
    parts.append("Goals\n" + tabulate([(g, v, "met" if ok else "MISSED") for g, v, ok in result["goals"]], headers=("goal", "value", ""), tablefmt="github"))
    return "\n\n".join(parts)


def goals(result: dict[str, Any]) -> list[tuple[str, str, bool]]:
    out = [
        ("no recapture at a new shape", str(result["recaptures"]), result["recaptures"] == 0),
        ("fxtp / DTensor step time <= 0.75", f"{result['ratio_fxtp_dtensor']:.3f}", result["ratio_fxtp_dtensor"] <= 0.75),
        ("fxtp ws1 / plain step time <= 1.05", f"{result['ratio_ws1_overhead']:.3f}", result["ratio_ws1_overhead"] <= 1.05),
    ]
    for name, c in result["collectives"].items():
        if c.get("floor_ok") is not None:
            out.append((f"{name}: collectives at the Megatron floor", "yes" if c["floor_ok"] else "no", c["floor_ok"]))
        elif "error" in c:
            out.append((f"{name}: collectives at the Megatron floor", "error", False))
    a = result["activations"]
    frac, ws = a["allocated_fraction"]["tp_sp"], a["world_size"]
    out.append((f"allocator: activations with sequence parallelism <= 1/{ws} + 0.05", f"{frac:.3f}", frac <= 1 / ws + 0.05))
    ac = a["allocated_fraction"]["tp_sp_ac"] * ws
    out.append((f"allocator: tp + sp + ac <= checkpointed single device / {ws} + 10%", f"{ac:.3f}", ac <= 1.10))
    worst = max(abs(r - 1) for k, r in a["counter_vs_allocator"].items() if k != "single_ac")
    out.append(("fxtp's counter within 2% of the allocator", f"{worst:.1%}", worst <= 0.02))
    peaks = a["logits_peak_bytes"]
    out.append(("loss parallel peak < logits-gathered peak", f"{peaks['loss_parallel']} < {peaks['gathered']}",
                peaks["loss_parallel"] < peaks["gathered"]))
    comp = result["compile"]
    for layers, t in comp.items():
        out.append((f"{layers} layers: passes <= 20% of capture", f"{t['passes_s'] / t['capture_s']:.1%}", t["passes_s"] <= 0.2 * t["capture_s"]))
    if "32" in comp:
        out.append(("32 layers: passes <= 1 s", f"{comp['32']['passes_s']:.3f} s", comp["32"]["passes_s"] <= 1.0))
    if "32" in comp and "8" in comp:
        r = comp["32"]["passes_s"] / comp["8"]["passes_s"]
        out.append(("passes(32 layers) <= 4.5 x passes(8 layers)", f"{r:.2f}x", r <= 4.5))
    return out


def plot(compile_result: dict[str, Any], path: str) -> bool:
    """Pass time against layers as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    layers = sorted(int(k) for k in compile_result)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for key, label in (("passes_s", "fxtp passes (normalize, plan, report)"), ("rewrite_s", "fxtp rewrite (one rank)")):
        ax.plot(layers, [compile_result[str(n)][key] for n in layers], marker="o", label=label)
    ax.set_xlabel("layers (Llama shapes: hidden 4096, 32 heads, vocab 32000)")
    ax.set_ylabel("seconds")
    ax.set_title("fxtp pass time, world_size 2, meta device")
    ax.set_xticks(layers)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True

