"""Run a Python file as ``python FILE.py`` or as ``torchrun --nproc-per-node N FILE.py`` would,
in processes forked from one that has already imported torch, fxtp and transformers.

Each ``python``/``torchrun`` start costs seconds of CPU before the file's first line: the
interpreter, ``import torch`` (and transformers) in every rank, and torchrun's own launcher and
teardown. On the suite's 2 cores that was most of the docs blocks' time. A :class:`Zygote` pays
the imports once; each run forks its ranks from it.

What a run gets, as under the real commands:

* ``sys.argv == [FILE]``, ``__name__ == "__main__"``, ``sys.modules["__main__"]`` is the file's
  module (with ``__file__``), ``sys.path[0]`` its directory, the working directory ``cwd``;
* under torchrun's form, torchrun's environment for the ``env://`` rendezvous (``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT`` on a free port), and torchrun's failure rule: when a rank exits non-zero the
  others are killed;
* exit: ``SystemExit`` codes, 1 with the traceback on an exception, the ``atexit`` handlers run.

What it does not get: a fresh interpreter. A file that depends on import side effects of its
own environment variables (set before ``import torch``) sees the zygote's. The real torchrun is
still run by ``tests/test_training.py`` (``examples/train.py``) and for the README's blocks.

The zygote never runs a tensor op itself, so no thread pool exists when it forks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from _dist import _free_port  # the rank pool's: a free port on 127.0.0.1

__all__ = ["Zygote"]

_PRELOAD = ("torch", "torch.distributed", "torch.nn.functional", "fxtp", "transformers")


class Zygote:
    """A server process that forks runs of Python files (see the module docstring).

    Args:
        env: the environment of the server, and so of every run unless ``run`` overrides it.
    """

    def __init__(self, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen([sys.executable, "-u", __file__], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env, text=True,
                                      cwd=os.path.dirname(os.path.abspath(__file__)))
        ready = self._proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the zygote did not start: {ready!r}")

    def run(self, path: Path, *, cwd: Path, env: dict[str, str], nproc: Optional[int],
            timeout_s: float) -> tuple[int, str]:
        """Runs ``path`` (``nproc`` ranks, or ``None`` for plain ``python``); returns
        ``(exit code, output)``: the first non-zero rank's code, and every rank's stdout and
        stderr together. A run over ``timeout_s`` seconds is killed and returns code -9."""
        out = cwd / f"{path.stem}.out"
        request = {"path": str(path), "cwd": str(cwd), "env": env, "nproc": nproc, "out": str(out), "timeout_s": timeout_s}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        reply = self._proc.stdout.readline()
        if not reply:
            raise RuntimeError("the zygote died")
        return int(json.loads(reply)["code"]), out.read_text(errors="replace")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()


# --- the server ------------------------------------------------------------------------------


def _child(request: dict, rank: Optional[int], port: int, out_fd: int) -> None:
    """In a forked child: become ``python FILE.py`` (rank ``rank`` of torchrun's form); never returns."""
    import atexit
    import traceback
    import types

    os.setsid()  # its own process group: a kill reaches what it starts
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # not the zygote's requests
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    if rank is not None:
        n = request["nproc"]
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                          GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    path = request["path"]
    os.chdir(request["cwd"])
    sys.argv = [path]
    sys.path[0] = os.path.dirname(path)
    module = types.ModuleType("__main__")
    module.__file__ = path
    sys.modules["__main__"] = module
    code = 0
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), module.__dict__)  # noqa: S102 - the docs' own file
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - as the interpreter: traceback, exit 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # noqa: SLF001 - what interpreter exit runs; os._exit skips it
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve_one(request: dict) -> int:
    nproc = request["nproc"]
    port = _free_port()
    with open(request["out"], "wb") as out:
        pids = []
        for rank in ([None] if nproc is None else range(nproc)):
            pid = os.fork()
            if pid == 0:
                _child(request, rank, port, out.fileno())
            pids.append(pid)
    deadline = time.monotonic() + request["timeout_s"]
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        failed = [c for c in codes.values() if c != 0]
        if failed or time.monotonic() > deadline:  # torchrun's rule: one rank fails, all stop
            for pid in set(pids) - set(codes):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:  # it has not called setsid yet
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            return failed[0] if failed else -9
        time.sleep(0.05)
    return 0


def _serve() -> None:
    import importlib

    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps({"code": _serve_one(json.loads(line))}), flush=True)


if __name__ == "__main__":
    _serve()
