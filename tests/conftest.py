"""Shared fixtures."""

from __future__ import annotations

from typing import Callable

import pytest
from _dist import RankPool

# `python -m pytest -m quick`: a first check of a few minutes (the README's), the per-op rules,
# the package structure and the API in one process, no ranks.
QUICK_MODULES = ("test_rules.py", "test_rules_graphs.py", "test_rules_graphs_more.py", "test_structure.py", "test_api.py")


# Fixtures that start real gloo ranks: a module using one runs where the ranks live.
RANK_FIXTURES = frozenset({"pool", "rank_pools"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the quick modules, and groups the tests for pytest-xdist's ``--dist loadgroup``
    (the README's test command runs two workers, one per core):

    * every module that starts gloo ranks goes to one group, ``ranks``, so that the ranks start
      once per session (not once per worker) and two worlds of ranks never share the 2 cores;
    * every other module is a group of its own, so that its module-scoped fixtures are built
      once and a module's tests run in file order (``test_docs`` runs the pages' commands in
      page order, in one directory).
    """
    uses_ranks = {item.path for item in items if RANK_FIXTURES & set(getattr(item, "fixturenames", ()))}
    for item in items:
        if item.path.name in QUICK_MODULES:
            item.add_marker(pytest.mark.quick)
        item.add_marker(pytest.mark.xdist_group("ranks" if item.path in uses_ranks else item.path.name))


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
