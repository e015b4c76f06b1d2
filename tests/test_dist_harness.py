"""Tests for the RankPool harness in tests/_dist.py, on real gloo process groups."""
from __future__ import annotations

import pickle
import time

import pytest
import torch
import torch.distributed as dist

from _dist import RankError, RankPool


# `pool` (world sizes 2 and 4) comes from conftest.py.

# Functions sent to the ranks are defined here, in the test module itself.

def _whoami() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _all_reduce_rank_plus_one() -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank(bad_rank: int) -> str:
    # Raises before any collective, so the other ranks are never left blocked.
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from the bad rank {bad_rank}")
    return "ok"


def _scaled_broadcast(scale: float, *, offset: int = 0) -> list[float]:
    t = torch.arange(4, dtype=torch.float32) * scale + offset if dist.get_rank() == 0 else torch.zeros(4)
    dist.broadcast(t, src=0)
    return t.tolist()


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_rank_and_world_size_in_order(pool: RankPool) -> None:
    n = pool.world_size
    assert pool.run(_whoami) == [(r, n) for r in range(n)]


def test_all_reduce_sum(pool: RankPool) -> None:
    n = pool.world_size
    assert pool.run(_all_reduce_rank_plus_one) == [n * (n + 1) / 2] * n


def test_exception_on_one_rank_reports_traceback(pool: RankPool) -> None:
    with pytest.raises(RankError) as info:
        pool.run(_fail_on_rank, 1)
    msg = str(info.value)
    assert "rank 1" in msg and "rank 0 ---" not in msg
    assert "ValueError: boom from the bad rank 1" in msg
    assert "Traceback" in msg and "_fail_on_rank" in msg
    # The pool stays usable, collectives included.
    assert pool.run(_whoami) == [(r, pool.world_size) for r in range(pool.world_size)]
    assert pool.run(_all_reduce_rank_plus_one)[0] == pool.world_size * (pool.world_size + 1) / 2


def test_module_local_function_with_args_and_kwargs(pool: RankPool) -> None:
    assert pool.run(_scaled_broadcast, 2.0, offset=1) == [[1.0, 3.0, 5.0, 7.0]] * pool.world_size


def test_unpicklable_function_fails_fast_in_parent(pool: RankPool) -> None:
    with pytest.raises((AttributeError, pickle.PicklingError), match="pickle"):
        pool.run(lambda: 0)
    assert pool.run(_whoami)[0] == (0, pool.world_size)


def test_hung_rank_raises_and_tears_down() -> None:
    p = RankPool(2, timeout_s=2.0)
    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[0, 1\] did not answer within 2.0s"):
        p.run(_sleep, 300.0)
    assert time.monotonic() - start < 60.0  # not the 300 s sleep; generous: the suite runs two workers on 2 cores
    assert all(not proc.is_alive() for proc in p._procs)
    with pytest.raises(RankError, match="closed"):
        p.run(_whoami)
    p.close()  # idempotent


def _extra_collective_on_rank_0() -> float:
    # Rank 0 issues one collective the others never do (issue 35, item 7's kind): its peers'
    # next call meets it, and gloo aborts with a size mismatch far from the cause.
    if dist.get_rank() == 0:
        dist.all_reduce(torch.zeros(2))
    t = torch.ones(192)
    dist.all_reduce(t)
    return t.sum().item()


def test_ranks_issuing_different_collectives_fail_with_the_first_difference() -> None:
    with RankPool(2, timeout_s=30.0, pg_timeout_s=5.0) as p:
        with pytest.raises(RankError) as info:
            p.run(_extra_collective_on_rank_0)
    msg = str(info.value)
    assert "ranks issued different collectives on group [0, 1]: collective #0 on it is" in msg, msg
    assert "rank 0: allreduce_ of [(2,)]" in msg and "rank 1: allreduce_ of [(192,)]" in msg, msg


