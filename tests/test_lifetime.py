"""One compile for the model's whole life: other batch sizes and sequence lengths, train and
eval switched both ways, no_grad / inference_mode, and random ops on sharded values, on real
gloo process groups at world sizes 2 and 4 against the single-device model.
"""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _helpers import compare_shapes, graph_code, loss_of, no_capture
from cases import build_case
from torch import nn

import fxtp
from fxtp.cli import examples
from fxtp.core.placement import shard_tensor
from fxtp.runtime.sharded import local_tensor


def _ids(batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed)),)


# (batch, seq) after compiling on the example's (2, 16): smaller, larger batch, shorter sequence, mixed.
SHAPES = [(3, 8), (5, 16), (2, 4), (4, 12)]


def _shapes(name: str, vocab: int = 128, **kwargs):
    model, example = getattr(examples, name)()
    calls = [_ids(b, t, vocab, seed=i) for i, (b, t) in enumerate(SHAPES)]
    return compare_shapes(model, example, calls, **kwargs)


@pytest.mark.parametrize("name,vocab", [("tiny_gpt", 128), ("transformer", 64)])
def test_one_compile_runs_every_batch_and_sequence_length(pool, name, vocab):
    (r, *_) = pool.run(_shapes, name, vocab)
    assert r["shapes"] == [[(b, t, vocab)] for b, t in SHAPES]
    (ids,) = r["report"]["inputs"]
    assert [d.get("symbol") is not None for d in ids["dims"]] == [True, True]  # batch and sequence dynamic


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hugging_face_models_at_every_shape(pool, name):
    pytest.importorskip("transformers")
    (r, *_) = pool.run(_shapes, name)
    assert len(r["shapes"]) == len(SHAPES)


def _reference_with_dropout(p: float = 0.1):
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(0)
    return Transformer(ModelArgs(n_layers=2, vocab_size=64, max_seq_len=16, dim=32, n_heads=4, dropout_p=p))


def _same_draws(pm, ref, ids, rank: int, ws: int):
    """pm(ids) and ref(ids) from one generator state: outputs and gradients."""
    state = torch.get_rng_state()
    out = pm(ids)
    torch.set_rng_state(state)
    ref_out = ref(ids)
    torch.testing.assert_close(out, ref_out)
    loss_of(out).backward()
    loss_of(ref_out).backward()
    for fqn, p in pm.named_parameters():
        torch.testing.assert_close(local_tensor(p.grad), shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], rank, ws))
        p.grad = None
    ref.zero_grad()
    return out


