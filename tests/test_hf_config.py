"""``fxtp inspect path/to/config.json``: a Hugging Face config planned on the ``meta`` device.

The config.json files are written by the tests from transformers' config classes (tiny: 2
layers, hidden 64, 4 heads), as ``save_pretrained`` writes them next to a checkpoint's weights.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from fxtp.cli.main import main
from fxtp.capture.hf_config import DEFAULT_SEQ, load_config_model
from fxtp.explain.counts import fmt_bytes
from fxtp.explain.report import megatron_floor

transformers = pytest.importorskip("transformers")

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, bos_token_id=0, eos_token_id=0)
_DECODER = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]

# name -> (config, layer-0 prefix, layer-0 modules in order, their styles, the example's sequence length)
CASES = {
    "llama": (
        lambda: transformers.LlamaConfig(**_SMALL, max_position_embeddings=64, architectures=["LlamaForCausalLM"], dtype="bfloat16"),
        "model.layers.0.", _DECODER, "cccrccr", 64,
    ),
    "gpt2": (
        lambda: transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                                        eos_token_id=0, architectures=["GPT2LMHeadModel"]),
        "transformer.h.0.", ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"], "crcr", 32,
    ),
    "bert": (
        lambda: transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, architectures=["BertModel"]),
        "encoder.layer.0.",
        ["attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense", "intermediate.dense", "output.dense"],
        "cccrcr", DEFAULT_SEQ,
    ),
    "qwen2": (lambda: transformers.Qwen2Config(**_SMALL, architectures=["Qwen2ForCausalLM"]), "model.layers.0.", _DECODER, "cccrccr", DEFAULT_SEQ),
    "mistral": (lambda: transformers.MistralConfig(**_SMALL, architectures=["MistralForCausalLM"]), "model.layers.0.", _DECODER, "cccrccr", DEFAULT_SEQ),
}
STYLE = {"c": "colwise", "r": "rowwise"}


def _inspect_json(capsys, path, world_size: int = 2) -> dict:
    code = main(["inspect", str(path), "-n", str(world_size), "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("name", list(CASES))
def test_config_json_is_planned_on_meta(capsys, tmp_path, name):
    """Megatron's plan and collectives (fwd: 2 all_reduce per block + 1 for the vocab-parallel
    lookup, + 1 all_gather for a causal LM's logits), bytes for the default token ids, and the
    parameter bytes of the config's dtype."""
    make_config, prefix, modules, styles, seq = CASES[name]
    config = make_config()
    config.save_pretrained(tmp_path)  # writes tmp_path/config.json, as next to a checkpoint
    report = _inspect_json(capsys, tmp_path / "config.json")

    rows = {row["name"]: row for row in report["layers"]}
    assert [rows[prefix + m]["style"] for m in modules] == [STYLE[s] for s in styles]
    forward, backward = megatron_floor(report, n_blocks=2)
    counts = {(c["phase"], c["kind"]): c for c in report["collectives"] if c["count"]}
    assert {k: c["count"] for (p, k), c in counts.items() if p == "forward"} == forward
    assert {k: c["count"] for (p, k), c in counts.items() if p == "backward"} == backward
    itemsize = 2 if name == "llama" else 4  # the llama config says bfloat16
    assert counts["forward", "all_reduce"]["bytes"] == forward["all_reduce"] * 1 * seq * 64 * itemsize

    cls = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        oracle = cls(config).to(config.dtype or torch.float32)
    whole = sum(p.numel() * p.element_size() for p in oracle.parameters())  # tied weights once
    assert report["param_bytes"]["total"] == whole
    assert 0.5 * whole < report["param_bytes"]["per_rank"] < 0.55 * whole


