"""Shared fixtures."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest
from _dist import RankPool

# `python -m pytest -m quick`: a first check of a few minutes (the README's), the per-op rules,
# the package structure and the API in one process, no ranks.
QUICK_MODULES = ("test_rules.py", "test_rules_graphs.py", "test_rules_graphs_more.py", "test_structure.py", "test_api.py")


# pytest-xdist (the README's `python -m pytest -q -n 2`): how the suite shares two workers.
# A module that starts gloo ranks names the fixture `pool` or `rank_pools`; those modules run in
# one worker, so the ranks start once per session and two worlds of ranks never share the cores.
_RANK_FIXTURE = re.compile(r"\b(pool|rank_pools)\b")
RANK_MODULES = frozenset(p.name for p in Path(__file__).parent.glob("test_*.py") if _RANK_FIXTURE.search(p.read_text()))
# Long modules without ranks, started first so that the other worker is not left with them last.
FIRST_MODULES = ("test_docs.py", "test_bench.py")


def _order(item: pytest.Item) -> int:
    name = item.path.name
    return 0 if name in RANK_MODULES else 1 + FIRST_MODULES.index(name) if name in FIRST_MODULES else 1 + len(FIRST_MODULES)


def scope_of(nodeid: str) -> str:
    """The unit of work one xdist worker takes: ``ranks`` for every module in
    :data:`RANK_MODULES`; each docs block on its own (``tests/test_docs.py`` runs them in fresh
    directories); any other module whole (its module-scoped fixtures are built once, and its
    tests run in file order: the docs' commands share one directory, in page order)."""
    path, _, test = nodeid.partition("::")
    name = Path(path).name
    if name in RANK_MODULES:
        return "ranks"
    if name == "test_docs.py" and test.startswith("test_python_block_runs_as_a_file"):
        return nodeid
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling with :func:`scope_of` as the scope. (xdist's ``loadgroup`` marks
    do not take under pytest 9, which no longer reads the ``_nodeid`` xdist rewrites; a scope
    scheduler with its own ``_split_scope`` is what xdist's ``loadfile`` itself is.)"""
    from xdist.scheduler import LoadScopeScheduling

    class _Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return _Scheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the quick modules, and orders the modules for two workers: the ranks' modules
    first (the longest unit), then :data:`FIRST_MODULES`, then the rest; each module's tests stay
    together, in file order."""
    for item in items:
        if item.path.name in QUICK_MODULES:
            item.add_marker(pytest.mark.quick)
    items.sort(key=_order)  # stable


@pytest.fixture(scope="session")
def rank_pools() -> Callable[[int], RankPool]:
    """``rank_pools(ws)``: real gloo ranks of world size ``ws``, started once per test session
    (a rank costs seconds to start: spawn, ``import torch``/``transformers``, rendezvous) and
    shared by every test module that asks for that world size."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size, timeout_s=300)
        return pools[world_size]

    yield get
    for p in pools.values():
        p.close()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ws: f"ws{ws}")
def pool(request, rank_pools):
    """Real gloo ranks at world sizes 2 and 4."""
    return rank_pools(request.param)
