"""The public API without process groups: arguments, errors, capture, world_size 1, plans."""

from __future__ import annotations

import json
import re

import pytest
import torch
from _helpers import count_graph_collectives, graph_code, graph_nodes
from models import build
from torch import nn

import fxtp


@pytest.mark.parametrize("bad", [0, -1, "2", 2.5, True, None])
def test_world_size_must_be_a_positive_int(bad):
    model, inputs = build("mlp")
    with pytest.raises(fxtp.FxtpConfigError, match=r"world_size must be an int >= 1"):
        fxtp.compile(model, bad, inputs)
    with pytest.raises(fxtp.FxtpConfigError, match=r"world_size must be an int >= 1"):
        fxtp.analyze(model, bad, inputs)


def test_example_inputs_that_do_not_fit_name_the_module_and_shape():
    """The seed feeds a (100, 10) tensor to Linear(100, 10)."""
    model = nn.Sequential(nn.Linear(100, 10))
    with pytest.raises(fxtp.FxtpInputError) as info:
        fxtp.compile(model, 2, (torch.randn(100, 10),))
    msg = str(info.value)
    assert "module '0'" in msg and "(100, 10)" in msg and "expects (..., 100)" in msg
    assert "Traceback" not in msg


def test_missing_example_inputs():
    with pytest.raises(fxtp.FxtpInputError, match="example_inputs are required"):
        fxtp.compile(nn.Linear(4, 4), 2)


def test_not_a_module():
    with pytest.raises(fxtp.FxtpConfigError, match="must be a torch.nn.Module"):
        fxtp.compile(lambda x: x, 2, (torch.randn(2),))


class _ValueDependent(nn.Module):
    """Python control flow on a tensor's values: no frontend can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            return h.relu()
        return h


def test_uncapturable_model_lists_every_frontend():
    with pytest.raises(fxtp.FxtpCaptureError) as info:
        fxtp.compile(_ValueDependent(), 2, (torch.randn(2, 8),))
    msg = str(info.value)
    for frontend in ("fx", "export", "dynamo"):
        assert re.search(rf"^  - {frontend}: \w+", msg, re.M), msg
    assert "fix:" in msg


def test_bad_capture_and_plan_arguments():
    model, inputs = build("mlp")
    with pytest.raises(fxtp.FxtpConfigError, match="capture must be one of"):
        fxtp.compile(model, 2, inputs, capture="jit")
    with pytest.raises(fxtp.FxtpConfigError, match="style must be one of"):
        fxtp.compile(model, 2, inputs, plan={"0": "diagonal"})
    with pytest.raises(fxtp.FxtpPlanError, match="matches no layer; layers are: 0, 2"):
        fxtp.compile(model, 2, inputs, plan={"fc*": "replicate"})
    with pytest.raises(fxtp.FxtpConfigError, match="outside world_size"):
        fxtp.compile(model, 2, inputs, rank=2)


def test_a_plan_on_a_shared_weight_is_refused():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 16)

        def forward(self, x):
            return self.a(torch.relu(self.a(x)))

    x = torch.randn(2, 16)
    assert fxtp.analyze(Twice(), 2, (x,)).plan == {"a:linear": "replicate", "a:linear_1": "replicate"}
    with pytest.raises(fxtp.FxtpPlanError, match="plan cannot be honoured for a:linear: parameter a.weight is tied"):
        fxtp.compile(Twice(), 2, (x,), plan={"a:linear": "rowwise"})


class _HFRMSNorm(nn.Module):
    """RMSNorm written out as pow/mean/rsqrt, as Hugging Face Llama does."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _GQABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2, self.nf = _HFRMSNorm(64), _HFRMSNorm(64), _HFRMSNorm(64)
        self.q, self.k, self.v, self.o = (nn.Linear(64, d, bias=False) for d in (64, 16, 16, 64))
        self.gate, self.up = nn.Linear(64, 128, bias=False), nn.Linear(64, 128, bias=False)
        self.down, self.head = nn.Linear(128, 64, bias=False), nn.Linear(64, 32, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, t, 8, 8).transpose(1, 2)
        k, v = (m(h).view(b, t, 2, 8).transpose(1, 2)[:, :, None].expand(b, 2, 4, t, 8).reshape(b, 8, t, 8) for m in (self.k, self.v))
        x = x + self.o(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 64))
        h = self.n2(x)
        x = x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
        return self.head(self.nf(x))


