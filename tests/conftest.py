"""Shared fixtures."""

from __future__ import annotations

import pytest
from _dist import RankPool


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ws: f"ws{ws}")
def pool(request):
    """Real gloo ranks at world sizes 2 and 4, started once per test module."""
    with RankPool(request.param, timeout_s=300) as p:
        yield p
