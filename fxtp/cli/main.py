"""The ``fxtp`` command line (also ``python -m fxtp``).

Examples::

    fxtp demo                                   # tiny GPT over 2 local gloo ranks, prints the report
    fxtp inspect llama --world-size 2           # the plan of a tiny Llama, as a table
    fxtp inspect mlp -n 2 --format graph        # rank 0's emitted code with placements
    fxtp inspect mlp -n 2 --format dot --out mlp.svg
    fxtp inspect path/to/config.json -n 8      # a Hugging Face config, on the meta device
    fxtp inspect path/to/checkpoint -n 8       # the config.json in a checkpoint directory
    fxtp inspect my_models.py:build -n 4 --input '2x16:int64[0,1000)' --verify
    fxtp plan path/to/config.json --devices 64 --device-memory 80GiB --batch 64 --seq 8192

Exit status: 0 on success, 1 on an fxtp error (one message; ``--verbose`` adds the traceback),
2 on bad usage (a malformed argument or an impossible combination of them).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from typing import Any, Callable, Optional, Sequence

__all__ = ["FORMATS", "get_args_parser", "main"]

FORMATS = ("table", "json", "graph", "dot")  # fxtp inspect --format

_EPILOG = """\
examples:
  fxtp demo --world-size 4
  fxtp inspect llama --world-size 2
  fxtp inspect --help
  fxtp plan path/to/config.json --devices 64 --device-memory 80GiB --batch 64 --seq 8192

