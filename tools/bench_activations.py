"""Activation memory for ``tools/bench.py``: saved activations per rank, and the logits path's peak.

Run on the bench's gloo ranks (``measure(settings, world_size)``), rank 0's figures reported:

* **Saved activations** (``fxtp.core.activations.measure``: the bytes a forward keeps for backward,
  parameters excluded, a storage once): the single device, fxtp tensor parallel, and fxtp
  tensor + sequence parallel (``sequence_parallel=True``), on torch's reference Transformer.
  Korthikanti et al. 2022 predict ``(10 + 24/t)/34`` of the single device for tensor
  parallelism alone and ``1/t`` with sequence parallelism.
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


def measure(model: nn.Module, ids: torch.Tensor, vocab: int, ws: int) -> dict[str, Any]:
    """Saved activations and logits-path peaks on this rank (see the module docstring);
    ``model`` is not modified."""
    model = copy.deepcopy(model).train()
    ref = copy.deepcopy(model)
    labels = torch.randint(0, ids.max().item() + 1, ids.shape, generator=torch.Generator().manual_seed(2))

    def saved(module: nn.Module) -> int:
        with activations.measure() as result:
            out = module(ids)
        out.float().square().mean().backward()
        return result.total

    figures: dict[str, Any] = {"single": saved(ref)}
    for key, sp in (("tp", False), ("tp_sp", True)):
        figures[key] = saved(fxtp.compile(model, ws, (ids,), sequence_parallel=sp))
    pm = fxtp.compile(model, ws, (ids,))
    with_loss = fxtp.compile(_WithLoss(model), ws, (ids, labels))
    dist.barrier()
    gathered = _peak(lambda: F.cross_entropy(pm(ids).flatten(0, 1), labels.flatten()).backward())
    loss_parallel = _peak(lambda: with_loss(ids, labels).backward())
    return {
        "saved_activation_bytes": figures,
        "saved_fraction": {k: figures[k] / figures["single"] for k in ("tp", "tp_sp")},
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
    saved, peaks = result["saved_activation_bytes"], result["logits_peak_bytes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    labels = ["single device", f"tp (ws {ws})", f"tp + sp (ws {ws})"]
    bars = left.bar(labels, [saved[k] / mib for k in ("single", "tp", "tp_sp")], color=["grey", "tab:blue", "tab:green"])
    left.bar_label(bars, fmt="%.2f")
    left.set_ylabel("MiB per rank")
    left.set_title("activations saved for backward")
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
