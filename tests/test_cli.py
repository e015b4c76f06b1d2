"""The ``fxtp`` command line, in process (``fxtp.cli.main.main``) but for one ``python -m fxtp`` run.

Exit status: 0 ok, 1 fxtp error (message only unless --verbose), 2 bad usage.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from _helpers import shell_calls
from fxtp.cli.main import get_args_parser, main
from fxtp.cli.examples import EXAMPLES
from fxtp.cli.inspection import InputSpec
from fxtp.cli.verify import VerifyResult

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden"

USER_MODELS = textwrap.dedent(
    """
    import torch
    from torch import nn

    def with_inputs():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), (torch.randn(4, 16),)

    def module_only():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

    def not_a_module():
        return 3

    def on_meta():
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), (torch.zeros(4, 16, device="meta"),)

    model_instance = nn.Linear(16, 16)

    def dropout_mlp():  # train mode (nn.Module's default), dropout between the pair
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.1), nn.Linear(64, 32)), (torch.randn(4, 32),)

    def other_on_ranks():  # a builder that is not deterministic: the ranks get another shape
        import torch.distributed as dist

        return nn.Linear(16, 32 if dist.is_initialized() else 16), (torch.randn(4, 16),)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Deep(nn.Module):  # 32 identical blocks, a list of one more block, then a head
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(32))
            self.last = nn.ModuleList([Block()])
            self.head = nn.Linear(16, 8)

        def forward(self, x):
            for block in [*self.layers, *self.last]:
                x = block(x)
            return self.head(x)

    def deep():
        return Deep(), (torch.randn(4, 16),)
    """
)


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_models.py"
    path.write_text(USER_MODELS)
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``fxtp *argv`` in process: (exit status, stdout, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse: --help and usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_help_shows_examples(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "fxtp inspect llama --world-size 2" in out and "exit status" in out
    code, out, _ = run(capsys, "inspect", "--help")
    assert code == 0
    for text in ("2x16:int64[0,128)", "llama-7b", "file.py:callable", "--format dot --out mlp.svg", "2 bad usage"):
        assert text in out, text
    from fxtp.cli.examples import EXAMPLES

    model_section = out.split("MODEL:")[1].split("path/to/config.json")[0]
    listed = {word.strip(",;()") for word in model_section.split()}
    assert set(EXAMPLES) <= listed, f"examples missing from inspect --help: {set(EXAMPLES) - listed}"


def _help_examples(capsys) -> list[str]:
    texts = [run(capsys, "--help")[1], run(capsys, "inspect", "--help")[1]]
    lines = [line.strip() for text in texts for line in text.splitlines()]
    return [line for line in lines if line.startswith(("fxtp ", "python -m fxtp "))]


# --help examples not run here, and why (each still parses, in bash and in argparse).
_HELP_NOT_RUN = {
    "--verify": "spawns ranks: docs/inspecting.md's tiny-gpt --verify runs in test_docs.py, mlp's below",
    "demo --world-size 4": "4 ranks: the README's `fxtp demo` (2 ranks) runs in test_docs.py",
    "llama-7b": "32 layers, ~10 s: tests/test_big_configs.py plans the same model",
    "path/to/": "a placeholder for the user's file (test_hf_config.py runs config.json files)",
    "mypkg.": "a placeholder for the user's module",
    "--out mlp.svg": "needs Graphviz's dot (test_renders_svg_with_graphviz)",
}


def test_help_examples_run_as_pasted(capsys, tmp_path, monkeypatch):
    """Every example in --help is valid shell and valid usage; the cheap ones run (exit 0)."""
    examples = _help_examples(capsys)
    assert len(examples) >= 10
    monkeypatch.chdir(tmp_path)
    ran = []
    for line in examples:
        ((program, *args),) = shell_calls(line, tmp_path)
        args = args[2:] if program == "python" else args  # python -m fxtp ...
        if "--help" not in args:
            get_args_parser().parse_args(args)  # exits 2 on bad usage
        if any(key in line for key in _HELP_NOT_RUN):
            continue
        code, _, err = run(capsys, *args)
        assert code == 0 and "Traceback" not in err, f"{line}: {err}"
        ran.append(args[0:2])
    assert ["inspect", "llama"] in ran and ["inspect", "transformer"] in ran


def test_an_unquoted_input_spec_is_a_shell_error(tmp_path):
    with pytest.raises(AssertionError, match="syntax error"):
        shell_calls("fxtp inspect mlp -n 2 --input 2x16:int64[0,1000)", tmp_path)


def test_table_and_graph_are_the_goldens(capsys):
    code, out, err = run(capsys, "inspect", "mlp", "--world-size", "2")
    assert (code, err) == (0, "")
    assert out == (GOLDEN / "mlp_ws2.plan.txt").read_text()
    code, out, _ = run(capsys, "inspect", "mlp", "-n", "2", "--format", "graph")
    assert code == 0 and out == (GOLDEN / "mlp_ws2.graph.txt").read_text()


def test_json_is_the_report_dict(capsys):
    code, out, _ = run(capsys, "inspect", "mlp", "-n", "4", "--format", "json")
    report = json.loads(out)
    assert code == 0 and report["world_size"] == 4
    assert [(layer["name"], layer["style"]) for layer in report["layers"]] == [("0", "colwise"), ("2", "rowwise")]


def test_rank_and_input_specs(capsys):
    """--rank picks the rank; --input replaces the example input (3x64 floats: 768 B all_reduce)."""
    code, out, _ = run(capsys, "inspect", "mlp", "-n", "2", "--rank", "1", "--input", "3x64")
    assert code == 0 and "fxtp: layer styles for world_size 2, rank 1" in out and "1 all_reduce (768 B)" in out
    code, out, _ = run(capsys, "inspect", "mlp", "-n", "2", "-r", "1", "-f", "graph", "-i", "3x64")
    assert code == 0 and "# mlp: rank 1 of world_size 2" in out and "input,  # R  f32[3, 64]" in out


def test_dot_marks_shards_and_collectives(capsys, tmp_path):
    code, out, _ = run(capsys, "inspect", "mlp", "-n", "2", "--format", "dot")
    assert code == 0 and out.startswith("digraph fxtp {") and out.rstrip().endswith("}")
    octagons = [line for line in out.splitlines() if "shape=octagon" in line]
    assert len(octagons) == 2 and "f: all_reduce bwd" in octagons[0] and "g: all_reduce fwd" in octagons[1]
    assert '"linear" [label="linear\\naten.linear\\nS(1)  f32[8, 256]", fillcolor="#c6dbef"]' in out
    assert '"linear_1" [label="linear_1\\naten.linear\\nP(sum)  f32[8, 64]", fillcolor="#fdd0a2"]' in out
    target = tmp_path / "mlp.dot"
    code, _, err = run(capsys, "inspect", "mlp", "-n", "2", "-f", "dot", "--out", str(target))
    assert code == 0 and target.read_text() == out and f"wrote {target}" in err


def test_rendering_without_graphviz_says_how_to_install_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    code, out, err = run(capsys, "inspect", "mlp", "-n", "2", "-f", "dot", "--out", str(tmp_path / "mlp.svg"))
    assert code == 1 and out == ""
    assert "apt-get install graphviz" in err and "brew install graphviz" in err and "Traceback" not in err


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_renders_svg_with_graphviz(capsys, tmp_path):
    target = tmp_path / "mlp.svg"
    code, _, _ = run(capsys, "inspect", "mlp", "-n", "2", "-f", "dot", "--out", str(target))
    assert code == 0 and "<svg" in target.read_text()


def test_user_models_from_a_file_and_a_module(capsys, user_file, monkeypatch):
    code, out, _ = run(capsys, "inspect", f"{user_file}:with_inputs", "-n", "2")
    assert code == 0 and "colwise" in out and "rowwise" in out
    code, _, err = run(capsys, "inspect", f"{user_file}:module_only", "-n", "2")
    assert code == 1 and "gives no example inputs" in err and "--input" in err
    monkeypatch.syspath_prepend(str(user_file.parent))
    code, out, _ = run(capsys, "inspect", "user_models:module_only", "-n", "2", "--input", "4x16")
    assert code == 0 and "colwise" in out
    code, out, _ = run(capsys, "inspect", "user_models:model_instance", "-n", "2", "-i", "4x16")
    assert code == 0 and "linear" in out


def test_meta_models_plan_and_graph_but_do_not_verify(capsys, user_file):
    code, out, _ = run(capsys, "inspect", f"{user_file}:on_meta", "-n", "2", "-f", "graph")
    assert code == 0 and "S(0)  f32[32, 16]" in out
    code, _, err = run(capsys, "inspect", f"{user_file}:on_meta", "-n", "2", "--verify")
    assert code == 2 and "meta device" in err
    code, _, err = run(capsys, "inspect", "llama-7b", "-n", "2", "--verify")
    assert code == 2 and "llama-7b is on the meta device" in err


@pytest.mark.parametrize(
    "argv, status, message",
    [
        (["nope"], 2, "unknown model 'nope': use a built-in example (mlp, tiny-gpt, transformer"),
        (["missing_dir/missing.py:build"], 1, "no such file: missing_dir/missing.py"),
        (["no_such_module_xyz:build"], 1, "cannot import 'no_such_module_xyz'"),
        (["{user_file}:nothing"], 1, "has no attribute 'nothing'"),
        (["{user_file}:not_a_module"], 1, "not_a_module() returned 'int'; it must return an nn.Module"),
        (["mlp", "--input", "2x"], 2, "malformed input spec '2x'"),
        (["mlp", "--input", "2x16:int64"], 2, "an integer input needs a range"),
        (["mlp", "--input", "2x16:floaty"], 2, "unknown dtype 'floaty'"),
        (["mlp", "--input", "3x5"], 1, "received input of shape (3, 5) but expects (..., 64)"),
        (["mlp", "--input", "8x64:bfloat16"], 1, "received input of dtype torch.bfloat16 but its weight is torch.float32"),
        (["tiny-gpt", "-i", "2x17:int64[0,128)"], 1,
         "tiny-gpt does not run on --input 2x17:int64[0,128): module 'pos' "
         "(Embedding(16, 64)) received input of shape (17,) but expects integer indices < 16"),
        (["tiny-gpt", "-i", "2x16:int64[128,200)", "--verify"], 1, "module 'tok' (Embedding(128, 64)) received input of shape (2, 16) but expects integer indices < 128"),
        (["mlp", "--world-size", "0"], 2, "world size must be >= 1, got 0"),
        (["mlp", "--world-size", "two"], 2, "invalid world size 'two'"),
        (["mlp", "--rank", "2"], 2, "--rank 2 is outside world size 2"),
        (["mlp", "--out", "x.png"], 2, "add --format dot"),
        (["mlp", "--format", "svg"], 2, "invalid choice: 'svg'"),
    ],
)
def test_bad_input(capsys, user_file, argv, status, message):
    argv = [a.format(user_file=user_file) for a in argv]
    if "--world-size" not in argv:
        argv += ["--world-size", "2"]
    code, out, err = run(capsys, "inspect", *argv)
    assert code == status, err
    assert message in err and out == ""
    assert "Traceback" not in err
    assert ("usage: fxtp inspect" in err) == (status == 2)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("boom.py", "raise RuntimeError('boom at import')\n", "importing {path} raised RuntimeError at boom.py:1: boom at import"),
        ("syntax.py", "def build(:\n", "importing {path} raised SyntaxError at syntax.py:1"),
        ("needs.py", "import no_such_package_xyz\n", "importing {path} raised ModuleNotFoundError at needs.py:1"),
    ],
)
def test_a_model_file_that_fails_to_import_is_one_line(capsys, tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    code, out, err = run(capsys, "inspect", f"{path}:build", "-n", "2")
    assert code == 1 and out == "" and "Traceback" not in err
    assert message.format(path=path) in err, err


def test_verify_compares_with_the_same_dropout_masks(capsys, user_file):
    """A model in train mode with dropout: both runs draw from one generator state, so --verify
    checks fxtp's global-mask dropout instead of failing on two different draws."""
    code, out, err = run(capsys, "inspect", f"{user_file}:dropout_mlp", "-n", "2", "--verify")
    assert code == 0 and out.rstrip().endswith("OK"), out + err


