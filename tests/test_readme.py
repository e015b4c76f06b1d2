"""The README's commands and code run as pasted.

* ``bash`` blocks: each line, split at ``&&``, is parsed by ``bash`` (quoting, expansion: a
  paste that is a shell syntax error fails here), which records the argv of each ``fxtp`` and
  ``python -c`` call; the calls then run in this process, from an empty directory (fast: no
  interpreter start per command). The install, test-suite and benchmark parts are skipped
  (:data:`SKIPPED`: minutes and the network; CI runs them itself); the ``fxtp`` parts run.
* ``$ fxtp ...`` lines in plain blocks (the shown outputs): run likewise.
* ``python`` blocks: in order, in one namespace per rank, on 2 real gloo ranks (the session's
  pool; its process group stands in for the one the first block initializes). A block marked
  ``<!-- readme-test: skip (reason) -->`` on the line above is not run: a sketch with the
  user's own names, or one that needs CUDA.

Inline code in the prose names commands with placeholders (``fxtp inspect MODEL -n N``); the
runnable forms are in the blocks.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from _helpers import shell_calls
from fxtp.explain.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

# Command parts not run, by prefix, and why.
SKIPPED = {
    "python -m venv": "the install: minutes and the network; CI runs it (.ci/run)",
    ". .venv/bin/activate": "the install",
    "pip install": "the install",
    "python -m pytest": "the test suite itself",
    "python tools/bench.py": "the benchmark: about 3 minutes; docs/bench.json holds its last run",
}
NEEDS_DOT = "--format dot --out"  # rendering a picture needs Graphviz's dot

_BLOCK = re.compile(r"(?:<!-- readme-test: (?P<mark>[^\n]*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)


def _blocks(lang: str) -> list[tuple[str, str | None]]:
    return [(m["body"], m["mark"]) for m in _BLOCK.finditer(README) if m["lang"] == lang]


def _commands() -> list[str]:
    """Every command part the README shows: bash lines split at ``&&``, and ``$ `` lines."""
    lines = [line for body, _ in _blocks("bash") for line in body.splitlines()]
    lines += [line[2:] for body, _ in _blocks("") for line in body.splitlines() if line.startswith("$ ")]
    parts = [part.strip() for line in lines if line.strip() and not line.lstrip().startswith("#") for part in line.split(" && ")]
    return [p for p in parts if not p.startswith(tuple(SKIPPED))]


def test_the_readme_shows_what_is_tested():
    """The extraction finds the commands this file is about (a README edit that hides them fails)."""
    commands = _commands()
    assert "fxtp demo" in commands
    assert any(c.startswith("fxtp inspect llama-2-7b/config.json") for c in commands)
    assert any("'2x17:int64[0,128)'" in c for c in commands)
    assert sum(mark is None for _, mark in _blocks("python")) >= 2


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One empty directory for every command, in README order (the config.json a command
    writes is read by the next)."""
    path = tmp_path_factory.mktemp("readme")
    (path / "docs").mkdir()
    return path


@pytest.mark.parametrize("command", _commands())
def test_command_runs_as_pasted(command, workdir, capsys, monkeypatch):
    """Each call runs in this process (``fxtp ARGS`` is ``fxtp.explain.cli.main(ARGS)``, ``python -c
    CODE`` is ``exec(CODE)``): exit 0, or, after ``||``, one fxtp error line and exit 1."""
    if NEEDS_DOT in command and shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed")
    monkeypatch.chdir(workdir)
    calls = shell_calls(command, workdir)
    assert calls and {argv[0] for argv in calls} <= {"fxtp", "python"}, calls
    for program, *args in calls:
        if program == "python":
            assert args[0] == "-c", f"{command}: only python -c is run in process"
            exec(compile(args[1], "<README python -c>", "exec"), {})  # noqa: S102 - the README's own code
            continue
        try:
            code = main(args)
        except SystemExit as exc:  # argparse: bad usage
            code = exc.code
        _, err = capsys.readouterr()
        if " || " in command:  # shows a failure on purpose
            assert code == 1 and err.startswith("fxtp: error: ") and err.count("\n") == 1, err
        else:
            assert code == 0, f"{command}\n{err[-3000:]}"
        assert "Traceback" not in err, err


def _run_python_blocks(blocks: list[str], workdir: str) -> tuple[str, float]:
    """On each rank: the blocks in one namespace, from ``workdir``; returns what they printed and
    the max abs difference of ``y`` from ``model(x)`` (the first block's claim)."""
    import torch
    import torch.distributed as dist

    init, cwd = dist.init_process_group, os.getcwd()
    dist.init_process_group = lambda *args, **kwargs: None  # the pool's group is already up
    os.chdir(workdir)
    namespace: dict = {}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            for block in blocks:
                exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    finally:
        dist.init_process_group = init
        os.chdir(cwd)
    with torch.no_grad():
        error = float((namespace["y"] - namespace["model"](namespace["x"])).abs().max())
    return out.getvalue(), error


def test_python_blocks_run_on_two_ranks(rank_pools, tmp_path):
    blocks = [body for body, mark in _blocks("python") if mark is None]
    for body, mark in _blocks("python"):
        assert mark is None or mark.startswith("skip ("), f"unknown readme-test mark {mark!r}"
        compile(body, "README.md", "exec")  # a skipped sketch still parses
    results = rank_pools(2).run(_run_python_blocks, blocks, str(tmp_path))
    for printed, error in results:
        assert printed.startswith("fxtp plan: world_size 2") and error < 1e-5
    assert (tmp_path / "ckpt.pt").is_file()