def test_config_json_table_and_inputs(capsys, tmp_path):
    """The table names the plan; the model is on meta, eval, without a KV cache; --input
    replaces the default ids."""
    transformers.LlamaConfig(**_SMALL, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    model, args, kwargs = load_config_model(str(path))
    assert all(p.is_meta for p in model.parameters()) and not model.training and model.config.use_cache is False
    assert [(a.shape, a.dtype, a.device.type) for a in args] == [((1, DEFAULT_SEQ), torch.long, "meta")] and kwargs == {}
    assert main(["inspect", str(path), "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fxtp: layer styles for world_size 2, rank 0") and "model.layers.0.mlp.down_proj" in out
    assert "x2 identical blocks: model.layers.0-1" in out  # the blocks once (--all-layers: each)
    assert "collectives per forward: 5 all_reduce (160.0 KiB), 1 all_gather (64.0 KiB)" in out
    assert main(["inspect", str(path), "-n", "2", "--input", "2x16:int64[0,128)"]) == 0
    assert "collectives per forward: 5 all_reduce (40.0 KiB)" in capsys.readouterr().out


def test_report_header_input_dims_and_tied_weights(capsys, tmp_path):
    """A Qwen2 config with ``tie_word_embeddings`` (2 layers, hidden 64): the header names the
    layer styles (not ``fxtp plan``), the ``input dims`` line is short with the reason for the
    static batch of 1 under it (gone with a batch of 2), and ``lm_head``'s row says its weight is
    the embedding table, whose bytes count once (as ``model.parameters()`` counts it)."""
    config = transformers.Qwen2Config(**_SMALL, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
    config.save_pretrained(tmp_path)
    path = str(tmp_path / "config.json")
    assert main(["inspect", path, "-n", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "fxtp: layer styles for world_size 2, rank 0"
    dims = next(i for i, line in enumerate(lines) if line.startswith("input dims: "))
    assert lines[dims].startswith("input dims: input_ids (1, s") and lines[dims].endswith(" in [2, inf])"), lines[dims]
    assert lines[dims + 1] == "  1: the example's size (torch.export specializes 0 and 1); an example of 2 keeps it dynamic"
    head = [i for i, line in enumerate(lines) if line.startswith("lm_head ")]
    assert len(head) == 1 and "weight tied with model.embed_tokens: one table, counted once" in " ".join(
        line.strip() for line in lines[head[0]:head[0] + 3]), lines[head[0]:head[0] + 3]
    assert not any("tied" in line for line in lines if line.startswith("model.embed_tokens "))
    model, _, _ = load_config_model(path)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied table once
    assert any(line.startswith("parameter bytes per rank: ") and f" of {fmt_bytes(whole)} (" in line for line in lines)
    assert main(["inspect", path, "-n", "2", "--input", "2x16:int64[0,128)"]) == 0
    out = capsys.readouterr().out
    assert "\ninput dims: input_ids (s" in out and "example's size" not in out and "static (" not in out


def test_input_dims_say_why_a_dim_is_static():
    """``describe_inputs`` without a capture: the 0/1 reason only in a dynamic capture; other
    static sizes get the generic line, naming the notes below only when there are some."""
    from fxtp.capture.shapes import DimSpec, InputSpec, describe_inputs

    dyn, one, hidden = DimSpec(symbol="s0", lo=2, example=4), DimSpec(size=1, example=1), DimSpec(size=64, example=64)
    x, y = InputSpec("x", torch.float32, (one, dyn, hidden)), InputSpec("y", torch.long, (one, dyn))
    assert describe_inputs((x, y, InputSpec("flag", value=True)), notes=True) == [
        "input dims: x (1, s0 in [2, inf], 64); y (1, s0 in [2, inf])",
        "  1: the example's size (torch.export specializes 0 and 1); an example of 2 keeps it dynamic",
        "  64: static (the model fixes it, e.g. a Linear's input features, or the dynamic_shapes= passed or a note below)",
    ]
    static = InputSpec("x", torch.float32, (one, hidden))  # dynamic=False: no dim has a symbol
    assert describe_inputs((static,)) == [
        "input dims: x (1, 64)", "  1, 64: static (dynamic=False; dynamic=True keeps the dims the model allows dynamic)"]
    assert describe_inputs((InputSpec("flag", value=3),)) == []


@pytest.mark.parametrize(
    "make_config, args, kwargs",
    [
        (  # an encoder-decoder: the decoder gets as many ids
            lambda: transformers.T5Config(vocab_size=128, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                                          architectures=["T5ForConditionalGeneration"]),
            [((1, DEFAULT_SEQ), torch.long)], {"decoder_input_ids": ((1, DEFAULT_SEQ), torch.long)},
        ),
        (  # an image model: pixels of the config's size
            lambda: transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                           image_size=32, patch_size=8, architectures=["ViTModel"]),
            [((1, 3, 32, 32), torch.float32)], {},
        ),
    ],
    ids=["t5", "vit"],
)
def test_other_inputs_by_the_models_main_input(capsys, tmp_path, make_config, args, kwargs):
    make_config().save_pretrained(tmp_path)
    path = str(tmp_path / "config.json")
    _, got_args, got_kwargs = load_config_model(path)
    assert [(tuple(a.shape), a.dtype) for a in got_args] == args
    assert {k: (tuple(v.shape), v.dtype) for k, v in got_kwargs.items()} == kwargs
    report = _inspect_json(capsys, path)
    assert {row["style"] for row in report["layers"]} >= {"colwise", "rowwise"}


@pytest.mark.parametrize(
    "content, message",
    [
        ({"model_type": "llama", "architectures": ["FooForBar"]}, "has no architecture 'FooForBar' (model_type 'llama')"),
        ({"model_type": "foo"}, "does not know model_type 'foo'"),
        ({"hidden_size": 64}, "has no 'model_type': not a Hugging Face config.json"),
        ("{not json", "is not a readable JSON file"),
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": -1}, "transformers cannot build it: RuntimeError"),
    ],
)
def test_unknown_configs_are_one_line_errors(capsys, tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["inspect", str(path), "-n", "2"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_missing_file(capsys):
    assert main(["inspect", "no/such/config.json", "-n", "2"]) == 1
    assert "no such file: no/such/config.json" in capsys.readouterr().err


def test_without_transformers_names_the_extra(capsys, tmp_path, monkeypatch):
    transformers.LlamaConfig(**_SMALL).save_pretrained(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ModuleNotFoundError
    assert main(["inspect", str(tmp_path / "config.json"), "-n", "2"]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"fxtp: error: fxtp inspect {tmp_path / 'config.json'} needs transformers, which is not installed: "
        "pip install 'fxtp[examples]' (in a clone: pip install -e '.[examples]')\n"
    )


def test_checkpoint_directory_is_its_config_json(capsys, tmp_path, monkeypatch):
    """``fxtp inspect qwen25 -n 8`` where ``qwen25/config.json`` exists (a checkpoint directory,
    as ``from_pretrained`` takes it) plans that config; ``--help`` says so; a directory without
    one is a usage error that says what it lacks."""
    checkpoint = tmp_path / "qwen25"
    transformers.Qwen2Config(**_SMALL, architectures=["Qwen2ForCausalLM"]).save_pretrained(checkpoint)
    monkeypatch.chdir(tmp_path)
    by_dir = _inspect_json(capsys, "qwen25", world_size=2)
    by_file = _inspect_json(capsys, checkpoint / "config.json", world_size=2)
    assert by_dir["layers"] == by_file["layers"] and by_dir["layers"][1]["style"] == "colwise"
    assert main(["inspect", "qwen25", "-n", "8"]) == 0
    assert "model.layers.0.self_attn.q_proj" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exit_:
        main(["inspect", "--help"])
    assert exit_.value.code == 0
    assert "a directory holding a config.json" in capsys.readouterr().out

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", "empty", "-n", "2"])
    assert exit_.value.code == 2
    assert "'empty' is a directory without a config.json" in capsys.readouterr().err
