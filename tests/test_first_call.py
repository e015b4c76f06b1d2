"""The first call as people make it (issue 21), on real gloo ranks against the single device:
a batch or sequence of 1 after a compile at 2 (NOTE: [size-1 graphs]), a Hugging Face model
with its default ``use_cache=True``, what ``fxtp.compile`` imports on a plain module, and ranks
that hold different models (refused before capture)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from _helpers import loss_of

import fxtp
from fxtp.core.placement import shard_tensor
from fxtp.cli import examples

ROOT = Path(__file__).resolve().parents[1]


def _build(name: str, batch: int):
    if name == "transformer":
        model, (ids,) = examples.transformer(0)
    elif name == "llama":
        model, (ids,) = examples.llama(0)
    else:
        model, (ids,) = examples.tiny_gpt(0)
    ids = ids[:1] if batch == 1 else ids
    return model.train(), ids


def _sizes(name: str, shapes: list[tuple[int, int]], batch: int = 2, sequence_parallel: bool = False):
    """Compile at ``batch`` and call at each of ``shapes``: outputs and every gradient equal the
    single device's; returns the report's shape notes and the number of graphs kept."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model, ids = _build(name, batch)
    ref = copy.deepcopy(model)
    pm = fxtp.compile(model, ws, (ids,), sequence_parallel=sequence_parallel)
    vocab = 64 if name == "transformer" else 128
    for shape in shapes:
        x = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(sum(shape)))
        out, ref_out = pm(x), ref(x)
        ref_out = ref_out.logits if hasattr(ref_out, "logits") else ref_out
        out = out.logits if hasattr(out, "logits") else out
        torch.testing.assert_close(out, ref_out, msg=lambda m: f"{shape}: {m}")
        loss_of(out).backward()
        loss_of(ref_out).backward()
        for fqn, p in pm.named_parameters():
            want = shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], rank, ws)
            torch.testing.assert_close(p.grad, want, msg=lambda m: f"{shape}, gradient of {fqn}: {m}")
        for p in (*pm.parameters(), *ref.parameters()):
            p.grad = None
    return pm.report.shape_notes, len(pm._size_graphs.graphs)


@pytest.mark.parametrize("ws,name", [(2, "tiny_gpt"), (2, "llama"), (4, "tiny_gpt")])
def test_batch_and_sequence_of_one_after_a_compile_at_two(rank_pools, ws, name):
    """Batch 1, sequence 1 and both run exactly (forward and backward) after one compile at
    (2, 16); each gets one graph captured on first use, kept (a second call reuses it) and
    noted; sizes of 2 and more keep running the compiled graph."""
    shapes = [(1, 8), (2, 1), (1, 1), (3, 5), (1, 8), (1, 3)]
    for notes, kept in rank_pools(ws).run(_sizes, name, shapes):
        assert kept == 3, notes
        assert len(notes) == 3 and all("a graph of its own, captured at the first such call" in n for n in notes), notes
        assert any("dim 0 at 1, dim 1 at 1" in n for n in notes), notes


def test_sizes_past_an_example_of_one(rank_pools):
    """A compile at batch 1 (export fixes that dim at 1) runs batch 3 and 2 through one graph
    captured for batches of 2 or more."""
    for notes, kept in rank_pools(2).run(_sizes, "tiny_gpt", [(3, 16), (1, 4), (2, 7)], batch=1):
        assert kept == 1 and "dim 0 at 2 or more" in notes[0], notes


def test_batch_of_one_with_sequence_parallel(rank_pools):
    """With sequence parallelism the tokens stay sharded at batch 1 (lengths that divide
    world_size)."""
    for notes, kept in rank_pools(2).run(_sizes, "transformer", [(1, 8), (1, 4), (2, 8)], sequence_parallel=True):
        assert kept == 1 and "dim 0 at 1" in notes[0], notes


class _BranchOnLength(torch.nn.Module):
    """Shared case 12's kind: the model's Python branches on the length. At a length above 1 a
    softmax over the features keeps ``up`` replicated; at 1 the branch is gone and a plan of
    its own would shard ``up`` and ``down``."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        h = self.up(x)
        if h.shape[1] > 1:
            h = h.softmax(-1)
        return self.down(h)


def _branch_on_length(shapes: list[tuple[int, int]]):
    """Compile at (2, 8) and call at each of ``shapes``: outputs and gradients equal the single
    device's; returns the compiled plan and the parameter placements."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _BranchOnLength()
    ref = copy.deepcopy(model)
    pm = fxtp.compile(model, ws, (torch.randn(2, 8, 16),))
    for shape in shapes:
        x = torch.randn(*shape, 16, generator=torch.Generator().manual_seed(sum(shape)))
        out, ref_out = pm(x), ref(x)
        torch.testing.assert_close(out, ref_out, msg=lambda m: f"{shape}: {m}")
        out.square().sum().backward()
        ref_out.square().sum().backward()
        for fqn, p in pm.named_parameters():
            want = shard_tensor(ref.get_parameter(fqn).grad, pm.placements[fqn], rank, ws)
            torch.testing.assert_close(p.grad, want, msg=lambda m: f"{shape}, gradient of {fqn}: {m}")
            p.grad = ref.get_parameter(fqn).grad = None
    return pm.report.plan, len(pm._size_graphs.graphs)


