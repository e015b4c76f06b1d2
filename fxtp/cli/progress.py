"""Stages of long work and their elapsed time, on stderr, for a person watching a terminal.

``fxtp plan`` and ``fxtp inspect`` on a large config spend tens of seconds in capture; the
stages say where the time goes. Quiet when stderr is not a terminal (a pipe, a log, a test) or
with ``--quiet``, so the output a script reads never changes.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

__all__ = ["Progress"]


class Progress:
    """``progress.stage("capture")`` ends the stage before (printing its seconds) and starts one.

    Args:
        quiet: print nothing.
        stream: where to print; default ``sys.stderr``, and only when it is a terminal.
    """

    def __init__(self, *, quiet: bool = False, stream: Optional[TextIO] = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = not quiet and bool(getattr(self._stream, "isatty", lambda: False)())
        self._current: Optional[tuple[str, float]] = None

    def stage(self, name: str) -> None:
        self.done()
        self._current = (name, time.perf_counter())
        self._print(f"fxtp: {name} ...")

    def done(self) -> None:
        """End the current stage, if any."""
        if self._current is not None:
            name, start = self._current
            self._print(f"fxtp: {name} took {time.perf_counter() - start:.1f} s")
            self._current = None

    def _print(self, line: str) -> None:
        if self.enabled:
            print(line, file=self._stream, flush=True)
