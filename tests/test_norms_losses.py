"""Issue 23, items 3-5: norms over a sharded dim, metadata reads of uneven shards, the
vocab-parallel cross entropy's options and relative-position tables sharded by heads.

Published configs are analyzed on ``meta`` at world_size 8 with ``num_hidden_layers`` cut to 2
(the per-rank fraction and the counts are per block); tiny versions (hidden 64, one block,
sequence 12) run on real gloo ranks against the single-device model: outputs, every gradient,
one SGD step (``compare_training``), at world size 2 and at 3 where uneven heads are the point
(:data:`_MODELS`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _helpers import compare_training, megatron_floor
from torch import nn

import fxtp
from fxtp.cli import examples

transformers = pytest.importorskip("transformers")

SEQ = 12  # divides 2, 3 and 4: sequence parallelism shards it

# Published sizes (the models' config.json on the Hugging Face Hub), num_hidden_layers cut to 2:
# the per-rank fraction is per block and embeddings, and the counts are per block.
OLMO2_7B = dict(vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-6)
BERT_LARGE = dict(vocab_size=30522, hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                  max_position_embeddings=512, type_vocab_size=2)


def _meta_report(make, config) -> dict:
    with torch.device("meta"):
        model = make(config).eval()
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    return fxtp.analyze(model, 8, (ids,)).to_dict()


def _count(report: dict, phase: str) -> tuple[int, int]:
    (stat,) = [c for c in report["collectives"] if c["phase"] == phase and c["kind"] == "all_reduce"]
    return stat["count"], stat["bytes"]


def test_published_configs_at_world_size_8():
    """OLMo-2-7B keeps q_proj/k_proj colwise (their RMSNorm over all heads is a distributed norm:
    one all_reduce of fp32 (1, 16, 1) each way per norm); BERT-large's uneven vocabulary (30522 at
    8) is vocab-parallel (the ``getattr(weight, 'device')`` read no longer blocks it). Both keep at
    most 1/8 + 0.03 of the bytes per rank, at Megatron's collective floor (+ the norms' payloads)."""
    olmo = _meta_report(transformers.Olmo2ForCausalLM, transformers.Olmo2Config(**OLMO2_7B, num_hidden_layers=2, use_cache=False))
    bert = _meta_report(transformers.BertModel, transformers.BertConfig(**BERT_LARGE, num_hidden_layers=2))
    for report in (olmo, bert):
        assert report["param_bytes"]["per_rank"] <= (1 / 8 + 0.03) * report["param_bytes"]["total"]
        styles = {row["name"]: row["style"] for row in report["layers"]}
        for i in range(2):
            prefix = f"model.layers.{i}.self_attn." if report is olmo else f"encoder.layer.{i}.attention.self."
            names = ("q_proj", "k_proj", "v_proj") if report is olmo else ("query", "key", "value")
            assert all(styles[prefix + name] == "colwise" for name in names)
    assert {row["name"]: row["style"] for row in bert["layers"]}["embeddings.word_embeddings"] == "rowwise"
    floor_fwd, floor_bwd = megatron_floor(olmo, 2)
    norms = 2 * 2  # q_norm and k_norm per block
    hidden = 4 * 16 * 4096  # fp32 (1, 16, 4096)
    assert _count(olmo, "forward") == (floor_fwd["all_reduce"] + norms, (2 * 2 + 1) * hidden + norms * 4 * 16)
    assert _count(olmo, "backward") == (floor_bwd["all_reduce"] + norms, (2 * 2 + 1) * hidden + norms * 4 * 16)
    assert _count(bert, "forward")[0] == megatron_floor(bert, 2)[0]["all_reduce"]


class _Losses(nn.Module):
    """One head of 11 classes (uneven at 2, 3, 4) into the ``cross_entropy`` variants of
    :data:`_LOSSES`, one loss each; ``weighted`` ones use a buffer of class weights."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 11)
        self.register_buffer("class_weight", torch.rand(11) + 0.5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = self.head(x)
        losses = []
        for options in _LOSSES.values():
            options = dict(options)
            weight = self.class_weight if options.pop("weighted", False) else None
            losses.append(F.cross_entropy(logits, labels.masked_fill(labels == 0, options.get("ignore_index", -100)),
                                          weight=weight, **options))
        return tuple(losses)


_LOSSES = {
    "smoothing": dict(label_smoothing=0.1),
    "weighted": dict(weighted=True),
    "weighted-smoothing-ignore": dict(weighted=True, label_smoothing=0.2, ignore_index=3),
    "sum-smoothing": dict(reduction="sum", label_smoothing=0.1),
    "none-weighted-smoothing": dict(reduction="none", weighted=True, label_smoothing=0.1),
}


def _losses():
    torch.manual_seed(0)
    labels = torch.randint(0, 11, (8,))
    labels[:2] = 0  # ignored in every variant (class 0 becomes its ignore_index)
    return _Losses(), (torch.randn(8, 16), labels)


def _olmo2():
    config = transformers.Olmo2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                                      use_cache=False, pad_token_id=None, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    return transformers.Olmo2ForCausalLM(config).eval(), (torch.randint(0, 128, (2, SEQ)),)


class _T5(nn.Module):
    """``T5Model`` with the encoder's ids as the decoder's too; returns the decoder's states."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.T5Config(vocab_size=128, d_model=64, d_ff=128, num_layers=1, num_heads=4, d_kv=16,
                                       dropout_rate=0.0, use_cache=False)
        self.t5 = transformers.T5Model(config).eval()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.t5(input_ids=ids, decoder_input_ids=ids).last_hidden_state


def _t5():
    torch.manual_seed(0)
    return _T5(), (torch.randint(0, 128, (2, SEQ)),)


def _bert_uneven_vocab():
    model, (ids,) = examples.bert(vocab_size=131, num_hidden_layers=1)
    return model, (ids[:, :SEQ],)


def _summary(result: dict) -> dict:
    layers = {row["name"]: row for row in result["report"]["layers"]}
    return {"styles": {name: row["style"] for name, row in layers.items()}, "forward": result["forward"],
            "backward": result["backward"], "report": result["report"], "shapes": result["local_shapes"]}


# What each world size adds: 2 runs every model (the losses' 11 classes and BERT's 131 rows are
# uneven there already) and OLMo-2 under sequence parallelism; 3 splits the 4 heads unevenly
# (OLMo-2's distributed q/k norm, T5's bias by heads), the classes 4/4/3 and BERT's rows
# 44/44/43; 4 splits the heads one a rank, the classes 3/3/3/2 and BERT's rows 33/33/33/32.
# Issue 23 asks each family at ws 2, 3 and 4; T5's bias by heads is not one of its families.
_MODELS = {2: ("losses", "olmo2", "olmo2-sp", "bert", "t5"), 3: ("losses", "olmo2", "bert", "t5"), 4: ("losses", "olmo2", "bert")}


def _exact(names: tuple[str, ...]) -> dict:
    """The models ``names`` against the single device on this rank (one ``pool.run``): outputs,
    every gradient, 3 SGD steps (issue 23). Static shapes (``dynamic=False``): a dynamic capture
    of these models costs minutes here and is not what these tests are about."""
    static = {"dynamic": False}
    make = {"losses": (_losses, {}), "olmo2": (_olmo2, static), "olmo2-sp": (_olmo2, {**static, "sequence_parallel": True}),
            "bert": (_bert_uneven_vocab, static), "t5": (_t5, static)}
    return {name: _summary(compare_training(*make[name][0](), **make[name][1])) for name in names}


@pytest.mark.parametrize("ws", sorted(_MODELS), ids=lambda ws: f"ws{ws}")
def test_exact_on_ranks(ws, rank_pools):
    """See :data:`_MODELS` for which models run at which world size."""
    results = rank_pools(ws).run(_exact, _MODELS[ws])
    r = results[0]
    if "losses" in r:  # vocab-parallel: the head stays colwise, 3 all_reduce per loss, no logits gather
        assert r["losses"]["styles"] == {"head": "colwise"} and r["losses"]["forward"] == {"all_reduce": 3 * len(_LOSSES)}
    if "olmo2" in r:
        olmo = r["olmo2"]
        assert all(style == "colwise" for name, style in olmo["styles"].items() if name.endswith(("q_proj", "k_proj")))
        floor_fwd, floor_bwd = megatron_floor(olmo["report"], 1)
        assert olmo["forward"] == {**floor_fwd, "all_reduce": floor_fwd["all_reduce"] + 2}  # + q_norm, k_norm
        assert olmo["backward"] == {"all_reduce": floor_bwd["all_reduce"] + 2}
    if "olmo2-sp" in r:  # the norms' statistics stay all_reduces under sequence parallelism
        assert r["olmo2-sp"]["styles"] == r["olmo2"]["styles"]
    if "bert" in r:
        bert = r["bert"]
        assert bert["styles"]["embeddings.word_embeddings"] == "rowwise"
        rows = [131 // ws + (rank < 131 % ws) for rank in range(ws)]
        assert [result["bert"]["shapes"]["embeddings.word_embeddings.weight"] for result in results] == [(n, 64) for n in rows]
        assert (bert["forward"], bert["backward"]) == megatron_floor(bert["report"], 1)
    if "t5" in r:
        t5 = r["t5"]
        bias = [name for name in t5["styles"] if name.endswith("relative_attention_bias")]
        assert len(bias) == 2 and all(t5["styles"][name] == "colwise" for name in bias)  # by heads, no all_reduce
        heads = [4 // ws + (rank < 4 % ws) for rank in range(ws)]
        assert [result["t5"]["shapes"][bias[0] + ".weight"] for result in results] == [(32, n) for n in heads]
        assert t5["forward"] == {"all_reduce": 2 + 2 + 3}  # 2 lookups, 2 in the encoder block, 3 in the decoder's


class _LossOverPositions(nn.Module):
    """``cross_entropy`` on ``(N, C, d)`` logits: not vocab-parallel (the rejection's fix names the line)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 11)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x).transpose(1, 2), labels)


def test_every_fix_names_something_to_do():
    """NOTE: [actionable fixes]: no fix says "keep the producer replicated" (fxtp does that
    itself); a code change names its source line."""
    import pathlib
    import re

    sources = pathlib.Path(fxtp.__file__).parents[1].joinpath("passes").rglob("*.py")
    vague = [(p.name, m) for p in sources for m in re.findall(r'"keep (?:the|one|those)[^"]*replicated[^"]*"', p.read_text())]
    assert not vague, vague
    report = fxtp.analyze(_LossOverPositions(), 2, (torch.randn(2, 4, 16), torch.randint(0, 11, (2, 4))))
    (head,) = report.layers
    assert (head.style, head.code) == ("replicate", "reduces-sharded-dim")
    assert "flatten the logits" in head.fix and "test_norms_losses.py:" in head.fix, head.fix


def _tiny_llama():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                                      use_cache=False, pad_token_id=None, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _same_or_both_nan(got: torch.Tensor, want: torch.Tensor, what: str, **tol) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, the single device's {want.dtype}"
    torch.testing.assert_close(got, want, equal_nan=True, **tol, msg=lambda m: f"{what}: {m}")


def _grads_match(pm, ref, what: str, **tol) -> None:
    import torch.distributed as dist

    from fxtp.core.placement import shard_tensor
    from fxtp.runtime.sharded import local_tensor

    rank, ws = dist.get_rank(), dist.get_world_size()
    for fqn, p in pm.named_parameters():
        want = shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], rank, ws)
        got = local_tensor(p.grad)
        assert torch.isfinite(got).all(), f"{what}: NaN or inf in the gradient of {fqn}"
        torch.testing.assert_close(got, want, **tol, msg=lambda m, fqn=fqn: f"{what}, gradient of {fqn}: {m}")