exit status: 0 ok, 1 fxtp error (--verbose for the traceback), 2 bad usage
"""

_INSPECT_EPILOG = """\
MODEL:
  a built-in example:  mlp, tiny-gpt, transformer (torch's TP reference model), gpt2, llama,
                       bert, mixtral, qwen2-moe, qwen3-moe, deepseek-v2, gpt-oss (tiny
                       configs, random weights, real inputs);
                       gpt2-124m, llama-7b, llama-3-8b, llama-3.1-8b, llama-3.1-70b,
                       llama-3.1-405b, mixtral-8x7b, qwen2-moe-a2.7b (full size on the meta device: tables
                       and graphs, no --verify);
                       all but mlp and tiny-gpt need: pip install 'fxtp[examples]'
  path/to/config.json  a Hugging Face config (its architectures / model_type), built on the
                       meta device: no weights, no download; example input: token ids (1, 128)
                       (shorter if its positions are fewer); needs fxtp[examples]
  path/to/checkpoint   a directory holding a config.json (a checkpoint's, as from_pretrained
                       takes it): that config, as above; a built-in name wins over a directory
                       of the same name (write ./NAME)
  package.module:callable, path/to/file.py:callable
                       the callable takes no arguments and returns an nn.Module or
                       (nn.Module, example_inputs); it runs after torch.manual_seed(0)

--input SPEC (one per positional input, replacing the example inputs; quote it in a shell):
  AxBxC[:dtype][[lo,hi)]   dtype defaults to float32 (randn); integer dtypes need a range
                           and draw from [lo,hi); values come from a generator seeded with 0
  2x16x64                  float32 (2, 16, 64)
  '2x16:int64[0,128)'      int64 token ids below 128
The model runs once on the inputs before it is planned: inputs it cannot take are an error.

examples:
  fxtp inspect llama --world-size 2
  fxtp inspect transformer -n 4 --format json > plan.json
  fxtp inspect mlp -n 2 --format graph --rank 1
  fxtp inspect mlp -n 2 --format dot --out mlp.svg     # needs Graphviz's dot
  fxtp inspect llama-7b -n 8
  fxtp inspect path/to/config.json -n 8
  fxtp inspect tiny-gpt -n 2 --input '4x16:int64[0,128)' --verify
  fxtp inspect my_models.py:build -n 2 --input '2x16:int64[0,1000)' --verify
  python -m fxtp inspect mypkg.models:tiny_model -n 2 --format graph

exit status: 0 ok (and --verify within tolerance), 1 fxtp error or --verify over tolerance,
2 bad usage (malformed argument, --rank outside the world, --verify on the meta device)
"""


def _world_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid world size {text!r}: an int >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"world size must be >= 1, got {value}")
    return value


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _memory(text: str) -> int:
    """Bytes from ``80GiB``, ``80GB`` (decimal), ``1.5TiB`` or a plain number of bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", text.lower())
    if match is None or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"invalid memory {text!r}: a size such as 80GiB, 80GB or 85899345920 (bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2) or "b"])


def _reserve(text: str) -> "int | float":
    """``--reserve``: a share of --device-memory (``10%``, or a bare number below 1 such as
    ``0.1``, as ``fxtp.plan(reserve=0.1)`` reads it) or a size with a unit (``4GiB``; ``0``
    keeps nothing back). A bare number of 1 or more is refused: bytes or a share, it is unclear."""
    text = text.strip()
    share = None
    try:
        share = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        if text.endswith("%"):
            share = -1.0
    if share is not None:
        if not 0 <= share < 1:
            raise argparse.ArgumentTypeError(f"invalid reserve {text!r}: a share in [0%, 100%) such as 10% or 0.1, "
                                             "or a size with its unit such as 4GiB")
        return share
    return _memory(text)


_reserve.__name__ = "SIZE"


def _deferred(module: str, name: str, what: str) -> Callable[[str], Any]:
    """An argparse ``type=`` that imports ``module`` and calls its ``name`` (dotted, e.g.
    ``InputSpec.parse``) when it converts a value, not when the parser is built, so
    ``fxtp --help`` and usage errors load no torch. ``name`` raises ``ValueError`` with a full
    message for bad text; it becomes argparse's ``ArgumentTypeError`` (exit 2)."""

    def convert(text: str) -> Any:
        fn: Any = importlib.import_module(module)
        for attr in name.split("."):
            fn = getattr(fn, attr)
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = what  # argparse names the converter in its "invalid MODEL value" message
    return convert


# The built-in examples' names, in the order of fxtp.cli.examples.EXAMPLES, which imports
# torch: MODEL is checked before torch loads (tests/test_cli.py keeps the two equal).
EXAMPLE_NAMES = (
    "mlp", "tiny-gpt", "transformer", "gpt2", "llama", "bert", "gpt2-124m", "llama-7b", "llama-3-8b", "llama-3.1-8b",
    "llama-3.1-70b", "llama-3.1-405b", "mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v2", "gpt-oss", "mixtral-8x7b", "qwen2-moe-a2.7b",
)


def _names_config(text: str) -> bool:
    """``fxtp.capture.hf_config.is_config_path`` without torch: a ``.json`` name, or a directory
    holding a ``config.json``."""
    from pathlib import Path

    return text.lower().endswith(".json") or (Path(text).is_dir() and (Path(text) / "config.json").is_file())


def _model(text: str) -> str:
    """argparse ``type=`` for MODEL, torch-free: a built-in name, a ``.json`` file, a directory
    holding a ``config.json``, or ``something:callable``; else ``ArgumentTypeError`` (exit 2)."""
    from pathlib import Path

    if text.replace("_", "-") not in EXAMPLE_NAMES and not _names_config(text) and not (":" in text and text.rpartition(":")[2]):
        held = f"; {text!r} is a directory without a config.json" if Path(text).is_dir() else ""
        raise argparse.ArgumentTypeError(
            f"unknown model {text!r}: use a built-in example ({', '.join(EXAMPLE_NAMES)}), a Hugging Face "
            f"path/to/config.json or a checkpoint directory holding one, package.module:callable or "
            f"path/to/file.py:callable{held}"
        )
    return text


_model.__name__ = "MODEL"  # argparse names the converter in its "invalid MODEL value" message


def _check_model_file(text: str) -> None:
    """The missing-file errors ``fxtp.cli.inspection.load_model`` raises for MODEL, raised
    before torch loads (seconds): a ``config.json`` or a ``file.py`` that is not there.

    Raises:
        FxtpConfigError: ``no such file: ...``, as ``load_model`` words it.
    """
    import os
    from pathlib import Path

    from fxtp.core.errors import FxtpConfigError

    if text.replace("_", "-") in EXAMPLE_NAMES:
        return
    if _names_config(text):
        if not Path(text).is_dir() and not Path(text).is_file():
            raise FxtpConfigError(f"no such file: {Path(text)} (MODEL is a Hugging Face config.json)")
        return
    where = text.rpartition(":")[0]
    if (where.endswith(".py") or os.sep in where or "/" in where) and not Path(where).is_file():
        raise FxtpConfigError(f"no such file: {where} (MODEL is path/to/file.py:callable)")


def get_args_parser() -> argparse.ArgumentParser:
    """The ``fxtp`` parser; building it and ``--help`` import no torch (the converters defer)."""
    parser = argparse.ArgumentParser(
        prog="fxtp",
        description="Automatic tensor parallelism for PyTorch models.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,inspect,plan}")
    demo = sub.add_parser(
        "demo",
        help="run a tiny GPT over local gloo ranks and check it against the single-device model",
        description="Compile a tiny GPT with fxtp over N local gloo ranks, print rank 0's plan and report, and\n"
        "check every rank's outputs against the single-device model.",
        epilog="example: fxtp demo --world-size 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--world-size", "-n", metavar="N", type=_world_size, default=2, help="number of local ranks (default: 2)")
    demo.set_defaults(subparser=demo)

    inspect = sub.add_parser(
        "inspect",
        help="show a model's tensor-parallel plan, a rank's rewritten graph, or a picture of it",
        description="Plan MODEL for --world-size ranks and print the report, a rank's emitted graph\n"
        "with each value's placement, or a Graphviz picture; --verify runs it on local ranks.",
        epilog=_INSPECT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inspect.add_argument("model", metavar="MODEL", type=_model, help="see MODEL below")
    inspect.add_argument("--world-size", "-n", metavar="N", type=_world_size, required=True, help="tensor-parallel degree, >= 1")
    inspect.add_argument(
        "--input", "-i", dest="inputs", metavar="SPEC", action="append", default=[],
        type=_deferred("fxtp.cli.inspection", "InputSpec.parse", "SPEC"), help="a positional input, repeatable (see SPEC below)",
    )
    inspect.add_argument(
        "--format", "-f", choices=FORMATS, default="table",
        help="table: report and summary (default); json: the report's dict; graph: the rank's code "
        "with placements; dot: Graphviz DOT",
    )
    inspect.add_argument("--rank", "-r", metavar="R", type=int, default=0, help="the rank shown (default: 0)")
    inspect.add_argument("--all-layers", action="store_true",
                         help="the table lists every repeated block's layers (default: a run of identical blocks shows "
                         "its first block's rows and a line 'x32 identical blocks: model.layers.0-31')")
    inspect.add_argument("--sequence-parallel", action="store_true",
                         help="Megatron sequence parallelism: token-sharded regions between rowwise and colwise layers")
    inspect.add_argument("--out", "-o", metavar="FILE", help="write to FILE; with --format dot, FILE.svg/.png/.pdf renders it with dot")
    inspect.add_argument("--verify", action="store_true", help="run the ranks on local gloo and compare outputs and gradients with the single-device model "
                         "(models with weights only: not the meta-device examples or a config.json)")
    inspect.add_argument("--tolerance", metavar="TOL", type=float, default=1e-4, help="max abs error --verify accepts (default: 1e-4)")
    inspect.add_argument(
        "--verbose", "-v", action="store_true",
        help="print the traceback of an fxtp error, and each failed capture frontend's error",
    )
    inspect.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr (it shows only on a terminal)")
    inspect.set_defaults(subparser=inspect)
    _add_plan_parser(sub)
    return parser


_PLAN_EPILOG = """\
MODEL: as for fxtp inspect (fxtp inspect --help), e.g. a Hugging Face config.json on meta.
--batch is the global batch (sequences per optimizer step); the plan may split it into
micro-batches (gradient accumulation) and says so. Without --batch/--seq they come from the
model's example input (a config.json's: 1 x 128).

The figures are predictions: see docs/plan_command.md for the cost model and its sources.

examples:
  fxtp plan path/to/config.json --devices 64 --device-memory 80GiB --batch 64 --seq 8192
  fxtp plan llama-3-8b --devices 8 --device-memory 80GiB --batch 16 --seq 8192 --format json
  fxtp plan llama-3.1-405b --devices 512 --device-memory 80GiB --batch 512 --seq 8192
  fxtp plan path/to/config.json --devices 16 --device-memory 141GiB --hardware h200 --batch 32 --seq 4096
  fxtp plan path/to/config.json --devices 4 --batch 8 --seq 128 --measure
"""


def _add_plan_parser(sub: Any) -> None:
    from fxtp.cli.calibration import add_measuring_arguments
    from fxtp.planner.hardware import HARDWARE

    plan = sub.add_parser(
        "plan",
        help="choose tp x dp, sequence parallelism and activation checkpointing for a memory budget",
        description="Choose the mesh (tensor parallelism inside a node, FSDP2 over the rest), sequence\n"
        "parallelism, activation checkpointing and micro-batches with the least predicted step\n"
        "time whose predicted peak memory per device fits --device-memory, and explain the choice.",
        epilog=_PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("model", metavar="MODEL", type=_model, help="as for fxtp inspect")
    plan.add_argument("--devices", "-n", metavar="N", type=_world_size, required=True, help="devices in the job (tp x dp)")
    plan.add_argument("--device-memory", "-m", metavar="SIZE", type=_memory, default=None,
                      help="memory each device may use, e.g. 80GiB (GiB = 2**30 bytes, GB = 10**9); "
                      "required unless --calibrate or --measure, which measure it")
    plan.add_argument("--reserve", metavar="SIZE", type=_reserve, default=None,
                      help="memory kept for the runtime (CUDA context, NCCL buffers, fragmentation) out of --device-memory: "
                      "a size (4GiB) or a share (10%%); a plan fits when it fits the rest (default: 10%%, docs/plan_command.md)")
    plan.add_argument("--devices-per-node", metavar="K", type=_world_size, default=None,
                      help="devices per node (NVLink domain); tp stays inside one (default: the hardware's, 8)")
    plan.add_argument("--hardware", choices=sorted(HARDWARE), default="h100", help="device and link figures (default: h100)")
    plan.add_argument("--batch", "-b", metavar="B", type=_world_size, default=None, help="global batch, sequences per optimizer step")
    plan.add_argument("--seq", "-s", metavar="T", type=_world_size, default=None, help="tokens per sequence")
    plan.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw", help="its state is priced (default: adamw)")
    plan.add_argument("--tp", metavar="T", type=_world_size, default=None,
                      help="pin the tensor-parallel degree (alone: not pipelined); the others are still priced, to show what the pin costs")
    plan.add_argument("--pp", metavar="P", type=_world_size, default=None, help="pin the pipeline degree (1: not pipelined), likewise")
    plan.add_argument("--tp-overlap", choices=("async-tp", "megatron"), default=None, help="price tp collectives under sequence "
                      "parallelism as hidden behind the matmuls, as torch's async TP or Megatron-LM's --tp-comm-overlap run them (default: not overlapped; docs/plan_command.md)")
    plan.add_argument("--inference", action="store_true", help="price a forward with a KV cache instead of a training step")
    add_measuring_arguments(plan)
    plan.add_argument("--format", "-f", choices=("table", "json"), default="table", help="table (default) or the plan's JSON")
    plan.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr (it shows only on a terminal)")
    plan.add_argument("--verbose", "-v", action="store_true", help="print the traceback of an fxtp error")
    plan.set_defaults(subparser=plan)


def _plan(args: argparse.Namespace) -> int:
    import json

    import fxtp
    from fxtp.cli.inspection import load_model
    from fxtp.cli.progress import Progress

    if args.tp is not None:  # before the model is built: seconds for a large config
        from fxtp.planner.search import check_pinned_tp

        check_pinned_tp(args.tp, args.devices, None if args.inference or args.pp not in (None, 1) else args.batch)
    from fxtp.cli.calibration import calibrated, check_measuring, run_measure

    check_measuring(args)
    progress = Progress(quiet=args.quiet)
    progress.stage("load model")
    loaded = load_model(args.model)
    if args.measure:
        return run_measure(args, loaded, progress)
    hardware = calibrated(args, loaded, progress) if args.calibrate else args.hardware
    result = fxtp.plan(
        loaded.model, args.devices, device_memory=args.device_memory or hardware.memory_bytes, example_inputs=loaded.inputs,
        example_kwargs=loaded.kwargs, batch=args.batch, seq=args.seq, devices_per_node=args.devices_per_node,
        hardware=hardware, optimizer=args.optimizer, training=not args.inference, tp=args.tp, pp=args.pp,
        reserve=args.reserve, tp_overlap=args.tp_overlap, progress=progress.stage,
    )
    progress.done()
    print(json.dumps(result.to_dict(), indent=2) if args.format == "json" else result)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from fxtp.cli.examples import EXAMPLES
    from fxtp.cli.progress import Progress
    from fxtp.cli.inspection import (
        RENDERED,
        UsageError,
        check_inputs,
        example_name,
        inspect_text,
        load_model,
        resolve_inputs,
        write_output,
    )
    from fxtp.core.errors import FxtpInputError

    if not 0 <= args.rank < args.world_size:
        raise UsageError(f"--rank {args.rank} is outside world size {args.world_size} (0..{args.world_size - 1})")
    if args.out and args.out.lower().endswith(RENDERED) and args.format != "dot":
        raise UsageError(f"--out {args.out} renders a picture: add --format dot")
    name = example_name(args.model)
    if args.verify and name is not None and EXAMPLES[name].meta:
        raise UsageError(f"--verify runs the model, but {name} is on the meta device (no weights): analysis only")
    progress = Progress(quiet=args.quiet)
    progress.stage("load model")
    loaded = load_model(args.model)
    if args.verify and loaded.on_meta:
        raise UsageError(f"--verify runs the model, but {args.model} is on the meta device (no weights): analysis only")
    inputs = resolve_inputs(loaded, args.inputs)
    check_inputs(loaded, inputs, args.inputs)
    progress.stage("analyze (capture and passes)" if args.format in ("table", "json") else "compile")
    try:
        text = inspect_text(loaded, inputs, world_size=args.world_size, rank=args.rank, fmt=args.format,
                            verbose=args.verbose, sequence_parallel=args.sequence_parallel, all_layers=args.all_layers)
    except FxtpInputError:  # a meta model's inputs are checked by the capture: say it in --input's words
        check_inputs(loaded, inputs, args.inputs, on_meta=True)
        raise
    progress.done()
    write_output(text, args.out, args.format)
    if not args.verify:
        return 0
    from fxtp.cli.verify import verify

    sys.stdout.flush()
    result = verify(args.model, loaded.model, inputs, args.world_size, tolerance=args.tolerance, verbose=args.verbose,
                    sequence_parallel=args.sequence_parallel)
    print(result)
    return 0 if result.ok else 1


def _run(args: argparse.Namespace) -> int:
    from fxtp.cli.inspection import UsageError

    try:
        return _plan(args) if args.command == "plan" else _inspect(args)
    except UsageError as exc:
        args.subparser.error(str(exc))  # exits 2
        raise  # not reached: error() exits


def _did_you_mean(unknown: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """`` (did you mean --format?)`` for the first mistyped flag in ``unknown`` that is close to
    one of ``parser``'s (difflib; argparse's own ``suggest_on_error`` is Python 3.14's)."""
    import difflib

    # argparse has no public list of a parser's option strings: its actions hold them
    options = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]
    for token in unknown:
        if token.startswith("--"):
            close = difflib.get_close_matches(token.partition("=")[0], options, n=1, cutoff=0.6)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (argparse exits 2 itself on bad usage)."""
    parser = get_args_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # as parse_args, from the subcommand's parser (its usage), with a suggestion
        target = getattr(args, "subparser", parser)
        target.error(f"unrecognized arguments: {' '.join(unknown)}{_did_you_mean(unknown, target)}")
    if args.command == "demo":
        from fxtp.cli.demo import run_demo

        run_demo(args.world_size)
        return 0
    from fxtp.core.errors import FxtpError

    try:
        _check_model_file(args.model)  # before torch loads
        return _run(args)
    except FxtpError as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"fxtp: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
