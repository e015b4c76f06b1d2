"""``fxtp.pipeline`` (issue 33): pipeline stages of fxtp tensor-parallel modules under
``torch.distributed.pipelining``'s schedules, exact against one device on 4 gloo ranks.

A Llama of 6 blocks (hidden 64, 4 heads, 2 kv heads, vocab 128, tied embeddings), a global
batch of 8 sequences of 8 tokens in 4 micro-batches, the cross entropy on the last stage: at
pp 2 x tp 2 and at pp 4, under 1F1B and Interleaved1F1B (2 stages a rank), and the split-backward
(zero-bubble) schedules DualPipeV at pp 2 x tp 2 (stages in a V) and InterleavedZeroBubble at pp 4, the loss, every gradient (the tied embedding's summed across its two stages), the
global norm of ``clip_grad_norm_`` and 3 AdamW steps equal the single device's; the bytes the
ranks send between stages (counted on c10d's ``send`` ops by a dispatch mode, not by fxtp) equal
the report's; the cut puts the embedding with stage 0 and the head with the last. Attention
dropout draws the single device's masks. DCP checkpoints reshard pp 2 x tp 2 <-> tp 4 exactly.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fxtp
from fxtp.core.placement import shard_tensor
from fxtp.runtime.sharded import local_tensor

_IDS = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(1))
_TARGET = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(2))


def _model(dropout: float = 0.0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         attention_dropout=dropout)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


class _Sent(TorchDispatchMode):
    """Bytes of the tensors this rank passes to c10d's ``send`` (pipelining's P2P)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func._opname == "send":
            self.bytes += sum(t.numel() * t.element_size() for t in args[0])
        return func(*args, **(kwargs or {}))


