"""The README and every page of the guide (``docs/*.md``) run as pasted.

Pages are collected when this module is imported, so a page added to ``docs/`` later is
covered without an edit here.

* ``python`` blocks: each is written to a file and run, from an empty directory, with a
  timeout. The README's blocks start a fresh ``python`` or the real ``torchrun``; the docs
  pages' blocks are forked from one process that has imported torch and fxtp
  (``tests/_zygote.py``, with torchrun's environment and failure rule), which saves seconds of
  CPU per rank. The first line says how:

  - ``# torchrun --nproc-per-node N FILE.py``: under torchrun (``python -m
    torch.distributed.run``, the console script's module), with ``--standalone`` added unless the
    line gives a rendezvous, so that runs at the same time do not share port 29500;
  - ``# excerpt: why``: not run, a fragment of a bigger program (it must still parse);
  - anything else: ``python FILE.py``.

  A block passes when it exits 0: blocks assert their own claims (``assert_close`` against the
  single-device model, ``assert`` on figures).
* ``bash`` blocks: each line, split at ``&&``, is parsed by ``bash`` (quoting, expansion: a
  paste that is a shell syntax error fails here), which records the argv of each ``fxtp`` and
  ``python -c`` call; the calls then run in this process, from one empty directory shared by
  all pages, in page order (the ``config.json`` a command writes is read by the next). The
  install, test-suite, benchmark and torchrun parts are skipped (:data:`SKIPPED`: minutes and
  the network; CI and other tests run them).
* ``$ fxtp ...`` lines in output blocks (no language, or ``text``): run likewise.
* Any other fence language fails: a block must be run, or say why not.

Inline code in the prose names commands with placeholders (``fxtp inspect MODEL -n N``); the
runnable forms are in the blocks.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from _helpers import shell_calls
from _zygote import Zygote
from fxtp.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 260  # issue 22: "the README fits in about 250 lines"
BLOCK_TIMEOUT_S = 600  # a torchrun block on 2 ranks takes ~15 s on 2 idle cores, ~60 s loaded

# Command parts not run, by prefix, and why.
SKIPPED = {
    "python -m venv": "the install: minutes and the network; CI runs it (.ci/run)",
    ". .venv/bin/activate": "the install",
    "pip install": "the install",
    "python -m pytest": "the test suite itself",
    "python tools/bench.py": "the benchmark: about 3 minutes; docs/bench.json holds its last run",
    "torchrun --nproc-per-node 2 examples/train.py": "tests/test_training.py runs it",
}
NEEDS_DOT = "--format dot --out"  # rendering a picture needs Graphviz's dot
OUTPUT_LANGS = {"", "text"}

_FENCE = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```$", re.S | re.M)
_TORCHRUN = re.compile(r"# torchrun (?P<args>.*\S)\s*$")
_EXCERPT = re.compile(r"# excerpt: \S")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    lang: str
    body: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.body.split("\n", 1)[0]


def _blocks(lang: str | set[str] | None = None) -> list[Block]:
    langs = {lang} if isinstance(lang, str) else lang
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in _FENCE.finditer(text):
            block = Block(str(page.relative_to(ROOT)), text.count("\n", 0, m.start()) + 1, m["lang"], m["body"])
            if langs is None or block.lang in langs:
                found.append(block)
    return found


def _commands() -> list[str]:
    """Every command part the pages show: bash lines split at ``&&``, and ``$ `` lines."""
    lines = [line for b in _blocks("bash") for line in b.body.splitlines()]
    lines += [line[2:] for b in _blocks(OUTPUT_LANGS) for line in b.body.splitlines() if line.startswith("$ ")]
    parts = [part.strip() for line in lines if line.strip() and not line.lstrip().startswith("#") for part in line.split(" && ")]
    return [p for p in parts if not p.startswith(tuple(SKIPPED))]


def _python_blocks() -> list[Block]:
    return [b for b in _blocks("python") if not _EXCERPT.match(b.first_line)]


def test_the_docs_show_what_is_tested():
    """The extraction finds what this file is about (an edit that hides it fails)."""
    commands = _commands()
    assert "fxtp demo" in commands
    assert any(c.startswith("fxtp inspect llama-2-7b/config.json") for c in commands)
    assert any("'2x17:int64[0,128)'" in c for c in commands)
    runnable = _python_blocks()
    assert sum(_TORCHRUN.match(b.first_line) is not None for b in runnable) >= 4
    assert any(b.page == "README.md" and _TORCHRUN.match(b.first_line) for b in runnable), "the quickstart runs"
    for page in PAGES:
        text = page.read_text()
        fences = text.count("\n```") + text.startswith("```")
        assert fences == 2 * len(_FENCE.findall(text)), f"{page.name}: a fence the test does not see (indented, or unclosed)"


def test_every_block_is_run_or_says_why_not():
    known = {"python", "bash"} | OUTPUT_LANGS
    unknown = [f"{b.where} ```{b.lang}" for b in _blocks() if b.lang not in known]
    assert not unknown, f"blocks in a language this test does not run (use python, bash or plain): {unknown}"
    for block in _blocks("python"):
        compile(block.body, block.where, "exec")  # an excerpt still parses


def test_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= README_MAX_LINES, "the README grows: move the detail to a docs/ page"
    unlinked = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


# Pages the README links that other branches add; drop an entry once its page is merged.
_LINK = re.compile(r"\]\((?!https?://|#)(?P<target>[^)#\s]+)")
_REPO_PATH = re.compile(r"`(?P<path>(?:fxtp|passes|tests|tools|examples|docs)/[\w/.-]*)`")
_MODULE_PATH = re.compile(r"`(?P<name>fxtp(?:\.\w+)+)`")


def test_links_and_named_paths_exist():
    """Every relative link, every repository path in backquotes (`fxtp/core/collectives.py`)
    and every dotted fxtp name (`fxtp.core.activations.measure`) resolves: a page that names
    what moved fails here."""
    missing = []
    for page in PAGES:
        text = page.read_text()
        for m in _LINK.finditer(text):
            target = (page.parent / m["target"]).resolve()
            rel = target.relative_to(ROOT) if target.is_relative_to(ROOT) else target
            if not target.exists():
                missing.append(f"{page.name}: link {m['target']}")
        missing += [f"{page.name}: `{m['path']}`" for m in _REPO_PATH.finditer(text) if not (ROOT / m["path"]).exists()]
        for m in _MODULE_PATH.finditer(text):
            if not _resolves(m["name"]):
                missing.append(f"{page.name}: `{m['name']}`")
    assert not missing, "named but missing: " + "; ".join(sorted(set(missing)))


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_readme_test_command_is_what_ci_runs():
    """The README's test command is `.ci/run`'s, command for command."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    steps = [line for line in ci if line and not line.startswith(("#", "set ", "cd "))]
    assert " && ".join(steps) in (ROOT / "README.md").read_text()