def test_verbose_adds_the_traceback(capsys):
    code, _, err = run(capsys, "inspect", "mlp", "-n", "2", "--input", "3x5", "--verbose")
    assert code == 1 and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("fxtp: error: mlp does not run on --input 3x5: module '0' (Linear")


def test_input_specs():
    gen = torch.Generator().manual_seed(0)
    ids = InputSpec.parse("2x16:int64[0,128)").make(gen, torch.device("cpu"))
    assert ids.shape == (2, 16) and ids.dtype == torch.int64 and 0 <= ids.min() and ids.max() < 128
    x = InputSpec.parse("2x3x4:bfloat16[-1,1)").make(gen, torch.device("cpu"))
    assert x.dtype == torch.bfloat16 and x.shape == (2, 3, 4) and -1 <= x.min() and x.max() < 1
    assert InputSpec.parse("2x16x64") == InputSpec((2, 16, 64), torch.float32)
    for bad in ("", "x2", "2x16:int64[5,5)", "2x16:int64[0.5,3)", "2,16", "2x16:int64[0,128]"):
        with pytest.raises(ValueError):
            InputSpec.parse(bad)


def test_verify_over_tolerance_exits_1(capsys, monkeypatch):
    import fxtp.cli.verify

    monkeypatch.setattr(fxtp.cli.verify, "verify", lambda *a, **k: VerifyResult(2, 1e-7, 3e-2, 4, 1e-4))
    code, out, _ = run(capsys, "inspect", "mlp", "-n", "2", "--verify")
    assert code == 1 and "gradients: max abs error 3.00e-02" in out and "FAIL: over tolerance" in out