def _run(pp: int, schedule: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    tp = 4 // pp
    mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
    tp_rank = mesh["tp"].get_local_rank()
    ref = _model()
    clock = time.perf_counter()
    pipe = fxtp.pipeline(copy.deepcopy(ref), mesh, (_IDS,), n_microbatches=4, loss_fn=_loss, schedule=schedule,
                         dynamic=False)
    seconds = {"build": time.perf_counter() - clock}
    with pytest.raises(fxtp.FxtpConfigError, match=r"ScheduleZBVZeroBubble cannot run 1 stages a rank; fix: stages_per_rank=2"):
        fxtp.pipeline(ref, mesh, (_IDS,), n_microbatches=4, loss_fn=_loss, schedule="ZBVZeroBubble", stages_per_rank=1)
    with pytest.raises(fxtp.FxtpConfigError, match=r"batch of 8 does not split into 3 equal micro-batches"):
        fxtp.pipeline(ref, mesh, (_IDS,), n_microbatches=3, loss_fn=_loss, schedule=schedule)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    last = len(pipe.report.stages) - 1 in pipe.stage_ids
    checked, sent = 0, []
    for step in range(3):
        losses: list = []
        clock = time.perf_counter()
        with _Sent() as counted:
            pipe.step(_IDS, target=_TARGET, losses=losses)
        seconds[f"step{step}"] = time.perf_counter() - clock
        sent.append(counted.bytes)
        want = _loss(ref(_IDS).logits, _TARGET)
        want.backward()
        if last:
            torch.testing.assert_close(torch.stack(losses).mean(), want, msg=lambda m: f"step {step} loss: {m}")
        for stage in pipe.stages:
            for fqn, p in stage.named_parameters():
                full = ref.get_parameter(fqn).grad
                torch.testing.assert_close(p.grad, shard_tensor(full, stage.placements[fqn], tp_rank, tp),
                                           msg=lambda m: f"step {step} gradient of {fqn}: {m}")
                checked += 1
        norm, ref_norm = pipe.clip_grad_norm_(0.5), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch.testing.assert_close(norm, ref_norm, msg=lambda m: f"step {step} norm: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for stage in pipe.stages:
        for fqn, p in stage.named_parameters():
            torch.testing.assert_close(local_tensor(p.detach()), shard_tensor(ref.get_parameter(fqn).detach(), stage.placements[fqn],
                                                                tp_rank, tp), rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"after 3 steps, {fqn}: {m}")  # Adam's m / sqrt(v) scales rounding up
    total = torch.tensor(sent, dtype=torch.int64)
    dist.all_reduce(total)  # every rank's sends: the pipeline's, over the tp ranks
    return {"seconds": seconds, "report": pipe.report, "text": str(pipe.report), "checked": checked, "sent": total.tolist(),
            "names": sorted(n for s in pipe.stages for n, _ in s.named_parameters())}


@pytest.mark.parametrize("pp,schedule", [(2, "1F1B"), (2, "Interleaved1F1B"), (4, "1F1B"), (4, "Interleaved1F1B"),
                                         (2, "DualPipeV"), (4, "InterleavedZeroBubble")])
def test_pipeline_trains_like_one_device(rank_pools, pp, schedule):
    """Loss, every gradient, the global norm and 3 AdamW steps with clipping equal the single
    device's (asserted on the ranks); every block is on exactly one stage, in order, the
    embedding on stage 0 and the head on the last; the bytes sent between stages equal the
    report's (a send per micro-batch per boundary that crosses ranks, forward and backward)."""
    results = rank_pools(4).run(_run, pp, schedule)
    report = results[0]["report"]
    assert [b for row in report.stages for b in row.blocks] == list(range(6)), report
    assert report.stages[0].embedding and report.stages[-1].head, report
    assert len(report.stages) == pp * (1 if schedule == "1F1B" else 2)
    assert all(r["checked"] > 0 for r in results)
    tp = 4 // pp
    for r in results:
        # the first step also sends the stages' shapes (PipelineStage's metadata handshake)
        assert r["sent"][1:] == [tp * report.sent_bytes_per_step] * 2, (r["sent"], report.sent_bytes_per_step)
        assert r["sent"][0] > r["sent"][1]
    if schedule == "1F1B":
        assert report.bubble == pytest.approx((pp - 1) / (4 + pp - 1))
    if schedule == "InterleavedZeroBubble":  # ZB1P: a third of 1F1B's bubble (Qi et al. 2024 s2.1)
        assert report.bubble == pytest.approx((pp - 1) / (3 * 4 + pp - 1))
    if schedule == "DualPipeV":  # V placement: rank r holds stages r and 2 pp - 1 - r
        assert [r.pp_rank for r in report.stages] == [0, 1, 1, 0], report
    print(results[0]["text"], [r["seconds"] for r in results])


def _run_dropout() -> dict:
    """pp 2 x tp 2, 1F1B, attention dropout 0.1: each stage's ranks draw the single device's
    masks. The reference runs the model's own modules stage by stage, each stage's micro-batches
    in order from the same seed, as each pipeline rank's generator draws them."""
    from torch.distributed.device_mesh import init_device_mesh

    from fxtp.pipelining import StageModule

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    tp_rank = mesh["tp"].get_local_rank()
    ref = _model(dropout=0.1)
    pipe = fxtp.pipeline(copy.deepcopy(ref), mesh, (_IDS,), n_microbatches=4, loss_fn=_loss, dynamic=False)
    torch.manual_seed(7)
    losses: list = []
    pipe.step(_IDS, target=_TARGET, losses=losses)
    hidden = _IDS.chunk(4)
    for s, row in enumerate(pipe.report.stages):
        torch.manual_seed(7)
        stage = StageModule(ref, range(row.blocks[0], row.blocks[-1] + 1), first=s == 0, last=row.head)
        hidden = [stage(h) for h in hidden]
    want = [_loss(logits, t) for logits, t in zip(hidden, _TARGET.chunk(4))]
    torch.stack(want).mean().backward()
    if losses:
        torch.testing.assert_close(torch.stack(losses), torch.stack(want).detach())
    torch.manual_seed(7)
    plain = torch.stack([_loss(logits, t) for logits, t in zip(_eval_free(ref), _TARGET.chunk(4))])
    for stage in pipe.stages:
        for fqn, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, shard_tensor(ref.get_parameter(fqn).grad, stage.placements[fqn], tp_rank, 2),
                                       msg=lambda m: f"gradient of {fqn}: {m}")
    return {"losses": [float(x.detach()) for x in losses], "without_dropout": plain.tolist()}


def _eval_free(model: torch.nn.Module) -> list[torch.Tensor]:
    """The micro-batches' logits with dropout off (to show the masks mattered)."""
    model.eval()
    with torch.no_grad():
        out = [model(ids).logits for ids in _IDS.chunk(4)]
    model.train()
    return out


def test_pipeline_dropout_stays_in_step(rank_pools):
    """With attention dropout, the last stage's micro-batch losses and every gradient equal the
    single device's drawing the same masks (stage by stage, micro-batch by micro-batch); the
    losses differ from dropout-free ones, so masks were drawn."""
    results = rank_pools(4).run(_run_dropout)
    last = [r for r in results if r["losses"]]
    assert len(last) == 2 and last[0]["losses"] == last[1]["losses"]
    assert last[0]["losses"] != pytest.approx(last[0]["without_dropout"], abs=1e-4)


def _run_checkpoint() -> dict:
    """A DCP checkpoint saved at pp 2 x tp 2 (after an SGD step) loads at tp 4, and one saved at tp 4
    (after another step) loads at pp 2 x tp 2, exactly; ``full_state_dict()`` has the model's
    FQNs and values."""
    import shutil
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    where = [tempfile.mkdtemp(prefix="fxtp_pp_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    ref = _model()
    pipe = fxtp.pipeline(copy.deepcopy(ref), mesh, (_IDS,), n_microbatches=4, loss_fn=_loss, dynamic=False)
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    pipe.step(_IDS, target=_TARGET)
    _loss(ref(_IDS).logits, _TARGET).backward()
    opt.step()
    ref_opt.step()
    full = pipe.full_state_dict()
    want = ref.state_dict()
    assert sorted(full) == sorted(want), (sorted(set(full) ^ set(want)))
    for k, v in want.items():
        torch.testing.assert_close(full[k], v, msg=lambda m: f"full_state_dict()[{k!r}]: {m}")
    dcp.save(pipe.state_dict(), checkpoint_id=f"{where[0]}/pp")
    torch.manual_seed(5)
    other = _model()
    for p in other.parameters():
        p.data.normal_()  # not the saved weights
    pm = fxtp.compile(copy.deepcopy(other), 4, (_IDS,), dynamic=False)
    state = pm.state_dict()
    dcp.load(state, checkpoint_id=f"{where[0]}/pp")
    pm.load_state_dict(state)
    for k, v in pm.full_state_dict().items():
        torch.testing.assert_close(v, full[k], rtol=0, atol=0, msg=lambda m: f"pp 2 x tp 2 -> tp 4, {k}: {m}")
    pm_opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    _loss(pm(_IDS).logits, _TARGET).backward()
    pm_opt.step()
    dcp.save(pm.state_dict(), checkpoint_id=f"{where[0]}/tp")
    back = fxtp.pipeline(copy.deepcopy(other), mesh, (_IDS,), n_microbatches=4, loss_fn=_loss, dynamic=False)
    state = back.state_dict()
    dcp.load(state, checkpoint_id=f"{where[0]}/tp")
    back.load_state_dict(state)
    saved = pm.full_state_dict()
    for k, v in back.full_state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=lambda m: f"tp 4 -> pp 2 x tp 2, {k}: {m}")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(where[0])
    return {"keys": len(full)}


def test_pipeline_checkpoints_reshard_to_tp(rank_pools):
    """DCP: pp 2 x tp 2 -> tp 4 and tp 4 -> pp 2 x tp 2, bit for bit; ``full_state_dict()``
    equals the single device's state dict after one SGD step, with its FQNs."""
    assert rank_pools(4).run(_run_checkpoint)[0]["keys"] == len(_model().state_dict())


def _run_fsdp() -> dict:
    """pp 2 x dp 2 (tp 1): FSDP2 per block and per stage over dp inside each stage; each dp rank
    steps its half of the global batch: the loss, every gradient (FSDP2's reduce-scatter averages
    over dp) and the global norm equal the single device's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    ref = _model()
    local, local_target = _IDS.chunk(2)[dp], _TARGET.chunk(2)[dp]
    pipe = fxtp.pipeline(copy.deepcopy(ref), mesh, (local,), n_microbatches=2, loss_fn=_loss, dynamic=False)
    assert all(isinstance(s, FSDPModule) for s in pipe.stages)
    losses: list = []
    pipe.step(local, target=local_target, losses=losses)
    _loss(ref(_IDS).logits, _TARGET).backward()
    if losses:
        with torch.no_grad():
            torch.testing.assert_close(torch.stack(losses).mean(), _loss(ref(local).logits, local_target))
    for stage in pipe.stages:
        for fqn, p in stage.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), ref.get_parameter(fqn).grad,
                                       msg=lambda m: f"gradient of {fqn}: {m}")
    norm = pipe.clip_grad_norm_(0.5)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
    return {"stages": [list(r.blocks) for r in pipe.report.stages]}


def test_pipeline_with_fsdp_over_dp(rank_pools):
    """A ``("pp", "dp", "tp")`` mesh of 2 x 2 x 1: gradients and the norm equal the single
    device's on the global batch (asserted on the ranks)."""
    assert len(rank_pools(4).run(_run_fsdp)[0]["stages"]) == 2


def test_cut_is_the_best_contiguous_one():
    """:func:`fxtp.pipelining.balance` against every contiguous cut of a Llama with a large vocab
    (the embedding and head are not free): no cut has a smaller largest stage cost, and it is not
    the even split by block count."""
    import itertools

    from transformers import LlamaConfig, LlamaForCausalLM

    from fxtp.pipelining.split import balance, unit_costs

    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    flops, state, acts = unit_costs(model, micro_batch=2, seq=16, tp=1)
    for in_flight in ([2, 1], [3, 2, 1], [1, 1, 1, 1]):
        cut = balance(flops, state, acts, in_flight)
        best = max(max(t, m) for t, m in zip(cut.time, cut.memory))
        n, k = len(flops), len(in_flight)
        for bounds in itertools.combinations(range(1, n), k - 1):
            edges = (0, *bounds, n)
            costs = []
            for s in range(k):
                i, j = edges[s], edges[s + 1]
                t = sum(flops[i:j]) / sum(flops)
                m = (sum(state[i:j]) + in_flight[s] * sum(acts[i:j])) / (sum(state) + sum(acts) * sum(in_flight) / k)
                costs.append(max(t, m))
            assert best <= max(costs) + 1e-12, (in_flight, edges, cut)
        if 8 % k == 0:
            assert [len(b) for b in cut.blocks] != [8 // k] * k, (in_flight, cut)
    assert sum(len(b) for b in cut.blocks) == 8