def test_quick_marker_selects_existing_modules():
    from conftest import QUICK_MODULES

    assert QUICK_MODULES and all((ROOT / "tests" / name).is_file() for name in QUICK_MODULES)
    assert "python -m pytest -q -m quick" in (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One empty directory for every command, in page order."""
    path = tmp_path_factory.mktemp("docs")
    (path / "docs").mkdir()
    return path


@pytest.mark.parametrize("command", _commands())
def test_command_runs_as_pasted(command, workdir, capsys, monkeypatch):
    """Each call runs in this process (``fxtp ARGS`` is ``fxtp.cli.main.main(ARGS)``, ``python -c
    CODE`` is ``exec(CODE)``): exit 0, or, after ``||``, one fxtp error line and exit 1."""
    if NEEDS_DOT in command and shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed")
    monkeypatch.chdir(workdir)
    calls = shell_calls(command, workdir)
    assert calls and {argv[0] for argv in calls} <= {"fxtp", "python"}, calls
    for program, *args in calls:
        if program == "python":
            assert args[0] == "-c", f"{command}: only python -c is run in process"
            exec(compile(args[1], "<docs python -c>", "exec"), {})  # noqa: S102 - the docs' own code
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


def _argv(block: Block, path: Path) -> list[str]:
    m = _TORCHRUN.match(block.first_line)
    if m is None:
        return [sys.executable, str(path)]
    args = shlex.split(m["args"])
    assert args and args[-1].endswith(".py"), f"{block.where}: `# torchrun [options] FILE.py`, got {block.first_line!r}"
    if not any(a.startswith(("--standalone", "--rdzv", "--master")) for a in args):
        args.insert(0, "--standalone")
    return [sys.executable, "-m", "torch.distributed.run", *args[:-1], str(path)]


def _block_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too; the cores are shared
    return env


@pytest.fixture(scope="module")
def zygote():
    """Forks the docs pages' blocks from one process that has imported torch and fxtp
    (``tests/_zygote.py``: seconds of CPU saved per rank); the README's own blocks still start
    fresh interpreters under the real ``torchrun``."""
    z = Zygote(_block_env())
    yield z
    z.close()


def _block_file(block: Block, tmp_path: Path) -> Path:
    m = _TORCHRUN.match(block.first_line)
    path = tmp_path / (m["args"].split()[-1] if m else "block.py")
    path.write_text(block.body)
    return path


def _nproc(block: Block) -> int | None:
    """``--nproc-per-node N`` of a ``# torchrun`` first line; ``None`` for ``python FILE.py``."""
    m = _TORCHRUN.match(block.first_line)
    if m is None:
        return None
    args = shlex.split(m["args"])
    flags = [a for a in args if a.startswith("--nproc")]
    assert len(flags) == 1 and not any(a.startswith(("--nnodes", "--rdzv", "--master")) for a in args), (
        f"{block.where}: a page's torchrun line is `# torchrun --nproc-per-node N FILE.py`; got {block.first_line!r}")
    value = flags[0].split("=", 1)[1] if "=" in flags[0] else args[args.index(flags[0]) + 1]
    return int(value)


@pytest.mark.parametrize("block", [b for b in _python_blocks() if b.page != "README.md"], ids=lambda b: b.where)
def test_python_block_runs_as_a_file(block, tmp_path, zygote):
    code, out = zygote.run(_block_file(block, tmp_path), cwd=tmp_path, env=_block_env(), nproc=_nproc(block),
                           timeout_s=BLOCK_TIMEOUT_S)
    assert code != -9, f"{block.where} ran over {BLOCK_TIMEOUT_S} s:\n{out[-4000:]}"
    assert code == 0, f"{block.where} exited {code}:\n{out[-6000:]}"


@pytest.mark.parametrize("block", [b for b in _python_blocks() if b.page == "README.md"], ids=lambda b: b.where)
def test_readme_block_runs_under_torchrun(block, tmp_path):
    """The README's blocks, as a new user pastes them: a fresh ``python`` or the real ``torchrun``."""
    path = _block_file(block, tmp_path)
    proc = subprocess.Popen(_argv(block, path), cwd=tmp_path, env=_block_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's ranks too: they share its session
        out, _ = proc.communicate()
        pytest.fail(f"{block.where} ran over {BLOCK_TIMEOUT_S} s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{block.where} exited {proc.returncode}:\n{out[-6000:]}"


def test_inspecting_lists_every_built_in():
    """docs/inspecting.md names every built-in MODEL ``fxtp inspect`` accepts."""
    from fxtp.cli.examples import EXAMPLES

    text = (ROOT / "docs" / "inspecting.md").read_text()
    assert [name for name in EXAMPLES if f"`{name}`" not in text] == []
