#!/usr/bin/env python
"""Rewrite the golden graphs and plans in tests/golden/ from the current code.

    python tools/accept_golden.py            # all of them
    python tools/accept_golden.py -k llama   # extra arguments go to pytest

Runs ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_golden.py``; review ``git diff
tests/golden`` before committing. CI never sets EXPECTTEST_ACCEPT.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    env = dict(os.environ, EXPECTTEST_ACCEPT="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-q", str(ROOT / "tests" / "test_golden.py"), *argv]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
