"""Golden graphs and plans: rank 0 of every built-in tiny example at world sizes 2 and 4.

``tests/golden/<example>_ws<N>.graph.txt`` is ``fxtp inspect <example> -n N --format graph``,
``<example>_ws<N>.plan.txt`` is ``--format table``. A changed rendering fails here with a diff;
review it like code and accept it with ``python tools/accept_golden.py`` (which runs this file
with ``EXPECTTEST_ACCEPT=1``). CI never accepts. A golden file without a case here fails too
(accepting deletes it).
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from pathlib import Path

import pytest

import fxtp
from fxtp.cli.examples import EXAMPLES
from fxtp.cli.inspection import load_model, render

GOLDEN = Path(__file__).parent / "golden"
ACCEPT = os.environ.get("EXPECTTEST_ACCEPT") == "1"  # expecttest's switch
TINY = [name for name, example in EXAMPLES.items() if not example.meta]
WORLD_SIZES = (2, 4)
KINDS = {"graph": "graph", "plan": "table"}  # file kind -> inspect --format
CASES = [(name, ws, kind) for name in TINY for ws in WORLD_SIZES for kind in KINDS]


def _path(name: str, ws: int, kind: str) -> Path:
    return GOLDEN / f"{name}_ws{ws}.{kind}.txt"


@functools.cache
def _compiled(name: str, ws: int) -> fxtp.ParallelModule:
    loaded = load_model(name)
    assert loaded.inputs is not None
    return fxtp.compile(loaded.model, ws, loaded.inputs, rank=0)


def _check(path: Path, actual: str) -> None:
    if ACCEPT:
        path.write_text(actual)
        return
    if not path.exists():
        pytest.fail(f"no golden file {path.name}; create it with: python tools/accept_golden.py")
    expected = path.read_text()
    if actual != expected:
        diff = difflib.unified_diff(expected.splitlines(), actual.splitlines(), f"{path.name} (golden)", "rendered", lineterm="")
        lines = list(diff)
        shown = "\n".join(lines[:80]) + (f"\n... {len(lines) - 80} more diff lines" if len(lines) > 80 else "")
        pytest.fail(f"{path.name} differs from the rendering (review, then python tools/accept_golden.py):\n{shown}")


@pytest.mark.parametrize("name, ws, kind", CASES, ids=[f"{n}-ws{w}-{k}" for n, w, k in CASES])
def test_golden(name, ws, kind):
    text = render(_compiled(name, ws), KINDS[kind], name=name)
    assert not re.search(r"0x[0-9a-f]{6,}|/work/|/home/|site-packages", text), "unstable text in a golden"
    _check(_path(name, ws, kind), text)


def test_no_golden_without_a_case():
    expected = {_path(*case).name for case in CASES}
    orphans = sorted(p.name for p in GOLDEN.glob("*") if p.name not in expected)
    if ACCEPT:
        for name in orphans:
            (GOLDEN / name).unlink()
        return
    assert not orphans, f"golden files without a test case (accept to delete them): {orphans}"