def test_collective_divergence_compares_each_group_in_order() -> None:
    from _helpers import collective_divergence

    same = [[("all_reduce", (0, 1), ((4,),)), ("allreduce_", (0, 1, 2, 3), ((1,),))],
            [("all_reduce", (0, 1), ((4,),)), ("allreduce_", (0, 1, 2, 3), ((1,),))],
            [("all_reduce", (2, 3), ((4,),)), ("allreduce_", (0, 1, 2, 3), ((1,),))],
            [("allreduce_", (0, 1, 2, 3), ((1,),)), ("all_reduce", (2, 3), ((4,),))]]  # order across groups: free
    assert collective_divergence(same) is None
    shape = [list(log) for log in same]
    shape[3][1] = ("all_reduce", (2, 3), ((8,),))
    assert collective_divergence(shape) == ("ranks issued different collectives on group [2, 3]: collective #0 on it is\n"
                                           "  rank 2: all_reduce of [(4,)]\n  rank 3: all_reduce of [(8,)]")
    missing = [list(log) for log in same]
    del missing[1][0]
    assert collective_divergence(missing).endswith("rank 1: nothing (rank 1 issued 0 on it)")


def test_fuzzers_fail_on_ranks_that_issued_different_collectives() -> None:
    """Both fuzzers' checks compare every rank's collectives before anything else: a rank with
    one more all_reduce fails the example with the first difference, even where each rank's own
    numbers came out right (issue 35, item 7)."""
    from fuzz_check import Outcome, check_outcomes
    from fuzz_loop import LoopOutcome, check_loop

    log = [("all_gather_into_tensor", (0, 1), ((4, 2, 16),)), ("all_reduce", (0, 1), ((16,),))]
    extra = [("all_reduce", (0, 1), ((2,),)), *log]
    want = "rank 0: all_reduce of [(2,)]\n  rank 1: all_gather_into_tensor of [(4, 2, 16)]"
    with pytest.raises(AssertionError, match="fxtp's ranks diverged at world_size 2") as info:
        check_outcomes("spec", [Outcome("ok", collectives=extra), Outcome("ok", collectives=log)])
    assert want in str(info.value)
    with pytest.raises(AssertionError, match="fxtp's ranks diverged at world_size 2") as info:
        check_loop("loop", [LoopOutcome(events=["ok"], collectives=extra), LoopOutcome(events=["ok"], collectives=log)])
    assert want in str(info.value)
    assert check_outcomes("spec", [Outcome("ok", collectives=log), Outcome("ok", collectives=list(log))]) == "ok"


def test_the_cores_alone_wait_for_shared_holders_and_hold_off_later_ones(monkeypatch, tmp_path) -> None:
    """tests/_cores.py on one test run's lock (threads in place of xdist's two workers): a test
    taking the cores alone waits for the shared holder before it, and a shared request made
    while it waits runs only after it."""
    import tempfile
    import threading

    from _cores import cores_alone, cores_shared

    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "cores-test")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    events: list[str] = []

    def run(holders: list[tuple[str, object, float]], gap_s: float) -> list[str]:
        """Each ``(name, lock, seconds)`` holds ``lock()`` for ``seconds`` on a thread, started
        ``gap_s`` after the one before; the order they went in and out."""
        events.clear()

        def hold(name: str, lock, seconds: float) -> None:
            with lock():
                events.append(f"{name} in")
                time.sleep(seconds)
                events.append(f"{name} out")

        threads = [threading.Thread(target=hold, args=holder) for holder in holders]
        for t in threads:
            t.start()
            time.sleep(gap_s)
        for t in threads:
            t.join()
        return list(events)

    # a second between the starts: a thread started late on a loaded host must not reorder them
    assert run([("first", cores_shared, 2.5), ("alone", cores_alone, 0.5), ("later", cores_shared, 0.1)], 1.0) == [
        "first in", "first out", "alone in", "alone out", "later in", "later out"]
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID")  # without xdist, nothing is locked: both at once
    assert run([("alone", cores_alone, 2.0), ("shared", cores_shared, 0.1)], 1.0) == [
        "alone in", "shared in", "shared out", "alone out"]