def test_a_parameter_used_whole_elsewhere_keeps_its_layer_replicated():
    """`a.bias` is also a layer_norm weight: sharding it for the colwise `a` would hand the
    norm a slice."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            h = self.b(torch.relu(self.a(x)))
            return torch.nn.functional.layer_norm(h, (32,), weight=self.a.bias)

    report = fxtp.analyze(Shared(), 2, (torch.randn(2, 32),))
    assert report.plan == {"a": "replicate", "b": "replicate"}
    assert report.layers[0].code == "tied"


def test_fewer_kv_heads_than_ranks_keeps_the_megatron_plan():
    """2 kv heads at world_size 4: each rank holds the kv head its query heads read (NOTE:
    [grouped shards]), everything else as Megatron; a norm weight sharded in an intermediate
    planning round must not sustain its own shard."""
    report = fxtp.analyze(_GQABlock(), 4, (torch.randn(2, 8, 64),))
    assert report.plan == {
        "q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise",
        "gate": "colwise", "up": "colwise", "down": "rowwise", "head": "replicate",
    }  # fmt: skip
    assert report.count("forward", "all_reduce") == 2


@pytest.mark.parametrize("frontend", ["fx", "export", "dynamo"])
def test_each_frontend(frontend):
    model, inputs = build("tiny_gpt")
    report = fxtp.analyze(model, 2, inputs, capture=frontend)
    assert report.frontend == frontend and report.attempts == ()
    # 2 per block, 1 after the vocab-parallel embedding; the colwise head's logits are gathered
    assert report.count("forward", "all_reduce") == 5
    assert report.count("forward", "all_gather") == 1


def test_auto_falls_back_and_says_why():
    model, inputs = build("reference_transformer")
    report = fxtp.analyze(model, 2, inputs)
    assert report.frontend == "export"
    assert [f for f, _ in report.attempts] == ["fx"]
    assert "TraceError" in report.attempts[0][1]
    assert "capture: export (fx could not capture the model, export could: nothing to fix; why: --verbose" in str(report)
    assert "TraceError" not in str(report) and "fx failed: TraceError" in report.to_text(verbose=True)


def test_world_size_1_is_an_exact_no_op():
    model, inputs = build("tiny_gpt")
    pm = fxtp.compile(model, 1, inputs)
    assert count_graph_collectives(pm) == {}
    out, ref = pm(*inputs), model(*inputs)
    assert torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for fqn, p in pm.named_parameters():
        assert torch.equal(p.grad, model.get_parameter(fqn).grad), fqn
    assert all(layer.style == "replicate" for layer in pm.report.layers)


def test_without_a_process_group_it_compiles_for_inspection_and_refuses_to_run():
    model, inputs = build("mlp")
    pm = fxtp.compile(model, 2, inputs)
    assert count_graph_collectives(pm) == {"copy_to_tp": 1, "reduce_from_tp": 1}
    assert pm.get_parameter("0.weight").shape == (128, 64)
    with pytest.raises(fxtp.FxtpRuntimeError, match="no process group was initialized"):
        pm(*inputs)


def test_compile_never_mutates_the_model():
    model, inputs = build("nn_transformer")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = {k: id(v) for k, v in model.named_parameters()}
    pm = fxtp.compile(model, 2, inputs)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert {k: id(v) for k, v in model.named_parameters()} == ids
    assert all(p.data_ptr() != model.get_parameter(k).data_ptr() for k, p in pm.named_parameters())


def test_shape_literals_are_localized():
    """Head counts in views become local; the -1 of the reshape is made explicit. Under dynamic
    shapes (the default) batch and sequence stay the capture's sym_size nodes."""
    model, inputs = build("reference_transformer")
    static = fxtp.compile(model, 2, inputs, dynamic=False)
    assert "aten.view.default(linear, [2, 16, 2, 8])" in graph_code(static)
    assert "aten.reshape.default(transpose_3, [2, 16, 16])" in graph_code(static)
    dynamic = fxtp.compile(model, 2, inputs)  # a block's sizes are read from its own input (NOTE: [rank program by block])
    assert "sym_size_int = torch.ops.aten.sym_size.int(dropout, 0)" in graph_code(dynamic)
    assert "aten.view.default(linear, [sym_size_int, sym_size_int_4, 2, 8])" in graph_code(dynamic)
    assert "aten.reshape.default(transpose_3, [sym_size_int, sym_size_int_4, 16])" in graph_code(dynamic)
    for pm in (static, dynamic):
        views = [n for n in graph_nodes(pm) if n.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default)]
        assert views and all(-1 not in n.args[1] for n in views)


def test_emitted_graph_hard_codes_no_device():
    model, inputs = build("tiny_gpt")
    code = fxtp.compile(model, 2, inputs).graph_module.code
    assert "device(type=" not in code
    assert "arange.default(sym_size_int_3, device = getattr_1" in code and "getattr_1 = p_tok_weight.device" in code


def test_the_module_follows_its_parameters_to_another_device():
    """Nothing in the graph pins the capture device: moved to `meta`, it runs on `meta`."""
    model, inputs = build("tiny_gpt")
    pm = fxtp.compile(model, 1, inputs).to("meta")
    out = pm(*(t.to("meta") for t in inputs))
    assert out.device.type == "meta" and out.shape == (2, 16, 128)


