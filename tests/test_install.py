"""What a fresh clone gets: the built-ins after the README's main install, and a repository that
tracks sources, not build artefacts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fxtp.cli.examples import EXAMPLES, EXTRA, EXTRA_PACKAGES

ROOT = Path(__file__).resolve().parent.parent

# Without the extra: only torch (transformers and expecttest look uninstalled).
_WITHOUT_EXTRA = textwrap.dedent(
    """
    import contextlib, io, json, sys
    for name in {packages!r}:
        sys.modules[name] = None  # `import name` raises ModuleNotFoundError, as if not installed
    from fxtp.cli.main import main
    from fxtp.cli.examples import EXAMPLES
    results = {{}}
    for example in EXAMPLES:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            results[example] = (main(["inspect", example, "-n", "2"]), err.getvalue())
    print(json.dumps(results))
    """
)


def test_builtins_without_the_extra_work_or_name_it():
    """Every built-in plans with torch alone, or fails with one line naming the extra."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_EXTRA.format(packages=EXTRA_PACKAGES)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert set(results) == set(EXAMPLES)
    assert {name: code for name, (code, _) in results.items() if code == 0} == {"mlp": 0, "tiny-gpt": 0}
    for name, (code, err) in results.items():
        if code:
            package = "expecttest" if name == "transformer" else "transformers"
            assert (code, err) == (1, (
                f"fxtp: error: fxtp inspect {name} needs {package}, which is not installed: "
                f"pip install 'fxtp[{EXTRA}]' (in a clone: pip install -e '.[{EXTRA}]')\n"
            ))


def test_readme_main_install_installs_the_extra():
    """The README's first command (the main job) installs the extra; the extra holds every
    package the built-ins import beyond torch, and the test extra includes it."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pinned = {re.split(r"[=<>!~ ]", req)[0] for req in extras[EXTRA]}
    assert pinned == set(EXTRA_PACKAGES)
    assert f"fxtp[{EXTRA}]" in extras["test"]
    first = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert f"pip install -e '.[{EXTRA}]'" in first and "fxtp " in first


def test_readme_quick_subset_runs_as_written():
    """Issue 34: the README's quick subset works after its first command: the same block installs
    the test extra (pytest is not in the examples extra) and says how long it took."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(req.startswith("pytest") for req in extras[EXTRA]) and any(req.startswith("pytest") for req in extras["test"])
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    quick = next(b for b in blocks if "-m quick" in b)
    assert quick.index("pip install -q -e '.[test]'") < quick.index("python -m pytest -q -m quick"), quick
    before = readme[:readme.index("```bash\n" + quick)].rsplit("\n\n", 2)[1]
    assert re.search(r"took \d+ s", before[before.index("quick subset"):]), before  # its own time, not the suite's


# What may be tracked besides text: the README's pictures.
_BINARY_ALLOWED = re.compile(r"^docs/[\w.-]+\.(png|svg)$")
_ARTEFACT = re.compile(r"\.(whl|tar\.gz|zip|egg|so|dylib|dll|pyc|pyo|o|a|pt|pth|bin|safetensors|npy|npz)$|(^|/)(build|dist|__pycache__|[^/]+\.egg-info)/")


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_no_build_artefacts_or_binaries_are_tracked():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    files = [f for f in files if f and (ROOT / f).is_file()]
    artefacts = [f for f in files if _ARTEFACT.search(f)]
    binaries = [f for f in files if not _BINARY_ALLOWED.match(f) and b"\0" in (ROOT / f).read_bytes()[:8192]]
    assert (artefacts, binaries) == ([], []), "build artefacts or binaries are tracked: git rm them"