def test_a_size_one_graph_keeps_the_compiled_styles(rank_pools):
    """A graph for sequence 1 whose own plan would shard what the compiled graph keeps
    replicated runs with the compiled graph's layer styles (one set of shards), exactly."""
    for plan, kept in rank_pools(2).run(_branch_on_length, [(2, 1), (1, 1), (3, 4)]):
        assert plan["up"] == "replicate", plan
        assert kept == 2


def test_a_size_the_model_refuses_is_still_an_input_error():
    """Only sizes 0 and 1 get a graph of their own; a static dim stays static."""
    model, (x,) = examples.mlp(0)
    pm = fxtp.compile(model, 1, (x,))
    with pytest.raises(fxtp.FxtpInputError, match=r"dim 0 is 1, outside the range \[2, inf\]"):
        pm(torch.randn(1, 32))  # in_features 32, not 64: no graph is captured for it
    assert not pm._size_graphs.graphs
    torch.testing.assert_close(pm(x[:1]), model(x[:1]))
    static = fxtp.compile(model, 1, (x,), dynamic=False)
    with pytest.raises(fxtp.FxtpInputError, match=r"dim 0 is 1 but the module was compiled with it static at 8"):
        static(torch.randn(1, 64))
    with pytest.raises(fxtp.FxtpInputError, match=r"bfloat16.*a static compile \(dynamic=False\) keeps its one graph"):
        static(x.to(torch.bfloat16))  # another dtype: the fix names dynamic=True (FSDP2's MixedPrecisionPolicy)