def test_buffer_mutations_update_the_modules_buffers_not_the_users():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 8)).train()
    x = torch.randn(4, 8)
    user_mean = model[1].running_mean.clone()
    pm = fxtp.compile(model, 1, (x,))
    assert torch.equal(model[1].running_mean, user_mean)
    pm(x)
    assert not torch.equal(pm.get_buffer("1.running_mean"), user_mean)
    model(x)  # the single-device model takes the same step
    torch.testing.assert_close(pm.get_buffer("1.running_mean"), model[1].running_mean)


def test_kwargs_and_dict_outputs():
    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x, *, scale):
            return {"y": self.down(self.up(x).relu()) * scale, "aux": (x.sum(),)}

    torch.manual_seed(0)
    model, x, scale = Heads(), torch.randn(2, 8), torch.tensor(2.0)
    pm = fxtp.compile(model, 1, (x,), example_kwargs={"scale": scale})
    out, ref = pm(x, scale=scale), model(x, scale=scale)
    assert set(out) == {"y", "aux"} and isinstance(out["aux"], tuple)
    torch.testing.assert_close(out, ref)
    assert fxtp.analyze(model, 2, (x,), example_kwargs={"scale": scale}).plan == {"up": "colwise", "down": "rowwise"}


def test_runtime_inputs_are_checked_against_the_dims_the_capture_allows():
    model, inputs = build("mlp")
    pm = fxtp.compile(model, 1, inputs)
    x = torch.randn(5, 64)
    torch.testing.assert_close(pm(x), model(x))  # the batch is dynamic
    with pytest.raises(fxtp.FxtpInputError, match=r"input 'input' dim 1 is 32 but the module was compiled with it static at 64") as info:
        pm(torch.randn(4, 32))
    # a Linear's input features: the model fixes the dim, no dynamic_shapes= can free it (issue 34)
    assert "fix: pass size 64; the model fixes it (e.g. a weight's size, such as a Linear's input features" in str(info.value)
    assert "compile with dynamic_shapes=" not in str(info.value)
    one = torch.randn(1, 64)  # export's range starts at 2: a graph of its own (NOTE: [size-1 graphs])
    torch.testing.assert_close(pm(one), model(one))
    with pytest.raises(fxtp.FxtpInputError, match=r"input 'input' is \(8, 64\) torch.float64 but the module runs on 2-D torch.float32"):
        pm(inputs[0].double())
    with pytest.raises(fxtp.FxtpInputError, match=r"input 'input' is \(2, 8, 64\) torch.float32 but the module runs on 2-D"):
        pm(torch.randn(2, 8, 64))
    with pytest.raises(fxtp.FxtpInputError, match=r"1 positional input\(s\) and keywords \[\] expected, got 2"):
        pm(*inputs, inputs[0])
    static = fxtp.compile(model, 1, inputs, dynamic=False)
    with pytest.raises(fxtp.FxtpInputError, match=r"input 'input' dim 0 is 4 but the module was compiled with it static at 8"
                       r".*fix: pass size 8, or compile with dynamic=True \(the default\)"):
        static(torch.randn(4, 64))


def test_non_tensor_arguments_are_checked_not_silently_reused():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, scale):
            return self.fc(x) * scale

    x = torch.randn(2, 8)
    pm = fxtp.compile(Scaled(), 1, (x, 2.0))
    pm(x, 2.0)
    with pytest.raises(fxtp.FxtpInputError, match="input 'scale' is 3.0 but the module was compiled with 2.0"):
        pm(x, 3.0)


def test_group_must_be_a_process_group_or_mesh():
    model, inputs = build("mlp")
    with pytest.raises(fxtp.FxtpConfigError, match="group must be a ProcessGroup or a 1-D DeviceMesh, got str"):
        fxtp.compile(model, 2, inputs, group="world")


def test_report_table_dict_and_plan_round_trip():
    model, inputs = build("reference_transformer")
    pm = fxtp.compile(model, 4, inputs)
    text = str(pm.report)
    for needle in ("layer", "style", "local weight", "communication", "reason", "collectives per forward: 5 all_reduce (20.0 KiB), 1 all_gather"):
        assert needle in text
    assert "parameter bytes per rank" in text
    data = json.loads(json.dumps(pm.report.to_dict()))
    wq = next(row for row in data["layers"] if row["name"] == "layers.0.attention.wq")
    assert wq["style"] == "colwise" and wq["local_weight_shape"] == [8, 32]
    again = fxtp.compile(model, 4, inputs, plan=pm.plan)
    assert again.plan == pm.plan
    # Megatron's regions: attention and MLP of each block, each entered through f, left through g.
    assert data["regions"] == [["tok_embeddings"]] + [
        [f"layers.{i}.attention.wq", f"layers.{i}.attention.wk", f"layers.{i}.attention.wv", f"layers.{i}.attention.wo"]
        if j == 0
        else [f"layers.{i}.feed_forward.w1", f"layers.{i}.feed_forward.w2"]
        for i in range(2)
        for j in range(2)
    ] + [["output"]]  # the vocab-parallel lookup (left through g) and the head (gathered) apart