def test_verify_failure_on_the_ranks_is_one_line(capsys, user_file):
    """Ranks that fail (here: the builder gives them another shape) are one message, no traceback."""
    code, _, err = run(capsys, "inspect", f"{user_file}:other_on_ranks", "-n", "2", "--verify")
    assert code == 1 and "Traceback" not in err
    assert err.startswith(
        "fxtp: error: verify failed on rank(s) 0, 1: RuntimeError: Error(s) in loading state_dict for Linear: "
        "size mismatch for weight: copying a param with shape torch.Size([16, 16]) from checkpoint"
    )
    assert err.count("\n") == 1


def test_verify_failure_message():
    from fxtp.cli.verify import _failure_message

    errors = [(1, "IndexError: index out of range", "Traceback 1"), (0, "IndexError: index out of range", "Traceback 0"), (2, "x", "T2")]
    assert _failure_message(errors, verbose=False) == "verify failed on rank(s) 0, 1: IndexError: index out of range\nverify failed on rank(s) 2: x"
    assert _failure_message(errors, verbose=True).endswith("rank 0:\nTraceback 0\nrank 1:\nTraceback 1\nrank 2:\nT2")


def test_python_dash_m_fxtp_verify():
    """One real run: ``python -m fxtp`` starts, and --verify runs 2 gloo ranks (seconds)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-m", "fxtp", "inspect", "mlp", "--world-size", "2", "--format", "json", "--verify"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    report, _, verified = done.stdout.partition("\nverify: ")
    assert json.loads(report)["world_size"] == 2
    assert verified.startswith("2 rank(s) on gloo") and "outputs:   max abs error" in verified
    assert "(4 parameters)" in verified and verified.rstrip().endswith("OK")


def test_help_and_usage_errors_import_no_torch():
    """``fxtp --help``, ``fxtp inspect --help``, ``fxtp plan --help``, a missing argument and a
    bad MODEL (an unknown name: exit 2; a missing ``config.json`` or ``file.py``: exit 1, the
    errors ``load_model`` gives) answer without importing torch (seconds of start-up): the
    parser's converters import on call, ``FORMATS``, ``HARDWARE`` and ``EXAMPLE_NAMES`` come from
    torch-free modules. One subprocess runs them all, each to its exit status, and lists what of
    torch got loaded."""
    code = (
        "import sys, contextlib, io; from fxtp.cli.main import main\n"
        "cases = [(['--help'], 0, 'usage: fxtp'), (['inspect', '--help'], 0, 'usage: fxtp'),\n"
        "         (['plan', '--help'], 0, 'h200'), (['plan'], 2, 'usage: fxtp'),\n"
        "         (['inspect', 'no_such_model', '-n', '2'], 2, \"unknown model 'no_such_model': use a built-in example (mlp,\"),\n"
        "         (['plan', 'nosuch.json', '-n', '8', '-m', '80GiB'], 1,\n"
        "          'fxtp: error: no such file: nosuch.json (MODEL is a Hugging Face config.json)'),\n"
        "         (['inspect', 'missing_dir/missing.py:build', '-n', '2'], 1, 'fxtp: error: no such file: missing_dir/missing.py')]\n"
        "for argv, status, text in cases:\n"
        "    out = io.StringIO()\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out): code = main(argv)\n"
        "    except SystemExit as exc:\n"
        "        code = exc.code\n"
        "    assert code == status and text in out.getvalue(), (argv, code, out.getvalue())\n"
        "    loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
        "    assert not loaded, (argv, loaded[:5])\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_example_names_are_the_examples():
    """The CLI's torch-free list of built-in names is ``EXAMPLES``'s, in its order."""
    from fxtp.cli.main import EXAMPLE_NAMES
    from fxtp.cli.examples import EXAMPLES

    assert EXAMPLE_NAMES == tuple(EXAMPLES)


def test_inspect_shows_a_repeated_block_once(capsys, user_file):
    """Issue 32: 32 identical blocks print block 0's rows and one count line; --all-layers keeps
    every row; the JSON is the same either way."""
    code, short, _ = run(capsys, "inspect", f"{user_file}:deep", "-n", "2")
    assert code == 0
    lines = short.splitlines()
    assert "x32 identical blocks: layers.0-31" in lines
    assert [line.split()[0] for line in lines if line.startswith("layers.")] == ["layers.0.up", "layers.0.down"]
    assert any(line.startswith("last.0.up") for line in lines)  # a list of one block: shown as is
    code, full, _ = run(capsys, "inspect", f"{user_file}:deep", "-n", "2", "--all-layers")
    assert code == 0 and "identical blocks" not in full
    assert [line.split()[0] for line in full.splitlines() if line.startswith("layers.")] == [
        f"layers.{i}.{name}" for i in range(32) for name in ("up", "down")]
    assert len(lines) <= 40 < 100 <= len(full.splitlines()), (len(lines), len(full.splitlines()))
    assert short.split("\n\n", 2)[2] == full.split("\n\n", 2)[2]  # the notes and summary are the same
    names = [line.split()[0] for line in lines if line.startswith(("layers.", "last.", "head"))]
    assert len(lines[3].split()[0]) == max(map(len, names))  # the count line does not widen the layer column
    _, as_json, _ = run(capsys, "inspect", f"{user_file}:deep", "-n", "2", "-f", "json")
    _, all_json, _ = run(capsys, "inspect", f"{user_file}:deep", "-n", "2", "-f", "json", "--all-layers")
    assert json.loads(as_json)["layers"] == json.loads(all_json)["layers"] and len(json.loads(as_json)["layers"]) == 67


def test_collapse_keeps_blocks_that_differ():
    from fxtp.explain.repeats import collapse_blocks

    names = ["emb", "h.0.fc", "h.1.fc", "h.2.fc", "h.3.fc", "h.10.fc"]
    rows = [(n, "colwise" if n != "h.2.fc" else "rowwise", f"until {n}") for n in names]
    shown = collapse_blocks(rows, names)
    assert [line or row[0] for line, row in shown] == [
        "emb", "h.0.fc", "x2 identical blocks: h.0-1", "h.2.fc", "h.3.fc", "h.10.fc"]


def test_a_mistyped_flag_gets_a_suggestion(capsys):
    code, out, err = run(capsys, "inspect", "mlp", "--fromat", "json", "-n", "2")
    assert code == 2 and out == "" and "usage: fxtp inspect" in err
    assert "fxtp inspect: error: unrecognized arguments: --fromat json (did you mean --format?)" in err
    code, _, err = run(capsys, "plan", "mlp", "-n", "2", "-m", "8GiB", "--devics-per-node", "4")
    assert code == 2 and "(did you mean --devices-per-node?)" in err
    code, _, err = run(capsys, "inspect", "mlp", "-n", "2", "--zzzzzz")
    assert code == 2 and "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err


def test_input_errors_speak_the_cli(capsys, tmp_path):
    """Issue 34: an --input the model cannot take is said in --input's syntax, not the Python
    API's (no example_inputs): for a model with weights (run before the plan) and for a
    config.json on meta (whose inputs the capture refuses)."""
    code, out, err = run(capsys, "inspect", "mlp", "-n", "2", "--input", "3x5")
    assert code == 1 and out == ""
    assert err.startswith("fxtp: error: mlp does not run on --input 3x5: module '0' (Linear(in_features=64")
    assert "fix: pass one --input SPEC per positional input" in err and "AxBxC[:dtype][[lo,hi)]" in err
    assert "example_inputs" not in err and "example inputs" not in err
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128,
        "max_position_embeddings": 64}))
    code, out, err = run(capsys, "inspect", str(config), "-n", "2", "--input", "2x16")  # float32, not token ids
    assert code == 1 and out == ""
    assert err.startswith(f"fxtp: error: {config} does not run on --input 2x16: module 'model.embed_tokens' (Embedding(128, 64))")
    assert "fix: pass one --input SPEC" in err and "example_inputs" not in err and "example inputs" not in err
