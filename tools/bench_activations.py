"""Activation memory for ``tools/bench.py``: saved activations per rank, and the logits path's peak.

Run on the bench's gloo ranks (``measure(settings, world_size)``), rank 0's figures reported:

* **Activations** per setting: the single device (without and with its blocks under
  ``torch.utils.checkpoint``), fxtp tensor parallel, tensor + sequence parallel
  (``sequence_parallel=True``) and both with ``activation_checkpointing="blocks"``, on torch's
  reference Transformer, each measured twice: by the allocator (``allocated_bytes``: the bytes
  still allocated after the forward less the outputs, ``fxtp.runtime.memory`` through
  ``torch.profiler``) and by fxtp's counter (``saved_activation_bytes``:
  ``fxtp.core.activations.measure``, the bytes saved for backward, parameters excluded, a
  storage once). Korthikanti et al. 2022 predict ``(10 + 24/t)/34`` of the single device for
  tensor parallelism alone and ``1/t`` with sequence parallelism.
* **Logits path peak**: the most bytes alive at once (tensors created during the step; weights
  and inputs excluded) while a rank computes the cross entropy of the head's logits, forward and
  backward: logits all_gathered at the model output and the loss computed on them (a loss
  written outside ``fxtp.compile``), against the loss compiled with the model (Megatron-LM's
  vocab-parallel cross entropy: the logits stay sharded).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxtp
from fxtp.core import activations
from fxtp.runtime.memory import allocated_after_forward

__all__ = ["LiveBytes", "measure", "plot"]


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors created while active that are still alive, and their maximum
    (``peak``). A storage counts once, until the last tensor on it is freed (a tensor autograd
    saves lives on: its Python object is kept with it)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, tensors]

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._storages[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key == 0:
                    continue
                entry = self._storages.setdefault(key, [storage.nbytes(), 0])
                if entry[1] == 0:
                    self.live += entry[0]
                    self.peak = max(self.peak, self.live)
                entry[1] += 1
                weakref.finalize(t, self._release, key)
        return out


class _WithLoss(nn.Module):
    """The model and a cross entropy on its logits, compiled together (loss parallel)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(ids)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _peak(step) -> int:
    with LiveBytes() as live:
        step()
    return live.peak


class _Checkpointed(nn.Module):
    """A block run under ``torch.utils.checkpoint``, as a user checkpoints a single-device model."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


_SETTINGS = {"tp": {}, "tp_sp": {"sequence_parallel": True},
             "tp_sp_ac": {"sequence_parallel": True, "activation_checkpointing": "blocks"}}


def measure(model: nn.Module, ids: torch.Tensor, vocab: int, ws: int) -> dict[str, Any]:
    """Activations by the allocator and by fxtp's counter, and logits-path peaks, on this rank
    (see the module docstring); ``model`` is not modified."""
    model = copy.deepcopy(model).train()
    labels = torch.randint(0, ids.max().item() + 1, ids.shape, generator=torch.Generator().manual_seed(2))

    def both(module: nn.Module) -> tuple[int, int]:
        module(ids).float().square().mean().backward()  # lazily made state exists from here on
        with activations.measure() as counted:
            out = module(ids)
        out.float().square().mean().backward()
        allocated = allocated_after_forward(lambda: module(ids), repeat=3)
        allocated.result.float().square().mean().backward()
        return allocated.held, counted.total

    checkpointed = copy.deepcopy(model)
    checkpointed.layers = nn.ModuleList(_Checkpointed(layer) for layer in checkpointed.layers)
    figures = {"single": both(copy.deepcopy(model)), "single_ac": both(checkpointed)}
    for key, kwargs in _SETTINGS.items():
        figures[key] = both(fxtp.compile(model, ws, (ids,), **kwargs))
    pm = fxtp.compile(model, ws, (ids,))
    with_loss = fxtp.compile(_WithLoss(model), ws, (ids, labels))
    dist.barrier()
    gathered = _peak(lambda: F.cross_entropy(pm(ids).flatten(0, 1), labels.flatten()).backward())
    loss_parallel = _peak(lambda: with_loss(ids, labels).backward())
    allocated = {k: a for k, (a, _) in figures.items()}
    counted = {k: c for k, (_, c) in figures.items()}
    return {
        "allocated_bytes": allocated,
        "allocated_fraction": {k: allocated[k] / allocated["single"] for k in ("tp", "tp_sp")}
        | {"tp_sp_ac": allocated["tp_sp_ac"] / allocated["single_ac"]},
        "saved_activation_bytes": counted,
        "saved_fraction": {k: counted[k] / counted["single"] for k in ("tp", "tp_sp")},
        "counter_vs_allocator": {k: counted[k] / allocated[k] for k in ("single", *_SETTINGS)},
        "logits_peak_bytes": {"gathered": gathered, "loss_parallel": loss_parallel},
        "logits_bytes": ids.numel() * vocab * 4,  # fp32 (B, T, V)
        "head_with_loss": with_loss.plan.get("model.output"),
    }


def plot(result: dict[str, Any], ws: int, path: str) -> bool:
    """Saved activations and logits peaks per rank as a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    mib = 2**20
    allocated, saved, peaks = result["allocated_bytes"], result["saved_activation_bytes"], result["logits_peak_bytes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    keys = ("single", "single_ac", "tp", "tp_sp", "tp_sp_ac")
    labels = ["single", "single\n+ ac", f"tp\n(ws {ws})", "tp + sp", "tp + sp\n+ ac"]
    x = range(len(keys))
    bars = left.bar([i - 0.2 for i in x], [allocated[k] / mib for k in keys], width=0.4, label="allocator (torch.profiler)")
    left.bar_label(bars, fmt="%.2f", fontsize=7)
    left.bar([i + 0.2 for i in x], [saved[k] / mib for k in keys], width=0.4, label="fxtp's counter", alpha=0.6)
    left.set_xticks(list(x), labels)
    left.legend(fontsize=8)
    left.set_ylabel("MiB per rank")
    left.set_title("bytes held after the forward (activations)")
    bars = right.bar(["logits gathered", "loss parallel"], [peaks[k] / mib for k in ("gathered", "loss_parallel")],
                     color=["tab:orange", "tab:green"])
    right.bar_label(bars, fmt="%.2f")
    right.set_ylabel("MiB per rank")
    right.set_title("peak of the loss step (fwd + bwd)")
    fig.suptitle("torch's reference Transformer, gloo, rank 0")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