def test_user_plan_replicate_and_colwise():
    model, inputs = build("mlp")
    pm = fxtp.compile(model, 2, inputs, plan={"0": "replicate"})
    assert pm.plan == {"0": "replicate", "2": "replicate"}
    assert pm.report.layers[0].code == "user-plan"
    forced = fxtp.compile(model, 2, inputs, plan={"2": "colwise"})
    assert forced.plan == {"0": "replicate", "2": "colwise"}
    assert count_graph_collectives(forced) == {"copy_to_tp": 1, "gather_from_tp": 1}
    assert forced.report.count("forward", "all_gather") == 1


class _TiedSmall(nn.Module):
    """A tied table too small to be a vocabulary on its own (24 rows, 16 columns)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(24, 16)
        self.head = nn.Linear(16, 24, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_a_tied_table_follows_its_head():
    ids = torch.randint(0, 24, (2, 8), generator=torch.Generator().manual_seed(0))
    pm = fxtp.compile(_TiedSmall(), 2, (ids,))
    assert pm.plan == {"emb": "rowwise", "head": "colwise"}  # one Shard(0) for both uses
    assert pm.get_parameter("emb.weight") is pm.get_parameter("head.weight")
    # Replicating the table by plan replicates the head too; its planned gather is dropped.
    pm = fxtp.compile(_TiedSmall(), 2, (ids,), plan={"emb": "replicate"})
    assert pm.plan == {"emb": "replicate", "head": "replicate"}
    assert pm.report.layers[1].code == "tied"
    assert count_graph_collectives(pm) == {}


class _NormHeadLoss(nn.Module):
    def __init__(self, **loss_options) -> None:
        super().__init__()
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 64)
        self.loss_options = loss_options

    def forward(self, x, labels):
        return nn.functional.cross_entropy(self.head(self.norm(x)), labels, **self.loss_options)


def test_a_loss_inside_the_model_keeps_the_head_colwise():
    x, labels = torch.randn(8, 16), torch.randint(0, 64, (8,))
    report = fxtp.analyze(_NormHeadLoss(), 2, (x, labels))
    head = next(layer for layer in report.layers if layer.name == "head")
    assert (head.style, head.code) == ("colwise", None)  # vocab-parallel cross entropy
    assert report.count("forward", "all_reduce") == 3 and report.count("forward", "all_gather") == 0


def test_a_loss_with_label_smoothing_keeps_the_head_colwise():
    """NOTE: [vocab-parallel cross entropy] covers label smoothing (exact on ranks: test_norms_losses.py)."""
    x, labels = torch.randn(8, 16), torch.randint(0, 64, (8,))
    report = fxtp.analyze(_NormHeadLoss(label_smoothing=0.1), 2, (x, labels))
    head = next(layer for layer in report.layers if layer.name == "head")
    assert (head.style, head.code) == ("colwise", None)
    assert report.count("forward", "all_reduce") == 3 and report.count("forward", "all_gather") == 0


def test_every_parameter_is_in_the_report():
    model = nn.Sequential(nn.Conv1d(4, 8, 3), nn.Flatten(), nn.Linear(48, 10), nn.LayerNorm(10))
    report = fxtp.analyze(model, 2, (torch.randn(2, 4, 8),))
    notes = {n.code: n for n in report.notes}
    assert "0.weight [8, 4, 3] (384 B)" in notes["not-a-layer"].message and "conv" in notes["not-a-layer"].message
    assert notes["other-params"].message.startswith("4 other parameters")  # conv bias, linear bias, norm weight and bias
    assert report.param_bytes == sum(p.numel() * 4 for p in model.parameters())


def test_outputs_keep_the_model_s_containers():
    class D(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(8, 16)

        def forward(self, x):
            y = self.up(x)
            return {"y": y, "pair": (y, [y * 2])}

    x = torch.randn(2, 8)
    out = fxtp.compile(D(), 1, (x,), capture="fx")(x)
    assert type(out) is dict and type(out["pair"]) is tuple and type(out["pair"][1]) is list
    out["extra"] = 1  # a plain dict the user may change


def test_an_input_of_the_wrong_dtype_is_refused_at_compile():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(fxtp.FxtpInputError, match=r"in module '0' multiplies operands of dtypes float32, int64.*x.float\(\)"):
        fxtp.compile(model, 2, (torch.zeros(2, 4, dtype=torch.long),))

