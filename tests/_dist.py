"""Persistent gloo worker pool for running check functions on real process groups.

Starting a rank (spawn + ``import torch`` + rendezvous) costs seconds, so a test module
starts one :class:`RankPool` and runs many checks on it::

    import pytest
    from _dist import RankPool

    @pytest.fixture(scope="module", params=[2, 4])
    def pool(request):
        with RankPool(request.param) as p:
            yield p

    def _check(x):                      # top-level, so it pickles by reference
        import torch.distributed as dist
        return dist.get_rank() * x

    def test_check(pool):
        assert pool.run(_check, 3) == [3 * r for r in range(pool.world_size)]

Sent functions may live in test modules: the parent ships its ``sys.path`` and the file of
``fn``'s module to the workers, which import that module before unpickling the task.

Every task runs under ``_helpers.CollectiveLog`` on each rank, and :meth:`RankPool.run` fails
when the ranks issued different collectives (NOTE: [same collectives on every rank] in
tests/_helpers.py), with the first differing collective per rank: also when the divergence made
gloo abort a later call, where the ranks' tracebacks alone point far from the cause.
"""
from __future__ import annotations

import ast
import contextlib
import datetime
import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

__all__ = ["RankError", "RankPool"]

_POLL_S = 0.2


class RankError(RuntimeError):
    """A rank raised, hung, or died; the message holds each failing rank's traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_module(name: str, path: str | None) -> None:
    """Make module ``name`` importable in a worker, loading it from ``path`` if needed."""
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
    except ImportError:
        if path is None:
            raise
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def _worker(rank: int, world_size: int, port: int, pg_timeout_s: float, sys_path: list[str],
            parent_pid: int, tasks: Any, results: Any, log_dir: str | None) -> None:
    """Worker main loop: init gloo, then execute ``(seq, module, file, payload)`` tasks until None."""
    sys.path[:] = sys_path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        results.put((rank, -1, True, pickle.dumps(None)))
    except BaseException:
        results.put((rank, -1, False, traceback.format_exc()))
        return
    if log_dir is not None:
        from _helpers import CollectiveLog  # NOTE: [same collectives on every rank]
    try:
        while True:
            try:
                task = tasks.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent_pid:  # parent died: do not linger
                    return
                continue
            if task is None:
                return
            seq, mod_name, mod_file, payload = task
            sink = open(os.path.join(log_dir, f"rank{rank}"), "w") if log_dir is not None else None
            if sink is not None:
                sink.write(f"{seq}\n")
                sink.flush()
            try:
                _ensure_module(mod_name, mod_file)
                fn, args, kwargs = pickle.loads(payload)
                with CollectiveLog(sink) if sink is not None else contextlib.nullcontext():
                    value = fn(*args, **kwargs)
                out = (rank, seq, True, pickle.dumps(value))
            except BaseException:
                out = (rank, seq, False, traceback.format_exc())
            finally:
                if sink is not None:
                    sink.close()
            results.put(out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Skip the interpreter's finalization (Py_FinalizeEx's last garbage collection over
        # torch's modules, seen in gdb): on 2 shared cores it held each rank ~10 s, which close()
        # waited out, pool by pool. The group is destroyed above, the answers flushed here.
        if os.getppid() == parent_pid:
            results.close()
            results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class RankPool:
    """World of ``world_size`` worker processes, each with an initialized gloo default process group.

    ``timeout_s`` bounds each :meth:`run` (startup gets at least 60 s); the process groups get
    ``pg_timeout_s`` (default ``timeout_s / 2``) so a stuck collective fails with a traceback
    before the parent gives up on the rank. ``check_collectives``: fail a task whose ranks issued
    different collectives (NOTE: [same collectives on every rank] in tests/_helpers.py).
    """

    def __init__(self, world_size: int, *, timeout_s: float = 120.0,
                 pg_timeout_s: float | None = None, check_collectives: bool = True) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._seq = 0
        self._closed = False
        self._log_dir = tempfile.mkdtemp(prefix="rankpool-") if check_collectives else None
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port, pg_timeout = _free_port(), pg_timeout_s or max(timeout_s / 2, 1.0)
        self._procs = [
            ctx.Process(target=_worker, name=f"rank{r}", daemon=True,
                        args=(r, world_size, port, pg_timeout, list(sys.path), os.getpid(),
                              self._tasks[r], self._results, self._log_dir))
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        try:
            self._collect(-1, "startup", max(timeout_s, 60.0))
        except BaseException:
            self._shutdown(grace_s=0.0)
            raise

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        ``fn`` must be a picklable top-level function and the arguments picklable. Raises
        :class:`RankError` with every failing rank's traceback if any rank raises; if a rank does
        not answer within ``timeout_s`` (or dies) the pool is torn down and RankError is raised.
        """
        if self._closed:
            raise RankError("RankPool is closed")
        payload = pickle.dumps((fn, args, kwargs))
        mod_name = getattr(fn, "__module__", None) or "__main__"
        mod_file = getattr(sys.modules.get(mod_name), "__file__", None)
        self._seq += 1
        for q in self._tasks:
            q.put((self._seq, mod_name, mod_file, payload))
        return self._collect(self._seq, getattr(fn, "__qualname__", repr(fn)), self.timeout_s)

    def _collect(self, seq: int, what: str, timeout_s: float) -> list[Any]:
        """Gather one answer per rank for task ``seq``; raise RankError on failure/hang/death."""
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size:
            try:
                rank, s, ok, payload = self._results.get(timeout=_POLL_S)
                if s == seq:
                    got[rank] = (ok, payload)
                continue
            except queue.Empty:
                pass
            missing = [r for r in range(self.world_size) if r not in got]
            dead = [r for r in missing if self._procs[r].exitcode is not None]
            if dead or time.monotonic() > deadline:
                diverged = self._divergence() if seq >= 0 else None
                self._shutdown(grace_s=0.0)
                why = (f"ranks {dead} died (exit codes {[self._procs[r].exitcode for r in dead]})"
                       if dead else f"ranks {missing} did not answer within {timeout_s}s")
                errors = "".join(f"\n--- rank {r} ---\n{p}" for r, (ok, p) in got.items() if not ok)
                first = f"\n{diverged}" if diverged else ""
                raise RankError(f"{what}: {why}; pool torn down{first}{errors}")
        diverged = self._divergence() if seq >= 0 else None
        failed = {r: p for r, (ok, p) in sorted(got.items()) if not ok}
        if failed:
            text = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in failed.items())
            first = f"\n{diverged}" if diverged else ""
            raise RankError(f"{what} failed on rank(s) {sorted(failed)}:{first}{text}")
        if diverged:
            raise RankError(f"{what}: {diverged}")
        return [pickle.loads(got[r][1]) for r in range(self.world_size)]

    def _divergence(self) -> str | None:
        """The first collective the ranks disagree on in the last task (NOTE: [same collectives
        on every rank] in tests/_helpers.py), read from the files the ranks wrote as they went."""
        if self._log_dir is None:
            return None
        logs = []
        for r in range(self.world_size):
            path = os.path.join(self._log_dir, f"rank{r}")
            lines = open(path).read().splitlines() if os.path.exists(path) else []
            if lines[:1] != [str(self._seq)]:  # not started on this task yet
                lines = []
            logs.append([ast.literal_eval(line) for line in lines[1:] if line.endswith(")")])  # a torn last line: dropped
        if not any(logs):
            return None
        from _helpers import collective_divergence

        return collective_divergence(logs)

    def close(self) -> None:
        """Destroy the process groups, join the workers (terminating stragglers); idempotent."""
        self._shutdown(grace_s=10.0)

    def _shutdown(self, grace_s: float) -> None:
        """Ask workers to exit, wait up to ``grace_s``, then terminate/kill what is left."""
        if self._closed:
            return
        self._closed = True
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            p.join(max(deadline - time.monotonic(), 0.0))
            if p.is_alive():
                p.terminate()
                p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()
        for q in [*self._tasks, self._results]:
            q.cancel_join_thread()
            q.close()
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
