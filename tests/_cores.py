"""The host's cores to one timed measurement at a time, across pytest-xdist's workers.

Under ``python -m pytest -n 2`` (the README's and CI's) the tests that need the session's rank
pools run in one worker and the rest beside them in the other (tests/conftest.py). Some of the
rest start ranks of their own (the docs' ``torchrun`` blocks, the benchmarks): on 2 cores, a
calibration beside them ran at a load average of 27 and took 62 and 72 s where it takes 47 alone
(2026-12-07). A test that times its ranks (tests/test_plan_measure.py) holds the cores with
:func:`cores_alone`; every test of the other worker holds them shared (:func:`cores_shared`,
around each test in conftest's ``pytest_runtest_protocol``): the timed test waits for the other
worker's current test to end, and the other worker's next test waits for it. Locks are
``flock`` s on one file per test run (xdist's ``PYTEST_XDIST_TESTRUNUID``); without xdist the
tests run one at a time and nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator

__all__ = ["cores_alone", "cores_shared", "remove_lock_files"]


def _path(run: str, kind: str) -> Path:
    return Path(tempfile.gettempdir()) / f"fxtp-cores-{run}.{kind}"


def remove_lock_files(run: str) -> None:
    """Removes test run ``run``'s lock files (xdist's controller, after every worker ended)."""
    for kind in ("gate", "lock"):
        _path(run, kind).unlink(missing_ok=True)


def _take(f, mode: int, deadline: float) -> bool:
    """``flock`` ``f`` in ``mode`` before ``deadline`` (``time.monotonic``); whether it did."""
    while True:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


@contextlib.contextmanager
def _locked(mode: int, timeout_s: float) -> Iterator[float]:
    """Holds the run's lock in ``mode`` (``fcntl.LOCK_SH`` or ``LOCK_EX``), waiting at most
    ``timeout_s`` for it (then going on without it, rather than failing the test); yields the
    seconds waited. A gate taken first keeps a waiting ``LOCK_EX`` ahead of the ``LOCK_SH`` s
    that come after it (one worker's tests follow each other within milliseconds)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield 0.0
        return
    start = time.monotonic()
    deadline = start + timeout_s
    with open(_path(run, "gate"), "a") as gate, open(_path(run, "lock"), "a") as lock:
        held = False
        if _take(gate, fcntl.LOCK_EX, deadline):
            held = _take(lock, mode, deadline)
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield time.monotonic() - start
        finally:
            if held:
                fcntl.flock(lock, fcntl.LOCK_UN)


def cores_alone(timeout_s: float = 600.0) -> contextlib.AbstractContextManager[float]:
    """The cores to the caller's ranks alone: no test of the other worker runs meanwhile."""
    return _locked(fcntl.LOCK_EX, timeout_s)


def cores_shared(timeout_s: float = 600.0) -> contextlib.AbstractContextManager[float]:
    """The cores shared with the other tests that share them: none that holds them alone."""
    return _locked(fcntl.LOCK_SH, timeout_s)
