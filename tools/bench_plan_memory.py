"""The planner's predicted peak memory per rank against a run, term by term (issue 32, item 5).

    python tools/bench_plan_memory.py     # 4 gloo ranks: dp 2 x tp 2 and dp 4 x tp 1, each policy

The model: a tiny Llama-style ``LlamaForCausalLM`` from a config (random weights, fp32), hidden
256, MLP 512, 8 query and 4 kv heads, 4 blocks, vocab 512; each dp rank trains on 4 x 128 tokens
with the labels in the call (Hugging Face's loss). The run is what fxtp runs: ``fxtp.compile``
on ``mesh["tp"]`` with the policy, FSDP2's ``fully_shard`` on each block then the root
(``reshard_after_forward=True``, no ``MixedPrecisionPolicy``: fp32 gathers), ``torch.optim.AdamW``.

The instrument is glibc's ``mallinfo2`` sampled every 0.2 ms on a thread
(``shared/tools/heap.py``, not fxtp's code). One warm-up step (FSDP2's lazy state, AdamW's
states), then a measured step whose phases are sampled one by one: forward, backward,
``optimizer.step()`` with ``zero_grad()``. Measured per rank, the largest over the ranks:

* ``params``: the bytes of the rank's parameter shards (``p.to_local()``), counted;
* ``optimizer``: what the warm-up's ``optimizer.step()`` left allocated (AdamW's states);
* ``activations``: allocated after the forward, above the step's entry (the loss is a scalar);
* ``grads``: allocated after the backward, above the step's entry;
* ``peak``: ``params + optimizer +`` the step's sampled peak above its entry (which holds the
  parameters and the optimizer's states).

The prediction (:func:`predict`, in one process) is :func:`fxtp.planner.costs.estimate` of the
same configuration, priced as it runs: ``Workload(..., "adamw", activation_bytes=4,
gather_bytes=4)`` (fp32 activations and gathers), micro-batch 4, no sequence parallelism.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(os.path.dirname(ROOT), "shared", "tools"), "/work/shared/tools"):
    if path not in sys.path:
        sys.path.insert(0, path)

import fxtp  # noqa: E402
from fxtp.planner.calibration import spawn_ranks  # noqa: E402

__all__ = ["CONFIG", "measure", "predict", "bench"]

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=128, use_cache=False)
BATCH, SEQ = 4, 128  # per dp rank


def _model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).train()


def predict(tps: tuple[int, ...] = (2, 1), world: int = 4) -> dict[tuple[int, Optional[str]], dict[str, int]]:
    """The planner's figures per rank for each ``(tp, policy)`` run on ``world`` ranks (bytes):
    the peak's terms (``estimate(...).memory``), each step moment's bytes above the parameters
    and the optimizer's states (``loss``, ``block``, ``step``), the bytes saved after the forward
    (``saved``) and the gradients after the backward (``grads_after``)."""
    from fxtp.planner import HARDWARE
    from fxtp.planner.costs import Choice, Workload, estimate, step_moments
    from fxtp.planner.model import AC_POLICIES, TransformerShape
    from fxtp.planner.params import parameter_shapes, repeated_blocks

    model = _model()
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    shape = TransformerShape.of(model, repeated_blocks(model).fqn)
    shapes = parameter_shapes(model, tps, (ids,), {})
    out = {}
    for tp in tps:
        dp = world // tp
        work = Workload(BATCH * dp, SEQ, True, "adamw", 8, activation_bytes=4, gather_bytes=4)  # fp32, no policy
        for ac in AC_POLICIES:
            choice = Choice(tp, dp, False, ac, BATCH, 1)
            moments = step_moments(choice, shape, shapes[tp], work)
            # after the forward: each block's saved tensors, the final norm's, the loss's saved softmax (fp32)
            saved = (shape.layers * shape.block_activations(BATCH, SEQ, tp, sp=False, ac=ac, e=4)
                     + shape.other_activations(BATCH, SEQ, tp, sp=False, e=4) + 4 * BATCH * SEQ * shape.vocab // tp)
            out[tp, ac] = {**estimate(choice, shape, shapes[tp], HARDWARE["h100"], work).memory, "saved": saved,
                           "grads_after": moments["step"]["grads"], **{k: sum(v.values()) for k, v in moments.items()}}
    return out


def measure(tp: int, ac: Optional[str]) -> dict[str, Any]:
    """On initialized gloo ranks (``dp = world / tp``): the measured terms (bytes, module
    docstring), the largest over the ranks."""
    from heap import Peak, in_use
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dp = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = _model()
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(mesh["dp"].get_local_rank()))
    pm = fxtp.compile(model, tp, (ids,), example_kwargs={"labels": ids}, group=mesh["tp"], dynamic=False,
                      activation_checkpointing=ac)
    del model
    for i in range(CONFIG["num_hidden_layers"]):
        fully_shard(pm.get_submodule(f"model.layers.{i}"), mesh=mesh["dp"], reshard_after_forward=True)
    fully_shard(pm, mesh=mesh["dp"], reshard_after_forward=True)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    gc.collect()
    pm(ids, labels=ids).loss.backward()  # warm-up: FSDP2's lazy state, AdamW's states
    before = in_use()
    opt.step()
    optimizer = in_use() - before
    opt.zero_grad()
    gc.collect()
    dist.barrier()
    base = in_use()
    with Peak() as forward:
        loss = pm(ids, labels=ids).loss
    activations = in_use() - base
    with Peak() as backward:
        loss.backward()
    grads = in_use() - base
    with Peak() as step:
        opt.step()
        opt.zero_grad()
    params = sum(p.to_local().numel() * p.element_size() for p in pm.parameters())
    got = {"params": params, "optimizer": optimizer, "activations": activations, "grads": grads,
           "forward": forward.peak - base, "backward": backward.peak - base, "step": step.peak - base}
    got["peak"] = params + optimizer + max(got["forward"], got["backward"], got["step"])
    del pm, opt, loss
    gc.collect()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, got)
    return {k: max(g[k] for g in gathered) for k in got}


def _all_configs() -> list[list[Any]]:
    return [[tp, ac, measure(tp, ac)] for tp in (2, 1) for ac in (None, "selective", "blocks")]


def bench() -> dict[str, Any]:
    """``{"dp2xtp2 None": {"measured": {...}, "predicted": {...}}, ...}`` on 4 spawned gloo ranks."""
    predicted = predict()
    measured = spawn_ranks(_all_configs, 4, 300)
    return {f"dp{4 // tp}xtp{tp} {ac}": {"measured": m, "predicted": predicted[tp, ac]} for tp, ac, m in measured}


def table(rows: dict[str, Any]) -> str:
    """:func:`bench`'s figures as a markdown table, MiB: measured / predicted."""
    mib = 2**20
    pairs = (("peak", "total"), ("forward", "loss"), ("backward", "block"), ("step", "step"), ("params", "params"),
             ("optimizer", "optimizer"), ("grads", "grads_after"), ("activations", "saved"))
    head = ["mesh", "checkpointing", "peak", "ratio", "forward (loss)", "backward (a block)", "optimizer step",
            "params", "AdamW states", "grads after backward", "activations after forward"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for config, row in rows.items():
        m, p = row["measured"], row["predicted"]
        mesh, ac = config.split()
        cells = [f"{m[a] / mib:.2f} / {p[b] / mib:.2f}" for a, b in pairs]
        cells.insert(1, f"{p['total'] / m['peak']:.3f}")
        lines.append(f"| {mesh} | {ac} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(bench()))