def _hf_default(name: str):
    """A tiny Hugging Face model from its config class with every default it has, ``use_cache=True``
    included: outputs equal the model's, and a ``use_cache=True`` call is refused with why."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "llama":
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        model = LlamaForCausalLM(config)
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4))
    model.eval()
    assert model.config.use_cache
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    pm = fxtp.compile(model, dist.get_world_size(), example_inputs=(ids,))
    out, ref = pm(ids), model(ids)
    assert type(out) is type(ref) and set(out.keys()) == {"logits"} and ref.cache is not None
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(pm(ids, use_cache=False).logits, ref.logits)
    one = ids[:1, :1]  # the first call of a chat: batch 1, one token
    torch.testing.assert_close(pm(one).logits, model(one).logits)
    with pytest.raises(fxtp.FxtpInputError, match=r"use_cache=True: the module was captured with use_cache=False"):
        pm(ids, use_cache=True)
    return pm.report.frontend, [f for f, _ in pm.report.attempts], pm.report.left_out, pm.report.summary()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hugging_face_default_config_compiles(rank_pools, name):
    """``use_cache=True`` (the config default) is applied by fxtp before any capture: export
    captures at the first try after fx (which never traces Hugging Face models), and the report
    says in one line that the cache is left out."""
    for frontend, failed, left_out, summary in rank_pools(2).run(_hf_default, name):
        assert frontend == "export" and failed == ["fx"], (frontend, failed)
        assert len(left_out) == 1 and "use_cache=False" in left_out[0] and "pm.generate" in left_out[0]
        assert f"outputs: {left_out[0]}" in summary


def test_compile_of_a_plain_module_imports_nothing_optional():
    """``fxtp.compile`` and a call on an ``nn.Module`` load neither transformers, safetensors
    nor the CLI (NOTE: [Hugging Face call defaults] reads the class's MRO, imports nothing)."""
    code = (
        "import sys, torch, fxtp; from torch import nn; torch.manual_seed(0); "
        "m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)); x = torch.randn(4, 8); "
        "pm = fxtp.compile(m, 1, (x,)); torch.testing.assert_close(pm(x), m(x)); pm(x[:1]); "
        "heavy = [n for n in sys.modules if n.split('.')[0] in ('transformers', 'safetensors') "
        "or n.startswith('fxtp.cli')]; "
        "print(heavy); assert not heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=300)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _mlp(seed: int = 0) -> _Mlp:
    torch.manual_seed(seed)
    return _Mlp()


def _rank_divergent_models() -> list[str]:
    """Ranks that hold different models (each seeded by its rank; one element of one parameter,
    one float, integer or complex buffer changed on the last rank; other parameter names) are
    refused on every rank at compile, before capture, naming the tensor (ranks that hold one
    model compile, a complex buffer among them)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    last = rank == ws - 1

    def seeded(m: nn.Module) -> nn.Module:
        m.register_buffer("scale", torch.ones(16))
        m.register_buffer("steps", torch.tensor(7))
        m.register_buffer("freqs_cis", torch.polar(torch.ones(4), torch.arange(4.0)))  # rotary's complex buffer
        return m

    def perturbed(where: str) -> nn.Module:
        m = seeded(_mlp())
        if last:
            with torch.no_grad():
                {"same": lambda: None, "param": lambda: m.fc2.weight[3, 5].add_(1e-3), "buffer": lambda: m.scale[0].add_(1e-3),
                 "int": lambda: m.steps.add_(1), "complex": lambda: m.freqs_cis[1].mul_(1j),
                 "names": lambda: m.register_parameter("extra", nn.Parameter(torch.ones(1))),
                 "seed": lambda: m.load_state_dict(seeded(_mlp(seed=1)).state_dict())}[where]()
        return m

    found = []
    for where in ("same", "seed", "param", "buffer", "int", "complex", "names"):
        try:
            fxtp.compile(perturbed(where), ws, (torch.randn(2, 5, 16),), dynamic=False)
            found.append(f"{where}: compiled")
        except fxtp.FxtpConfigError as e:
            found.append(f"{where}: {e}")
    return found


def test_ranks_holding_different_models_are_refused(pool):
    """Each rank slices its shards from its own copy of the model: copies that differ (another
    seed, one element, a buffer) would silently run a model that is none of theirs."""
    for found in pool.run(_rank_divergent_models):
        assert found[0] == "same: compiled", found[0]
        assert "'fc1.weight' has sum" in found[1] and "torch.manual_seed(0)" in found[1], found[1]
        for line, name in zip(found[2:6], ("fc2.weight", "scale", "steps", "freqs_cis")):
            assert f"the model differs between the ranks: {name!r} has sum" in line, line
        assert "other names" in found[6], found[6]


def _under_torch_modes():
    """pm under torch's own debugging modes, with and without grad: CommDebugMode counts the
    graph's collective, FlopCounterMode the single device's FLOPs over world_size; no_grad used to
    raise "Expected gradient function to be set" from their module hooks (a fresh user's find)."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils.flop_counter import FlopCounterMode

    ws = dist.get_world_size()
    model, x = _mlp(), torch.randn(4, 16)
    want = model(x)
    pm = fxtp.compile(model, ws, (x,))
    found = []
    for grad in (True, False):
        with torch.set_grad_enabled(grad), CommDebugMode() as comms, FlopCounterMode(display=False) as flops:
            out = pm(x)
        torch.testing.assert_close(out, want)
        found.append((grad, comms.get_total_counts(), flops.get_total_flops()))
    with FlopCounterMode(display=False) as single:
        model(x)
    return found, single.get_total_flops(), _under_module_hooks()


class _MaxNormEmbedding(torch.nn.Module):
    """An embedding whose lookup renormalizes its weight in place (``max_norm``: replicated,
    ``embedding-max-norm``) before a colwise/rowwise pair: its graph writes a parameter input."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16, max_norm=1.0)
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, ids):
        return self.down(torch.tanh(self.up(self.emb(ids))))


def _under_module_hooks() -> list[str]:
    """pm trained one step under each global module hook torch has, and under CommDebugMode (which
    installs them), against the single device under the same: the rank graph is no module of the
    model, so its parameter inputs must not be wrapped (an in-place max_norm renorm of a wrapped
    one raised "Output 0 of BackwardHookFunction is a view ... modified inplace"; a fresh user's
    find, shared/cases 16B)."""
    import contextlib

    from torch.distributed.tensor.debug import CommDebugMode
    from torch.nn.modules import module as nn_module

    def hooked(register, hook):
        @contextlib.contextmanager
        def scope():
            handle = register(hook)
            try:
                yield
            finally:
                handle.remove()
        return scope

    scopes = {
        "CommDebugMode": CommDebugMode,
        "full backward hook": hooked(nn_module.register_module_full_backward_hook, lambda m, gi, go: None),
        "forward hook": hooked(nn_module.register_module_forward_hook, lambda m, a, out: None),
        "forward pre-hook": hooked(nn_module.register_module_forward_pre_hook, lambda m, a: None),
    }
    torch.manual_seed(0)
    model = _MaxNormEmbedding()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    ids[0, :4] = 3  # one row looked up 4 times
    found = []
    for name, scope in scopes.items():
        ref = copy.deepcopy(model)
        pm = fxtp.compile(copy.deepcopy(model), dist.get_world_size(), (ids,))
        for module in (ref, pm):
            with scope():
                module(ids).square().mean().backward()
            torch.optim.SGD(module.parameters(), lr=0.5).step()
        torch.testing.assert_close(pm(ids), ref(ids))
        torch.testing.assert_close(pm.full_state_dict(), ref.state_dict())
        found.append(name)
    return found


def test_torch_debug_modes_under_no_grad(pool):
    for found, single_flops, hooked in pool.run(_under_torch_modes):
        assert [(grad, comms) for grad, comms, _ in found] == [(True, 1), (False, 1)]
        assert all(flops * pool.world_size == single_flops for _, _, flops in found)
        assert hooked == ["CommDebugMode", "full backward hook", "forward hook", "forward pre-hook"]