def _modes(compiled_in: str):
    """torch's reference Transformer with dropout 0.1 (embedding, attention's dropout_p,
    residuals), compiled in one mode and switched both ways, at two shapes."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _reference_with_dropout()
    model.train(compiled_in == "train")
    ref = copy.deepcopy(model)
    torch.manual_seed(100 + rank)  # different on every rank: fxtp.compile syncs the generators
    pm = fxtp.compile(model, ws, _ids(2, 16, 64, 1))
    other = "eval" if compiled_in == "train" else "train"
    assert pm.report.modes[other].startswith("captured at the first switch")
    modes = []
    for i, mode in enumerate([other, compiled_in, other]):
        with contextlib.nullcontext() if i == 0 else no_capture():  # the first switch captures, later ones nothing
            pm.train(mode == "train")
            ref.train(mode == "train")
            for shape in ((2, 16), (3, 8)):
                out = _same_draws(pm, ref, _ids(*shape, 64, 2)[0], rank, ws)
                gathered = [torch.empty_like(out) for _ in range(ws)]
                dist.all_gather(gathered, out)
                assert all(torch.equal(g, out) for g in gathered), "replicated output differs across ranks"
        modes.append(pm.mode)
    with no_capture():
        eval_ids = _ids(4, 12, 64, 3)[0]
        pm.eval()
        ref.eval()
        with torch.no_grad():
            torch.testing.assert_close(pm(eval_ids), ref(eval_ids))
        with torch.inference_mode():
            torch.testing.assert_close(pm(eval_ids), ref(eval_ids))
    train_off = pm.train()(eval_ids)  # dropout on: not the eval output
    return modes, pm.report.to_dict(), bool((train_off - ref(eval_ids)).abs().max() > 1e-3)


@pytest.mark.parametrize("compiled_in", ["train", "eval"])
def test_train_and_eval_switch_both_ways(pool, compiled_in):
    for modes, report, differs in pool.run(_modes, compiled_in):
        assert modes == (["eval", "train", "eval"] if compiled_in == "train" else ["train", "eval", "train"])
        assert set(report["modes"]) == {"train", "eval"}
        assert differs
        notes = [n for n in report["notes"] if n["code"] == "dropout-on-shard"]
        if compiled_in == "train":  # attention dropout on sharded heads: one global mask
            assert any("scaled_dot_product_attention" in n["node"] for n in notes)


def _sdpa_dropout():
    """Case 17: SDPA dropout_p=0.25 on sharded heads equals the same-seed single device."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model, (x,) = build_case("17-sdpa-dropout")
    ref = copy.deepcopy(model)
    pm = fxtp.compile(model, ws, (x,))
    outs = []
    with no_capture():
        for shape in ((2, 8), (3, 5)):
            x = torch.randn(*shape, 64, generator=torch.Generator().manual_seed(shape[0]))
            outs.append(_same_draws(pm, ref, x, rank, ws))
    # Dropout really happened: another draw gives another output.
    again = pm(x)
    report = pm.report.to_dict()
    return report["plan"] if "plan" in report else pm.plan, report["notes"], graph_code(pm), bool((again - outs[-1]).abs().max() > 1e-3)


