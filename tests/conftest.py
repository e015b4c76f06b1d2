"""Shared fixtures."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Callable

import pytest
from _cores import cores_shared, remove_lock_files
from _dist import RankPool

# `python -m pytest -m quick`: a first check of a few minutes (the README's), the per-op rules,
# the package structure and the API in one process, no ranks.
QUICK_MODULES = ("test_rules.py", "test_rules_graphs.py", "test_rules_graphs_more.py", "test_structure.py", "test_api.py")


# pytest-xdist (the README's `python -m pytest -q -n 2`): how the suite shares two workers.
# A test that starts gloo ranks asks for the fixture `pool` or `rank_pools`, directly or through
# a fixture of its module; those tests run in one worker, so the ranks start once per session
# and two worlds of ranks never share the cores. The rest run beside them, in the other worker.
_RANK_FIXTURES = frozenset({"pool", "rank_pools"})
# Long modules without ranks, started first so that the other worker is not left with them last.
FIRST_MODULES = ("test_docs.py", "test_bench.py")


def _rank_tests(path: Path) -> frozenset[str]:
    """Names of the test functions in ``path`` that need ranks (read from its source, as the
    xdist controller does not collect): a parameter named in :data:`_RANK_FIXTURES`, or one
    naming a function of the module that needs them (its fixtures), transitively."""
    functions = {node.name: {a.arg for a in node.args.args + node.args.kwonlyargs}
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}
    needs = set(_RANK_FIXTURES)
    while True:
        more = {name for name, args in functions.items() if args & needs} - needs
        if not more:
            break
        needs |= more
    return frozenset(name for name in needs if name.startswith("test_"))


RANK_TESTS = {p.name: _rank_tests(p) for p in Path(__file__).parent.glob("test_*.py")}


def _needs_ranks(module: str, test: str) -> bool:
    return test.split("::")[-1].split("[")[0] in RANK_TESTS.get(module, ())


def _order(item: pytest.Item) -> int:
    name = item.path.name
    if _needs_ranks(name, item.name):
        return 0
    return 1 + FIRST_MODULES.index(name) if name in FIRST_MODULES else 1 + len(FIRST_MODULES)


def scope_of(nodeid: str) -> str:
    """The unit of work one xdist worker takes: ``ranks`` for every test that needs ranks; each
    docs block on its own (``tests/test_docs.py`` runs them in fresh directories); the other
    tests of a module together (its module-scoped fixtures are built once per worker, and its
    tests run in file order: the docs' commands share one directory, in page order)."""
    path, _, test = nodeid.partition("::")
    name = Path(path).name
    if _needs_ranks(name, test):
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    """Each test that needs no ranks shares the cores (tests/_cores.py): the worker of the rank
    pools takes them alone where it times its ranks."""
    if _needs_ranks(item.path.name, item.name):
        return (yield)
    with cores_shared():
        return (yield)


_TEST_RUNS: set[str] = set()  # xdist's test run ids, on its controller


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist's controller, for each worker it starts: the run id tests/_cores.py's locks use."""
    _TEST_RUNS.add(node.workerinput["testrunuid"])


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The controller's, after every worker: tests/_cores.py's lock files removed from /tmp."""
    for run in _TEST_RUNS:
        remove_lock_files(run)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the quick modules, and orders the tests for two workers: the ones that need ranks
    first (the longest unit), then :data:`FIRST_MODULES`, then the rest; within each, in
    collection order."""
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
