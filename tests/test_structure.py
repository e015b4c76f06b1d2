"""The house rules (issue 22): imports run one way, no cycles, small files, cheap ``import fxtp``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fxtp", "passes")
MAX_LINES = 450  # a few hundred lines a file (STYLE.md 11)
MAX_MODULES_PER_PACKAGE = 10


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of ours that ``name`` imports anywhere in its body (functions included: a
    deferred import is still a dependency)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for dep in _imports(name, path, set(modules)):
            # a package's __init__ is executed on the way to its submodules: not an edge of ours
            if not name.startswith(dep + "."):
                graph.add_edge(name, dep)
    return graph


def test_no_import_cycles():
    cycles = sorted(nx.simple_cycles(_import_graph()), key=len)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_passes_depend_only_on_the_core():
    graph = _import_graph()
    wrong = sorted(
        (src, dst)
        for src, dst in graph.edges
        if src.startswith("passes") and dst.startswith("fxtp") and dst != "fxtp" and not dst.startswith("fxtp.core")
    )
    assert not wrong, f"passes import above the core: {wrong}"
    assert not [s for s, d in graph.edges if s.startswith("passes") and d == "fxtp"], "passes import the package root"


def test_the_core_imports_nothing_above_it():
    graph = _import_graph()
    wrong = sorted((s, d) for s, d in graph.edges if s.startswith("fxtp.core") and not d.startswith("fxtp.core") and d != "fxtp")
    assert not wrong, f"the core imports above itself: {wrong}"


def test_nothing_below_the_cli_imports_it():
    """``fxtp.cli`` (the command line, its examples, --verify, the demo) is the top: the
    library (``fxtp.api``, the planner, the report) never imports it; ``python -m fxtp`` does."""
    graph = _import_graph()
    wrong = sorted((s, d) for s, d in graph.edges if d.startswith("fxtp.cli") and not s.startswith("fxtp.cli") and s != "fxtp.__main__")
    assert not wrong, f"the library imports the CLI: {wrong}"


@pytest.mark.parametrize("module", ["passes.plan", "passes.kv_heads", "passes.rewrite", "fxtp.core.collectives", "fxtp.explain.report",
                                    "fxtp.cli.main"])
def test_a_module_imports_on_its_own(module):
    subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, check=True, timeout=120)


def test_import_fxtp_loads_nothing_optional():
    code = (
        "import sys, fxtp; "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'safetensors', 'passes') "
        "or m.startswith(('fxtp.runtime', 'fxtp.explain', 'fxtp.capture', 'fxtp.api', 'fxtp.cli'))]; "
        "print(heavy); assert not heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_old_flat_paths_still_import():
    code = (
        "import fxtp.local_ops, fxtp.core.local_ops as new; from fxtp.activations import measure; "
        "import fxtp; assert fxtp.local_ops is new and fxtp.local_ops.__spec__.name == 'fxtp.core.local_ops'; "
        "assert fxtp.report.Report is fxtp.Report; "
        # the CLI's modules before they left fxtp.explain for fxtp.cli (and hf_config for fxtp.capture)
        "import fxtp.explain.examples, fxtp.cli.examples; assert fxtp.explain.examples is fxtp.cli.examples; "
        "from fxtp.explain.cli import main; from fxtp.cli import main as new; assert main is new; "
        "from fxtp.explain.hf_config import load_config_model; import fxtp.capture.hf_config as h; "
        "assert load_config_model is h.load_config_model"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_files_stay_short():
    long = {
        str(p.relative_to(ROOT)): n
        for top in (*PACKAGES, "tools", "tests", "examples")
        for p in (ROOT / top).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_packages_stay_small():
    big = {}
    for pkg in PACKAGES:
        for folder in [ROOT / pkg, *(p for p in (ROOT / pkg).rglob("*") if p.is_dir() and (p / "__init__.py").exists())]:
            n = len([p for p in folder.iterdir() if p.suffix == ".py" and p.name != "__init__.py" or (p / "__init__.py").exists()])
            if n > MAX_MODULES_PER_PACKAGE + 3:  # "about 10"
                big[str(folder.relative_to(ROOT))] = n
    assert not big, f"packages with too many modules: {big}"


def test_package_names_that_were_modules_keep_their_names():
    code = (
        "import fxtp; from fxtp.runtime import ParallelModule; from fxtp.capture import capture, FRONTENDS; "
        "assert ParallelModule is fxtp.ParallelModule"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_every_package_is_installed():
    """pyproject's explicit ``packages`` list names every package directory: a wheel (not the
    editable install the suite uses) would leave an unlisted subpackage out."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for top in PACKAGES for init in (ROOT / top).rglob("__init__.py")}
    assert found == listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}; remove: {sorted(listed - found)}"