def _all_ignored() -> dict:
    """Issue 35, item 4: a micro-batch whose labels are all ``ignore_index``. (1) Every
    ``cross_entropy`` variant of :data:`_LOSSES` (reductions, class weights, label smoothing):
    the same loss (NaN for a mean over nothing) and the single device's exact-zero gradients.
    (2) Hugging Face Llama ``labels=`` under gradient accumulation (a prompt-only micro-batch,
    then a normal one), TP and TP+SP: the same NaN loss, the same finite gradients, the same
    SGD step."""
    import copy

    import torch.distributed as dist

    ws = dist.get_world_size()
    model, (x, _) = _losses()
    ref = copy.deepcopy(model)
    pm = fxtp.compile(model, ws, (x, torch.randint(1, 11, (8,))), dynamic=False)
    ignored = torch.zeros(8, dtype=torch.long)  # class 0 is every variant's ignore_index
    outs, ref_outs = pm(x, ignored), ref(x, ignored)
    for name, got, want in zip(_LOSSES, outs, ref_outs):
        _same_or_both_nan(got, want, f"{name} on all-ignored labels")
    sum(o.sum() for o in outs).backward()
    sum(o.sum() for o in ref_outs).backward()
    _grads_match(pm, ref, "all-ignored labels", atol=0.0, rtol=0.0)  # exact zeros, both
    nan_losses = [name for name, want in zip(_LOSSES, ref_outs) if want.isnan().any()]
    steps = {}
    for sp in (False, True):
        ref = _tiny_llama()
        gen = torch.Generator().manual_seed(1)
        ids = [torch.randint(0, 128, (2, 8), generator=gen) for _ in range(2)]
        labels = [torch.full((2, 8), -100), ids[1].clone()]  # a prompt-only micro-batch, then a normal one
        pm = fxtp.compile(copy.deepcopy(ref), ws, (ids[0],), example_kwargs={"labels": ids[1]}, dynamic=False,
                          sequence_parallel=sp)
        opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(2):
            for i in range(2):  # gradient accumulation over the two micro-batches
                got, want = pm(ids[i], labels=labels[i]).loss, ref(ids[i], labels=labels[i]).loss
                _same_or_both_nan(got, want, f"sp={sp} step {step} micro-batch {i} loss", rtol=1e-4, atol=1e-5)
                got.backward()
                want.backward()
            _grads_match(pm, ref, f"sp={sp} step {step}", rtol=1e-4, atol=1e-5)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        steps[sp] = sum(1 for p in pm.parameters())
    return {"nan_losses": nan_losses, "parameters": steps}


