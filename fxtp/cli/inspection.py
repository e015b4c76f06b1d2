"""``fxtp inspect``: load a model, plan it, and show the report, the rank's graph or a picture.

MODEL is a built-in example (:data:`fxtp.cli.examples.EXAMPLES`), a Hugging Face ``config.json``
(:mod:`fxtp.capture.hf_config`: built on ``meta``), ``package.module:callable`` or
``path/to/file.py:callable``. The callable takes no arguments and returns an ``nn.Module`` or
``(nn.Module, example_inputs)``; ``--input`` specs (:class:`InputSpec`) replace the inputs.
The model runs once on the inputs (:func:`check_inputs`) before it is planned.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

import fxtp
from fxtp.capture.frontends import diagnose_inputs
from fxtp.core.errors import FxtpConfigError, FxtpError, FxtpInputError
from fxtp.cli.examples import EXAMPLES, EXTRA, EXTRA_PACKAGES
from fxtp.capture.hf_config import is_config_path, load_config_model
from fxtp.explain.render import graph_dot, graph_text
from fxtp.runtime.blocks import rank_graphs

__all__ = [
    "InputSpec",
    "Loaded",
    "UsageError",
    "check_inputs",
    "example_name",
    "inspect_text",
    "load_model",
    "render",
    "resolve_inputs",
    "write_output",
]

RENDERED = (".svg", ".png", ".pdf")


class UsageError(Exception):
    """A command line that cannot work (exit 2), found after parsing: e.g. ``--verify`` on a
    model on the ``meta`` device."""


# --- inputs -----------------------------------------------------------------------------------

_SPEC = re.compile(
    r"^(?P<shape>\d+(?:x\d+)*)"
    r"(?::(?P<dtype>[a-z0-9]+))?"
    r"(?:\[(?P<lo>-?\d+(?:\.\d*)?),\s*(?P<hi>-?\d+(?:\.\d*)?)\))?$"
)


@dataclass(frozen=True)
class InputSpec:
    """One positional input: ``AxBxC[:dtype][[lo,hi)]``.

    ``2x16x64`` is a float32 ``randn`` tensor; ``2x16:int64[0,128)`` int64 drawn from
    ``[0, 128)`` (integer dtypes need the range); a float range draws uniformly from it. Values
    come from one generator seeded with 0, in the order of the specs.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    low: Optional[float] = None
    high: Optional[float] = None

    @classmethod
    def parse(cls, text: str) -> "InputSpec":
        """Raises ``ValueError`` with a message that says what is wrong and shows the grammar."""
        grammar = "expected AxBxC[:dtype][[lo,hi)], e.g. 2x16x64 or 2x16:int64[0,128)"
        match = _SPEC.match(text.strip().replace(" ", ""))
        if match is None:
            raise ValueError(f"malformed input spec {text!r}: {grammar}")
        shape = tuple(int(d) for d in match["shape"].split("x"))
        dtype = getattr(torch, match["dtype"] or "float32", None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {match['dtype']!r} in input spec {text!r} (e.g. float32, bfloat16, int64)")
        low = high = None
        if match["lo"] is not None:
            low, high = float(match["lo"]), float(match["hi"])
            if low >= high:
                raise ValueError(f"empty range [{match['lo']},{match['hi']}) in input spec {text!r}")
        integral = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        if integral and low is None:
            raise ValueError(f"input spec {text!r}: an integer input needs a range, e.g. {match['shape']}:{match['dtype']}[0,128)")
        if integral and not (low.is_integer() and high.is_integer()):
            raise ValueError(f"input spec {text!r}: an integer range needs integer bounds")
        return cls(shape, dtype, low, high)

    def __str__(self) -> str:
        """The spec as ``--input`` takes it, e.g. ``2x16:int64[0,128)``."""
        text = "x".join(map(str, self.shape)) + ("" if self.dtype == torch.float32 else f":{str(self.dtype).removeprefix('torch.')}")
        if self.low is not None:
            text += f"[{self.low:g},{self.high:g})"
        return text

    def make(self, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        if self.dtype == torch.bool:
            value = torch.randint(0, 2, self.shape, generator=generator).bool()
        elif not self.dtype.is_floating_point:
            value = torch.randint(int(self.low), int(self.high), self.shape, generator=generator, dtype=self.dtype)
        elif self.low is None:
            value = torch.randn(self.shape, generator=generator).to(self.dtype)
        else:
            value = (torch.rand(self.shape, generator=generator) * (self.high - self.low) + self.low).to(self.dtype)
        return value.to(device)


def make_inputs(specs: list[InputSpec], device: torch.device) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    return tuple(spec.make(generator, device) for spec in specs)


# --- models -----------------------------------------------------------------------------------


@dataclass
class Loaded:
    """A loaded MODEL: ``name`` is the example name or the MODEL text as given; ``kwargs`` are
    keyword inputs that stay when ``--input`` replaces the positional ones."""

    name: str
    model: nn.Module
    inputs: Optional[tuple[Any, ...]]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def on_meta(self) -> bool:
        return any(t.is_meta for t in (*self.model.parameters(), *self.model.buffers()))


def example_name(text: str) -> Optional[str]:
    """The built-in example ``text`` names (``tiny_gpt`` and ``tiny-gpt`` alike), or None."""
    name = text.replace("_", "-")
    return name if name in EXAMPLES else None


def _import(where: str) -> Any:
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise FxtpConfigError(f"no such file: {where} (MODEL is path/to/file.py:callable)")
        spec = importlib.util.spec_from_file_location(f"_fxtp_model_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.resolve().parent))  # its sibling imports work, as for a script
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - the user's file: one line, not a traceback
            raise _import_failed(where, exc) from exc
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules in the working directory
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name is not None and not where.startswith(exc.name):
            raise _import_failed(where, exc) from exc  # the module exists; something it imports does not
        raise FxtpConfigError(f"cannot import {where!r}: {exc} (MODEL is package.module:callable)") from exc
    except Exception as exc:  # noqa: BLE001 - the user's module: one line, not a traceback
        raise _import_failed(where, exc) from exc


def _import_failed(where: str, exc: BaseException) -> FxtpConfigError:
    """One line for a user's file or module that raised while being imported, with the line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    at = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    if isinstance(exc, SyntaxError) and exc.lineno is not None:
        at = f" at {Path(exc.filename or where).name}:{exc.lineno}"
    first = (str(exc).splitlines() or [""])[0]
    return FxtpConfigError(f"importing {where} raised {type(exc).__name__}{at}: {first} (fix the model's file; "
                           "MODEL is path/to/file.py:callable or package.module:callable)")


def _missing_package(what: str, exc: ModuleNotFoundError) -> FxtpConfigError:
    package = (exc.name or "").partition(".")[0]
    if package in EXTRA_PACKAGES:
        return FxtpConfigError(
            f"{what} needs {package}, which is not installed: pip install 'fxtp[{EXTRA}]' "
            f"(in a clone: pip install -e '.[{EXTRA}]')"
        )
    return FxtpConfigError(f"{what} needs the module {exc.name!r}, which is not installed")


def load_model(text: str) -> Loaded:
    """Build the model MODEL names (``torch.manual_seed(0)`` first, so unseeded builders repeat).

    Raises:
        FxtpConfigError: a missing file or module, a missing callable, a callable that fails or
            does not return an ``nn.Module`` (or ``(nn.Module, example_inputs)``); a built-in or a
            ``config.json`` whose packages are not installed (naming the extra that installs them);
            a ``config.json`` transformers cannot build (:func:`fxtp.capture.hf_config.load_config_model`).
    """
    torch.manual_seed(0)
    name = example_name(text)
    try:
        if name is not None:
            model, inputs = EXAMPLES[name].build()
            return Loaded(name, model, tuple(inputs))
        if is_config_path(text):
            model, inputs, kwargs = load_config_model(text)
            return Loaded(text, model, inputs, kwargs)
    except ModuleNotFoundError as exc:
        raise _missing_package(f"fxtp inspect {text}", exc) from None
    where, _, attr = text.rpartition(":")
    module = _import(where)
    try:
        obj = functools.reduce(getattr, attr.split("."), module)
    except AttributeError:
        raise FxtpConfigError(f"{where} has no attribute {attr!r}") from None
    if not isinstance(obj, nn.Module):
        if not callable(obj):
            raise FxtpConfigError(f"{text} is neither an nn.Module nor a callable that returns one (it is {type(obj).__name__!r})")
        try:
            obj = obj()
        except FxtpError:
            raise
        except Exception as exc:
            raise FxtpConfigError(f"{text}() raised {type(exc).__name__}: {exc}") from exc
    inputs = None
    if isinstance(obj, (tuple, list)) and len(obj) == 2 and isinstance(obj[0], nn.Module):
        obj, inputs = obj
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if not isinstance(obj, nn.Module):
        raise FxtpConfigError(
            f"{text}() returned {type(obj).__name__!r}; it must return an nn.Module or (nn.Module, example_inputs)"
        )
    return Loaded(text, obj, inputs)


def resolve_inputs(loaded: Loaded, specs: list[InputSpec]) -> tuple[Any, ...]:
    """The ``--input`` tensors (on the model's device) if given, else the loaded example inputs."""
    if specs:
        device = next((t.device for t in loaded.model.parameters()), torch.device("cpu"))
        return make_inputs(specs, device)
    if loaded.inputs is None:
        raise FxtpInputError(
            f"{loaded.name} gives no example inputs: return (model, example_inputs) from it, or pass "
            "--input SPEC per positional input, e.g. --input 2x16:int64[0,128)"
        )
    return loaded.inputs


# --- the command ------------------------------------------------------------------------------


def check_inputs(loaded: Loaded, inputs: tuple[Any, ...], specs: list[InputSpec], *, on_meta: bool = False) -> None:
    """Run the model once, on one device, on ``inputs`` (a copy of it: the model is not touched),
    so inputs it cannot take (a sequence longer than its position table, ids beyond its
    vocabulary, a wrong feature size) are refused before a plan is printed: tracing with fake
    tensors does not check index values, and the ranks would fail later. A model on ``meta``
    is not run (it has no values, and Hugging Face models read some, e.g. to build masks);
    capture checks its shapes. ``on_meta``: run a model on ``meta`` too, once the pipeline refused
    its inputs, to say so in ``--input``'s words rather than the Python API's.

    Raises:
        FxtpInputError: naming the inputs, the module that refused them and what it expects.
    """
    if loaded.on_meta and not on_meta:
        return
    fix = ("pass one --input SPEC per positional input, with the shape and dtype the model takes: "
           "AxBxC[:dtype][[lo,hi)], e.g. --input 8x64 or --input '2x16:int64[0,128)' (fxtp inspect --help)")
    mismatch = diagnose_inputs(loaded.model, inputs, loaded.kwargs, given="", fix=fix)
    if mismatch is not None:
        given = " ".join(f"--input {spec}" for spec in specs) if specs else "its example inputs"
        raise FxtpInputError(f"{loaded.name} does not run on {given}: {mismatch}")


def inspect_text(
    loaded: Loaded, inputs: tuple[Any, ...], *, world_size: int, rank: int, fmt: str, verbose: bool = False,
    sequence_parallel: bool = False, all_layers: bool = True,
) -> str:
    """What ``fxtp inspect`` prints in format ``fmt`` for rank ``rank`` of ``world_size``
    (``verbose``: the table shows each failed capture frontend's error; ``all_layers=False``:
    the table shows a run of identical repeated blocks once, with its count)."""
    if fmt in ("table", "json"):
        report = fxtp.analyze(loaded.model, world_size, inputs, example_kwargs=loaded.kwargs, rank=rank,
                              sequence_parallel=sequence_parallel)
        return render(report, fmt, verbose=verbose, all_layers=all_layers)
    pm = fxtp.compile(loaded.model, world_size, inputs, example_kwargs=loaded.kwargs, rank=rank, sequence_parallel=sequence_parallel)
    return render(pm, fmt, name=loaded.name)


def render(what: "fxtp.ParallelModule | fxtp.Report", fmt: str, *, name: str = "", verbose: bool = False,
           all_layers: bool = True) -> str:
    """A report as ``table``/``json``, or a compiled rank as ``graph``/``dot`` (titled with
    ``name``, the rank and the world size); also what the golden files hold (every layer's row)."""
    if fmt in ("table", "json"):
        report = what.report if isinstance(what, fxtp.ParallelModule) else what
        if fmt == "json":
            return json.dumps(report.to_dict(), indent=2) + "\n"
        return report.to_text(verbose=verbose, all_layers=all_layers) + "\n"
    assert isinstance(what, fxtp.ParallelModule), "graph and dot need a compiled rank"
    title = f"{name}: rank {what.report.rank} of world_size {what.report.world_size}"
    graphs = rank_graphs(what)  # the root graph, then each block's body (NOTE: [rank program by block])
    root = graphs.pop("")
    if fmt == "dot":
        return graph_dot(root, title=title, blocks=graphs)
    return "\n".join([graph_text(root, title=title), *(graph_text(g, title=f"{title}: block {fqn}") for fqn, g in graphs.items())])


def write_output(text: str, out: Optional[str], fmt: str) -> None:
    """Print ``text``, or write it to ``out``; a ``.svg``/``.png``/``.pdf`` ``out`` of DOT text
    is rendered with Graphviz's ``dot`` program.

    Raises:
        FxtpConfigError: ``dot`` is not installed, or fails.
    """
    if out is None:
        sys.stdout.write(text)
        return
    suffix = Path(out).suffix.lower()
    if fmt == "dot" and suffix in RENDERED:
        dot = shutil.which("dot")
        if dot is None:
            raise FxtpConfigError(
                f"rendering {out} needs Graphviz's `dot` program, which is not installed: "
                "apt-get install graphviz (Debian/Ubuntu), brew install graphviz (macOS), "
                "conda install graphviz; or write the DOT text with --out FILE.dot"
            )
        done = subprocess.run([dot, f"-T{suffix[1:]}", "-o", out], input=text, text=True, capture_output=True, check=False)
        if done.returncode != 0:
            raise FxtpConfigError(f"dot failed rendering {out}: {done.stderr.strip()}")
    else:
        Path(out).write_text(text)
    print(f"wrote {out}", file=sys.stderr)