def test_case17_attention_dropout_one_global_mask(pool):
    for plan, notes, code, redraws in pool.run(_sdpa_dropout):
        assert plan == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
        assert "sharded_attention(" in code and "aten.scaled_dot_product_attention" not in code
        assert [n["code"] for n in notes if n["code"] != "other-params"] == ["dropout-on-shard"]
        assert redraws


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_attention_is_sdpa_bitwise(autocast, dtype):
    """Each rank's heads of ``rng.sharded_attention`` (its slice of one global mask), put together,
    are ATen's SDPA with dropout, bitwise, forward and backward; under bf16 autocast too, where
    ATen casts the inputs to bf16 and then runs its math form in float32 (the form run in bf16
    rounded otherwise: the fuzz regression sp-autocast-dropout-strided). No ranks: every rank's
    call is made here in turn, from the same generator state."""
    from fxtp.core.rng import sharded_attention

    gen = torch.Generator().manual_seed(3)
    for ws, causal, mask in ((2, False, False), (3, True, False), (2, False, True), (1, False, False)):
        q, k, v = (torch.randn(2, 6, 5, 4, generator=gen, dtype=dtype).requires_grad_() for _ in range(3))
        bias = torch.randn(5, 5, generator=gen, dtype=dtype) if mask else None
        cotangent = torch.randn(2, 6, 5, 4, generator=gen, dtype=dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            torch.manual_seed(7)
            want = F.scaled_dot_product_attention(q, k, v, bias, dropout_p=0.3, is_causal=causal)
            parts = []
            for rank in range(ws):
                heads = slice(rank * 6 // ws, (rank + 1) * 6 // ws)
                torch.manual_seed(7)
                parts.append(sharded_attention(1, (6,), rank, ws, q[:, heads], k[:, heads], v[:, heads], bias,
                                               0.3, causal))
        got = torch.cat(parts, 1)
        assert got.dtype == want.dtype and torch.equal(got, want), (ws, causal, mask)
        want_grads = torch.autograd.grad(want, (q, k, v), cotangent.to(want.dtype))
        got_grads = torch.autograd.grad(got, (q, k, v), cotangent.to(got.dtype))
        for a, b in zip(got_grads, want_grads):
            assert torch.equal(a, b), (ws, causal, mask)


class RandomOps(nn.Module):
    """F.dropout, bernoulli and rand_like on a sharded hidden value; a replicated dropout too."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        h = torch.tanh(self.up(x))
        h = F.dropout(h, 0.2, training=True) * torch.bernoulli(torch.sigmoid(h)) + 0.1 * torch.rand_like(h)
        return F.dropout(self.down(h), 0.3, training=True)


def _random_ops():
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = RandomOps()
    ref = copy.deepcopy(model)
    pm = fxtp.compile(model, ws, (torch.randn(2, 8, 16),))
    out = _same_draws(pm, ref, torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1)), rank, ws)
    gathered = [torch.empty_like(out) for _ in range(ws)]
    dist.all_gather(gathered, out)
    return pm.plan, [n["code"] for n in pm.report.to_dict()["notes"]], all(torch.equal(g, out) for g in gathered)


def test_random_ops_on_sharded_values_draw_one_global_mask(pool):
    for plan, notes, same in pool.run(_random_ops):
        assert plan == {"up": "colwise", "down": "rowwise"}
        assert notes.count("dropout-on-shard") == 3  # dropout, bernoulli, rand_like on the shard
        assert same


def _reseeded_per_rank():
    """Case 10's model in train mode: a per-rank reseed after compile is refused, not silent."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model, (x,) = build_case("10-dropout-eval")
    pm = fxtp.compile(model.train(), ws, (x,), dynamic=False)  # one input shape
    pm(x)  # in step since compile
    torch.manual_seed(1000 + rank)  # a data-parallel habit: every rank another seed
    try:
        pm(x)
        refused = None
    except fxtp.FxtpRuntimeError as exc:
        refused = str(exc)
    torch.manual_seed(1000)  # alike on every rank: runs again, replicas bitwise equal
    out = pm(x)
    gathered = [torch.empty_like(out) for _ in range(ws)]
    dist.all_gather(gathered, out)
    pm.eval()
    torch.manual_seed(rank)  # eval draws nothing: no check, no error
    pm(x)
    return refused, all(torch.equal(g, out) for g in gathered)


def _only_sharded_random_ops():
    """Case 17: the only random op is SDPA's dropout on sharded heads, which the rank graph runs
    as fxtp's own call; compile must still put generators seeded per rank in step."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model, (x,) = build_case("17-sdpa-dropout")
    ref = copy.deepcopy(model)
    torch.manual_seed(100 + rank)  # different on every rank before compile
    pm = fxtp.compile(model, ws, (x,), dynamic=False)  # one input shape
    out = _same_draws(pm, ref, x, rank, ws)  # raises if the generators were left out of step
    gathered = [torch.empty_like(out) for _ in range(ws)]
    dist.all_gather(gathered, out)
    return all(torch.equal(g, out) for g in gathered)


def test_compile_syncs_generators_when_only_sharded_ops_draw(pool):
    assert all(pool.run(_only_sharded_random_ops))


def test_generators_out_of_step_are_refused(pool):
    for refused, same in pool.run(_reseeded_per_rank):
        assert refused is not None and "random generators are out of step" in refused and "torch.manual_seed(seed)" in refused
        assert same


# --- in process: what the capture allows, and what it specializes -------------------------


class RegroupHeads(nn.Module):
    """A view that groups the sharded features with the sequence dim: (B, T, 64) -> (B, 4T, 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.up(x).reshape(b, 4 * t, 16).relu().reshape(b, t, 64)
        return self.down(h)


def test_a_plan_that_reads_a_dynamic_size_specializes_it():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    report = fxtp.analyze(RegroupHeads(), 2, (x,))
    assert report.plan == {"up": "colwise", "down": "rowwise"}
    (spec,) = report.inputs
    assert spec.dims[0].dynamic and not spec.dims[1].dynamic and spec.dims[1].size == 8  # T specialized, B not
    assert any(note.startswith("x dim 1 (s") and "specialized to 8: the plan depends on its size" in note for note in report.shape_notes)
    assert "specialized to 8" in str(report)


def test_dynamic_shapes_pass_through_and_fall_back_to_suggested_fixes():
    from torch.export import Dim

    model, (ids,) = examples.transformer()
    pm = fxtp.compile(model, 1, (ids,), dynamic_shapes={"tokens": {0: Dim("batch", min=1), 1: Dim("seq", min=1)}})
    # The model asserts seq <= 16 (and its attention needs seq >= 2): torch's suggested fixes apply.
    assert any("suggested fixes" in note for note in pm.report.shape_notes)
    batch, seq = pm.report.inputs[0].dims
    assert (batch.lo, batch.hi) == (1, None) and seq.hi == 16
    one = torch.randint(0, 64, (1, 9))
    torch.testing.assert_close(pm(one), model(one))
    with pytest.raises(fxtp.FxtpInputError, match=r"input 'tokens' dim 1 is 17, outside the range \[\d+, 16\]"):
        pm(torch.randint(0, 64, (2, 17)))


def test_dynamic_false_specializes_every_dim():
    model, (ids,) = examples.tiny_gpt()
    report = fxtp.analyze(model, 2, (ids,), dynamic=False)
    assert [d.size for d in report.inputs[0].dims] == [2, 16]
    assert report.to_dict()["inputs"][0]["dims"] == [{"size": 2}, {"size": 16}]


def test_dims_that_share_a_symbol_must_agree():
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, mask):
            return self.fc(x) * mask

    torch.manual_seed(0)
    model = Gate()
    pm = fxtp.compile(model, 1, (torch.randn(2, 5, 8), torch.ones(2, 5, 1)))
    x, mask = torch.randn(3, 7, 8), torch.ones(3, 7, 1)
    torch.testing.assert_close(pm(x, mask), model(x, mask))
    with pytest.raises(fxtp.FxtpInputError, match=r"input 'mask' dim 0 is 4 but must equal input 'x' dim 0 \(3\)"):
        pm(x, torch.ones(4, 7, 1))



_FREED = """
import datetime, os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn


def run(rank, path):
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    import fxtp  # its runtime loads on first use, after init_process_group, as in a torchrun script
    torch.manual_seed(0)
    pm = fxtp.compile(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), 2, (torch.randn(2, 8),))
    pm(torch.randn(2, 8)).sum().backward()
    from torch.distributed.nn import functional
    held = [name for name, fn in vars(functional).items() if isinstance(getattr(fn, "__defaults__", None), tuple)
            and any(isinstance(d, dist.ProcessGroup) for d in fn.__defaults__)]
    assert not held, held
    dist.destroy_process_group()  # pm still alive, as at the end of a script
    threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    assert not [t for t in threads if "gloo" in t], threads


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=2)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process's threads from Linux's /proc")
def test_destroy_process_group_frees_the_group_fxtp_ran_on(tmp_path):
    """Two fresh ranks, as a torchrun script runs them: after ``destroy_process_group()``, with
    ``pm`` still alive, nothing holds the group and none of gloo's threads is left. Two holders
    kept it, and 2 of about 130 runs of the README's quickstart aborted at exit ("terminate
    called without an active exception"): ``pm``'s capture of its other mode held the group
    itself (now its name, NOTE: [group by name]), and fxtp's runtime, loaded after
    ``init_process_group``, imports ``torch._dynamo`` and with it ``torch.distributed.nn.functional``,
    whose argument defaults bind the group (NOTE: [world defaults])."""
    script = tmp_path / "freed.py"
    script.write_text(_FREED)
    subprocess.run([sys.executable, str(script), str(tmp_path / "store")], check=True, timeout=180)