@pytest.mark.parametrize("ws", [2, 4], ids=lambda ws: f"ws{ws}")
def test_all_ignored_labels_give_torchs_nan_loss_and_zero_gradients(ws, rank_pools):
    (result, *_) = rank_pools(ws).run(_all_ignored)
    assert result["nan_losses"] == ["smoothing", "weighted", "weighted-smoothing-ignore"]  # the mean ones
    assert result["parameters"] == {False: 21, True: 21}


class _NanoGPTLoss(nn.Module):
    """nanoGPT's shape: the loss inside ``forward`` (``F.cross_entropy`` of the flattened
    logits), run under the user's autocast."""

    def __init__(self, smoothing: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(96, 32)
        self.fc, self.proj = nn.Linear(32, 64), nn.Linear(64, 32)
        self.lm_head = nn.Linear(32, 96, bias=False)
        self.smoothing = smoothing

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.wte(idx)
        h = h + self.proj(F.gelu(self.fc(h)))
        logits = self.lm_head(h)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1,
                               label_smoothing=self.smoothing)
        return logits, loss


def _autocast_losses() -> dict:
    """Issue 35, item 5: cross entropy under bf16 autocast (fp32 on autocast's cast list) has
    the single device's dtype and value; gradients and an SGD step within bf16 tolerance."""
    import copy

    import torch.distributed as dist

    ws = dist.get_world_size()
    dtypes = {}
    for smoothing in (0.0, 0.1):
        torch.manual_seed(0)
        ref = _NanoGPTLoss(smoothing)
        gen = torch.Generator().manual_seed(2)
        idx, targets = torch.randint(0, 96, (2, 8), generator=gen), torch.randint(0, 96, (2, 8), generator=gen)
        pm = fxtp.compile(copy.deepcopy(ref), ws, (idx, targets), dynamic=False)
        assert pm.plan["lm_head"] == "colwise"  # the loss is vocab-parallel
        for step in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                (logits, loss), (ref_logits, ref_loss) = pm(idx, targets), ref(idx, targets)
            _same_or_both_nan(logits, ref_logits, f"smoothing {smoothing} logits", rtol=2e-2, atol=2e-2)
            # both compute the loss in fp32 from the same bf16 logits (up to bf16 rounding of the matmuls)
            _same_or_both_nan(loss, ref_loss, f"smoothing {smoothing} loss", rtol=1e-3, atol=1e-3)
            dtypes[smoothing] = str(loss.dtype).replace("torch.", "")
            loss.backward()
            ref_loss.backward()
            _grads_match(pm, ref, f"smoothing {smoothing} step {step}", rtol=2e-2, atol=2e-2)
            for module in (pm, ref):
                with torch.no_grad():
                    for p in module.parameters():
                        p -= 0.1 * p.grad
                        p.grad = None
    return dtypes


@pytest.mark.parametrize("ws", [2, 4], ids=lambda ws: f"ws{ws}")
def test_cross_entropy_under_autocast_keeps_the_single_devices_fp32(ws, rank_pools):
    (dtypes, *_) = rank_pools(ws).run(_autocast_losses)
    assert dtypes == {0.0: "float32", 0.1: "float32"}
