"""Shared fixtures."""

from __future__ import annotations

from typing import Callable

import pytest
from _dist import RankPool

# `python -m pytest -m quick`: a first check of a few minutes (the README's), the per-op rules,
# the package structure and the API in one process, no ranks.
QUICK_MODULES = ("test_rules.py", "test_rules_graphs.py", "test_rules_graphs_more.py", "test_structure.py", "test_api.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in QUICK_MODULES:
            item.add_marker(pytest.mark.quick)


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
